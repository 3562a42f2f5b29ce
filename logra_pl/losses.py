"""Policy-gradient losses and the running baseline (SPEC §8), on padded per-token tensors.

Shapes: ``logp``, ``logp_rollout``, ``logp_old``, ``mask`` are ``(batch, response_len)``; ``advantages`` and
``weights`` are ``(batch,)``. Every loss is a *sum* over valid tokens divided by ``num_tokens`` — the token
count of the whole update — so that summing microbatch losses gives the update's token-mean loss exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from logra_pl.errors import check_choice, check_range

OutcomeMode = Literal["outcome", "reward"]


@dataclass
class RunningBaseline:
    """Global running baseline over past batches.

    ``outcome = success_value if reward ≥ success_threshold else failure_value`` (mode ``"outcome"``) or the
    plain reward (mode ``"reward"``); ``A = outcome − b``; then ``b ← momentum·b + (1−momentum)·mean(outcome)``,
    so a batch's advantages use the baseline of previous batches only.

    Arguments:
        momentum: EMA factor of the baseline (0.9).
        mode: ``"outcome"`` (SPEC default) or ``"reward"``.
        success_threshold: reward at or above which a response counts as a success (1.0).
        success_value: outcome of a success (1.0).
        failure_value: outcome of a failure (−0.01).
        value: the current baseline ``b`` (0 at the start).
    """

    momentum: float = 0.9
    mode: OutcomeMode = "outcome"
    success_threshold: float = 1.0
    success_value: float = 1.0
    failure_value: float = -0.01
    value: float = 0.0

    def __post_init__(self) -> None:
        check_choice("baseline.mode", self.mode, ("outcome", "reward"))
        check_range("baseline.momentum", self.momentum, 0.0, 1.0, high_open=True)
        for name in ("success_threshold", "success_value", "failure_value", "value"):
            check_range(f"baseline.{name}", getattr(self, name))

    def outcomes(self, rewards: torch.Tensor) -> torch.Tensor:
        """Map verifier rewards to outcomes."""
        rewards = rewards.to(torch.float64)
        if self.mode == "reward":
            return rewards
        return torch.where(rewards >= self.success_threshold, self.success_value, self.failure_value).to(torch.float64)

    def advantages(
        self, rewards: torch.Tensor, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """``A = outcome − b`` with the current ``b``, then update ``b`` from this batch's mean outcome.

        ``all_reduce_sum`` sums ``[Σ outcome, count]`` over data-parallel ranks, so every rank moves ``b`` by
        the global batch mean and the baseline stays identical everywhere.
        """
        outcome = self.outcomes(rewards)
        adv = outcome - self.value
        stats = torch.tensor([float(outcome.sum()), float(outcome.numel())], dtype=torch.float64)
        if all_reduce_sum is not None:
            stats = all_reduce_sum(stats)
        if float(stats[1]) > 0:
            self.value = self.momentum * self.value + (1.0 - self.momentum) * float(stats[0] / stats[1])
        return adv

    def state_dict(self) -> dict[str, Any]:
        """The baseline value (the settings come from the config)."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the baseline value."""
        self.value = float(state["value"])


def length_weights(lengths: torch.Tensor, reference: float | None) -> torch.Tensor:
    """Per-response weight ``reference / L`` (SPEC §8's optional reweighting), or ones when ``reference`` is None."""
    if reference is None:
        return torch.ones_like(lengths, dtype=torch.float32)
    return reference / lengths.clamp(min=1).to(torch.float32)


def reinforce_tis_loss(
    logp: torch.Tensor,
    logp_rollout: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    num_tokens: int,
    weights: torch.Tensor | None = None,
    tis_cap: float = 2.0,
) -> torch.Tensor:
    """REINFORCE with truncated importance sampling: ``Σ −A·w·min(π/π_rollout, cap).detach()·log π / num_tokens``.

    The ratio corrects for the rollout engine sampling from slightly different weights/numerics; it is
    detached, so the gradient is that of ``log π`` only.
    """
    ratio = torch.exp(logp.detach() - logp_rollout).clamp(max=tis_cap)
    per_seq = advantages.to(logp.dtype) * (weights.to(logp.dtype) if weights is not None else 1.0)
    per_token = -per_seq.unsqueeze(1) * ratio * logp
    return (per_token * mask).sum() / num_tokens


def ppo_clip_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    num_tokens: int,
    weights: torch.Tensor | None = None,
    clip_eps: float = 0.2,
) -> torch.Tensor:
    """PPO's clipped surrogate ``Σ −min(r·A, clip(r, 1−ε, 1+ε)·A)·w / num_tokens`` with ``r = π/π_old``.

    ``logp_old`` are the trainer's log-probs before the first update on this batch.
    """
    ratio = torch.exp(logp - logp_old)
    adv = (advantages.to(logp.dtype) * (weights.to(logp.dtype) if weights is not None else 1.0)).unsqueeze(1)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv)
    return -(surrogate * mask).sum() / num_tokens


def clip_fraction(logp: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor, clip_eps: float = 0.2) -> float:
    """Share of valid tokens whose PPO ratio lies outside ``[1−ε, 1+ε]``."""
    ratio = torch.exp(logp - logp_old)
    outside = ((ratio < 1 - clip_eps) | (ratio > 1 + clip_eps)) & mask.bool()
    return float(outside.sum()) / max(int(mask.sum()), 1)
