"""``RunSummary``: at the end of ``fit``, print what the run achieved, in numbers."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override


class RunSummary(pl.Callback):
    """Collect per-update metrics and validation results; print a short summary when training ends.

    Arguments:
        window: updates averaged at the start and at the end of the run for the reward comparison.
    """

    def __init__(self, window: int = 10) -> None:
        self.window = window
        self.rewards: list[float] = []
        self.val: list[tuple[int, float, float]] = []
        self._start = 0.0

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        ctx = getattr(pl_module, "step_context", None)
        if ctx is not None and "train/reward_mean" in ctx.metrics:
            self.rewards.append(ctx.metrics["train/reward_mean"])

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        metrics = trainer.callback_metrics
        if "val/pass@1" in metrics and not trainer.sanity_checking:
            self.val.append((trainer.global_step, float(metrics["val/reward_mean"]), float(metrics["val/pass@1"])))

    def summary(self) -> str:
        """The summary text (empty before any update)."""
        if not self.rewards:
            return ""
        w = min(self.window, len(self.rewards))
        first = sum(self.rewards[:w]) / w
        last = sum(self.rewards[-w:]) / w
        lines = [
            f"updates: {len(self.rewards)} in {time.perf_counter() - self._start:.0f} s",
            f"train/reward_mean: first {w} updates {first:.3f} -> last {w} updates {last:.3f} ({last - first:+.3f})",
        ]
        lines += [f"val @ update {step}: reward {r:.3f}, pass@1 {p:.3f}" for step, r, p in self.val]
        return "\n".join(lines)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        text = self.summary()
        if text:
            rank_zero_info("\n" + text)
