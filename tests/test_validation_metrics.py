"""``ValidationMetrics`` without a Trainer: unbiased pass@j (checked against ``math.comb``), per-task values, panel."""

from __future__ import annotations

import math

import torch

from logra_pl.validation import ValidationMetrics

CPU = torch.device("cpu")


def _item(task: str, q: str) -> dict:
    return {"messages": [{"role": "user", "content": q}], "task": task}


def test_pass_at_j_per_task_and_the_panel() -> None:
    metrics = ValidationMetrics(ks=[1, 2], samples=4)
    batch = [_item("sum", "1+1"), _item("sum", "2+2"), _item("prod", "3*3")]
    metrics.start(batch, CPU)
    correct = [[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 0]]
    rewards = torch.tensor([float(c) for row in correct for c in row], dtype=torch.float64)
    texts = [f"answer {i}" for i in range(12)]
    metrics.update(batch, rewards, texts, CPU)
    out = metrics.compute()

    def pass_at(n: int, c: int, k: int) -> float:  # the unbiased estimator, written here
        return 1.0 - (math.comb(n - c, k) / math.comb(n, k) if n - c >= k else 0.0)

    counts = [sum(row) for row in correct]
    assert abs(float(out["val/pass@1"]) - sum(counts) / 12) < 1e-6
    assert abs(float(out["val/pass@2"]) - sum(pass_at(4, c, 2) for c in counts) / 3) < 1e-6
    per_task = {"sum": (2 + 0) / 8, "prod": 3 / 4}
    for task, value in per_task.items():
        assert abs(float(out[f"val/{task}/pass@1"]) - value) < 1e-6
    assert abs(float(out["val/macro_pass@1"]) - sum(per_task.values()) / 2) < 1e-6
    panel = metrics.panel()
    assert panel.count("\n") == 4 and "| 1+1 | answer 0 | 1.00 |" in panel and "| 3*3 | answer 8 | 1.00 |" in panel
    assert metrics.compute() is None  # reset after compute


def test_one_task_logs_no_per_task_values() -> None:
    metrics = ValidationMetrics(ks=[1], samples=1)
    batch = [_item("sum", "1+1"), _item("sum", "2+2")]
    metrics.start(batch, CPU)
    metrics.update(batch, torch.tensor([1.0, 0.0], dtype=torch.float64), [], CPU)
    out = metrics.compute()
    assert set(out) == {"val/pass@1"} and abs(float(out["val/pass@1"]) - 0.5) < 1e-6
    assert metrics.panel() is None
