"""``RolloutMismatch``: how far the rollout engine's log-probs sit above the trainer's (algorithm.md §7)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from logra_pl.callbacks.contract import require_view, view_of
from logra_pl.errors import check_range
from logra_pl.runtime.ranks import all_reduce_sum


def observed_mismatch(
    logp_rollout: torch.Tensor, logp_trainer: torch.Tensor, mask: torch.Tensor, eos_terminated: torch.Tensor
) -> tuple[float, int]:
    """``(Σ (logp_rollout − logp_trainer), token count)`` over valid tokens of EOS-terminated responses."""
    keep = mask * eos_terminated.to(mask.dtype).unsqueeze(1)
    diff = (logp_rollout.to(torch.float64) - logp_trainer.to(torch.float64)) * keep
    return float(diff.sum()), int(keep.sum())


class RolloutMismatch(pl.Callback):
    """EMA of the observed rollout/trainer log-prob gap, read by step controllers through the step context.

    Per update, over responses that ended with EOS (truncated ones are excluded) and their valid tokens:
    ``observed = mean(logp_rollout − logp_trainer)`` (summed over ranks, clamped ≥ 0), then
    ``m ← (1 − ema)·m + ema·observed`` (the first valid observation sets ``m``'s EMA from 0). An update
    without a valid measurement leaves ``m`` unchanged. The step controller uses
    ``max(budget − m, floor·budget)``. In an asynchronous run only batches sampled by the trainer's current weights
    (``ctx.staleness == 0``) are measured: a stale batch's gap holds the updates made since, not the engine's error.

    Arguments:
        ema: weight of the new observation (0.3).
        floor: lower bound of the effective budget as a fraction of the budget (0.5).
    """

    READS = ("step_context",)  # what it reads of the policy contract (docs/extending.md)

    def __init__(self, ema: float = 0.3, floor: float = 0.5) -> None:
        check_range("ema", ema, 0.0, 1.0, low_open=True)
        check_range("floor", floor, 0.0, 1.0)
        self.ema = ema
        self.floor = floor
        self.value = 0.0
        self.last_observed: float | None = None
        self._seen_update: int | None = None
        self._logged_update: int | None = None

    def observe(self, ctx: Any, trainer: pl.Trainer | None = None) -> float:
        """Fold this step's observation into ``m`` once per update index; return ``m``. Idempotent."""
        if self._seen_update == ctx.update_index:
            return self.value
        self._seen_update = ctx.update_index
        if getattr(ctx, "staleness", 0):  # sampled by older weights: the gap is the updates', not the engine's
            self.last_observed = None
            return self.value
        total, count = observed_mismatch(
            ctx.logp_rollout, ctx.logp_trainer, ctx.packed.response_mask, ctx.eos_terminated
        )
        if trainer is not None and trainer.world_size > 1:
            # Summed on the strategy's device: NCCL, the process group of GPU runs, reduces no CPU tensors.
            both = torch.tensor([total, float(count)], dtype=torch.float64)
            summed = all_reduce_sum(trainer, both, trainer.strategy.root_device)
            total, count = float(summed[0]), int(summed[1])
        if count == 0:
            self.last_observed = None
            return self.value
        observed = max(total / count, 0.0)
        self.last_observed = observed
        self.value = (1.0 - self.ema) * self.value + self.ema * observed
        return self.value

    def effective_budget(self, budget: float) -> float:
        """``max(budget − m, floor·budget)``."""
        return max(budget - self.value, self.floor * budget)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse a module without the policy contract (it has no rollouts to measure: the callback would do
        nothing)."""
        require_view(pl_module, "RolloutMismatch", self.READS)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        view = view_of(pl_module, self.READS)
        ctx = view.step_context if view is not None else None
        if ctx is None:
            return
        self.observe(ctx, trainer)  # a step controller may already have folded this update in
        if self._logged_update != ctx.update_index:
            self._logged_update = ctx.update_index
            bs = len(ctx.rollout)
            if self.last_observed is not None:
                pl_module.log("mismatch/observed", self.last_observed, on_step=True, batch_size=bs)
            pl_module.log("mismatch/ema", self.value, on_step=True, batch_size=bs)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "last_observed": self.last_observed}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.value = float(state_dict["value"])
        self.last_observed = state_dict.get("last_observed")
