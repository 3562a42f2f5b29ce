"""The arithmetic of the policy-gradient losses and baselines (algorithm.md §8), as pure functions.

Shapes: ``logp``, ``logp_old``/``logp_rollout``/``ref_logp`` and ``mask`` are ``(batch, response_len)``;
``advantages`` and ``weights`` are ``(batch,)``. Every loss is a *sum* over valid tokens of ``weights``-scaled terms
divided by ``num_tokens`` — the token count of the whole update over all ranks — so that summing microbatch losses
gives the update's loss exactly. Each function is one formula; :mod:`logra_pl.losses.policy` wraps them as the loss
objects a config chooses, :mod:`logra_pl.losses.baselines` as the advantage baselines.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


# ---------------------------------------------------------------------------------------------- the surrogates
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


def clip_bounds(clip_eps: float, eps_low: float | None, eps_high: float | None) -> tuple[float, float]:
    """The ratio interval's two half-widths: ``eps_low``/``eps_high`` where given, else the symmetric ``clip_eps``."""
    return (clip_eps if eps_low is None else eps_low), (clip_eps if eps_high is None else eps_high)


def ppo_clip_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    num_tokens: int,
    weights: torch.Tensor | None = None,
    clip_eps: float = 0.2,
    eps_low: float | None = None,
    eps_high: float | None = None,
) -> torch.Tensor:
    """PPO's clipped surrogate ``Σ −min(r·A·w, clip(r, 1−ε_low, 1+ε_high)·A·w) / num_tokens`` with ``r = π/π_old``.

    ``logp_old`` are the trainer's log-probs before the first update on this batch. ``ε_low = ε_high = clip_eps``
    unless given (DAPO's clip-higher, arXiv 2503.14476, widens the upper side only).
    """
    low, high = clip_bounds(clip_eps, eps_low, eps_high)
    ratio = torch.exp(logp - logp_old)
    adv = (advantages.to(logp.dtype) * (weights.to(logp.dtype) if weights is not None else 1.0)).unsqueeze(1)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1.0 - low, 1.0 + high) * adv)
    return -(surrogate * mask).sum() / num_tokens


def clip_fraction(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    eps_low: float | None = None,
    eps_high: float | None = None,
) -> float:
    """Share of valid tokens whose PPO ratio lies outside ``[1−ε_low, 1+ε_high]``."""
    clipped, tokens = ppo_stats(logp, logp_old, mask, clip_eps, eps_low, eps_high)["clip_fraction"]
    return clipped / max(tokens, 1.0)


def ppo_stats(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    eps_low: float | None = None,
    eps_high: float | None = None,
) -> dict[str, tuple[float, float]]:
    """``clip_fraction`` as (clipped tokens, valid tokens), summed over microbatches by the caller."""
    low, high = clip_bounds(clip_eps, eps_low, eps_high)
    ratio = torch.exp(logp.detach() - logp_old)
    outside = ((ratio < 1 - low) | (ratio > 1 + high)) & mask.bool()
    return {"clip_fraction": (float(outside.sum()), float(mask.sum()))}


def sequence_log_ratio(logp: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's ``log s_i = (1/|y_i|) Σ_t (log π − log π_old)`` over each row's valid tokens, ``(batch,)`` (0 for a
    row without any; the gradient reaches every token of the row with weight ``1/|y_i|``)."""
    return ((logp - logp_old) * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)


def gspo_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    num_tokens: int,
    weights: torch.Tensor | None = None,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> torch.Tensor:
    """GSPO (arXiv 2507.18071): ``Σ_i Σ_t −min(s_i·A_i·w_i, clip(s_i, 1−ε_low, 1+ε_high)·A_i·w_i) / num_tokens``.

    ``s_i = exp(mean_t(log π − log π_old))`` is one ratio per sequence, clipped per sequence; its term is counted on
    each of the sequence's valid tokens, so that the aggregation (``weights``, ``num_tokens``) decides how sequences
    are averaged — with ``seq_mean_token_mean`` it is the paper's ``(1/G) Σ_i``.
    """
    seq_ratio = torch.exp(sequence_log_ratio(logp, logp_old, mask))
    adv = advantages.to(logp.dtype) * (weights.to(logp.dtype) if weights is not None else 1.0)
    surrogate = torch.minimum(seq_ratio * adv, seq_ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv)
    return -(surrogate.unsqueeze(1) * mask).sum() / num_tokens


def gspo_stats(
    logp: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor, eps_low: float, eps_high: float
) -> dict[str, tuple[float, float]]:
    """``clip_fraction`` as (sequences whose ``s_i`` lies outside ``[1−ε_low, 1+ε_high]``, sequences)."""
    seq_ratio = torch.exp(sequence_log_ratio(logp.detach(), logp_old, mask))
    present = mask.sum(dim=1) > 0
    outside = ((seq_ratio < 1 - eps_low) | (seq_ratio > 1 + eps_high)) & present
    return {"clip_fraction": (float(outside.sum()), float(present.sum()))}


def cispo_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    num_tokens: int,
    weights: torch.Tensor | None = None,
    eps_low: float | None = None,
    eps_high: float = 0.28,
) -> torch.Tensor:
    """CISPO (MiniMax-M1, arXiv 2506.13585): ``Σ −sg(clip(r, 1−ε_low, 1+ε_high))·A·w·log π / num_tokens``.

    ``r = π/π_old`` per token; the clipped ratio is detached, so every token keeps the gradient of ``log π`` (a
    clipped token is weighed down, never dropped). ``eps_low=None``: no lower bound (the paper's practice).
    """
    ratio = torch.exp(logp.detach() - logp_old)
    weight = ratio.clamp(min=None if eps_low is None else 1.0 - eps_low, max=1.0 + eps_high)
    per_seq = advantages.to(logp.dtype) * (weights.to(logp.dtype) if weights is not None else 1.0)
    per_token = -per_seq.unsqueeze(1) * weight * logp
    return (per_token * mask).sum() / num_tokens


def cispo_stats(
    logp: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor, eps_low: float | None, eps_high: float
) -> dict[str, tuple[float, float]]:
    """``clip_fraction`` as (tokens whose IS weight was clipped, valid tokens)."""
    ratio = torch.exp(logp.detach() - logp_old)
    outside = ratio > 1 + eps_high
    if eps_low is not None:
        outside |= ratio < 1 - eps_low
    return {"clip_fraction": (float((outside & mask.bool()).sum()), float(mask.sum()))}


# ------------------------------------------------------------------------- aggregation and the KL penalty
@dataclass(frozen=True)
class UpdateTotals:
    """What the normalisers of one update count, over all its rows on all ranks (all-reduced by the module).

    Arguments:
        tokens: loss tokens (valid response tokens, less those ``mask_truncated`` leaves out).
        sequences: responses with at least one loss token.
        max_new_tokens: the rollout's response length limit (Dr.GRPO's constant by default).
    """

    tokens: int
    sequences: int
    max_new_tokens: int


def aggregation_scale(
    mode: str, lengths: torch.Tensor, totals: UpdateTotals, constant: int | None = None
) -> torch.Tensor | None:
    """Per-response factor ``c_i·T`` that turns the contract's ``Σ_tokens (w·term) / T`` into ``Σ_i c_i Σ_t term``.

    ``T = totals.tokens``, ``N = totals.sequences``, ``L_i`` the row's loss tokens (``lengths``), ``C`` the constant:

    - ``token_mean``: ``c_i = 1/T`` — every token of the update weighs the same (returns None: nothing to scale);
    - ``seq_mean_token_mean``: ``c_i = 1/(N·L_i)`` — each response's token mean, averaged over responses;
    - ``seq_mean_token_sum_norm``: ``c_i = 1/(N·C)`` — Dr.GRPO's token sum over a constant length
      (arXiv 2503.20783), ``C = constant`` or else ``totals.max_new_tokens``.

    ``T`` and ``N`` count the whole update on all ranks, so microbatch and rank losses add up to the update's.
    """
    if mode == "token_mean":
        return None
    n = max(totals.sequences, 1)
    if mode == "seq_mean_token_mean":
        denominator = n * lengths.to(torch.float64).clamp(min=1)
    elif mode == "seq_mean_token_sum_norm":
        denominator = torch.full(lengths.shape, float(n * (constant or totals.max_new_tokens)), dtype=torch.float64)
    else:
        raise ValueError(f"unknown aggregation {mode!r}: use one of {', '.join(AGGREGATIONS)}")
    return max(totals.tokens, 1) / denominator


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of ``KL(π‖π_ref)`` from a token sampled by π (Schulman, "Approximating KL Divergence").

    With ``x = log π_ref − log π``: ``k1 = −x``, ``k2 = x²/2``, ``k3 = exp(x) − x − 1`` (unbiased and ≥ 0).
    """
    x = ref_logp - logp
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * x * x
    if estimator == "k3":
        return torch.exp(x) - x - 1.0
    raise ValueError(f"unknown kl_estimator {estimator!r}: use one of {', '.join(KL_ESTIMATORS)}")


def kl_penalty(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    num_tokens: int,
    weights: torch.Tensor | None,
    coef: float,
    estimator: str,
) -> torch.Tensor:
    """``coef · Σ_tokens w·k(log π, log π_ref) / num_tokens``: the KL-to-reference term, aggregated as the loss is."""
    w = (weights.to(logp.dtype) if weights is not None else logp.new_ones(logp.shape[0])).unsqueeze(1)
    return coef * (w * kl_estimate(logp, ref_logp, estimator) * mask).sum() / num_tokens


def truncation_mask(response_mask: torch.Tensor, truncated: Sequence[bool]) -> torch.Tensor:
    """``response_mask`` with the rows of truncated responses (length limit hit without EOS) zeroed."""
    keep = torch.tensor([not t for t in truncated], dtype=response_mask.dtype)
    return response_mask * keep.unsqueeze(1)


def shuffled_plan(rows: int, generator_seed: int, epochs: int, minibatches: int) -> list[list[int]]:
    """``epochs`` passes over ``rows`` rows: each a seeded random permutation cut into parts of ``ceil(rows /
    minibatches)`` (the last may be shorter); one ``torch.Generator`` seeded once draws every epoch's permutation."""
    gen = torch.Generator().manual_seed(generator_seed)
    size = max(math.ceil(rows / minibatches), 1)
    plan: list[list[int]] = []
    for _ in range(epochs):
        perm = torch.randperm(rows, generator=gen).tolist()
        plan += [perm[i : i + size] for i in range(0, len(perm), size)]
    return plan


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
    if g.numel() == 0:  # every response of this rank failed to score: nothing to compare
        return outcome.clone()
    _, inverse = torch.unique(g, return_inverse=True)
    sums = torch.zeros(int(inverse.max()) + 1, dtype=outcome.dtype).index_add_(0, inverse, outcome)
    counts = torch.zeros_like(sums).index_add_(0, inverse, torch.ones_like(outcome))
    if not leave_one_out:
        return sums[inverse] / counts[inverse]
    if bool((counts < 2).any()):
        raise ValueError("the leave-one-out (rloo) baseline needs at least 2 responses per prompt")
    return (sums[inverse] - outcome) / (counts[inverse] - 1)
