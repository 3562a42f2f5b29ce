"""Rollout engines: where responses are sampled, and how they receive each update (``model.engine``).

An engine is a :class:`RolloutEngine` (``base.py``, the contract: ``generate``, ``apply_payload`` / ``load_weights``,
``place``, ``close``); it is built from its settings, an :class:`EngineSpec` chosen by ``class_path`` or by a short
name: ``hf`` (:class:`HFSettings`: transformers sampling in the trainer's process), ``vllm`` (:class:`VLLMSettings`:
vLLM, factors applied in place), ``remote`` (:class:`RemoteSettings`: engines started by ``logra-pl serve``).
:func:`engine_spec` resolves a setting, :func:`build_engine` builds the engine for an :class:`EngineRequest`. The
asynchronous pipeline, weight versions and staleness live beside them (``pipeline.py``, ``versions.py``,
``staleness.py``); ``serve/`` is the server side of ``remote``.
"""

from logra_pl.rollout.base import EngineRequest, EngineSpec, Rollout, RolloutEngine, SamplingConfig, SyncReport
from logra_pl.rollout.hf import HFSettings
from logra_pl.rollout.registry import build_engine, engine_spec
from logra_pl.rollout.remote import RemoteSettings
from logra_pl.rollout.vllm import VLLMSettings

__all__ = [
    "EngineRequest",
    "EngineSpec",
    "HFSettings",
    "RemoteSettings",
    "Rollout",
    "RolloutEngine",
    "SamplingConfig",
    "SyncReport",
    "VLLMSettings",
    "build_engine",
    "engine_spec",
]
