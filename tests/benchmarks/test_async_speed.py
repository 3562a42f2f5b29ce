"""benchmarks/async_speed.py's reading of a run: updates per minute from the events' wall times, gain, mean ± std."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import async_speed


def test_summarize_reads_rates_and_gains_from_the_events(tmp_path: Path) -> None:
    writer = SummaryWriter(str(tmp_path))
    for step in range(10):  # one update every 2 s after a slow start (the first 3 are skipped)
        wall = 100.0 + (30.0 if step else 0.0) + 2.0 * step
        writer.add_scalar("train/reward_mean", 0.1 * step, step, walltime=wall)
        writer.add_scalar("async/trainer_wait_s", 0.5, step, walltime=wall)
        writer.add_scalar("time/rollout_s", 9.0 if step < 3 else 1.0, step, walltime=wall)  # startup skipped
        writer.add_scalar("async/engine_idle_s", float(step), step, walltime=wall)
    writer.add_scalar("val/pass@1", 0.4, 9, walltime=200.0)
    writer.close()
    out = async_speed.summarize(tmp_path, skip=3)
    assert out["updates_per_min"] == pytest.approx(6 / (12 / 60))  # steps 3..9: 6 intervals in 12 s
    assert out["reward_gain"] == pytest.approx(0.1 * 8.5 - 0.1 * 0.5)  # last two vs first two (a fifth of 10)
    assert out["wall_min"] == pytest.approx(48 / 60) and out["val_pass@1"] == pytest.approx(0.4)
    assert out["trainer_wait_s"] == pytest.approx(0.5) and len(out["curve"]) == 10
    assert out["rollout_s"] == pytest.approx(1.0) and out["engine_idle_s"] == pytest.approx(6.0)  # mean of 3..9
    assert "train_s" not in out  # not logged: left out, not zero
    assert async_speed._mean_std([1.0, 3.0]) == (2.0, pytest.approx(2**0.5)) and async_speed._mean_std([5.0]) == (5, 0)
