"""``DenseAdamW``: the dense baseline of algorithm.md §10 — AdamW with warmup and cosine decay on the target matrices.

Its optimizer (:class:`~logra_pl.methods.adamw.ProposingAdamW`) steps through a proposal, as LoGRA's does: AdamW's step
``ΔW`` (previewed from the gradients and AdamW's state, :func:`~logra_pl.methods.adamw.adamw_step_deltas`) is offered to
``on_before_optimizer_step`` callbacks, which may scale it by ``α`` (``lr·α`` for this step) or veto it; the
divergence guard then judges the α-scaled step (:func:`adamw_step_preview`) before it is taken. A
vetoed or rejected step drops the gradients, so nothing changes. Step controllers probe the step with
:meth:`DenseAdamW.logit_tangent` (the logits' JVP along ``ΔW``, algorithm.md §6; the mechanism is
:mod:`logra_pl.methods.proposing`, shared with dense SGD). Engines receive the changed tensors.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from typing_extensions import override

from logra_pl.config import as_settings, register
from logra_pl.errors import ConfigError, check_int, check_range
from logra_pl.methods.base import (
    AllReduceSum,
    PlanSettings,
    PlanShapes,
    StepResult,
    UpdateMethod,
    bytes_text,
    count_text,
)
from logra_pl.methods.guard import DivergenceGuard
from logra_pl.methods.proposing import ProposalAnswers, ProposingOptimizer, local, step_preview
from logra_pl.sketch import select_targets
from logra_pl.sketch.memory import MemoryReport, memory_report
from logra_pl.sketch.merge import full_tensor
from logra_pl.sketch.targets import canonical_name
from logra_pl.sketch.update import lr_factor


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


class ProposingAdamW(ProposingOptimizer, torch.optim.AdamW):
    """``torch.optim.AdamW`` whose ``step`` is propose → closure (Lightning's hooks) → guard → step at ``lr·α``, or
    none (:class:`~logra_pl.methods.proposing.ProposingOptimizer`). Its ``ΔW`` is :func:`adamw_step_deltas`: with
    ``alpha == 1`` the step is exactly ``torch.optim.AdamW.step``; a vetoed or rejected step changes neither the
    weights nor the moments. Its ``state_dict`` is AdamW's.
    """

    @override
    def step_deltas(self) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        return adamw_step_deltas(self)


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
            w, g = local(p.detach()), local(p.grad)
            state = optimizer.state.get(p) or {}
            step = float(state["step"]) + 1 if "step" in state else 1.0
            m = g * (1 - beta1) if "exp_avg" not in state else local(state["exp_avg"]) * beta1 + g * (1 - beta1)
            v = (
                g.square() * (1 - beta2)
                if "exp_avg_sq" not in state
                else local(state["exp_avg_sq"]) * beta2 + g.square() * (1 - beta2)
            )
            denom = v.sqrt().div_(math.sqrt(1 - beta2**step)).add_(eps)
            delta = m.div_(denom).mul_(-lr / (1 - beta1**step))
            if wd:
                delta.sub_(w, alpha=lr * wd)
            yield p, delta


def adamw_step_preview(
    optimizer: torch.optim.AdamW,
    alpha: float = 1.0,
    deltas: dict[torch.nn.Parameter, torch.Tensor] | None = None,
) -> tuple[float, float, int]:
    """What the next ``optimizer.step()`` at multiplier ``alpha`` would do, without doing it:
    ``(Σ‖α·ΔW‖², Σ‖W‖², #non-finite entries of W + α·ΔW)`` with ``ΔW`` from :func:`adamw_step_deltas`
    (:func:`~logra_pl.methods.proposing.step_preview`). ``deltas`` are ``ΔW`` already computed (a proposal's
    ``deltas()``), left unchanged; without them each parameter's ``ΔW`` is formed and dropped in turn, so the
    temporaries are the size of the largest one.
    """
    return step_preview(deltas.items() if deltas is not None else adamw_step_deltas(optimizer), alpha)


@register("adamw")
class DenseAdamW(ProposalAnswers, UpdateMethod):
    """Dense AdamW on the module's target matrices (or, with ``adamw.train_all``, on every parameter).

    Arguments:
        adamw: learning rate, moments, schedule (:class:`~logra_pl.methods.adamw.AdamWConfig`).
    """

    name = "adamw"
    makes_proposals = True

    def __init__(self, adamw: AdamWConfig | None = None) -> None:
        self.adamw = as_settings(AdamWConfig, adamw, "adamw")
        self.guard = DivergenceGuard()
        self.optimizer: ProposingAdamW | None = None
        self.last_relative_update = 0.0

    @classmethod
    @override
    def planned(cls, settings: PlanSettings) -> DenseAdamW:
        """AdamW on the targets, or on every parameter with the plan's ``train_all``."""
        return cls(AdamWConfig(train_all=settings.train_all))

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

    def build_optimizer(self, params: list[nn.Parameter]) -> tuple[ProposingOptimizer, LambdaLR]:
        """The torch optimizer of ``params`` (a :class:`ProposingOptimizer`) and its schedule: torch's AdamW here. A
        diagnostic that keeps AdamW's moments in another basis (``rotated.py``, ``projected.py``) builds its own and
        shares everything else."""
        return self.adamw.build(params)

    def applied_norm(self, inner: Any) -> float:
        """``‖ΔW‖`` of the step ``inner`` just took: from AdamW's state, no copy of the weights."""
        return adamw_update_norm(inner, alpha=inner.last_alpha)

    @override
    def configure_optimizers(self, policy: nn.Module, targets: Sequence[str], guard: DivergenceGuard) -> Any:
        self.guard = guard
        opt, sched = self.build_optimizer(self.trainable(policy, targets))
        self.optimizer = opt  # type: ignore[assignment]
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    @override
    def step(self, optimizer: Any, scheduler: Any, all_reduce_sum: AllReduceSum) -> StepResult:
        inner: ProposingOptimizer = optimizer.optimizer
        inner.check = lambda opt, proposal: self.judge(self.guard, proposal, all_reduce_sum)
        self.begin_step()
        optimizer.step()  # propose → closure (hooks: α, veto) → the guard's check → the step at lr·α, or no step
        rejected = inner.last_rejection
        optimizer.zero_grad(set_to_none=True)
        norm = 0.0 if rejected else self.applied_norm(inner)
        scheduler.step()
        return StepResult(rejected, norm)

    # ------------------------------------------------------------------------------------ step control
    @property
    @override
    def applied_updates(self) -> int:
        """AdamW's step count (restored with its state on resume): vetoed and rejected steps never reach it."""
        state = self.optimizer.state if self.optimizer is not None else {}
        return max((int(s["step"]) for s in state.values() if "step" in s), default=0)

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
        return {"guard/relative_update": self.last_relative_update, "train/update_gain": self.last_gain or 0.0}

    @override
    def memory(self, policy: nn.Module) -> MemoryReport:
        return memory_report(policy, optimizer=self.optimizer)

    @override
    def plan_memory(self, shapes: PlanShapes) -> MemoryReport:
        """A gradient per trained parameter and torch's AdamW state (``exp_avg``, ``exp_avg_sq`` in the parameter's
        dtype and a float32 ``step``), sharded like the parameter: the targets, or every parameter (``train_all``)."""
        trained = shapes.params if self.adamw.train_all else [m.weight for m in shapes.matrices.values()]
        grads = sum(shapes.shard_bytes(p) for p in trained)
        state = sum(2 * shapes.shard_bytes(p) + 4 for p in trained)
        return MemoryReport(weights=shapes.weights, gradients=grads, optimizer_state=state)

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
