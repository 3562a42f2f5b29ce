"""Engine names of earlier versions (deprecated): ``resolve_engine``, ``build_hf_engine`` and the ``ENGINES`` table
of ``logra_pl.rollout.registry``, from before engines were chosen by their settings (``EngineSpec``)."""

from __future__ import annotations

import warnings
from typing import Any

from logra_pl.rollout.base import EngineBuilder, EngineRequest, EngineSpec, RolloutEngine
from logra_pl.rollout.hf import HFSettings
from logra_pl.rollout.registry import engine_spec
from logra_pl.rollout.vllm import engine_model_folder

ENGINES: dict[str, Any] = EngineSpec.registry.names  # the short names, now registered by the specs themselves

__all__ = ["ENGINES", "build_hf_engine", "engine_model_folder", "resolve_engine"]


def resolve_engine(name: str | EngineSpec) -> EngineBuilder:
    """Deprecated — use :func:`logra_pl.rollout.registry.engine_spec` (``engine_spec(name).build``)."""
    warnings.warn("resolve_engine is deprecated: use engine_spec(name).build", DeprecationWarning, stacklevel=2)
    return engine_spec(name).build


def build_hf_engine(request: EngineRequest) -> RolloutEngine:
    """Deprecated — use ``HFSettings().build(request)``: transformers sampling in the trainer process."""
    warnings.warn("build_hf_engine is deprecated: use HFSettings().build(request)", DeprecationWarning, stacklevel=2)
    return HFSettings().build(request)
