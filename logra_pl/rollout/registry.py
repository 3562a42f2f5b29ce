"""Rollout engines by name: ``model.engine: hf | vllm | my_package.engines.build_mine`` in a config.

A builder turns an :class:`EngineRequest` — the loaded policy, its tokenizer, the stop tokens and the module's
settings — into an object that meets the :class:`~logra_pl.rollout.base.RolloutEngine` contract. The module holds
no reference to a concrete engine class: it builds through :func:`resolve_engine` and then uses the contract only.
A new engine is one builder plus :func:`register_engine` (or its dotted path in the config).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from logra_pl.errors import ConfigError, import_dotted
from logra_pl.rollout.base import RolloutEngine


@dataclass
class EngineRequest:
    """What an engine builder is given.

    Arguments:
        source: the policy source the module loaded (a folder, ``tiny``, ``smollm2``, a ``.gguf`` file, a hub id).
        model: the loaded policy (the trainer's; copy it if the engine needs weights of its own).
        tokenizer: its tokenizer (left padding, a pad token).
        eos: token ids that end a response.
        module: the ``LoGRAPolicyModule`` (for its settings: ``rollout_settings``, ``vllm_settings``, ``dtype_name``).
        world_size: training processes.
    """

    source: str
    model: Any
    tokenizer: Any
    eos: list[int]
    module: Any
    world_size: int = 1


EngineBuilder = Callable[[EngineRequest], RolloutEngine]
ENGINES: dict[str, EngineBuilder] = {}


def register_engine(name: str, builder: EngineBuilder) -> EngineBuilder:
    """Make ``builder`` available as ``model.engine: <name>``. Re-registering a name replaces it."""
    ENGINES[name] = builder
    return builder


def resolve_engine(name: str) -> EngineBuilder:
    """The builder of ``name``: a registered engine or the dotted path of a builder function."""
    if name in ENGINES:
        return ENGINES[name]
    builder = import_dotted(name, "model.engine")
    if callable(builder):
        return register_engine(name, builder)
    raise ConfigError(
        f"unknown model.engine {name!r}: use one of {sorted(ENGINES)}, or the dotted path of a builder "
        "(a function EngineRequest -> engine, e.g. my_package.engines.build)"
    )


def build_hf_engine(request: EngineRequest) -> RolloutEngine:
    """Transformers sampling in the trainer process: a private copy of the policy, or its own weights (share)."""
    from logra_pl.rollout.hf import HFEngine

    settings = request.module.rollout_settings
    if settings.share_weights and request.world_size > 1:
        raise ConfigError(
            "rollout.share_weights generates with the trainer's weights, which are sharded over "
            f"{request.world_size} ranks: set it to false for data-parallel runs"
        )
    return HFEngine(
        request.model,
        request.eos,
        request.tokenizer.pad_token_id,
        max_batch=settings.max_batch,
        copy=not settings.share_weights,
    )


def build_vllm_engine(request: EngineRequest) -> RolloutEngine:
    """One vLLM engine in the trainer process, on a safetensors folder of the policy (cached when written)."""
    from logra_pl.export import policy_folder_complete, save_policy_folder
    from logra_pl.models.load import resolve_source
    from logra_pl.models.tiny import cache_root
    from logra_pl.rollout.vllm import VLLMEngine

    module = request.module
    if module.rollout_settings.share_weights:
        raise ConfigError("rollout.share_weights applies to the HF engine; vLLM holds its own weights")
    if request.world_size > 1:
        raise ConfigError(
            "model.engine=vllm runs one vLLM engine in the trainer process, so it needs one training process "
            f"(got {request.world_size}); use model.engine=hf with several ranks, or train on one rank"
        )
    resolved = resolve_source(request.source)
    folder = Path(resolved.location)
    if resolved.gguf_file is not None or resolved.is_hub_id or not any(folder.glob("*.safetensors")):
        # vLLM (and the worker's master copy) read safetensors folders: write one once, cached by source.
        digest = hashlib.blake2b(f"{request.source}/{module.dtype_name}".encode(), digest_size=8).hexdigest()
        folder = cache_root() / "engine" / digest
        if not policy_folder_complete(folder):  # written atomically: a complete folder is a valid one
            save_policy_folder(
                request.model, request.tokenizer, folder, provenance={"source": request.source, "engine_cache": True}
            )
    return VLLMEngine(folder, request.eos, module.vllm_settings, trainer_dtype=module.dtype_name)


build_vllm_engine.max_training_processes = 1  # type: ignore[attr-defined]  (checked by the CLI before spawning)

register_engine("hf", build_hf_engine)
register_engine("vllm", build_vllm_engine)
