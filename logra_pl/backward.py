"""One update's backward passes: the loss over its rows, microbatch by microbatch, into the gradients (or sketches).

The loss of each microbatch is summed over its tokens and divided by the token count of the whole update over all
ranks, so microbatch and rank losses add up to the token mean (algorithm.md §8). A response without a reward (its
verifier call failed) has no tokens in the loss (``StepContext.loss_mask``, algorithm.md §10). No Lightning here:
the caller passes its backward (``manual_backward``) and the microbatch plan.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from logra_pl.batching import select_rows
from logra_pl.logprobs import response_logprobs
from logra_pl.losses import Loss
from logra_pl.step import StepContext


def backward_over(
    policy: torch.nn.Module,
    ctx: StepContext,
    groups: list[list[int]],
    loss_fn: Loss,
    num_tokens: int,
    backward: Callable[[torch.Tensor], None],
    device: torch.device,
    trim: bool = False,
    padding: int = 0,
) -> float:
    """Forward, loss and ``backward`` for each microbatch of ``groups`` (rows of ``ctx``); the loss statistics are
    added to ``ctx.loss_stats``. Returns the summed loss. REINFORCE+TIS weighs tokens by π/π_rollout (capped), PPO by
    π/π_old with π_old the pre-update trainer (``loss_fn.reference``). The last ``padding`` microbatches only keep
    the ranks' forward counts equal: their loss is multiplied by zero, so they add exact zeros to the gradients
    (sketches) and nothing to the statistics."""
    reference = ctx.logp_rollout if loss_fn.reference == "rollout" else ctx.logp_trainer
    total = 0.0
    loss_mask = ctx.loss_mask  # the response tokens, without the responses that have no reward
    for i, mb in enumerate(groups):
        packed = select_rows(ctx.packed, mb, trim).to(device)
        logp = response_logprobs(policy, packed, ctx.temperature)
        adv, ref, mask = ctx.advantages[mb].to(device), reference[mb].to(device), loss_mask[mb].to(device)
        loss = loss_fn(logp, ref, adv, mask, max(num_tokens, 1), loss_fn.weights(packed.lengths))
        if i >= len(groups) - padding:
            ctx.padded_microbatches += 1
            backward(loss * 0.0)
            continue
        backward(loss)
        total += float(loss.detach())
        for name, (num, den) in loss_fn.stats(logp.detach(), ref, mask).items():
            acc = ctx.loss_stats.setdefault(name, [0.0, 0.0])
            acc[0] += num
            acc[1] += den
    return total
