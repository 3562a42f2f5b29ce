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


def engine_model_folder(source: str, resolved: Any, dtype: str, load: Callable[[], tuple[Any, Any]]) -> Path:
    """A safetensors folder of the policy ``source`` that vLLM (and the worker's master copy) can read.

    A folder with safetensors files is used as it is; anything else (a GGUF file, a hub id, a folder of ``.bin``
    files) is written once, atomically, to the cache — keyed by source and dtype — from the model ``load()`` returns.
    """
    from logra_pl.export import policy_folder_complete, save_policy_folder
    from logra_pl.models.tiny import cache_root

    folder = Path(resolved.location)
    if resolved.gguf_file is None and not resolved.is_hub_id and any(folder.glob("*.safetensors")):
        return folder
    digest = hashlib.blake2b(f"{source}/{dtype}".encode(), digest_size=8).hexdigest()
    folder = cache_root() / "engine" / digest
    if not policy_folder_complete(folder):  # written atomically: a complete folder is a valid one
        model, tokenizer = load()
        save_policy_folder(model, tokenizer, folder, provenance={"source": source, "engine_cache": True})
    return folder


def build_vllm_engine(request: EngineRequest) -> RolloutEngine:
    """One vLLM engine in the trainer process, on a safetensors folder of the policy (cached when written)."""
    from logra_pl.models.load import resolve_source
    from logra_pl.rollout.vllm import VLLMEngine

    module = request.module
    if module.rollout_settings.share_weights:
        raise ConfigError("rollout.share_weights applies to the HF engine; vLLM holds its own weights")
    if request.world_size > 1:
        raise ConfigError(
            "model.engine=vllm runs one vLLM engine in the trainer process, so it needs one training process "
            f"(got {request.world_size}); use model.engine=remote (engines started with `logra-pl serve`) or hf "
            "with several ranks, or train on one rank"
        )
    resolved = resolve_source(request.source)
    folder = engine_model_folder(
        request.source, resolved, module.dtype_name, lambda: (request.model, request.tokenizer)
    )
    return VLLMEngine(folder, request.eos, module.vllm_settings, trainer_dtype=module.dtype_name)


build_vllm_engine.max_training_processes = 1  # type: ignore[attr-defined]  (checked by the CLI before spawning)


def build_remote_engine(request: EngineRequest) -> RolloutEngine:
    """A client of ``logra-pl serve`` engines (``model.remote.urls``); any number of training processes."""
    import uuid

    from logra_pl.rollout.remote import RemoteEngine
    from logra_pl.sketch.targets import select_targets

    module = request.module
    if module.rollout_settings.share_weights:
        raise ConfigError("rollout.share_weights applies to the HF engine; served engines hold their own weights")
    trainer = getattr(module, "_trainer", None)
    rank = int(trainer.global_rank) if trainer is not None else 0
    run_id = uuid.uuid4().hex[:12]
    if trainer is not None and request.world_size > 1:
        run_id = trainer.strategy.broadcast(run_id, src=0)  # every rank names the same weight versions
    targets = select_targets(request.model, module.logra_config.targets)
    matrices = {name: (m.out_features, m.in_features) for name, m in targets.items()}
    return RemoteEngine(
        module.remote_settings,
        request.eos,
        rank=rank,
        world_size=request.world_size,
        run_id=run_id,
        trainer_dtype=module.dtype_name,
        matrices=matrices,
        vocab_size=int(request.model.config.vocab_size),
    )


register_engine("hf", build_hf_engine)
register_engine("vllm", build_vllm_engine)
register_engine("remote", build_remote_engine)
