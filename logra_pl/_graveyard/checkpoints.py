"""Checkpoints whose hyper-parameters hold the old ``{kind: ...}`` sections (CLI checkpoints of earlier versions).

LightningCLI saves a module's hyper-parameters as plain config data, and ``load_from_checkpoint`` parses them again
with the module's current type hints, which no longer take the old ``loss: {kind: ...}`` / ``baseline: {kind: ...}``
sections. :class:`LegacyCheckpoints` gives ``load_from_checkpoint`` their ``class_path`` form in their place (a
``FutureWarning`` says so); the baseline's value is restored from the checkpoint's state as always.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from logra_pl._graveyard.losses import translate_hparams


def saved_hparams(checkpoint_path: Any) -> dict[str, Any]:
    """The hyper-parameters of a local checkpoint file (memory-mapped: its tensors are not read); {} for anything
    else (a URL, a file object, a sharded checkpoint's folder)."""
    if not isinstance(checkpoint_path, str | os.PathLike) or not Path(checkpoint_path).is_file():
        return {}
    checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=False, mmap=True)
    return dict(checkpoint.get("hyper_parameters") or {}) if isinstance(checkpoint, dict) else {}


class LegacyCheckpoints:
    """A LightningModule mixin: ``load_from_checkpoint`` reads checkpoints with the old sections in their
    hyper-parameters (arguments given to it still win)."""

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        translated = translate_hparams(saved_hparams(checkpoint_path))
        return super().load_from_checkpoint(checkpoint_path, *args, **(translated | kwargs))  # type: ignore[misc]
