"""Policy-gradient losses, their registry, and the baselines (algorithm.md §8), on padded per-token tensors.

Shapes: ``logp``, ``logp_rollout``, ``logp_old``, ``mask`` are ``(batch, response_len)``; ``advantages`` and
``weights`` are ``(batch,)``. Every loss is a *sum* over valid tokens divided by ``num_tokens`` — the token
count of the whole update — so that summing microbatch losses gives the update's token-mean loss exactly.

A loss is one function plus one :class:`LossSpec` entry in :data:`LOSSES` (:func:`register_loss`): which
reference log-probs it is given (the rollout engine's, or the trainer's before the update — the latter also
means several updates per rollout, ``ppo_epochs × ppo_minibatches``), the names of its hyper-parameters (fields
of ``LossConfig`` or keys of ``LossConfig.params``), and optionally token statistics to log (``train/<name>``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from logra_pl.errors import ConfigError, check_choice, check_range, import_dotted

OutcomeMode = Literal["outcome", "reward"]
BaselineKind = Literal["running", "group", "rloo"]


@dataclass
class Baseline:
    """The advantage baseline: the global running baseline (algorithm.md §8), or per-prompt group baselines.

    ``outcome = success_value if reward ≥ success_threshold else failure_value`` (mode ``"outcome"``) or the
    plain reward (mode ``"reward"``). Then, by ``kind``:

    - ``running`` (default): ``A = outcome − b``, then ``b ← momentum·b + (1−momentum)·mean(outcome)``, so a
      batch's advantages use the baseline of previous batches only;
    - ``group`` (GRPO-style): ``A = outcome − mean(outcomes of the same prompt)``;
    - ``rloo`` (leave-one-out): ``A = outcome − mean(outcomes of the prompt's other responses)``.

    The group kinds need several responses per prompt (``rollout.responses_per_prompt > 1``); ``b`` is still
    tracked (and logged) for them, but not used.

    Arguments:
        kind: ``"running"``, ``"group"`` or ``"rloo"``.
        momentum: EMA factor of the baseline (0.9).
        mode: ``"outcome"`` (algorithm.md §8 default) or ``"reward"``.
        success_threshold: reward at or above which a response counts as a success (1.0).
        success_value: outcome of a success (1.0).
        failure_value: outcome of a failure (−0.01).
        value: the current baseline ``b`` (0 at the start).
    """

    kind: BaselineKind = "running"
    momentum: float = 0.9
    mode: OutcomeMode = "outcome"
    success_threshold: float = 1.0
    success_value: float = 1.0
    failure_value: float = -0.01
    value: float = 0.0

    def __post_init__(self) -> None:
        check_choice("baseline.kind", self.kind, ("running", "group", "rloo"))
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
        self,
        rewards: torch.Tensor,
        all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
        groups: list[int] | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The advantages of this batch (by ``kind``), then update ``b`` from this batch's mean outcome.

        ``groups`` gives each response's prompt (rows of one prompt share a value); the group kinds need it. A
        prompt's responses are always on one rank, so group means need no communication. ``all_reduce_sum``
        sums ``[Σ outcome, count]`` over data-parallel ranks, so every rank moves ``b`` by the global batch mean
        and the baseline stays identical everywhere.
        """
        outcome = self.outcomes(rewards)
        if self.kind == "running":
            adv = outcome - self.value
        else:
            adv = outcome - group_baseline(outcome, groups, leave_one_out=self.kind == "rloo")
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


RunningBaseline = Baseline  # the name of algorithm.md §8's default, kept for configs and checkpoints that use it


def group_baseline(outcome: torch.Tensor, groups: list[int] | torch.Tensor | None, leave_one_out: bool) -> torch.Tensor:
    """Per response: the mean outcome of its prompt's responses (``leave_one_out``: of the *other* responses).

    ``b_i = (Σ_{j∈g(i)} o_j) / n_g``, or ``(Σ_{j∈g(i)} o_j − o_i) / (n_g − 1)`` leave-one-out. A prompt with one
    response has no baseline from others: leave-one-out is then an error.
    """
    if groups is None:
        raise ValueError("a group baseline needs the prompt of every response (groups)")
    g = torch.as_tensor(groups, dtype=torch.long)
    if g.numel() != outcome.numel():
        raise ValueError(f"{g.numel()} group ids for {outcome.numel()} responses")
    _, inverse = torch.unique(g, return_inverse=True)
    sums = torch.zeros(int(inverse.max()) + 1, dtype=outcome.dtype).index_add_(0, inverse, outcome)
    counts = torch.zeros_like(sums).index_add_(0, inverse, torch.ones_like(outcome))
    if not leave_one_out:
        return sums[inverse] / counts[inverse]
    if bool((counts < 2).any()):
        raise ValueError("the leave-one-out (rloo) baseline needs at least 2 responses per prompt")
    return (sums[inverse] - outcome) / (counts[inverse] - 1)


def length_weights(lengths: torch.Tensor, reference: float | None) -> torch.Tensor:
    """Per-response weight ``reference / L`` (algorithm.md §8, optional), or ones when ``reference`` is None."""
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


def ppo_stats(
    logp: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor, clip_eps: float = 0.2
) -> dict[str, tuple[float, float]]:
    """``clip_fraction`` as (clipped tokens, valid tokens), summed over microbatches by the caller."""
    ratio = torch.exp(logp.detach() - logp_old)
    outside = ((ratio < 1 - clip_eps) | (ratio > 1 + clip_eps)) & mask.bool()
    return {"clip_fraction": (float(outside.sum()), float(mask.sum()))}


@dataclass(frozen=True)
class LossSpec:
    """One registered loss.

    Arguments:
        fn: ``fn(logp, reference, advantages, mask, num_tokens, weights, **params) -> loss`` (a scalar tensor; the
            token sum divided by ``num_tokens``).
        reference: the log-probs ``fn`` is given as ``reference``: ``"rollout"`` (the engine's, per sampled token)
            or ``"trainer"`` (the trainer's before this rollout's first update; the rollout is then used for
            ``ppo_epochs × ppo_minibatches`` updates).
        params: names of ``fn``'s hyper-parameters, read from ``LossConfig`` fields or ``LossConfig.params``.
        stats: optional ``stats(logp, reference, mask, **params) -> {name: (numerator, denominator)}``; summed over
            microbatches and logged as ``train/<name>`` = numerator / denominator.
    """

    fn: Callable[..., torch.Tensor]
    reference: Literal["rollout", "trainer"]
    params: tuple[str, ...] = ()
    stats: Callable[..., dict[str, tuple[float, float]]] | None = None


LOSSES: dict[str, LossSpec] = {}


def register_loss(name: str, spec: LossSpec) -> LossSpec:
    """Add a loss under ``name`` (``loss.kind: name`` in a config). Re-registering a name replaces it."""
    if spec.reference not in ("rollout", "trainer"):
        raise ValueError(f"loss {name!r}: reference must be 'rollout' or 'trainer', got {spec.reference!r}")
    LOSSES[name] = spec
    return spec


def resolve_loss(kind: str) -> LossSpec:
    """The spec of ``kind``: a registered name, or a dotted path ``package.module.NAME`` to a :class:`LossSpec`."""
    if kind in LOSSES:
        return LOSSES[kind]
    spec = import_dotted(kind, "loss.kind")
    if isinstance(spec, LossSpec):
        return register_loss(kind, spec)
    raise ConfigError(
        f"unknown loss.kind {kind!r}: use one of {sorted(LOSSES)}, or the dotted path of a LossSpec "
        "(e.g. my_package.losses.MY_LOSS)"
    )


register_loss("reinforce_tis", LossSpec(reinforce_tis_loss, "rollout", ("tis_cap",)))
register_loss("ppo", LossSpec(ppo_clip_loss, "trainer", ("clip_eps",), stats=ppo_stats))
