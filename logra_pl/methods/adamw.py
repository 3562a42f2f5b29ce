"""``DenseAdamW``: the dense baseline of algorithm.md §10 — AdamW with warmup and cosine decay on the target matrices.

Its optimizer (:class:`~logra_pl.optim.ProposingAdamW`) steps through a proposal, as LoGRA's does: AdamW's step
``ΔW`` (previewed from the gradients and AdamW's state, :func:`~logra_pl.optim.adamw_step_deltas`) is offered to
``on_before_optimizer_step`` callbacks, which may scale it by ``α`` (``lr·α`` for this step) or veto it; the
divergence guard then judges the α-scaled step (:func:`~logra_pl.optim.adamw_step_preview`) before it is taken. A
vetoed or rejected step drops the gradients, so nothing changes. Step controllers probe the step with
:meth:`DenseAdamW.logit_tangent` (the logits' JVP along ``ΔW``, algorithm.md §6). Engines receive the changed tensors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from logra_pl.guard import DivergenceGuard
from logra_pl.methods.base import AllReduceSum, StepResult, UpdateMethod, bytes_text, count_text, relative
from logra_pl.optim import AdamWConfig, AdamWProposal, ProposingAdamW, adamw_step_preview, adamw_update_norm
from logra_pl.sketch import select_targets
from logra_pl.sketch.memory import MemoryReport, memory_report
from logra_pl.sketch.merge import full_tensor
from logra_pl.sketch.probe import ProbeMode, parameter_logit_tangent
from logra_pl.sketch.targets import canonical_name


class DenseAdamW(UpdateMethod):
    """Dense AdamW on the module's target matrices (or, with ``adamw.train_all``, on every parameter).

    Arguments:
        adamw: learning rate, moments, schedule (:class:`~logra_pl.optim.AdamWConfig`).
    """

    name = "adamw"
    makes_proposals = True

    def __init__(self, adamw: AdamWConfig | None = None) -> None:
        self.adamw = adamw or AdamWConfig()
        self.guard = DivergenceGuard()
        self.optimizer: ProposingAdamW | None = None
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
        inner: ProposingAdamW = optimizer.optimizer
        inner.check = lambda opt, proposal: self.judge(opt, proposal, all_reduce_sum)
        optimizer.step()  # propose → closure (hooks: α, veto) → the guard's check → AdamW at lr·α, or no step
        rejected = inner.last_rejection
        optimizer.zero_grad(set_to_none=True)
        # From the state: no copy of the weights.
        norm = 0.0 if rejected else adamw_update_norm(inner, alpha=inner.last_alpha)
        scheduler.step()
        return StepResult(rejected, norm)

    def judge(
        self, optimizer: torch.optim.Optimizer, proposal: AdamWProposal, all_reduce_sum: AllReduceSum
    ) -> str | None:
        """The divergence guard's verdict on the step at ``proposal.alpha`` (None: take it). Runs after the step
        controllers, so it judges the step that would be taken; ``ProposingAdamW`` drops a rejected step."""
        if not self.guard.enabled:
            return None
        preview = adamw_step_preview(optimizer, proposal.alpha, proposal.previewed)
        upd, w, bad = all_reduce_sum(torch.tensor(preview, dtype=torch.float64)).tolist()
        self.last_relative_update = relative(upd, w)
        if bad:
            return f"the step would make {int(bad)} weights non-finite"
        if not math.isfinite(self.last_relative_update):
            return "non-finite update (the gradients hold inf/NaN)"
        if self.last_relative_update > self.guard.max_update_ratio:
            return (
                f"update size ‖ΔW‖/‖W‖ = {self.last_relative_update:.3g} exceeds the guard's max_update_ratio "
                f"{self.guard.max_update_ratio:g}"
            )
        return None

    # ------------------------------------------------------------------------------------ step control
    @property
    @override
    def applied_updates(self) -> int:
        """AdamW's step count (restored with its state on resume): vetoed and rejected steps never reach it."""
        state = self.optimizer.state if self.optimizer is not None else {}
        return max((int(s["step"]) for s in state.values() if "step" in s), default=0)

    @override
    def applied(self, proposal: Any) -> bool:
        opt = self.optimizer
        return opt is not None and opt.last_proposal is proposal and opt.last_applied

    @override
    def logit_tangent(
        self,
        policy: nn.Module,
        proposal: Any,
        model_inputs: Mapping[str, torch.Tensor],
        mode: ProbeMode = "jvp",
        fd_step: float = 1e-3,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits' JVP along the previewed step ``ΔW`` of every trained parameter (LoRA: its adapters)."""
        names = {id(p): n for n, p in policy.named_parameters()}
        deltas = {names[id(p)]: d for p, d in proposal.deltas().items()}
        return parameter_logit_tangent(policy, deltas, model_inputs, mode, fd_step)

    @override
    def trained_tensors(self, policy: nn.Module) -> dict[str, torch.Tensor]:
        # Engine names: activation checkpointing puts `_checkpoint_wrapped_module.` into the policy's parameter names.
        trained = ((n, p) for n, p in policy.named_parameters() if p.requires_grad)
        return {canonical_name(n): full_tensor(p).detach() for n, p in trained}

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
