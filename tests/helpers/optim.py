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


def assert_moved_as_written(policy: Any, trained: Any, before: dict, want: dict) -> None:
    """Every trained parameter of ``policy`` moved from ``before`` as the float64 steps written out in a test
    (``want``: the expected weights), every other one unmoved, bit for bit.

    Adam's first steps are about ``sign(g)``: an entry of the gradient near zero turns float32 rounding into a step
    of its own sign, so the moves match to 1e-3 of the largest move, where a wrong basis or step misses by O(1).
    """
    import torch

    for n, p in policy.named_parameters():
        if n in trained:
            moved, expected = p.detach().double() - before[n], want[n] - before[n]
            torch.testing.assert_close(moved, expected, rtol=0, atol=1e-3 * float(expected.abs().max()), msg=n)
        else:
            assert torch.equal(p.detach().double(), before[n]), n
