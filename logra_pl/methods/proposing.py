"""A dense optimizer whose step is a *proposal* first: step controllers may scale it by ``α`` or veto it, the
divergence guard judges the step that would be taken, and only then does torch's own step run (at ``lr·α``) — or
nothing does, and the weights and the optimizer's state stay exactly as they were.

``ProposingOptimizer`` is the mechanism, mixed into a torch optimizer whose step is linear in its learning rate
(``ΔW(α) = α·ΔW``: AdamW, with its decoupled weight decay, and SGD, with or without momentum): the optimizer says
what its next step is (:meth:`ProposingOptimizer.step_deltas`, formed as torch forms it, without taking it), and the
mixin runs propose → closure (Lightning's ``on_before_optimizer_step`` hooks) → guard → step. :class:`StepProposal`
is what a controller sees; :func:`step_preview` the sizes the guard judges; :func:`guard_verdict` its verdict. The
dense methods (``DenseAdamW``, ``DenseSGD``, ``LoRAMethod``) answer a step controller's questions from it
(:class:`ProposalAnswers`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from logra_pl.methods.base import AllReduceSum, relative
from logra_pl.methods.guard import DivergenceGuard
from logra_pl.sketch.probe import ProbeMode, parameter_logit_tangent, parameter_moved_logits

Deltas = Iterable[tuple[torch.nn.Parameter, torch.Tensor]]


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of ``t`` (an FSDP2 ``DTensor``'s local tensor), or ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


class StepProposal:
    """The step about to be taken, open to step controllers during ``on_before_optimizer_step``.

    The step at ``alpha`` is the optimizer's own step with ``lr·alpha`` for this update only: ``ΔW(α) = α·ΔW``.
    :meth:`skip` drops it (weights and optimizer state untouched).

    Arguments:
        optimizer: the :class:`ProposingOptimizer` whose step this is (its gradients and state define ``ΔW``).
    """

    def __init__(self, optimizer: ProposingOptimizer) -> None:
        self.optimizer: ProposingOptimizer | None = optimizer
        self.alpha = 1.0
        self.veto: str | None = None
        self.priced_kl: float | None = None  # the KL a step controller priced the step at, at alpha (None: unpriced)
        self._deltas: dict[torch.nn.Parameter, torch.Tensor] | None = None

    def skip(self, reason: str) -> None:
        """Ask the optimizer not to take this step (e.g. a step controller's NaN prediction)."""
        self.veto = reason

    def deltas(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        """``{parameter: ΔW}`` at ``α = 1`` for every parameter with a gradient (the local shard under FSDP).

        Computed on the first call and kept until the step is taken (a copy of every trained parameter: only a
        step controller that probes the step asks for it); the divergence guard then reuses it.
        """
        if self._deltas is None:
            if self.optimizer is None:
                raise RuntimeError("this step was already taken (or dropped): its ΔW is gone")
            self._deltas = dict(self.optimizer.step_deltas())
        return self._deltas

    @property
    def previewed(self) -> dict[torch.nn.Parameter, torch.Tensor] | None:
        """The deltas if :meth:`deltas` computed them already, else None (nothing is computed)."""
        return self._deltas

    def release(self) -> None:
        """Forget the deltas and the optimizer (called once the step is taken or dropped)."""
        self._deltas, self.optimizer = None, None


class ProposingOptimizer(torch.optim.Optimizer):
    """Mixed in before a torch optimizer: ``step`` is propose → closure (Lightning's hooks) → guard → step at α.

    During the closure :attr:`proposal` is the :class:`StepProposal` of the step; a callback may set its ``alpha``
    or call ``skip(reason)``. Then :attr:`check` (the divergence guard, set by the update method) judges the
    α-scaled step; a vetoed or rejected step drops the gradients, so nothing changes — torch's optimizers leave a
    parameter without a gradient, and its state, untouched. With ``alpha == 1`` the step is exactly the torch
    optimizer's (the same bits); otherwise every group's ``lr`` is multiplied by ``alpha`` for this step only.

    After ``step()``: :attr:`last_proposal`, :attr:`last_applied` (the step changed the weights),
    :attr:`last_rejection` (why not, or None) and :attr:`last_alpha` (the multiplier it was taken at).
    """

    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.proposal: StepProposal | None = None
        self.last_proposal: StepProposal | None = None
        self.last_applied = False
        self.last_rejection: str | None = None
        self.last_alpha = 1.0
        # The divergence guard's verdict on the α-scaled step (None: accept); set by the update method.
        self.check: Callable[[ProposingOptimizer, StepProposal], str | None] | None = None

    def step_deltas(self) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        """``(parameter, ΔW)`` of the next step at ``α = 1`` for every parameter with a gradient, without taking it
        (this process's shard of each; one parameter's temporaries at a time)."""
        raise NotImplementedError(f"{type(self).__name__} does not say what its step is")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Propose, run ``closure`` (Lightning's hooks), then take the (possibly rescaled) step unless refused."""
        self.proposal = StepProposal(self)
        result = None
        if closure is not None:
            with torch.enable_grad():
                result = closure()
        proposal, self.proposal = self.proposal, None
        self.last_proposal = proposal
        reason = proposal.veto
        if reason is None and self.check is not None:
            reason = self.check(self, proposal)
        proposal.release()
        self.last_rejection, self.last_applied = reason, reason is None
        if reason is not None:
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = None
            return result
        self.last_alpha = float(proposal.alpha)
        self._step_at(self.last_alpha)
        return result

    def _step_at(self, alpha: float) -> None:
        """The torch optimizer's step with every group's ``lr`` multiplied by ``alpha`` for this call (restored)."""
        if alpha == 1.0:
            super().step()
            return
        saved = [group["lr"] for group in self.param_groups]
        try:
            for group in self.param_groups:
                group["lr"] = group["lr"] * alpha
            super().step()
        finally:
            for group, lr in zip(self.param_groups, saved, strict=True):
                group["lr"] = lr


@torch.no_grad()
def step_measures(deltas: Deltas, alpha: float = 1.0) -> tuple[float, float, int, float]:
    """What a step of ``deltas`` (``(parameter, ΔW)`` pairs) at multiplier ``alpha`` would do, without doing it:
    ``(Σ‖α·ΔW‖², Σ‖W‖², #non-finite entries of W + α·ΔW, −Σ⟨g, α·ΔW⟩)`` over this process's (local) shards, ``g``
    each parameter's gradient (a parameter without one adds no gain); a data-parallel caller all-reduces them. The
    last is the step's first-order gain: the decrease of the loss it predicts. The deltas are left unchanged."""
    update_sq = weight_sq = gain = 0.0
    nonfinite = 0
    for p, delta in deltas:
        w = local(p.detach())
        if alpha != 1.0:
            delta = delta * alpha
        update_sq += float(torch.linalg.vector_norm(delta, dtype=torch.float64)) ** 2
        weight_sq += float(torch.linalg.vector_norm(w, dtype=torch.float64)) ** 2
        nonfinite += int((~torch.isfinite(delta + w)).sum())
        gain += first_order_gain(p, delta)
    return update_sq, weight_sq, nonfinite, gain


def first_order_gain(p: torch.nn.Parameter, delta: torch.Tensor) -> float:
    """``−⟨g, Δ⟩`` in float64 of ``p``'s gradient now (this process's shard) and a step ``Δ`` of it; 0 without one."""
    if p.grad is None:
        return 0.0
    g = local(p.grad).detach().reshape(-1).to(torch.float64)
    return -float(torch.dot(g, delta.reshape(-1).to(torch.float64)))


@torch.no_grad()
def kept_step_gain(kept: Mapping[torch.nn.Parameter, torch.Tensor]) -> float:
    """``−Σ⟨g, Δ⟩`` of a kept step ``{parameter: Δ}`` (this process's shards) against each parameter's gradient now,
    in float64; a parameter without a gradient adds nothing. A data-parallel caller all-reduces it."""
    return sum((first_order_gain(p, delta) for p, delta in kept.items()), 0.0)


def step_preview(deltas: Deltas, alpha: float = 1.0) -> tuple[float, float, int]:
    """``(Σ‖α·ΔW‖², Σ‖W‖², #non-finite entries of W + α·ΔW)`` of a step, without taking it: the sizes the divergence
    guard judges (:func:`step_measures` without the gain)."""
    return step_measures(deltas, alpha)[:3]


def guard_verdict(guard: DivergenceGuard, sums: list[float]) -> tuple[str | None, float]:
    """The divergence guard's verdict on a step of all-reduced ``(Σ‖ΔW‖², Σ‖W‖², #non-finite)`` and its relative
    size ``‖ΔW‖/‖W‖``: ``(None, size)`` takes it, ``(reason, size)`` refuses it."""
    update_sq, weight_sq, bad = sums
    size = relative(update_sq, weight_sq)
    if not guard.enabled:
        return None, size
    if bad:
        return f"the step would make {int(bad)} weights non-finite", size
    if not math.isfinite(size):
        return "non-finite update (the gradients hold inf/NaN)", size
    if size > guard.max_update_ratio:
        return (
            f"update size ‖ΔW‖/‖W‖ = {size:.3g} exceeds the guard's max_update_ratio {guard.max_update_ratio:g}",
            size,
        )
    return None, size


class ProposalAnswers:
    """What a dense method whose optimizer is a :class:`ProposingOptimizer` (in ``self.optimizer``) answers a step
    controller (``UpdateMethod.applied`` and ``logit_tangent``), its guard's verdict and its step's measures (size,
    first-order gain); mixed in before ``UpdateMethod``.
    """

    optimizer: ProposingOptimizer | None
    last_relative_update = 0.0
    last_update_sq = 0.0
    last_step_gain = 0.0
    # With keep_last_step: the last step taken ({} before the first), and its gain on this update's gradients.
    _kept_step: dict[torch.nn.Parameter, torch.Tensor] | None = None
    _next_gain: float | None = None

    def applied(self, proposal: Any) -> bool:
        """Whether ``proposal`` was the optimizer's last step and changed the weights."""
        opt = self.optimizer
        return opt is not None and opt.last_proposal is proposal and opt.last_applied

    def logit_tangent(
        self,
        policy: nn.Module,
        proposal: Any,
        model_inputs: Mapping[str, torch.Tensor],
        mode: ProbeMode = "jvp",
        fd_step: float = 1e-3,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits' JVP along the proposed step ``ΔW`` of every trained parameter (LoRA: its adapters)."""
        names = {id(p): n for n, p in policy.named_parameters()}
        deltas = {names[id(p)]: d for p, d in proposal.deltas().items()}
        return parameter_logit_tangent(policy, deltas, model_inputs, mode, fd_step)

    def logits_at(
        self, policy: nn.Module, proposal: Any, model_inputs: Mapping[str, torch.Tensor], alpha: float
    ) -> torch.Tensor:
        """The logits with every trained parameter moved by ``α·ΔW`` for one forward (LoRA: its adapters), then
        restored bit for bit."""
        names = {id(p): n for n, p in policy.named_parameters()}
        deltas = {names[id(p)]: d for p, d in proposal.deltas().items()}
        return parameter_moved_logits(policy, deltas, model_inputs, alpha)

    def judge(self, guard: DivergenceGuard, proposal: StepProposal, all_reduce_sum: AllReduceSum) -> str | None:
        """The divergence guard's verdict on the step at ``proposal.alpha`` (None: take it); sets
        ``last_relative_update``, ``last_update_sq`` (``Σ‖α·ΔW‖²``) and ``last_step_gain`` (``−Σ⟨g, α·ΔW⟩``), over
        all ranks. Runs after the step controllers, so it measures the step that would be taken (with the guard off
        too: the size and gain are logged for every update). With :meth:`keep_last_step`, it also measures the kept
        step's gain on this update's gradients (:attr:`next_batch_gain`, in the same all-reduce) and keeps this step
        in its place when it is taken."""
        opt = self.optimizer
        assert opt is not None, "judge runs inside the optimizer's step"
        kept = self._kept_step
        keep = kept is not None
        if keep:  # this step is kept once taken: its deltas are formed once, here (or by a probe before)
            deltas: Deltas = proposal.deltas().items()
        else:
            deltas = proposal.previewed.items() if proposal.previewed is not None else opt.step_deltas()
        measures = [*step_measures(deltas, proposal.alpha), kept_step_gain(kept) if keep else 0.0]
        sums = all_reduce_sum(torch.tensor(measures, dtype=torch.float64)).tolist()
        reason, self.last_relative_update = guard_verdict(guard, sums[:3])
        self.last_update_sq, self.last_step_gain = sums[0], sums[3]
        if keep:
            self._next_gain = sums[4] if kept else None  # {}: no step taken yet
            if reason is None:
                alpha = float(proposal.alpha)
                self._kept_step = {p: d if alpha == 1.0 else d * alpha for p, d in proposal.deltas().items()}
        return reason

    def keep_last_step(self) -> bool:
        """Keep each step taken (``α·ΔW`` of every trained tensor, this process's shard) until the next update."""
        if self._kept_step is None:
            self._kept_step = {}
        return True

    @property
    def next_batch_gain(self) -> float | None:
        """``−Σ⟨g', α·ΔW⟩`` of the kept step against this update's gradients ``g'``, over all ranks (None: no step
        kept, or this update's step never reached the guard, e.g. a controller's veto)."""
        return self._next_gain

    def begin_step(self) -> None:
        """Forget the last update's :attr:`next_batch_gain` (called as each step begins)."""
        self._next_gain = None

    @property
    def last_gain(self) -> float | None:
        """``−Σ⟨g, α·ΔW⟩`` of the last step over all ranks (0 when it was vetoed or rejected)."""
        opt = self.optimizer
        return self.last_step_gain if opt is not None and opt.last_applied else 0.0
