"""benchmarks/compare.py end to end on the tiny model: two fresh processes, JSON with runs and ratios."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "compare.py"


def test_compare_writes_runs_and_ratios(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--json",
        str(out),
        "--model-size",
        "tiny",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--repeats",
        "1",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["order"] == ["adamw", "logra"]
    for name in ("adamw", "logra"):
        run = report["runs"][name]
        assert run["updates"] == 3 and run["optimizer"] == name
        for key in (
            "state_bytes",
            "peak_rss_bytes",
            "step_seconds_median",
            "rollout_seconds_median",
            "train_seconds_median",
            "update_seconds_median",
            "sync_payload_bytes",
        ):
            assert run[key] > 0, (name, key)
        assert run["planned_state_bytes"] == run["state_bytes"]  # the planner, checked on the measured run
        assert run["peak_rss_bytes"] > run["baseline_rss_bytes"]
    ratios = report["ratios"]
    assert (
        ratios["logra_vs_adamw_state"]
        == report["runs"]["logra"]["state_bytes"] / report["runs"]["adamw"]["state_bytes"]
    )
    assert ratios["logra_vs_adamw_state"] < 0.6  # tiny model, r=64 of d_in=128: still well under dense Adam
    assert {"logra_vs_adamw_peak", "logra_vs_adamw_step_time"} <= set(ratios)
    assert "logra/adamw" in proc.stdout  # the printed table
