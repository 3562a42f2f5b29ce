"""``RunSummary``: at the end of ``fit``, print what the run achieved, in numbers."""

from __future__ import annotations

import math
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from logra_pl.callbacks.contract import view_of


def _mean(values: list[float]) -> float:
    """The mean of the finite values (an update whose responses all failed to score has a NaN reward mean)."""
    finite = [v for v in values if math.isfinite(v)]
    return math.fsum(finite) / len(finite) if finite else math.nan


class RunSummary(pl.Callback):
    """Collect per-update metrics and validation results; print a short summary when training ends.

    Arguments:
        window: updates averaged at the start and at the end of the run for the reward comparison.
    """

    READS = ("step_context",)  # what it reads of the policy contract (any other module: no reward summary)

    def __init__(self, window: int = 10) -> None:
        self.window = window
        self.rewards: list[float] = []
        self.val: list[tuple[int, float, float]] = []
        self._start = 0.0
        self._elapsed = 0.0  # seconds of earlier sessions of a resumed run
        self._resumes = 0

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        view = view_of(pl_module, self.READS)
        ctx = view.step_context if view is not None else None
        if ctx is not None and "train/reward_mean" in ctx.metrics:
            self.rewards.append(ctx.metrics["train/reward_mean"])

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After the module's on_validation_epoch_end, which logs val/pass@1.
        metrics = trainer.callback_metrics
        if "val/pass@1" in metrics and not trainer.sanity_checking:
            self.val.append((trainer.global_step, float(metrics["val/reward_mean"]), float(metrics["val/pass@1"])))

    def summary(self) -> str:
        """The summary text (empty before any update). Covers the whole run, across resumes."""
        if not self.rewards:
            return ""
        n, w = len(self.rewards), self.window
        elapsed = self._elapsed + time.perf_counter() - self._start
        lines = [
            f"updates: {n} in {elapsed:.0f} s" + (f" (over {self._resumes + 1} sessions)" if self._resumes else "")
        ]
        if n < 2 * w:
            mean = _mean(self.rewards)
            lines.append(
                f"train/reward_mean: {mean:.3f} over {n} updates (too short to compare the first and last {w}: "
                f"needs {2 * w})"
            )
        else:
            first = _mean(self.rewards[:w])
            last = _mean(self.rewards[-w:])
            lines.append(
                f"train/reward_mean: first {w} updates {first:.3f} -> last {w} updates {last:.3f} ({last - first:+.3f})"
            )
        lines += [f"val @ update {step}: reward {r:.3f}, pass@1 {p:.3f}" for step, r, p in self.val]
        return "\n".join(lines)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        text = self.summary()
        if text:
            rank_zero_info("\n" + text)

    @override
    def state_dict(self) -> dict[str, Any]:
        """Every update's reward and every validation so far: a resumed run's summary covers the whole run."""
        return {
            "rewards": list(self.rewards),
            "val": [list(v) for v in self.val],
            "elapsed": self._elapsed + time.perf_counter() - self._start,
            "resumes": self._resumes,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rewards = [float(r) for r in state_dict.get("rewards", [])]
        self.val = [(int(s), float(r), float(p)) for s, r, p in state_dict.get("val", [])]
        self._elapsed = float(state_dict.get("elapsed", 0.0))
        self._resumes = int(state_dict.get("resumes", 0)) + 1
