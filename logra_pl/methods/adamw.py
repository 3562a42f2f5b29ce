"""``DenseAdamW``: the dense baseline of algorithm.md §10 — AdamW with warmup and cosine decay on the target matrices.

The divergence guard previews the step from the gradients and AdamW's state (:func:`~logra_pl.optim.adamw_step_preview`)
before taking it; a rejected step drops the gradients, so ``step()`` changes nothing. Engines receive the changed
tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from logra_pl.guard import DivergenceGuard
from logra_pl.methods.base import AllReduceSum, StepResult, UpdateMethod, bytes_text, count_text, relative
from logra_pl.optim import AdamWConfig, adamw_step_preview, adamw_update_norm
from logra_pl.sketch import select_targets
from logra_pl.sketch.memory import MemoryReport, memory_report
from logra_pl.sketch.merge import full_tensor


class DenseAdamW(UpdateMethod):
    """Dense AdamW on the module's target matrices (or, with ``adamw.train_all``, on every parameter).

    Arguments:
        adamw: learning rate, moments, schedule (:class:`~logra_pl.optim.AdamWConfig`).
    """

    name = "adamw"

    def __init__(self, adamw: AdamWConfig | None = None) -> None:
        self.adamw = adamw or AdamWConfig()
        self.guard = DivergenceGuard()
        self.optimizer: torch.optim.AdamW | None = None
        self.last_relative_update = 0.0

    def trainable(self, policy: nn.Module, targets: Sequence[str]) -> list[nn.Parameter]:
        """The parameters AdamW trains (``requires_grad`` set on them, cleared on the rest)."""
        if self.adamw.train_all:
            params = list(policy.parameters())
            for p in params:
                p.requires_grad_(True)
            return params
        for p in policy.parameters():
            p.requires_grad_(False)
        params = [m.weight for m in select_targets(policy, targets).values()]
        for p in params:
            p.requires_grad_(True)
        return params

    @override
    def configure_optimizers(self, policy: nn.Module, targets: Sequence[str], guard: DivergenceGuard) -> Any:
        self.guard = guard
        opt, sched = self.adamw.build(self.trainable(policy, targets))
        self.optimizer = opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    @override
    def step(self, optimizer: Any, scheduler: Any, all_reduce_sum: AllReduceSum) -> StepResult:
        rejected = self.preview(optimizer.optimizer, all_reduce_sum)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        norm = 0.0 if rejected else adamw_update_norm(optimizer.optimizer)  # from the state: no copy of the weights
        scheduler.step()
        return StepResult(rejected, norm)

    def preview(self, optimizer: torch.optim.Optimizer, all_reduce_sum: AllReduceSum) -> str | None:
        """Preview the step; if the guard rejects it, drop the gradients so ``step()`` changes nothing."""
        if not self.guard.enabled:
            return None
        upd, w, bad = all_reduce_sum(torch.tensor(adamw_step_preview(optimizer), dtype=torch.float64)).tolist()
        self.last_relative_update = relative(upd, w)
        if bad:
            reason = f"the step would make {int(bad)} weights non-finite"
        elif not math.isfinite(self.last_relative_update):
            reason = "non-finite update (the gradients hold inf/NaN)"
        elif self.last_relative_update > self.guard.max_update_ratio:
            reason = (
                f"update size ‖ΔW‖/‖W‖ = {self.last_relative_update:.3g} exceeds the guard's max_update_ratio "
                f"{self.guard.max_update_ratio:g}"
            )
        else:
            return None
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None  # torch's AdamW leaves parameters without a gradient (and their state) untouched
        return reason

    @override
    def trained_tensors(self, policy: nn.Module) -> dict[str, torch.Tensor]:
        return {n: full_tensor(p).detach() for n, p in policy.named_parameters() if p.requires_grad}

    @override
    def changed_numel(self, policy: nn.Module) -> int:
        return sum(p.numel() for p in policy.parameters() if p.requires_grad)

    @override
    def metrics(self) -> dict[str, float]:
        return {"guard/relative_update": self.last_relative_update}

    @override
    def memory(self, policy: nn.Module) -> MemoryReport:
        return memory_report(policy, optimizer=self.optimizer)

    @override
    def trained_parameter_count(self, policy: nn.Module) -> int:
        return sum(p.numel() for p in policy.parameters() if p.requires_grad)

    def _state_text(self, policy: nn.Module) -> tuple[str, str]:
        grad = sum(p.numel() * p.element_size() for p in policy.parameters() if p.requires_grad)
        return bytes_text(grad), bytes_text(2 * grad)

    @override
    def report(self, policy: nn.Module, targets: Sequence[str]) -> str:
        grads, moments = self._state_text(policy)
        what = "every parameter" if self.adamw.train_all else "the attention/MLP matrices"
        return (
            f"dense AdamW trains {count_text(self.trained_parameter_count(policy))} parameters ({what}): {grads} of "
            f"gradients and {moments} of Adam moments"
        )
