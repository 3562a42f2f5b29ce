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


def assert_alpha_scales_the_step(method: Any, inner: Any, scheduler: Any, trained: dict) -> None:
    """One step through ``method`` with a controller that sets α = 0.3: every trained parameter moves by 0.3 times
    the step its optimizer previewed at α = 1 (float32 weights: to 1e-4), and the step is not rejected."""
    import torch

    preview = {p: d.clone() for p, d in inner.step_deltas()}
    w0 = {n: p.detach().clone() for n, p in trained.items()}

    def scale(optimizer: Any) -> None:
        optimizer.proposal.alpha = 0.3

    assert method.step(StepThrough(inner, scale), scheduler, lambda x: x).rejected is None
    for n, p in trained.items():
        torch.testing.assert_close(p.detach() - w0[n], 0.3 * preview[p], rtol=1e-4, atol=1e-8, msg=n)


def kl_controlled_run(method: Any, targets: list[str], tmp_path: Any, rl_run: Any) -> Any:
    """Two updates of ``method`` in a real Trainer under the KL-matched protocol's step control (the probe's JVP
    along the method's step, calibrated): both applied, and the engine's weights equal to the policy's after them.
    Returns the module."""
    import torch

    from logra_pl.callbacks import PredictedKLControl
    from logra_pl.callbacks.kl_control import BudgetSchedule
    from logra_pl.module import LoGRAPolicyModule, RolloutSettings

    module = LoGRAPolicyModule(
        policy="tiny", method=method, targets=targets, rollout=RolloutSettings(max_new_tokens=4), microbatch_size=4
    )
    control = PredictedKLControl(BudgetSchedule("cosine", delta_max=1e-3, delta_min=1e-3, horizon=2), calibrate=True)
    rl_run(module, tmp_path, 2, callbacks=[control])
    assert module.global_step == 2 and module.method.applied_updates == 2
    engine = module.engine.model.state_dict()
    assert all(torch.equal(t, engine[k]) for k, t in module.policy.state_dict().items())
    return module


def assert_step_taken(method: Any, optimizer: Any, scheduler: Any, step_sq: float) -> None:
    """One step through ``method``, accepted, its norm that of the float64 steps written out in a test (``step_sq``:
    their summed squares)."""
    import pytest

    result = method.step(optimizer, scheduler, lambda x: x)
    assert result.rejected is None
    assert result.update_norm == pytest.approx(step_sq**0.5, rel=1e-3)


def lm_gradients(policy: Any, seed: int) -> dict[str, Any]:
    """Fill ``policy``'s ``.grad`` with the language-model loss's gradient on a seeded random batch (2 × 10 tokens)
    and return each trainable parameter's gradient as a float64 copy."""
    import torch

    ids = torch.randint(3, 200, (2, 10), generator=torch.Generator().manual_seed(seed))
    policy(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.detach().double().clone() for n, p in policy.named_parameters() if p.grad is not None}
