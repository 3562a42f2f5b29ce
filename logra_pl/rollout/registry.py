"""Rollout engines from their settings: ``model.engine`` in a config.

``model.engine`` takes an *engine spec* (:class:`~logra_pl.rollout.base.EngineSpec`): an object with ``build(request)
-> engine`` whose fields are the engine's settings, written in YAML as ``{class_path: ..., init_args: {...}}``. The
three shipped specs register their short names: :class:`~logra_pl.rollout.hf.HFSettings` (``hf``: transformers, in the
trainer process; the default), :class:`~logra_pl.rollout.vllm.VLLMSettings` (``vllm``: one vLLM engine in the trainer
process) and :class:`~logra_pl.rollout.remote.RemoteSettings` (``remote``: ``logra-pl serve`` engines over HTTP). A
string is resolved by :func:`logra_pl.config.resolve`: a short name (the spec with its defaults), a dotted path to a
spec class (built with its defaults) or to a builder function ``EngineRequest -> engine``; :func:`register_engine`
adds short names. The module builds with :func:`build_engine` and then uses the
:class:`~logra_pl.rollout.base.RolloutEngine` contract only.
"""

from __future__ import annotations

import inspect
from typing import Any

import logra_pl.rollout.hf
import logra_pl.rollout.remote
import logra_pl.rollout.vllm  # noqa: F401  (with the two above: the shipped specs register their short names)
from logra_pl.config import class_path_of, resolve
from logra_pl.rollout.base import BuilderSpec, EngineRequest, EngineSpec, RolloutEngine, check_engine_spec


def register_engine(name: str, builder: Any) -> Any:
    """Make ``builder`` available as ``model.engine: <name>``: a function ``EngineRequest -> engine``, a spec class
    (built with its defaults), a spec instance, or the dotted path of one. Re-registering a name replaces it."""
    return EngineSpec.registry.add(name, builder)


def _as_spec(target: Any, name: str) -> Any:
    """What a name or dotted path gives, as a spec: a spec class with its defaults, a spec, or a builder function."""
    if inspect.isclass(target) and issubclass(target, EngineSpec):
        return target()
    if isinstance(target, EngineSpec) or not callable(target):
        return target
    return BuilderSpec(target, name)  # a function (or another class) called with the request


def engine_spec(value: str | EngineSpec) -> EngineSpec:
    """The spec ``model.engine`` names: a spec as it is, or a short name or a dotted path resolved. Raises
    :class:`~logra_pl.errors.ConfigError` for anything else, before any model is loaded."""
    if not isinstance(value, str):
        check_engine_spec(value)
    return resolve(value, EngineSpec.registry, build=_as_spec)


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
    return next((name for name, target in EngineSpec.registry.names.items() if target is cls), class_path_of(cls))
