"""``StepThrough``: the part of Lightning's optimizer wrapper an update method's ``step`` uses (tests, no Trainer)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class StepThrough:
    """``step``, ``zero_grad`` and ``optimizer``, as ``LightningOptimizer`` offers them.

    Arguments:
        optimizer: the torch optimizer a method's ``configure_optimizers`` built.
        before_step: called with the optimizer where Lightning fires ``on_before_optimizer_step`` — inside the
            closure it passes to ``optimizer.step`` (None: no closure, no hooks).
    """

    def __init__(self, optimizer: Any, before_step: Callable[[Any], None] | None = None) -> None:
        self.optimizer = optimizer
        self.before_step = before_step

    def step(self) -> Any:
        if self.before_step is None:
            return self.optimizer.step()
        hook = self.before_step
        return self.optimizer.step(closure=lambda: hook(self.optimizer))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
