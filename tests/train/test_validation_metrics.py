"""``ValidationMetrics`` without a Trainer: unbiased pass@j (checked against ``math.comb``), per-task values, panel."""

from __future__ import annotations

import math

import torch

from logra_pl.train.validation import ValidationMetrics

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


def test_pass_at_1_per_eval_subset() -> None:
    """Items tagged ``eval_subset`` get ``val/tune/pass@1`` and ``val/report/pass@1``, counted over their own
    responses; ``val/pass@1`` stays the mean over every problem, and untagged items log no subset values."""
    metrics = ValidationMetrics(ks=[1], samples=2)
    batch = [
        {**_item("sum", "1+1"), "eval_subset": "report"},
        {**_item("sum", "2+2"), "eval_subset": "tune"},
        {**_item("sum", "3+3"), "eval_subset": "report"},
        {**_item("sum", "4+4"), "eval_subset": "tune"},
        {**_item("sum", "5+5"), "eval_subset": "tune"},
    ]
    correct = [[1, 1], [0, 1], [0, 0], [1, 1], [0, 0]]  # report: 2 of 4; tune: 3 of 6; all: 5 of 10
    metrics.start(batch, CPU)
    for lo, hi in ((0, 2), (2, 5)):  # two validation batches accumulate
        rewards = torch.tensor([float(c) for row in correct[lo:hi] for c in row], dtype=torch.float64)
        metrics.update(batch[lo:hi], rewards, [], CPU)
    out = metrics.compute()
    assert set(out) == {"val/pass@1", "val/tune/pass@1", "val/report/pass@1"}
    assert abs(float(out["val/pass@1"]) - 5 / 10) < 1e-6
    assert abs(float(out["val/tune/pass@1"]) - 3 / 6) < 1e-6
    assert abs(float(out["val/report/pass@1"]) - 2 / 4) < 1e-6
    # A second pass starts from zero (reset after compute).
    metrics.start(batch, CPU)
    metrics.update(batch[:2], torch.tensor([0.0, 0.0, 1.0, 1.0], dtype=torch.float64), [], CPU)
    again = metrics.compute()
    assert float(again["val/tune/pass@1"]) == 1.0 and float(again["val/report/pass@1"]) == 0.0
    # Untagged evaluation problems: no subset values (what every existing config logs).
    plain = [_item("sum", "1+1"), _item("sum", "2+2")]
    metrics.start(plain, CPU)
    metrics.update(plain, torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64), [], CPU)
    assert set(metrics.compute()) == {"val/pass@1"}
