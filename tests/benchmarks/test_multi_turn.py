"""benchmarks/multi_turn.py: each engine's command line, the summary of a run's curves, the report table. Quick paths
only (nothing is trained; the runs themselves are the benchmark's)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import multi_turn  # noqa: E402


def test_each_engine_runs_the_calculator_overlay_last(tmp_path: Path) -> None:
    for engine in multi_turn.ENGINES:
        args = multi_turn.run_args(engine, 2, 40, tmp_path, "http://127.0.0.1:9")
        configs = [args[i + 1] for i, a in enumerate(args) if a == "--config"]
        assert configs[0] == "configs/tiny_cpu.yaml" and configs[-1] == "configs/overlays/calculator.yaml"
        assert ("configs/overlays/vllm.yaml" in configs) == (engine != "hf")
        assert (
            "--seed_everything=2" in args and "--model.logra.base_seed=2" in args and "--trainer.max_steps=40" in args
        )
        served = [a for a in args if a.startswith("--model.engine")]
        assert served == (
            [
                "--model.engine=logra_pl.rollout.remote.RemoteSettings",
                "--model.engine.init_args.urls=[http://127.0.0.1:9]",
            ]
            if engine == "served"
            else []
        )


def test_summary_counts_an_update_without_tool_calls_as_zero() -> None:
    steps = range(1, 21)
    scalars = {
        "train/reward_mean": [(s, 0.5 if s <= 2 else 0.9) for s in steps],
        "env/tool_calls": [(s, 1.0) for s in steps if s > 2],  # the first two updates made no call: not logged
        "env/turns": [(s, 2.0) for s in steps],
        "val/pass@1": [(20, 0.75)],
    }
    out = multi_turn.summarize(scalars, 12.0)
    assert out["updates"] == 20 and out["wall_s"] == 12.0
    assert out["reward_mean_first"] == pytest.approx(0.5) and out["reward_mean_last"] == pytest.approx(0.9)
    assert out["tool_calls_first"] == 0.0 and out["tool_calls_last"] == 1.0
    assert out["tool_errors_first"] == 0.0 and out["val_final"] == 0.75


def test_report_names_each_engines_seeds() -> None:
    def run(engine: str, seed: int, first: float, last: float) -> dict:
        keys = ("reward_mean", "tool_calls", "tool_errors", "turns")
        numbers = {f"{k}_{w}": v for k in keys for w, v in (("first", first), ("last", last))}
        return {"engine": engine, "seed": seed, "val_final": 0.9, "wall_s": 100.0, **numbers}

    text = multi_turn.report([run("hf", 0, 0.4, 0.8), run("hf", 1, 0.6, 0.9), run("served", 0, 0.5, 0.9)], 40)
    assert "| | hf (seeds 0, 1) | served (seeds 0) |" in text
    assert "| reward (first 10% → last 10%) | 0.500 ± 0.141 → 0.850 ± 0.071 | 0.500 ± 0.000 → 0.900 ± 0.000 |" in text
    assert "| reward gain | 0.350 ± 0.071 | 0.400 ± 0.000 |" in text
