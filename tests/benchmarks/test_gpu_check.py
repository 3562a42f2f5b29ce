"""benchmarks/gpu_check.py in its CPU mode (``--tiny``): a markdown table and JSON for all three optimizers."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

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
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--json", str(out), "--profile", str(tmp_path / "profile")]
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
    assert rows["logra"]["logra_counters"]["applied"] == 5  # warm-up + 3 timed updates + the profiled one, all merged
    assert rows["logra"]["state_bytes"] < rows["adamw"]["state_bytes"]
    assert rows["logra"]["ratios"]["state"] < 1.0 and rows["adamw"]["ratios"]["state"] == 1.0
    assert rows["logra"]["state_by_kind"]["gradients"] == rows["logra"]["state_by_kind"]["optimizer_state"] == 0
    assert rows["adamw"]["state_by_kind"]["optimizer_state"] > 0
    assert rows["adamw"]["state_by_kind"]["gradients"] > 0  # taken right after the step, before zero_grad

    # --profile: one more update per configuration, its operator table and the named ranges' totals.
    for name, row in rows.items():
        assert "update.forward" in (tmp_path / "profile" / f"tiny_{name}.txt").read_text()
        phases = {k: v["count"] for k, v in row["profile"].items() if k.startswith("update.")}
        assert phases == {"update.forward": 1, "update.backward": 1, "update.step": 1}, name
        assert all(v["cpu_ms"] > 0 for v in row["profile"].values())
    logra = {k: v["count"] for k, v in rows["logra"]["profile"].items() if k.startswith("logra.")}
    # 14 matrices; the forward hook runs again when activation checkpointing recomputes the forward in the backward.
    assert logra == {"logra.sketch.project": 28, "logra.sketch.accumulate": 14, "logra.propose": 1, "logra.apply": 1}
    assert not any(k.startswith("logra.") for k in rows["adamw"]["profile"])


def test_the_chunked_log_probs_option_gives_the_full_paths_loss_and_gradients() -> None:
    """``--logprob-chunk``: one update's loss and the target matrices' gradients equal the full log-softmax's
    (fp32, chunks of 7 tokens that do not divide the 56-token response)."""
    import dataclasses
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gpu_check  # its dataclasses look their module up
    try:
        spec.loader.exec_module(gpu_check)
    finally:
        del sys.modules[spec.name]

    class Keep(gpu_check.Method):  # no step: both passes see the same weights; gradients stay to be read
        def step(self) -> None:
            pass

    full = gpu_check.Settings(
        device=torch.device("cpu"), models=["tiny"], optimizers=["adamw"], prompt_len=8, response_len=56, autocast=False
    )
    chunked = dataclasses.replace(full, logprob_chunk=7)
    shape = gpu_check.SHAPES["tiny"]
    model = gpu_check.build_model(shape, full)
    ids, advantage = gpu_check.make_batches(shape, full)[0]
    got = []
    for settings in (full, chunked):
        model.zero_grad(set_to_none=True)
        loss = gpu_check.one_update(model, Keep(model), ids, advantage, settings)["loss"]
        got.append((loss, [p.grad.clone() for p in gpu_check.target_weights(model)]))
    (loss_full, grads_full), (loss_chunked, grads_chunked) = got
    assert math.isfinite(loss_full) and loss_full != 0.0
    assert loss_chunked == pytest.approx(loss_full, rel=1e-5)
    assert len(grads_full) == 14 and all(g.abs().sum() > 0 for g in grads_full)
    for a, b in zip(grads_full, grads_chunked, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
