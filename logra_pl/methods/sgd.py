"""``DenseSGD``: stateless dense SGD on the target matrices — the memory baseline that keeps a gradient per trained
parameter and nothing else (RL post-training reports plain SGD on par with AdamW: arXiv 2602.07729).

``W ← W − lr·(G + wd·W)``, or with momentum ``μ > 0`` (one buffer per trained parameter more): ``B ← μ·B + (G +
wd·W)`` (``B = G + wd·W`` at the first step), ``W ← W − lr·B`` — torch's SGD without dampening or Nesterov.

Its optimizer (:class:`ProposingSGD`) steps through a proposal, as AdamW's and LoGRA's do: the step ``ΔW`` (formed as
torch forms it, :func:`sgd_step_deltas`) is offered to ``on_before_optimizer_step`` callbacks, which may scale it by
``α`` (``lr·α`` for this step: ``ΔW`` is linear in ``lr``) or veto it — so ``PredictedKLControl`` sizes SGD's steps
to a KL budget like any other method's —; the divergence guard then judges the α-scaled step before it is taken, so
a vetoed or rejected step changes nothing. Engines receive the changed tensors. ``model.method: sgd`` (its defaults)
or ``{class_path: logra_pl.methods.sgd.DenseSGD, init_args: {sgd: {lr: 0.01}}}``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from logra_pl.config import as_settings, register
from logra_pl.errors import check_range
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
from logra_pl.methods.proposing import ProposalAnswers, ProposingOptimizer, local
from logra_pl.sketch import select_targets
from logra_pl.sketch.memory import MemoryReport, memory_report
from logra_pl.sketch.merge import full_tensor
from logra_pl.sketch.targets import canonical_name


@dataclass
class SGDConfig:
    """Dense SGD's settings.

    Arguments:
        lr: the learning rate (constant).
        momentum: ``μ`` of the momentum buffer; 0 keeps no state at all.
        weight_decay: L2 weight decay added to the gradient (torch's SGD).
        train_all: train every parameter (embeddings, norms, head too); False trains the module's target matrices.
    """

    lr: float = 1e-3
    momentum: float = 0.0
    weight_decay: float = 0.0
    train_all: bool = False

    def __post_init__(self) -> None:
        check_range("sgd.lr", self.lr, 0.0, low_open=True)
        check_range("sgd.momentum", self.momentum, 0.0, 1.0, high_open=True)
        check_range("sgd.weight_decay", self.weight_decay, 0.0)


@torch.no_grad()
def sgd_step_deltas(optimizer: torch.optim.SGD) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
    """``(parameter, ΔW)`` of the next ``optimizer.step()`` for every parameter with a gradient, without taking it
    (this process's shard of each; one parameter's temporaries at a time)."""
    for group in optimizer.param_groups:
        if group.get("nesterov") or group.get("dampening") or group.get("maximize"):
            raise ValueError("sgd_step_deltas forms torch's SGD without nesterov, dampening or maximize")
        lr, momentum, wd = float(group["lr"]), float(group["momentum"]), float(group["weight_decay"])
        for p in group["params"]:
            if p.grad is None:
                continue
            d = local(p.grad)
            if wd:
                d = d.add(local(p.detach()), alpha=wd)
            if momentum:
                buf = optimizer.state.get(p, {}).get("momentum_buffer")
                d = d.clone() if buf is None else local(buf).mul(momentum).add_(d)
            yield p, d.mul(-lr)


class ProposingSGD(ProposingOptimizer, torch.optim.SGD):
    """``torch.optim.SGD`` whose ``step`` is propose → closure (Lightning's hooks) → guard → step at ``lr·α``, or
    none (:class:`~logra_pl.methods.proposing.ProposingOptimizer`); with ``alpha == 1`` exactly torch's step.

    Plain SGD keeps no state from which to count its steps, so each parameter group counts the steps taken in
    ``applied_steps``: it travels in ``state_dict`` (param groups keep extra keys), and a resumed run's step
    controller continues its budget schedule where it stopped.
    """

    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        for group in self.param_groups:
            group.setdefault("applied_steps", 0)

    @override
    def step_deltas(self) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        return sgd_step_deltas(self)

    @override
    def _step_at(self, alpha: float) -> None:
        super()._step_at(alpha)
        for group in self.param_groups:
            group["applied_steps"] = group.get("applied_steps", 0) + 1


@register("sgd")
class DenseSGD(ProposalAnswers, UpdateMethod):
    """Dense SGD on the module's target matrices (or, with ``sgd.train_all``, on every parameter).

    Arguments:
        sgd: learning rate, momentum, weight decay (:class:`SGDConfig`).
    """

    name = "sgd"
    makes_proposals = True

    def __init__(self, sgd: SGDConfig | None = None) -> None:
        self.sgd = as_settings(SGDConfig, sgd, "sgd")
        self.guard = DivergenceGuard()
        self.optimizer: ProposingSGD | None = None
        self.last_relative_update = 0.0

    @classmethod
    @override
    def plan_options(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--sgd-momentum", action="store_true", help="dense SGD keeps a momentum buffer")

    @classmethod
    @override
    def planned(cls, settings: PlanSettings) -> DenseSGD:
        """Option ``sgd_momentum``: a momentum buffer (``sgd.momentum`` 0.9), one more copy of the gradients."""
        momentum = 0.9 if settings.options.get("sgd_momentum") else 0.0
        return cls(SGDConfig(momentum=momentum, train_all=settings.train_all))

    def _trained(self, policy: nn.Module) -> list[nn.Parameter]:
        return [p for p in policy.parameters() if p.requires_grad]

    @override
    def configure_optimizers(self, policy: nn.Module, targets: Sequence[str], guard: DivergenceGuard) -> Any:
        self.guard = guard
        wanted = {id(p) for p in policy.parameters()} if self.sgd.train_all else None
        if wanted is None:
            wanted = {id(m.weight) for m in select_targets(policy, targets).values()}
        for p in policy.parameters():
            p.requires_grad_(id(p) in wanted)
        cfg = self.sgd
        self.optimizer = ProposingSGD(
            self._trained(policy), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
        return self.optimizer

    @override
    def step(self, optimizer: Any, scheduler: Any, all_reduce_sum: AllReduceSum) -> StepResult:
        """Propose → closure (``on_before_optimizer_step``: a controller's α or veto) → the guard's verdict on the
        α-scaled step (its size and finiteness over all ranks) → torch's SGD at ``lr·α``, or no step."""
        inner: ProposingSGD = optimizer.optimizer
        inner.check = lambda opt, proposal: self.judge(self.guard, proposal, all_reduce_sum)
        self.begin_step()
        optimizer.step()
        rejected = inner.last_rejection
        optimizer.zero_grad(set_to_none=True)
        return StepResult(rejected, 0.0 if rejected else math.sqrt(self.last_update_sq))

    @property
    @override
    def applied_updates(self) -> int:
        """Steps taken (``applied_steps`` of the optimizer's groups, restored on resume): vetoed and rejected steps
        are not counted."""
        groups = self.optimizer.param_groups if self.optimizer is not None else []
        return max((int(g.get("applied_steps", 0)) for g in groups), default=0)

    @override
    def trained_tensors(self, policy: nn.Module) -> dict[str, torch.Tensor]:
        # Engine names: activation checkpointing puts `_checkpoint_wrapped_module.` into the policy's parameter names.
        return {canonical_name(n): full_tensor(p).detach() for n, p in policy.named_parameters() if p.requires_grad}

    @override
    def changed_numel(self, policy: nn.Module) -> int:
        return sum(p.numel() for p in self._trained(policy))

    @override
    def metrics(self) -> dict[str, float]:
        return {"guard/relative_update": self.last_relative_update, "train/update_gain": self.last_gain or 0.0}

    @override
    def memory(self, policy: nn.Module) -> MemoryReport:
        return memory_report(policy, optimizer=self.optimizer)

    @override
    def plan_memory(self, shapes: PlanShapes) -> MemoryReport:
        """A gradient per trained parameter (the targets, or every parameter with ``train_all``), sharded like it;
        with momentum, one buffer as large again."""
        trained = shapes.params if self.sgd.train_all else [m.weight for m in shapes.matrices.values()]
        grads = sum(shapes.shard_bytes(p) for p in trained)
        return MemoryReport(weights=shapes.weights, gradients=grads, optimizer_state=grads if self.sgd.momentum else 0)

    @override
    def trained_parameter_count(self, policy: nn.Module) -> int:
        return self.changed_numel(policy)

    @override
    def report(self, policy: nn.Module, targets: Sequence[str]) -> str:
        grads = sum(p.numel() * p.element_size() for p in self._trained(policy))
        what = "every parameter" if self.sgd.train_all else f"{', '.join(targets)}"
        state = f"{bytes_text(grads)} of momentum" if self.sgd.momentum else "no optimizer state"
        return (
            f"dense SGD (lr {self.sgd.lr:g}) trains {count_text(self.trained_parameter_count(policy))} parameters "
            f"({what}): {bytes_text(grads)} of gradients and {state}"
        )
