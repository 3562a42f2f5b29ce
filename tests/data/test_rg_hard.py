"""Reasoning-Gym Hard: per-task caps, default-difficulty eval, the preset, the selection script and its config."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import reasoning_gym
import yaml

from logra_pl.data import ReasoningGymDataModule
from logra_pl.data.reasoning_gym import _task_seed
from logra_pl.data.rg_hard import RG_HARD_TASKS, RGHardDataModule
from logra_pl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}


def _digest(items: list[dict]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for it in items:
        h.update(it["question"].encode() + b"\0" + it["id"].encode() + b"\0")
    return h.hexdigest()


def test_tiny_cpu_draw_is_unchanged() -> None:
    """configs/tiny_cpu.yaml draws the same questions, in the same order, as before per-task caps existed."""
    cfg = yaml.safe_load((ROOT / "configs" / "tiny_cpu.yaml").read_text())["data"]
    dm = ReasoningGymDataModule(**cfg)
    dm.setup()
    assert (len(dm.train_items), len(dm.eval_items)) == (3000, 256)
    assert _digest(dm.train_items) == "88b0aa83fab010ac"
    assert _digest(dm.eval_items) == "cd1ef696706469aa"


def test_per_task_caps_default_difficulty_and_disjoint_splits() -> None:
    tasks = {"chain_sum": {"weight": 5.0, "config": SMALL}, "leg_counting": {"weight": 1.0}}
    dm = ReasoningGymDataModule(
        tasks, per_task_train=30, per_task_eval=7, eval_default_difficulty=True, prompts_per_step=8, seed=5
    )
    dm.setup()
    train = [it["task"] for it in dm.train_items]
    evals = [it["task"] for it in dm.eval_items]
    assert train.count("chain_sum") == 30 and train.count("leg_counting") == 30  # weights ignored
    assert evals.count("chain_sum") == 7 and evals.count("leg_counting") == 7
    train_q = [it["question"] for it in dm.train_items]
    eval_q = [it["question"] for it in dm.eval_items]
    assert len(set(train_q)) == len(train_q) and len(set(eval_q)) == len(eval_q)
    assert not set(train_q) & set(eval_q)
    # Eval at the default config: the same questions as a direct draw without the config overrides ...
    direct = reasoning_gym.create_dataset("chain_sum", size=28, seed=_task_seed(5, "chain_sum", "eval"))
    assert eval_q[:7] == [direct[i]["question"] for i in range(7)]
    # ... while training keeps them (SMALL: at most 3 one-digit terms).
    assert all(re.findall(r"\d+", q) and max(map(len, re.findall(r"\d+", q))) == 1 for q in train_q[:30])
    assert any(max(map(len, re.findall(r"\d+", q))) > 1 for q in eval_q[:7])


def test_small_problem_space_caps_below_the_request() -> None:
    tiny_space = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    dm = ReasoningGymDataModule({"chain_sum": {"config": tiny_space}}, per_task_train=5000, per_task_eval=20)
    dm.setup()
    assert len(dm.eval_items) == 20 and 64 <= len(dm.train_items) < 5000  # "up to N"


def test_bad_per_task_arguments() -> None:
    with pytest.raises(ConfigError, match=r"data\.per_task_train must be an integer >= 1"):
        ReasoningGymDataModule(["chain_sum"], per_task_train=0)
    with pytest.raises(ConfigError, match=r"data\.per_task_eval must be an integer"):
        ReasoningGymDataModule(["chain_sum"], per_task_eval=2.5)
    with pytest.raises(ConfigError, match="eval_default_difficulty"):
        ReasoningGymDataModule(["chain_sum"], eval_default_difficulty="yes")


def test_rg_hard_preset() -> None:
    assert len(RG_HARD_TASKS) == 8 and len(set(RG_HARD_TASKS)) == 8
    dm = RGHardDataModule(per_task_train=8, per_task_eval=3, prompts_per_step=8)
    assert (dm.per_task_eval, dm.eval_default_difficulty) == (3, True)
    assert RGHardDataModule().per_task_train == 5000 and RGHardDataModule().per_task_eval == 25
    dm.setup()
    assert [it["task"] for it in dm.eval_items] == [t for t in RG_HARD_TASKS for _ in range(3)]
    assert len(dm.train_items) == 64
    assert dm.hparams["per_task_eval"] == 3


@pytest.mark.slow
def test_select_script_on_the_tiny_model() -> None:
    cmd = [sys.executable, str(ROOT / "scripts" / "select_rg_hard.py"), "--policy", "tiny", "--problems", "4"]
    cmd += ["--tasks", "chain_sum", "basic_arithmetic", "leg_counting", "--scoring-timeout", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("task "))
    rows = [line.split()[0] for line in lines[header + 1 : header + 4]]
    assert rows == ["chain_sum", "basic_arithmetic", "leg_counting"]
    start = next(i for i, line in enumerate(lines) if line.startswith("tasks:"))
    kept = yaml.safe_load("\n".join(lines[start:]))["tasks"]
    assert isinstance(kept, list) and set(kept) <= set(rows)


@pytest.fixture
def _argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["logra-pl"])


@pytest.mark.usefixtures("_argv")
def test_rg_hard_config_parses_and_validates(tmp_path: Path) -> None:
    from logra_pl.cli import LoGRACLI

    config = str(ROOT / "configs" / "eval" / "rg_hard.yaml")
    cli = LoGRACLI(args=["--config", config], run=False)
    assert isinstance(cli.datamodule, RGHardDataModule)
    assert cli.model.rollout_settings.max_new_tokens == 16384
    cli = LoGRACLI(
        args=[
            "validate",
            "--config",
            config,
            "--model.policy=tiny",
            "--model.rollout.max_new_tokens=4",
            "--data.init_args.per_task_train=8",
            "--data.init_args.per_task_eval=2",
            "--trainer.accelerator=cpu",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
        ]
    )
    metrics = cli.trainer.callback_metrics
    assert "val/macro_pass@1" in metrics
    assert {f"val/{t}/pass@1" for t in RG_HARD_TASKS} <= set(metrics)
