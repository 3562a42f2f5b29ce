"""A callback: the share of each update's responses per reward bin, logged as ``reward_hist/<lo>-<hi>``."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch


class RewardHistogram(pl.Callback):
    """Histogram of the verifier's rewards, per update.

    Arguments:
        bins: equal-width bins over [0, 1].
    """

    def __init__(self, bins: int = 4) -> None:
        if bins < 1:
            raise ValueError(f"bins must be >= 1, got {bins}")
        self.bins = bins
        self.counts = [0] * bins  # responses per bin over the whole run

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        ctx = getattr(pl_module, "step_context", None)  # what this update produced (LoGRAPolicyModule)
        if ctx is None:
            return
        rewards = ctx.rewards.to(torch.float64)
        rewards = rewards[~rewards.isnan()].clamp(0.0, 1.0)  # responses the verifier failed on have no reward (NaN)
        if not len(rewards):
            return
        index = (rewards * self.bins).long().clamp(max=self.bins - 1)  # a reward of 1 goes to the last bin
        counts = torch.bincount(index, minlength=self.bins).tolist()
        for k, count in enumerate(counts):
            self.counts[k] += count
            lo, hi = k / self.bins, (k + 1) / self.bins
            pl_module.log(f"reward_hist/{lo:.2f}-{hi:.2f}", count / len(rewards), on_step=True, batch_size=len(rewards))
