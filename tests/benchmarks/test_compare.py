"""benchmarks/compare.py end to end on the tiny model: three fresh processes (adamw, lora, logra), JSON with runs
and ratios."""

from __future__ import annotations

import json
import math
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
    assert report["order"] == ["adamw", "lora", "logra"]
    for name in ("adamw", "lora", "logra"):
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
            assert math.isfinite(run[key]) and run[key] > 0, (name, key)
        assert run["planned_state_bytes"] == run["state_bytes"]  # the planner, checked on the measured run
        assert run["peak_rss_bytes"] > run["baseline_rss_bytes"]
        assert [r["optimizer"] for r in report["per_run"][name]] == [name]  # one repeat: the median is that run
    ratios = report["ratios"]
    assert (
        ratios["logra_vs_adamw_state"]
        == report["runs"]["logra"]["state_bytes"] / report["runs"]["adamw"]["state_bytes"]
    )
    assert ratios["logra_vs_adamw_state"] < 0.6  # tiny model, r=64 of d_in=128: still well under dense Adam
    assert {"logra_vs_adamw_peak", "logra_vs_adamw_step_time"} <= set(ratios)
    # the LoRA column: adapters and their AdamW state as kinds of their own, no dense optimizer state
    lora, adamw = report["runs"]["lora"], report["runs"]["adamw"]
    kinds = lora["state_by_kind"]
    assert kinds["adapters"] > 0 and kinds["adapter_optimizer_state"] > 0 and kinds["optimizer_state"] == 0
    assert kinds["adapter_optimizer_state"] >= 2 * kinds["adapters"]  # exp_avg and exp_avg_sq
    assert lora["adapter_parameters"] > 0 and lora["rank"] == 64 and lora["lora_alpha"] == 128
    assert lora["parameters"] == adamw["parameters"]  # the base model, adapters counted apart
    assert lora["sync_payload_bytes"] == adamw["sync_payload_bytes"]  # merged target matrices in bf16
    for pair in ("lora_vs_adamw", "logra_vs_adamw", "logra_vs_lora"):
        for metric in ("state", "peak", "step_time", "train_time", "update_time", "sync_bytes"):
            value = ratios[f"{pair}_{metric}"]
            assert value is not None and math.isfinite(value) and value > 0, (pair, metric)
    assert ratios["lora_vs_adamw_state"] == lora["state_bytes"] / adamw["state_bytes"]
    assert ratios["lora_vs_adamw_state"] < 1  # rank-64 adapters and their Adam state: less than dense Adam's
    lines = proc.stdout.splitlines()
    header = next(line for line in lines if "logra/adamw" in line)  # the printed table
    assert header.split() == ["adamw", "lora", "logra", "lora/adamw", "logra/adamw", "logra/lora"]
    for label in ("adapters", "adapter optimizer state", "peak RSS in updates", "step s"):
        row = next(line for line in lines if line.strip().startswith(label))
        numbers = [float(x) for x in row[30:].split() if x != "-"]
        assert numbers and all(math.isfinite(x) for x in numbers), row
