"""Engines by name or dotted path: the module uses the RolloutEngine contract only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from logra_pl.errors import ConfigError
from logra_pl.module import LoGRAPolicyModule, RolloutSettings
from logra_pl.rollout.base import RolloutEngine
from logra_pl.rollout.hf import HFEngine
from logra_pl.rollout.registry import ENGINES, EngineRequest, build_hf_engine, resolve_engine
from logra_pl.sketch import LoGRAConfig


class CountingEngine:
    """A user's engine: transformers sampling plus a count of what the trainer asked of it (no subclassing)."""

    def __init__(self, inner: HFEngine) -> None:
        self.inner = inner
        self.context_limit = inner.context_limit
        self.shares_weights = inner.shares_weights
        self.calls = {"generate": 0, "apply_payload": 0, "load_weights": 0}

    def generate(self, prompts, sampling, prompt_seeds=None):
        self.calls["generate"] += 1
        return self.inner.generate(prompts, sampling, prompt_seeds)

    def apply_payload(self, payload) -> None:
        self.calls["apply_payload"] += 1
        self.inner.apply_payload(payload)

    def load_weights(self, tensors) -> None:
        self.calls["load_weights"] += 1
        self.inner.load_weights(tensors)

    def place(self, device: torch.device) -> bool:
        return self.inner.place(device)

    def close(self) -> None:
        self.inner.close()


def build_counting(request: EngineRequest) -> CountingEngine:
    return CountingEngine(build_hf_engine(request))


def test_a_users_engine_by_dotted_path(tmp_path: Path, rl_run) -> None:
    name = f"{__name__}.build_counting"
    try:
        module = LoGRAPolicyModule(
            policy="tiny",
            engine=name,
            logra=LoGRAConfig(rank=16, update_ratio=1e-2),
            rollout=RolloutSettings(max_new_tokens=4),
            microbatch_size=4,
        )
        rl_run(module, tmp_path, 3)
        engine = module.engine
        assert isinstance(engine, CountingEngine) and isinstance(engine, RolloutEngine)
        # One full load at train start, one payload per update, one rollout per update.
        assert engine.calls == {"generate": 3, "apply_payload": 3, "load_weights": 1}
        for (key, a), b in zip(
            module.policy.state_dict().items(), engine.inner.model.state_dict().values(), strict=True
        ):
            assert torch.equal(a, b), key
    finally:
        ENGINES.pop(name, None)


def test_unknown_engine_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"unknown model\.engine 'nope'"):
        resolve_engine("nope")
    with pytest.raises(ConfigError, match="cannot import it"):
        resolve_engine("no_such_package.build")
    assert {"hf", "vllm"} <= set(ENGINES)
