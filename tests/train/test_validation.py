"""Bad settings fail at construction — before any model is built, loaded or warm-started — as one clear message."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from logra_pl.cli import main
from logra_pl.module import RolloutSettings

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"


def _run(tmp_path: Path, capsys: pytest.CaptureFixture[str], *flags: str, config: Path = CONFIG) -> str:
    """``logra-pl fit`` in process; returns what it printed on stderr after exiting with status 1."""
    with pytest.raises(SystemExit) as info:
        main(["fit", f"--config={config}", f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}", *flags])
    assert info.value.code == 1
    return capsys.readouterr().err


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh model cache: whatever a run builds or warm-starts lands here, so we can see it did nothing."""
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("LOGRA_PL_CACHE", str(cache))
    return cache


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model.logra.update_ratio=.nan"], "logra.update_ratio must be a finite number, got nan"),
        (["--model.logra.update_ratio=-1"], "logra.update_ratio must lie in (0, inf), got -1"),
        (["--model.loss.tis_cap=0"], "loss.tis_cap must lie in (0, inf), got 0"),
        (["--model.rollout.temperature=-1"], "rollout.temperature must lie in [0, inf), got -1"),
        (["--model.rollout.max_new_tokens=0"], "rollout.max_new_tokens must be an integer >= 1, got 0"),
        (["--model.rollout.top_p=1.5"], "rollout.top_p must lie in (0, 1], got 1.5"),
        (["--model.baseline.momentum=1"], "baseline.momentum must lie in [0, 1), got 1"),
        (["--model.guard.max_update_ratio=0"], "guard.max_update_ratio must lie in (0, inf), got 0"),
        (["--model.warm_start.task=no_such_task"], "unknown warm_start.task 'no_such_task'"),
        (["--data.prompts_per_step=0"], "data.prompts_per_step must be an integer >= 1, got 0"),
        (["--checkpoint.every_n_updates=-1"], "checkpoint.every_n_updates must be an integer >= 0, got -1"),
        (["--model.engine=vllm", "--trainer.devices=2"], "model.engine=vllm runs one engine in the training process"),
        (
            ["--model.engine=vllm", "--trainer.num_nodes=2"],
            "the trainer starts 2 processes (trainer.devices × trainer.num",
        ),
        (["--model.engine=no_such_engine"], "unknown model.engine 'no_such_engine'"),
        (["--data.prompts_per_step=63", "--trainer.devices=2"], "data.prompts_per_step=63 is not divisible by the 2"),
    ],
)
def test_bad_value_is_one_message_before_any_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], empty_cache: Path, flags: list[str], message: str
) -> None:
    err = _run(tmp_path, capsys, *flags)
    assert message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 3, err
    assert not any(empty_cache.iterdir()), "a model was built before the setting was checked"
    assert not (tmp_path / "runs").exists()


def test_budget_bounds_in_the_wrong_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], empty_cache: Path
) -> None:
    config = yaml.safe_load(CONFIG.read_text())
    kl = next(cb for cb in config["trainer"]["callbacks"] if cb["class_path"].endswith("PredictedKLControl"))
    kl["init_args"]["schedule"].update(delta_min=0.01, delta_max=0.001)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(config))
    err = _run(tmp_path, capsys, config=bad)
    assert "schedule.delta_min=0.01 exceeds schedule.delta_max=0.001" in err, err
    assert not any(empty_cache.iterdir())


def test_rank_above_d_in_fails_before_the_warm_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], empty_cache: Path
) -> None:
    err = _run(tmp_path, capsys, "--model.logra.rank=200", "--trainer.enable_progress_bar=false")
    assert "logra.rank=200 exceeds d_in=128" in err and "use rank <= 128" in err, err
    assert not (empty_cache / "warm").exists()  # the model config was read; nothing was trained


def test_greedy_training_warns(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="logra_pl")
    RolloutSettings(temperature=0.0)
    assert "training samples greedily" in caplog.text


def test_a_response_length_beyond_the_engines_context_is_refused_before_the_first_update(tmp_path, rl_run) -> None:
    """Known once the policy and its engine are loaded (tiny: 1,024 positions): one message, no update run."""
    from logra_pl.errors import ConfigError
    from logra_pl.module import LoGRAPolicyModule, RolloutSettings

    module = LoGRAPolicyModule(policy="tiny", rollout=RolloutSettings(max_new_tokens=5000))
    with pytest.raises(ConfigError, match=r"max_new_tokens=5000 leaves no room .* context of 1024 tokens") as info:
        rl_run(module, tmp_path, 2)
    assert "lower model.rollout.max_new_tokens" in str(info.value)
    assert module.step_context is None  # no update began
