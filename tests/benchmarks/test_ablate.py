"""benchmarks/ablate.py: the quick grid end to end (real `logra-pl fit` processes), resuming, and its arithmetic."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import ablate  # noqa: E402


def _ablate(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "ablate.py"), "--quick", "--out", str(out), *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)


@pytest.mark.slow
@pytest.mark.cores(2)  # two runs at a time (--jobs 2)
def test_quick_grid_runs_reports_and_resumes(tmp_path: Path) -> None:
    """2 cells x 2 seeds, each its own process: curves, mean ± std, recon cosine, plots; a rerun reuses every run."""
    out = tmp_path / "quick"
    proc = _ablate(out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    assert report["grid"] == "quick" and report["seeds"] == [0, 1] and report["updates"] == 8
    assert sorted(report["cells"]) == ["adamw", "logra_r16"]
    assert 0.0 <= report["val_start"] <= 1.0
    for cell in report["cells"].values():
        runs = cell["runs"]
        assert sorted(runs) == ["0", "1"]
        for run in runs.values():
            assert run["updates"] == 8 and len(run["curves"]["train/reward_mean"]) == 8
            # Validation every 2 updates, logged at the step of the update it follows (the last one included).
            steps = [s for s, _ in run["curves"]["train/reward_mean"]]
            assert [s for s, _ in run["curves"]["val/pass@1"]] == steps[1::2]
            assert run["val_final"] == run["curves"]["val/pass@1"][-1][1]
        # The summary is the mean and sample std over the seeds' own numbers (computed here independently).
        finals = [r["val_final"] for r in runs.values()]
        assert cell["summary"]["val_final"]["mean"] == pytest.approx(statistics.fmean(finals))
        assert cell["summary"]["val_final"]["std"] == pytest.approx(statistics.stdev(finals))
        rewards = runs["0"]["curves"]["train/reward_mean"]
        first, last = [v for _, v in rewards[:4]], [v for _, v in rewards[-4:]]
        assert runs["0"]["reward_gain"] == pytest.approx(statistics.fmean(last) - statistics.fmean(first))
    # Seeds change the RL trajectory (sampling and projections), not the data: different rewards, same prompts.
    logra = report["cells"]["logra_r16"]["runs"]
    assert logra["0"]["curves"]["train/reward_mean"] != logra["1"]["curves"]["train/reward_mean"]
    # LoGRA runs carry SketchDiagnostics and calibrated KL control; AdamW runs have neither.
    for run in logra.values():
        assert 0.0 < run["recon_cosine"] <= 1.0 and 0.0 < run["captured_energy"] <= 1.0
        assert run["kl_realized"] > 0 and run["kl_realized_over_budget"] > 0
    for run in report["cells"]["adamw"]["runs"].values():
        assert math.isnan(run["recon_cosine"]) and run["kl_realized_over_budget"] is None
    for png in ("reward_curves.png", "kl_realized_vs_predicted.png"):
        assert (out / png).stat().st_size > 1000, png
    table = (out / "results.md").read_text()
    assert "| `logra_r16` |" in table and "| `adamw` |" in table and "±" in table

    # Resuming: every finished run is reused, nothing is rerun, and the report is the same.
    again = _ablate(out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("finished earlier, reused") == 4 and "0 runs to do" in again.stdout
    assert json.loads((out / "results.json").read_text())["cells"]["logra_r16"]["runs"] == logra


def test_plan_updates_fits_the_budget() -> None:
    cells = ablate.GRIDS["default"]
    seeds = [0, 1, 2]
    updates = ablate.plan_updates(cells, seeds, budget_minutes=75, jobs=2)
    assert updates % ablate.VALIDATIONS == 0 and updates > 100
    # The estimate it was planned on fits the budget; one more validation period would not.
    cost = ablate.COSTS
    per_update = statistics.fmean(cost[c.optimizer] for c in cells)

    def estimate(n: int) -> float:
        per_run = cost["startup"] + ablate.VALIDATIONS * cost["validation"] + n * per_update
        return per_run * len(cells) * len(seeds) / 2 / 60

    assert estimate(updates) <= 75 < estimate(updates + 2 * ablate.VALIDATIONS)
    with pytest.raises(SystemExit, match="too little"):
        ablate.plan_updates(cells, seeds, budget_minutes=1, jobs=2)


def test_run_args_seed_and_overrides() -> None:
    logra, adamw = ablate.GRIDS["default"][0], ablate.ADAMW_CELL
    args = ablate.run_args("default", logra, 3, 40, Path("out"), 5, ["--model.logra.update_ratio=0.01", "--x=1"])
    assert "--seed_everything=3" in args and "--model.seed=3" in args and "--model.logra.base_seed=3" in args
    assert args[-2:] == ["--model.logra.update_ratio=0.01", "--x=1"]
    assert "--trainer.max_steps=40" in args and "--trainer.val_check_interval=10" in args
    assert "--trainer.callbacks+=callbacks/sketch_diagnostics.yaml" in args
    other = ablate.run_args("default", adamw, 3, 40, Path("out"), 5, ["--model.logra.update_ratio=0.01"])
    assert not any(a.startswith("--model.logra.") for a in other)
    assert "--trainer.callbacks+=callbacks/sketch_diagnostics.yaml" not in other
    demo = ablate.run_args("demo", ablate.GRIDS["demo"][1], 0, None, Path("out"), 5)
    assert demo[:3] == ["fit", "--config", "configs/tiny_cpu_adamw.yaml"] and "--trainer.max_steps" not in " ".join(
        demo
    )


def test_findings_state_the_numbers() -> None:
    def cell(rank, groups, val, gain, recon=None, optimizer="logra"):
        stat = lambda m, s=0.01: {"mean": m, "std": s, "min": m, "max": m, "n": 3}  # noqa: E731
        summary = {k: None for k in ("kl_realized", "kl_realized_over_budget")}
        summary.update(val_final=stat(val), reward_gain=stat(gain), recon_cosine=stat(recon) if recon else None)
        return {"rank": rank, "groups": groups, "optimizer": optimizer, "summary": summary, "runs": {}}

    report = {
        "seeds": [0, 1, 2],
        "cells": {
            "logra_r4": cell(4, {"rank": "r = 4"}, 0.20, 0.05, 0.17),
            "logra_r64": cell(64, {"rank": "r = 64", "optimizer": "LoGRA"}, 0.30, 0.09, 0.55),
            "adamw": cell(None, {"optimizer": "AdamW"}, 0.31, 0.10, optimizer="adamw"),
        },
    }
    text = "\n".join(ablate.findings(report))
    assert "reproduces at 80%" in text and "90% of AdamW's" in text
    assert "Pass@1 grows with rank (reproduces): r=4: 0.200, r=64: 0.300" in text
    assert "Reconstruction cosine grows with rank (reproduces" in text
    report["cells"]["adamw"]["summary"]["reward_gain"]["mean"] = 0.2
    assert "does not reproduce at 80%" in "\n".join(ablate.findings(report))
