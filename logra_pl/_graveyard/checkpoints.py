"""Checkpoints of earlier versions: the old ``{kind: ...}`` sections in their hyper-parameters, and no record of the
method that wrote them (removed in logra-pl 0.3.0, :data:`logra_pl._graveyard.REMOVED_IN`).

LightningCLI saves a module's hyper-parameters as plain config data, and ``load_from_checkpoint`` parses them again
with the module's current type hints, which no longer take the old ``loss: {kind: ...}`` / ``baseline: {kind: ...}``
sections. :func:`translate_on_load` makes ``LoGRAPolicyModule.load_from_checkpoint`` read them through the
``hparams`` translators (their ``class_path`` form; a ``FutureWarning`` says so); the baseline's value is restored
from the checkpoint's state as always. :func:`record_method` gives a checkpoint written before the module recorded
its method the kind its optimizer state shows.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from logra_pl.config import translated


def saved_hparams(checkpoint_path: Any) -> dict[str, Any]:
    """The hyper-parameters of a local checkpoint file (memory-mapped: its tensors are not read); {} for anything
    else (a URL, a file object, a sharded checkpoint's folder)."""
    if not isinstance(checkpoint_path, str | os.PathLike) or not Path(checkpoint_path).is_file():
        return {}
    checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=False, mmap=True)
    return dict(checkpoint.get("hyper_parameters") or {}) if isinstance(checkpoint, dict) else {}


def translate_on_load(module_class: type) -> None:
    """Patch ``module_class.load_from_checkpoint`` (a LightningModule's) to give the module the translated form of
    the old settings among a checkpoint's hyper-parameters (arguments given to it still win)."""
    if getattr(module_class.load_from_checkpoint, "translates_old_settings", False):  # patched already
        return
    descriptor = inspect.getattr_static(module_class, "load_from_checkpoint")  # Lightning's _restricted_classmethod
    inherited = descriptor.__func__

    @functools.wraps(inherited)
    def load_from_checkpoint(cls: type, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        saved = saved_hparams(checkpoint_path)
        new = translated("hparams", dict(saved))
        changed = {key: value for key, value in new.items() if key not in saved or saved[key] is not value}
        return inherited(cls, checkpoint_path, *args, **(changed | kwargs))

    load_from_checkpoint.translates_old_settings = True  # type: ignore[attr-defined]
    module_class.load_from_checkpoint = type(descriptor)(load_from_checkpoint)


def record_method(checkpoint: Mapping[str, Any]) -> Mapping[str, Any]:
    """A checkpoint without a record of its method (``logra_pl.method`` or ``logra_pl.optimizer``) gets the kind its
    optimizer state shows: LoGRA's ``logra`` state, or torch's ``param_groups`` (AdamW); unchanged otherwise."""
    state = checkpoint.get("logra_pl") or {}
    if state.get("method") or state.get("optimizer"):
        return checkpoint
    states = checkpoint.get("optimizer_states") or []
    if not states:
        return checkpoint
    kind = "logra" if "logra" in states[0] else ("adamw" if "param_groups" in states[0] else None)
    return checkpoint if kind is None else {**checkpoint, "logra_pl": {**state, "optimizer": kind}}
