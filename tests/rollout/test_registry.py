"""Engines from their specs, names or dotted paths: the module uses the RolloutEngine contract only."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from jsonargparse import ArgumentParser

from logra_pl.errors import ConfigError
from logra_pl.models.load import load_policy
from logra_pl.module import LoGRAPolicyModule, RolloutSettings
from logra_pl.rollout.base import BuilderSpec, EngineRequest, EngineSpec, RolloutEngine, StaleableEngine, SyncReport
from logra_pl.rollout.hf import HFEngine, HFSettings
from logra_pl.rollout.registry import build_engine, engine_name, engine_spec, max_training_processes, register_engine
from logra_pl.rollout.remote import RemoteSettings
from logra_pl.rollout.vllm import VLLMSettings
from logra_pl.sketch import LoGRAConfig

ENGINES = EngineSpec.registry.names  # every short name of model.engine


class CountingEngine:
    """A user's engine: transformers sampling plus a count of what the trainer asked of it (no subclassing)."""

    def __init__(self, inner: HFEngine) -> None:
        self.inner = inner
        self.context_limit = inner.context_limit
        self.shares_weights = inner.shares_weights
        self.receivers = inner.receivers
        self.calls = {"generate": 0, "apply_payload": 0, "load_weights": 0}

    def generate(self, prompts, sampling, prompt_seeds=None):
        self.calls["generate"] += 1
        return self.inner.generate(prompts, sampling, prompt_seeds)

    def apply_payload(self, payload) -> SyncReport:
        self.calls["apply_payload"] += 1
        return self.inner.apply_payload(payload)

    def load_weights(self, tensors) -> SyncReport:
        self.calls["load_weights"] += 1
        return self.inner.load_weights(tensors)

    def place(self, device: torch.device) -> bool:
        return self.inner.place(device)

    def close(self) -> None:
        self.inner.close()


def build_counting(request: EngineRequest) -> CountingEngine:
    return CountingEngine(HFSettings().build(request))


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
        assert not isinstance(engine, StaleableEngine)
        # One full load at train start, one payload per update, one rollout per update.
        assert engine.calls == {"generate": 3, "apply_payload": 3, "load_weights": 1}
        for (key, a), b in zip(
            module.policy.state_dict().items(), engine.inner.model.state_dict().values(), strict=True
        ):
            assert torch.equal(a, b), key
    finally:
        ENGINES.pop(name, None)


def test_unknown_engine_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"unknown model\.engine 'nope': use one of 'hf', 'remote', 'vllm'"):
        engine_spec("nope")
    with pytest.raises(ConfigError, match="cannot import it"):
        engine_spec("no_such_package.build")
    assert {"hf", "vllm"} <= set(ENGINES)


def test_short_names_are_the_shipped_specs_with_default_settings() -> None:
    assert engine_spec("hf") == HFSettings()
    assert engine_spec("vllm") == VLLMSettings() and engine_spec("remote") == RemoteSettings()
    assert engine_spec("logra_pl.rollout.vllm.VLLMSettings") == VLLMSettings()  # a spec class by its path
    spec = VLLMSettings(kv_cache_gib=2.0)
    assert engine_spec(spec) is spec  # a spec is used as it is
    assert max_training_processes("vllm") == 1 and max_training_processes(spec) == 1
    assert max_training_processes("hf") is None and max_training_processes(RemoteSettings()) is None
    assert [engine_name(v) for v in ("hf", spec, RemoteSettings())] == ["hf", "vllm", "remote"]
    with pytest.raises(ConfigError, match="EngineSpec"):
        engine_spec(3.5)


@dataclass
class EchoSpec(EngineSpec):
    """A user's engine with settings of its own (here: how many prompts per HF forward batch)."""

    batch: int = 2

    def build(self, request: EngineRequest) -> RolloutEngine:
        engine = HFSettings().build(request)
        engine.max_batch = self.batch
        return engine


def build_limited(request: EngineRequest) -> RolloutEngine:
    return HFSettings().build(request)


build_limited.max_training_processes = 2


def test_specs_builders_and_registered_names_build_engines() -> None:
    model, tokenizer = load_policy("tiny")
    request = EngineRequest("tiny", model, tokenizer, [1], max_batch=8)
    assert build_engine("hf", request).max_batch == 8  # the module's rollout settings reach the engine
    assert build_engine(EchoSpec(batch=3), request).max_batch == 3  # the spec's own settings
    name = f"{__name__}.build_limited"
    try:
        spec = engine_spec(name)
        assert isinstance(spec, BuilderSpec) and spec.max_training_processes == 2
        assert isinstance(build_engine(name, request), HFEngine)
        register_engine("echo", EchoSpec)
        assert engine_spec("echo") == EchoSpec() and max_training_processes("echo") is None
    finally:
        ENGINES.pop(name, None)
        ENGINES.pop("echo", None)
    with pytest.raises(ConfigError, match="share_weights"):
        RemoteSettings().build(EngineRequest("tiny", model, tokenizer, [1], share_weights=True))
    with pytest.raises(ConfigError, match="one training process"):
        VLLMSettings().build(EngineRequest("tiny", model, tokenizer, [1], world_size=2))


def fit(engine: str | EngineSpec = "hf") -> Any:
    """A LightningCLI-like entry point: ``model.engine`` as the module takes it."""
    return engine


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ([], "hf"),
        (["--engine=vllm"], "vllm"),
        (["--engine=my_package.engines.build"], "my_package.engines.build"),
        (
            ["--engine", "{class_path: logra_pl.rollout.vllm.VLLMSettings, init_args: {kv_cache_gib: 2.0}}"],
            VLLMSettings(kv_cache_gib=2.0),
        ),
        (
            ["--engine.class_path=logra_pl.rollout.remote.RemoteSettings", "--engine.init_args.urls=[http://h:1]"],
            RemoteSettings(urls=["http://h:1"]),
        ),
        (["--engine.class_path=logra_pl.rollout.hf.HFSettings"], HFSettings()),
        ([f"--engine.class_path={__name__}.EchoSpec", "--engine.init_args.batch=5"], EchoSpec(batch=5)),
    ],
)
def test_jsonargparse_takes_a_name_or_engine_settings(args: list[str], expected: Any) -> None:
    parser = ArgumentParser(exit_on_error=False)
    parser.add_function_arguments(fit)
    assert parser.instantiate(parser.parse_args(args)).engine == expected


def test_jsonargparse_takes_engine_settings_from_yaml(tmp_path: Path) -> None:
    config = tmp_path / "engine.yaml"
    config.write_text(
        "engine:\n  class_path: logra_pl.rollout.remote.RemoteSettings\n  init_args:\n    urls: [http://h:1]\n"
    )
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--config", action="config")
    parser.add_function_arguments(fit)
    cfg = parser.parse_args([f"--config={config}", "--engine.init_args.retry_for_s=3"])
    assert parser.instantiate(cfg).engine == RemoteSettings(urls=["http://h:1"], retry_for_s=3.0)
    with pytest.raises(Exception, match="does not correspond to a subclass of EngineSpec"):
        parser.parse_args(["--engine.class_path=logra_pl.rollout.hf.HFEngine"])
