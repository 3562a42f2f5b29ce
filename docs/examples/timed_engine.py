"""A rollout engine with its own YAML settings: the HF engine, wrapped to record the latency of every generate call."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from logra_pl.rollout.base import Rollout, RolloutEngine, SamplingConfig, SyncReport
from logra_pl.rollout.hf import HFSettings
from logra_pl.rollout.registry import EngineRequest, EngineSpec
from logra_pl.sketch import Payload


class TimedEngine:
    """Meets the RolloutEngine contract by delegating to ``inner``; nothing is subclassed."""

    def __init__(self, inner: RolloutEngine, history: int) -> None:
        self.inner = inner
        self.context_limit = inner.context_limit
        self.shares_weights = inner.shares_weights
        self.receivers = inner.receivers
        self.latencies: deque[float] = deque(maxlen=history)  # seconds per generate call, the newest last
        self.tokens: deque[int] = deque(maxlen=history)  # response tokens per generate call

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, prompt_seeds: Sequence[int] | None = None
    ) -> Rollout:
        start = time.perf_counter()
        rollout = self.inner.generate(prompts, sampling, prompt_seeds)
        seconds = time.perf_counter() - start
        self.latencies.append(seconds)
        self.tokens.append(rollout.num_response_tokens)
        rollout.timings["timed_engine_s"] = seconds
        return rollout

    def apply_payload(self, payload: Payload) -> SyncReport:
        return self.inner.apply_payload(payload)

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> SyncReport:
        return self.inner.load_weights(tensors)

    def place(self, device: torch.device) -> bool:
        return self.inner.place(device)

    def close(self) -> None:
        self.inner.close()


@dataclass
class TimedSettings(EngineSpec):
    """What ``model.engine: {class_path: timed_engine.TimedSettings, init_args: {...}}`` builds.

    Arguments:
        history: generate calls whose latency and token count are kept (older ones are dropped).
    """

    history: int = 1000

    def build(self, request: EngineRequest) -> RolloutEngine:
        """The HF engine for the loaded policy (``request``), timed."""
        return TimedEngine(HFSettings().build(request), history=self.history)
