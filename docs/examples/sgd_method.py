"""Plain SGD on the target matrices: a new update method is one class (``model.method``)."""

from __future__ import annotations

import math

import torch

from logra_pl.methods import StepResult, UpdateMethod
from logra_pl.methods.base import relative
from logra_pl.sketch import select_targets


class PlainSGD(UpdateMethod):
    """``W ← W − lr·G`` on the module's target matrices (``lr``: the learning rate); the guard refuses big steps."""

    name = "plain_sgd"  # recorded in checkpoints: a resume under another method is refused

    def __init__(self, lr: float = 0.1) -> None:
        self.lr = lr
        self.params: dict[str, torch.nn.Parameter] = {}
        self.last_relative = 0.0

    def configure_optimizers(self, policy, targets, guard):
        policy.requires_grad_(False)
        self.params = {f"{n}.weight": m.weight.requires_grad_(True) for n, m in select_targets(policy, targets).items()}
        self.guard = guard
        return torch.optim.SGD(list(self.params.values()), lr=self.lr)

    def step(self, optimizer, scheduler, all_reduce_sum):
        # The guard's check comes first: a rejected step leaves every weight as it is.
        sums = torch.tensor([0.0, 0.0], dtype=torch.float64)
        for p in self.params.values():
            sums += torch.stack([p.grad.double().square().sum() * self.lr**2, p.detach().double().square().sum()])
        update_sq, weight_sq = all_reduce_sum(sums).tolist()
        self.last_relative = relative(update_sq, weight_sq)
        rejected = None
        if self.guard.enabled and not self.last_relative <= self.guard.max_update_ratio:  # NaN fails too
            rejected = f"update size {self.last_relative:.3g} above the guard's {self.guard.max_update_ratio:g}"
        else:
            optimizer.step()  # through Lightning: on_before_optimizer_step fires
        optimizer.zero_grad(set_to_none=True)
        return StepResult(rejected, 0.0 if rejected else math.sqrt(update_sq))

    def trained_tensors(self, policy):
        return {name: p.detach() for name, p in self.params.items()}

    def changed_numel(self, policy):
        return sum(p.numel() for p in self.params.values())

    def metrics(self):
        return {"guard/relative_update": self.last_relative}

    def trained_parameter_count(self, policy):
        return self.changed_numel(policy)

    def report(self, policy, targets):
        return f"plain SGD (lr {self.lr:g}) trains {self.changed_numel(policy)} parameters in {', '.join(targets)}"
