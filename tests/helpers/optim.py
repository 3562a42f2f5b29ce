"""``StepThrough``: the part of Lightning's optimizer wrapper an update method's ``step`` uses (tests, no Trainer)."""

from __future__ import annotations

from typing import Any


class StepThrough:
    """``step``, ``zero_grad`` and ``optimizer``, as ``LightningOptimizer`` offers them (minus Lightning's hooks).

    Arguments:
        optimizer: the torch optimizer a method's ``configure_optimizers`` built.
    """

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def step(self) -> Any:
        return self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
