"""RolloutMismatch (algorithm.md §7): k1 over EOS-terminated responses, clamped, EMA 0.3, floor 0.5·budget."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from logra_pl.callbacks import RolloutMismatch, observed_mismatch


@dataclass
class _Packed:
    response_mask: torch.Tensor


@dataclass
class _Rollout:
    finish_reasons: list[str]

    def __len__(self) -> int:
        return len(self.finish_reasons)


@dataclass
class _Ctx:
    """The fields of the module's StepContext the estimator reads."""

    update_index: int
    logp_rollout: torch.Tensor
    logp_trainer: torch.Tensor
    packed: _Packed
    finish_reasons: list[str]

    @property
    def eos_terminated(self) -> torch.Tensor:
        return torch.tensor([r == "stop" for r in self.finish_reasons])


def _ctx(i: int, gap: float, reasons=("stop", "stop", "length")) -> _Ctx:
    trainer = -torch.rand(3, 5, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.float64)
    rollout = trainer + gap
    rollout[2] += 5.0  # a truncated response with a huge gap: must be ignored
    return _Ctx(i, rollout * mask, trainer * mask, _Packed(mask), list(reasons))


def test_equal_logprobs_give_zero() -> None:
    mm = RolloutMismatch()
    for i in range(4):
        mm.observe(_ctx(i, 0.0))
    assert mm.value == 0.0 and mm.last_observed == 0.0
    assert mm.effective_budget(1e-4) == 1e-4


def test_constant_gap_follows_the_ema() -> None:
    mm = RolloutMismatch(ema=0.3)
    gap = 2e-5
    for k in range(1, 8):
        mm.observe(_ctx(k, gap))
        assert mm.last_observed == pytest.approx(gap)  # the truncated response is excluded
        assert mm.value == pytest.approx(gap * (1 - 0.7**k))
    assert mm.effective_budget(1e-4) == pytest.approx(1e-4 - mm.value)
    assert mm.effective_budget(2e-5) == pytest.approx(1e-5)  # floor 0.5·budget


def test_negative_gap_clamped_and_idempotent() -> None:
    mm = RolloutMismatch()
    ctx = _ctx(1, -0.3)
    assert mm.observe(ctx) == 0.0
    mm2 = RolloutMismatch()
    first = mm2.observe(_ctx(5, 1e-3))
    assert mm2.observe(_ctx(5, 1e-3)) == first  # the same update is folded in once


def test_no_valid_measurement_leaves_m() -> None:
    mm = RolloutMismatch()
    mm.observe(_ctx(1, 1e-3))
    before = mm.value
    mm.observe(_ctx(2, 5.0, reasons=("length", "length", "length")))
    assert mm.value == before and mm.last_observed is None


def test_observed_counts_only_valid_tokens() -> None:
    ctx = _ctx(0, 0.5)
    total, count = observed_mismatch(ctx.logp_rollout, ctx.logp_trainer, ctx.packed.response_mask, ctx.eos_terminated)
    assert count == 3 + 5 and total == pytest.approx(0.5 * 8)
