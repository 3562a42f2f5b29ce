"""benchmarks/gpu_check.py in its CPU mode (``--tiny``): a markdown table and JSON for all three optimizers."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu_check.py"
OPTIMIZERS = ("adamw", "lora", "logra")


def numbers(value: Any) -> list[float]:
    """Every int/float inside a JSON value (bools excluded)."""
    if isinstance(value, dict):
        return [x for v in value.values() for x in numbers(v)]
    if isinstance(value, list):
        return [x for v in value for x in numbers(v)]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [float(value)]
    return []


def test_gpu_check_tiny_prints_table_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--json", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    table = [line for line in proc.stdout.splitlines() if line.startswith("| tiny Qwen2 |")]
    assert [line.split("|")[2].strip() for line in table] == list(OPTIMIZERS)
    assert "OOM" not in proc.stdout and "error" not in proc.stdout
    assert "0.782" in proc.stdout and "0.543" in proc.stdout  # the paper's ratios, for reference
    assert "not the same quantity" in proc.stdout

    report = json.loads(out.read_text())
    rows = {row["optimizer"]: row for row in report["rows"]}
    assert set(rows) == set(OPTIMIZERS)
    values = numbers(report)
    assert values and all(math.isfinite(v) for v in values)
    for name, row in rows.items():
        assert row["status"] == "ok", (name, row.get("error"))
        assert row["state_bytes"] > 0 and row["seconds_per_update"] > 0, name
        assert row["state_bytes"] == row["state_by_kind"]["total"]
        assert len(row["updates"]) == report["settings"]["updates"] == 3
    assert rows["logra"]["logra_counters"]["applied"] == 4  # warm-up + 3 timed updates, all merged
    assert rows["logra"]["state_bytes"] < rows["adamw"]["state_bytes"]
    assert rows["logra"]["ratios"]["state"] < 1.0 and rows["adamw"]["ratios"]["state"] == 1.0
    assert rows["logra"]["state_by_kind"]["gradients"] == rows["logra"]["state_by_kind"]["optimizer_state"] == 0
    assert rows["adamw"]["state_by_kind"]["optimizer_state"] > 0
    assert rows["adamw"]["state_by_kind"]["gradients"] > 0  # taken right after the step, before zero_grad
