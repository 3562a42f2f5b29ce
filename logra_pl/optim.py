"""Optimizers the policy module can use: ``LoGRAOptimizer`` (sketch core) and ``ProposingAdamW`` (the dense baseline).

Both are ``torch.optim.Optimizer`` subclasses so that Lightning treats them like any other, and both step the same
way: form the proposal *first*, then run the closure — inside which Lightning fires ``on_before_optimizer_step``,
so a callback sees (and may rescale or veto) ``optimizer.proposal`` — then let the divergence guard judge the
(rescaled) update, and only then apply it. ``LoGRAOptimizer`` proposes factors ``U`` and merges ``W ← W − α U P``;
``ProposingAdamW`` proposes AdamW's own step ``ΔW`` (previewed by :func:`adamw_step_deltas`) and takes it at
``lr·α``.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from logra_pl.errors import ConfigError, check_int, check_range
from logra_pl.sketch import LoGRASketcher, Payload, Proposal
from logra_pl.sketch.update import lr_factor


class LoGRAOptimizer(torch.optim.Optimizer):
    """One LoGRA update per ``step()``: propose → closure (hooks) → merge, or skip.

    Arguments:
        sketcher: the model's :class:`LoGRASketcher` (hooks attached, sketches filled by backward).
        max_relative_update: the divergence guard's bound: an update larger than this fraction of the weights is
            rejected before it merges (None: no bound).

    After ``step()``: :attr:`last_payload` is the merged payload (``None`` if skipped) — what a rollout engine
    must apply — and :attr:`last_proposal` the proposal it came from, while something else still holds it (a step
    controller does, until it has calibrated the update). ``grad_scale`` multiplies the sketches before RowAdam (e.g.
    ``1/world_size`` after a sum all-reduce).
    """

    def __init__(self, sketcher: LoGRASketcher, max_relative_update: float | None = None) -> None:
        params = [m.module.weight for m in sketcher.matrices.values()]
        super().__init__(params, defaults={})
        self.sketcher = sketcher
        self.proposal: Proposal | None = None
        self._last_proposal: weakref.ref[Proposal] | None = None
        self.last_payload: Payload | None = None
        self.grad_scale = 1.0
        self.last_merge_s = 0.0
        self.max_relative_update = max_relative_update
        # Set by a data-parallel strategy: all-reduce the sketches, and sum ‖W_i‖² over row shards.
        self.before_propose: Callable[[LoGRAOptimizer], None] | None = None
        self.weight_sq_norms: Callable[[LoGRAOptimizer], dict[str, float]] | None = None

    @property
    def last_proposal(self) -> Proposal | None:
        """The proposal the last ``step()`` came from, or None once nothing else holds it.

        The optimizer keeps no reference of its own, as ``ProposingAdamW`` releases its previewed deltas: a merged
        proposal holds the update's directions and the projections it was made with (the sketcher has drawn the
        next ones), and keeping them into the next step's forward and backward raised LoGRA's peak RSS on
        ``tiny:medium`` by 34 MiB (957.6 → 923.2 MiB, ``benchmarks/compare.py``'s LoGRA run).
        """
        return self._last_proposal() if self._last_proposal is not None else None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Propose, run ``closure`` (Lightning's hooks), then merge the (possibly rescaled) proposal."""
        if self.before_propose is not None:
            self.before_propose(self)
        norms = self.weight_sq_norms(self) if self.weight_sq_norms is not None else None
        self.proposal = self.sketcher.propose(grad_scale=self.grad_scale, weight_sq_norms=norms)
        result = None
        if closure is not None:
            with torch.enable_grad():
                result = closure()
        proposal, self.proposal = self.proposal, None
        self._last_proposal = weakref.ref(proposal) if proposal is not None else None
        self.last_payload = None
        if proposal is None:
            return result
        start = time.perf_counter()
        self.last_payload = self.sketcher.apply(proposal, max_relative_update=self.max_relative_update)
        self.last_merge_s = time.perf_counter() - start
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Sketches are reset after every update; nothing else holds gradients."""

    def state_dict(self) -> dict[str, Any]:
        """All LoGRA state (row statistics, update index, counters, config)."""
        return {"logra": self.sketcher.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (refuses a mismatched LoGRA config)."""
        self.sketcher.load_state_dict(state_dict["logra"])


@dataclass
class AdamWConfig:
    """The dense baseline of algorithm.md §10: AdamW, linear warmup, then cosine decay to ``min_lr_ratio``.

    Arguments:
        lr: peak learning rate.
        betas: Adam's moment factors.
        eps: Adam's epsilon.
        weight_decay: decoupled weight decay.
        warmup_steps: updates of linear warmup: update k (from 0) uses ``lr·(k+1)/(warmup_steps+1)``.
        decay_steps: updates (after warmup) of the cosine decay; constant at ``min_lr_ratio·lr`` after.
        min_lr_ratio: final learning rate as a fraction of ``lr``.
        train_all: train every parameter (embeddings, norms, head too); False trains the same matrices LoGRA
            sketches, for a like-for-like comparison of the update rule alone.
    """

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int = 9
    decay_steps: int = 300
    min_lr_ratio: float = 0.1
    train_all: bool = False

    def __post_init__(self) -> None:
        check_range("adamw.lr", self.lr, 0.0, low_open=True)
        if len(self.betas) != 2:
            raise ConfigError(f"adamw.betas must be two numbers, got {self.betas!r}")
        for k, beta in enumerate(self.betas):
            check_range(f"adamw.betas[{k}]", beta, 0.0, 1.0, high_open=True)
        check_range("adamw.eps", self.eps, 0.0)
        check_range("adamw.weight_decay", self.weight_decay, 0.0)
        check_int("adamw.warmup_steps", self.warmup_steps, 0)
        check_int("adamw.decay_steps", self.decay_steps, 0)
        check_range("adamw.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)

    def lr_factor(self, step: int) -> float:
        """Multiplier of ``lr`` after ``step`` completed updates (``LambdaLR`` semantics)."""
        return lr_factor(step, self.warmup_steps, self.decay_steps, self.min_lr_ratio)

    def build(self, params: list[torch.nn.Parameter]) -> tuple[ProposingAdamW, LambdaLR]:
        """The optimizer (torch's AdamW, stepping through a proposal) and its per-update schedule."""
        opt = ProposingAdamW(params, lr=self.lr, betas=tuple(self.betas), eps=self.eps, weight_decay=self.weight_decay)
        return opt, LambdaLR(opt, self.lr_factor)


class AdamWProposal:
    """The AdamW step about to be taken, open to step controllers during ``on_before_optimizer_step``.

    The step at ``alpha`` is torch's AdamW step with ``lr·alpha`` for this update only: ``ΔW(α) = α·ΔW`` with
    ``ΔW = −lr·wd·W − lr/(1−β1^t) · m/(sqrt(v)/sqrt(1−β2^t) + eps)``, the decoupled weight decay scaled alike;
    the moments are updated as usual. :meth:`skip` drops the step (weights and AdamW state untouched).

    Arguments:
        optimizer: the :class:`ProposingAdamW` whose step this is (its gradients and state define ``ΔW``).
    """

    def __init__(self, optimizer: ProposingAdamW) -> None:
        self.optimizer: ProposingAdamW | None = optimizer
        self.alpha = 1.0
        self.veto: str | None = None
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
                raise RuntimeError("this AdamW step was already taken (or dropped): its ΔW is gone")
            self._deltas = dict(adamw_step_deltas(self.optimizer))
        return self._deltas

    @property
    def previewed(self) -> dict[torch.nn.Parameter, torch.Tensor] | None:
        """The deltas if :meth:`deltas` computed them already, else None (nothing is computed)."""
        return self._deltas

    def release(self) -> None:
        """Forget the deltas and the optimizer (called once the step is taken or dropped)."""
        self._deltas, self.optimizer = None, None


class ProposingAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose ``step`` is propose → closure (Lightning's hooks) → guard → step at α, or none.

    During the closure :attr:`proposal` is the :class:`AdamWProposal` of the step; a callback may set its
    ``alpha`` or call ``skip(reason)``. Then :attr:`check` (the divergence guard, set by the update method) judges
    the α-scaled step; a vetoed or rejected step drops the gradients, so nothing changes — not the weights, not the
    moments. With ``alpha == 1`` the step is exactly ``torch.optim.AdamW.step`` (the same bits); otherwise ``lr`` is
    multiplied by ``alpha`` for this step only. Its ``state_dict`` is AdamW's.

    After ``step()``: :attr:`last_proposal`, :attr:`last_applied` (the step changed the weights),
    :attr:`last_rejection` (why not, or None) and :attr:`last_alpha` (the multiplier it was taken at).
    """

    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.proposal: AdamWProposal | None = None
        self.last_proposal: AdamWProposal | None = None
        self.last_applied = False
        self.last_rejection: str | None = None
        self.last_alpha = 1.0
        # The divergence guard's verdict on the α-scaled step (None: accept); set by the update method.
        self.check: Callable[[ProposingAdamW, AdamWProposal], str | None] | None = None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Propose, run ``closure`` (Lightning's hooks), then take the (possibly rescaled) step unless refused."""
        self.proposal = AdamWProposal(self)
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
                    p.grad = None  # torch's AdamW leaves parameters without a gradient (and their state) untouched
            return result
        self.last_alpha = float(proposal.alpha)
        self._step_at(self.last_alpha)
        return result

    def _step_at(self, alpha: float) -> None:
        """AdamW's step with every group's ``lr`` multiplied by ``alpha`` for this call (restored after)."""
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
def adamw_update_norm(optimizer: torch.optim.AdamW, alpha: float = 1.0) -> float:
    """``‖ΔW‖_F`` of the AdamW step just taken, recomputed from the optimizer's state (no copy of the weights).

    ``torch.optim.AdamW`` (not amsgrad) does ``W ← W(1 − lr·wd) − lr/bc1 · m / (sqrt(v)/sqrt(bc2) + eps)``, so
    ``ΔW = −lr·wd·W_old − lr/bc1 · m/denom`` with ``W_old = (W + lr/bc1 · m/denom) / (1 − lr·wd)``. Call it after
    ``step()`` and before the scheduler changes ``lr``; ``alpha`` is the multiplier the step was taken at
    (:attr:`ProposingAdamW.last_alpha`: its ``lr`` was ``lr·alpha``). One parameter at a time: the only temporaries
    are the size of the largest parameter, where a before/after copy would hold every trained weight twice.
    """
    total = 0.0
    for group in optimizer.param_groups:
        if group.get("amsgrad", False):
            raise ValueError("adamw_update_norm does not handle amsgrad")
        lr, wd, eps = float(group["lr"]) * alpha, float(group["weight_decay"]), float(group["eps"])
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                continue
            step = float(state["step"])
            step_size = lr / (1 - beta1**step)
            denom = (state["exp_avg_sq"].double().sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
            move = state["exp_avg"].double().div_(denom).mul_(step_size)
            delta = move.neg_()
            if wd:
                old = (p.detach().double() - delta) / (1 - lr * wd)
                delta.sub_(old.mul_(lr * wd))
            total += float(delta.square().sum())
    return math.sqrt(total)


@torch.no_grad()
def adamw_step_deltas(optimizer: torch.optim.AdamW) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
    """``(parameter, ΔW)`` of the next ``optimizer.step()`` for every parameter with a gradient, without taking it.

    AdamW's update is formed as torch does it (no amsgrad/maximize)::

        m' = β1·m + (1−β1)·g ;  v' = β2·v + (1−β2)·g² ;  t' = t + 1
        ΔW = −lr·wd·W − lr/(1−β1^t') · m' / (sqrt(v')/sqrt(1−β2^t') + eps)

    in the gradient's dtype, on this process's (local) shard of each parameter. A generator: one parameter's
    temporaries at a time, unless the caller keeps them.
    """
    for group in optimizer.param_groups:
        if group.get("amsgrad", False) or group.get("maximize", False):
            raise ValueError("adamw_step_preview does not handle amsgrad or maximize")
        lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            w, g = _local(p.detach()), _local(p.grad)
            state = optimizer.state.get(p) or {}
            step = float(state["step"]) + 1 if "step" in state else 1.0
            m = g * (1 - beta1) if "exp_avg" not in state else _local(state["exp_avg"]) * beta1 + g * (1 - beta1)
            v = (
                g.square() * (1 - beta2)
                if "exp_avg_sq" not in state
                else _local(state["exp_avg_sq"]) * beta2 + g.square() * (1 - beta2)
            )
            denom = v.sqrt().div_(math.sqrt(1 - beta2**step)).add_(eps)
            delta = m.div_(denom).mul_(-lr / (1 - beta1**step))
            if wd:
                delta.sub_(w, alpha=lr * wd)
            yield p, delta


@torch.no_grad()
def adamw_step_preview(
    optimizer: torch.optim.AdamW,
    alpha: float = 1.0,
    deltas: dict[torch.nn.Parameter, torch.Tensor] | None = None,
) -> tuple[float, float, int]:
    """What the next ``optimizer.step()`` at multiplier ``alpha`` would do, without doing it:
    ``(Σ‖α·ΔW‖², Σ‖W‖², #non-finite entries of W + α·ΔW)`` with ``ΔW`` from :func:`adamw_step_deltas`.

    The divergence guard calls this *before* the step, so a rejected step is simply not taken (its gradients are
    dropped): nothing to undo. ``deltas`` are ``ΔW`` already computed (:meth:`AdamWProposal.deltas`), left
    unchanged; without them each parameter's ``ΔW`` is formed and dropped in turn, so the temporaries are the size
    of the largest one. Sums are over this process's (local) shards; a data-parallel caller all-reduces them.
    """
    update_sq = weight_sq = 0.0
    nonfinite = 0
    steps = deltas.items() if deltas is not None else adamw_step_deltas(optimizer)
    for p, delta in steps:
        w = _local(p.detach())
        if alpha != 1.0:
            delta = delta * alpha
        update_sq += float(torch.linalg.vector_norm(delta, dtype=torch.float64)) ** 2
        weight_sq += float(torch.linalg.vector_norm(w, dtype=torch.float64)) ** 2
        nonfinite += int((~torch.isfinite(delta + w)).sum())
    return update_sq, weight_sq, nonfinite


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t
