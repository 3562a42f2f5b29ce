"""Rollout engines from their settings: ``model.engine`` in a config.

``model.engine`` takes an *engine spec*: an object with ``build(request) -> engine`` whose fields are the engine's
settings, written in YAML as ``{class_path: ..., init_args: {...}}``. The three shipped specs are
:class:`~logra_pl.rollout.hf.HFSettings` (transformers, in the trainer process; the default),
:class:`~logra_pl.rollout.vllm.VLLMSettings` (one vLLM engine in the trainer process) and
:class:`~logra_pl.rollout.remote.RemoteSettings` (``logra-pl serve`` engines over HTTP). A string is accepted too:
``hf``, ``vllm`` and ``remote`` name those specs with their default settings, a dotted path names a spec class
(built with its defaults) or a builder function ``EngineRequest -> engine``, and :func:`register_engine` adds short
names. :func:`engine_spec` resolves any of these (an unknown name fails early, with the choices); the module builds
with :func:`build_engine` and then uses the :class:`~logra_pl.rollout.base.RolloutEngine` contract only.

An :class:`EngineRequest` carries what a spec builds from: the loaded policy, its tokenizer, the stop tokens, the
topology and the few module settings an engine needs — not the module itself.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from logra_pl.errors import ConfigError, import_dotted
from logra_pl.rollout.base import RolloutEngine
from logra_pl.sketch.config import DEFAULT_TARGETS
from logra_pl.train.settings import RolloutSettings


def _same_value(value: Any) -> Any:
    return value


@dataclass
class EngineRequest:
    """What an engine is built from.

    Arguments:
        source: the policy source the module loaded (a folder, ``tiny``, ``smollm2``, a ``.gguf`` file, a hub id).
        model: the loaded policy (the trainer's; copy it if the engine needs weights of its own).
        tokenizer: its tokenizer (left padding, a pad token).
        eos: token ids that end a response.
        world_size: training processes.
        rollout: the module's sampling settings (``share_weights``, ``max_batch``).
        dtype: the trainer's parameter dtype name (``float32``...): an engine's master copy must have it.
        targets: last name parts of the trained matrices (``q_proj``...), as ``model.logra.targets``.
        rank: this process's global rank.
        broadcast: ``broadcast(value)`` returns rank 0's ``value`` on every rank (a collective: call it on all
            ranks or none); the identity in one process.
    """

    source: str
    model: Any
    tokenizer: Any
    eos: list[int]
    world_size: int = 1
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    dtype: str = "float32"
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    rank: int = 0
    broadcast: Callable[[Any], Any] = _same_value


class EngineSpec(ABC):
    """An engine's settings and how to build it: what ``model.engine: {class_path, init_args}`` instantiates.

    A spec subclasses this class (usually as a dataclass); its ``__init__`` arguments are the engine's YAML
    settings, and :meth:`build` makes the engine. (A base class rather than a protocol: jsonargparse accepts a
    protocol's implementation only when its ``build`` signature repeats the protocol's annotations exactly.)

    Attributes:
        max_training_processes: the most training processes the engine can serve (checked by the CLI before it
            spawns them); None: any number.
    """

    max_training_processes: ClassVar[int | None] = None

    @abstractmethod
    def build(self, request: EngineRequest) -> RolloutEngine:
        """The engine, built for the loaded policy ``request.model``."""


EngineBuilder = Callable[[EngineRequest], RolloutEngine]


@dataclass(frozen=True)
class BuilderSpec(EngineSpec):
    """A builder function ``EngineRequest -> engine`` used as a spec (``model.engine: my_package.build``).

    The function's own ``max_training_processes`` attribute, if it has one, is the spec's.
    """

    builder: EngineBuilder
    name: str

    def build(self, request: EngineRequest) -> RolloutEngine:
        return self.builder(request)

    @property
    def max_training_processes(self) -> int | None:  # the builder's own attribute, if it has one
        return getattr(self.builder, "max_training_processes", None)


# name -> a builder function, a spec (class or instance), or the dotted path of a spec class (imported when used)
ENGINES: dict[str, Any] = {
    "hf": "logra_pl.rollout.hf.HFSettings",
    "vllm": "logra_pl.rollout.vllm.VLLMSettings",
    "remote": "logra_pl.rollout.remote.RemoteSettings",
}


def register_engine(name: str, builder: Any) -> Any:
    """Make ``builder`` available as ``model.engine: <name>``: a function ``EngineRequest -> engine``, a spec class
    (built with its defaults) or a spec instance. Re-registering a name replaces it."""
    ENGINES[name] = builder
    return builder


def _unknown(name: str) -> ConfigError:
    return ConfigError(
        f"unknown model.engine {name!r}: use one of {sorted(ENGINES)}, engine settings "
        "({class_path: logra_pl.rollout.vllm.VLLMSettings, init_args: {...}}), or the dotted path of a spec class "
        "or of a builder (a function EngineRequest -> engine, e.g. my_package.engines.build)"
    )


def _as_spec(target: Any, name: str) -> EngineSpec:
    """A registered or imported ``target`` as a spec: a spec class with its defaults, a spec, or a builder."""
    if isinstance(target, str):
        target = import_dotted(target, "model.engine")
    if isinstance(target, EngineSpec):
        return target
    if isinstance(target, type) and issubclass(target, EngineSpec):
        return target()  # a spec class by name: its default settings
    if callable(target):
        return BuilderSpec(target, name)  # a function (or a class) called with the request
    raise _unknown(name)


def engine_spec(value: str | EngineSpec) -> EngineSpec:
    """The spec ``model.engine`` names: a spec as it is, or a registered name or a dotted path resolved.

    A builder function found by its dotted path is registered under that path. Raises :class:`ConfigError` for a
    name that resolves to nothing (before any model is loaded).
    """
    if not isinstance(value, str):
        if isinstance(value, EngineSpec):
            return value
        raise ConfigError(
            f"model.engine must be a name, a dotted path or engine settings (a subclass of {__name__}.EngineSpec), "
            f"got {type(value).__name__}"
        )
    if value in ENGINES:
        return _as_spec(ENGINES[value], value)
    target = import_dotted(value, "model.engine")
    if target is None:
        raise _unknown(value)
    spec = _as_spec(target, value)
    if isinstance(spec, BuilderSpec):
        register_engine(value, target)
    return spec


def build_engine(value: str | EngineSpec, request: EngineRequest) -> RolloutEngine:
    """The engine ``value`` (see :func:`engine_spec`) builds for ``request``."""
    return engine_spec(value).build(request)


def max_training_processes(value: str | EngineSpec) -> int | None:
    """The most training processes the engine of ``value`` can serve; None: any number."""
    limit = engine_spec(value).max_training_processes
    return None if limit is None else int(limit)


def engine_name(value: str | EngineSpec) -> str:
    """How messages name the engine of ``value``: its name (``vllm`` for a VLLMSettings), or its spec's class path."""
    if isinstance(value, str):
        return value
    if isinstance(value, BuilderSpec):
        return value.name
    cls = type(value)
    path = f"{cls.__module__}.{cls.__qualname__}"
    return next((name for name, target in ENGINES.items() if target in (path, cls)), path)


def resolve_engine(name: str | EngineSpec) -> EngineBuilder:
    """The builder of ``name`` (``engine_spec(name).build``), for code written before engine specs."""
    return engine_spec(name).build


def build_hf_engine(request: EngineRequest) -> RolloutEngine:
    """Transformers sampling in the trainer process: a private copy of the policy, or its own weights (share)."""
    from logra_pl.rollout.hf import HFSettings

    return HFSettings().build(request)


def engine_model_folder(source: str, resolved: Any, dtype: str, load: Callable[[], tuple[Any, Any]]) -> Path:
    """A safetensors folder of the policy ``source`` that vLLM (and the worker's master copy) can read.

    A folder with safetensors files is used as it is; anything else (a GGUF file, a hub id, a folder of ``.bin``
    files) is written once, atomically, to the cache — keyed by source and dtype — from the model ``load()`` returns.
    """
    from logra_pl.models.tiny import cache_root
    from logra_pl.runs.export import policy_folder_complete, save_policy_folder

    folder = Path(resolved.location)
    if resolved.gguf_file is None and not resolved.is_hub_id and any(folder.glob("*.safetensors")):
        return folder
    digest = hashlib.blake2b(f"{source}/{dtype}".encode(), digest_size=8).hexdigest()
    folder = cache_root() / "engine" / digest
    if not policy_folder_complete(folder):  # written atomically: a complete folder is a valid one
        model, tokenizer = load()
        save_policy_folder(model, tokenizer, folder, provenance={"source": source, "engine_cache": True})
    return folder
