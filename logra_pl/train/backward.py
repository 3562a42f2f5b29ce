"""One update's backward passes: the loss over its rows, microbatch by microbatch, into the gradients (or sketches).

The loss of each microbatch is a sum over its loss tokens divided by the loss-token count of the whole update over
all ranks, with each response's terms scaled by the loss's aggregation factor (computed from the whole update's
token and sequence counts over all ranks), so microbatch and rank losses add up to the update's loss exactly
(algorithm.md §8). A KL-to-reference penalty, when the loss has one, is added to each microbatch's loss with the
same weights and normaliser. A response without a reward (its verifier call failed) has no loss tokens
(``StepContext.loss_mask``, algorithm.md §10), so it adds nothing and leaves the counts. No Lightning here: the caller
passes its backward (``manual_backward``), the microbatch plan and the update's totals.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from logra_pl.losses import Loss, UpdateTotals
from logra_pl.train.batching import select_rows
from logra_pl.train.logprobs import PackedResponses
from logra_pl.train.step import StepContext


def update_totals(
    ctx: StepContext,
    rows: list[int],
    max_new_tokens: int,
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor],
) -> UpdateTotals:
    """The normalisers' counts of the update over ``rows``: its loss tokens and the responses that have any,
    summed over all ranks in one all-reduce (so every rank divides by the same numbers)."""
    mask = ctx.loss_mask[rows]
    local = torch.stack([mask.sum().double(), (mask.sum(dim=1) > 0).sum().double()])
    tokens, sequences = all_reduce_sum(local).tolist()
    return UpdateTotals(int(tokens), int(sequences), max_new_tokens)


def microbatch_loss(
    loss_fn: Loss,
    logp: torch.Tensor,
    reference: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    lengths: torch.Tensor,
    totals: UpdateTotals,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, row weights)`` of one microbatch as a part of its whole update, without a KL penalty: the loss's row
    weights (``loss_fn.weights`` of the responses' ``lengths``) times its aggregation's scale for the rows' loss
    tokens (``mask``) within the update's ``totals``, the token sum normalized by the update's token count. The one
    place the per-microbatch loss is formed: the backward and the sketch diagnostics both call it."""
    weights = loss_fn.weights(lengths)
    scale = loss_fn.row_scale(mask.sum(dim=1), totals)
    if scale is not None:
        weights = weights * scale.to(device=weights.device, dtype=weights.dtype)
    return loss_fn(logp, reference, advantages, mask, max(totals.tokens, 1), weights), weights


def backward_over(
    score: Callable[[PackedResponses, float], torch.Tensor | tuple[torch.Tensor, torch.Tensor]],
    ctx: StepContext,
    groups: list[list[int]],
    loss_fn: Loss,
    totals: UpdateTotals,
    backward: Callable[[torch.Tensor], None],
    device: torch.device,
    trim: bool = False,
    padding: int = 0,
) -> float:
    """Forward (``score(packed, temperature)``: the policy's log-probs with grad, e.g. ``TrainerPasses.forward``), loss
    and ``backward`` for each microbatch of ``groups`` (rows of ``ctx``); the loss statistics are
    added to ``ctx.loss_stats``. Returns the summed loss. REINFORCE+TIS weighs tokens by π/π_rollout (capped), the
    PPO family by π/π_old with π_old the pre-update trainer (``loss_fn.reference``). The last ``padding`` microbatches
    only keep the ranks' forward counts equal: their loss (penalty included) is multiplied by zero, so they add exact
    zeros to the gradients (sketches) and nothing to the statistics.

    A single-pass step (``ctx.pending_scores`` set, ``groups`` covering every row once) has no separate pre-update
    pass: ``score`` returns ``(log-probs, entropy)`` (``TrainerPasses.forward_and_entropy``), the forward runs at
    the pre-update weights, so its detached log-probs are π_old (a ratio of exactly 1) and, with the entropy, become
    ``ctx.logp_trainer``/``ctx.entropy`` once every microbatch has run."""
    single = ctx.pending_scores is not None
    if single:
        logp_seen, entropy_seen = torch.zeros_like(ctx.logp_rollout), torch.zeros_like(ctx.logp_rollout)
        reference = ctx.logp_rollout if loss_fn.reference == "rollout" else None
    else:
        reference = ctx.logp_rollout if loss_fn.reference == "rollout" else ctx.logp_trainer
    num_tokens = max(totals.tokens, 1)
    penalised = loss_fn.needs_reference_policy
    if penalised and ctx.logp_reference is None:
        raise RuntimeError("the loss has a KL penalty (kl_coef > 0) but the step has no reference log-probs")
    total = 0.0
    for i, mb in enumerate(groups):
        packed = select_rows(ctx.packed, mb, trim).to(device)
        mask = ctx.loss_mask[mb].to(device)
        logp = score(packed, ctx.temperature)
        if isinstance(logp, tuple):
            logp, entropy = logp
            if single and i < len(groups) - padding:
                logp_seen[mb], entropy_seen[mb] = logp.detach().to(logp_seen), entropy.detach().to(entropy_seen)
        adv = ctx.advantages[mb].to(device)
        ref = logp.detach() if reference is None else reference[mb].to(device)
        loss, weights = microbatch_loss(loss_fn, logp, ref, adv, mask, packed.lengths, totals)
        if penalised:
            ref_policy = ctx.logp_reference[mb].to(device)
            loss = loss + loss_fn.penalty(logp, ref_policy, mask, num_tokens, weights)
        if i >= len(groups) - padding:
            ctx.padded_microbatches += 1
            backward(loss * 0.0)
            continue
        stats = loss_fn.stats(logp.detach(), ref, mask)
        if penalised:
            stats |= loss_fn.penalty_stats(logp, ref_policy, mask)
        backward(loss)
        total += float(loss.detach())
        for name, (num, den) in stats.items():
            acc = ctx.loss_stats.setdefault(name, [0.0, 0.0])
            acc[0] += num
            acc[1] += den
    if single:
        ctx.fill_trainer_scores(logp_seen, entropy_seen)
    return total
