"""A rollout engine: the HF engine, wrapped to record the latency and throughput of every generate call."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch

from logra_pl.rollout.base import Rollout, RolloutEngine, SamplingConfig
from logra_pl.rollout.registry import EngineRequest, build_hf_engine
from logra_pl.sketch import Payload


class TimedEngine:
    """Meets the RolloutEngine contract by delegating to ``inner``; nothing is subclassed."""

    def __init__(self, inner: RolloutEngine) -> None:
        self.inner = inner
        self.context_limit = inner.context_limit
        self.shares_weights = inner.shares_weights
        self.latencies: list[float] = []  # seconds per generate call
        self.tokens: list[int] = []  # response tokens per generate call

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

    def apply_payload(self, payload: Payload) -> None:
        self.inner.apply_payload(payload)

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.inner.load_weights(tensors)

    def place(self, device: torch.device) -> bool:
        return self.inner.place(device)

    def close(self) -> None:
        self.inner.close()


def build_engine(request: EngineRequest) -> TimedEngine:
    """The builder named in ``model.engine``: EngineRequest (policy, tokenizer, stop tokens, module) -> engine."""
    return TimedEngine(build_hf_engine(request))
