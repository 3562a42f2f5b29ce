"""Trainer-side log-probs of sampled responses: the π_train of the losses and of the mismatch estimate."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from logra_pl.train.chunked_logprobs import chunked_response_scores
from logra_pl.train.packed import PackedResponses


def pack_responses(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    pad_token_id: int,
    masks: Sequence[Sequence[int]] | None = None,
) -> PackedResponses:
    """Right-pad ``prompt + response`` rows; positions count from 0 in every row (no left padding). ``masks``: per
    response, 1 at the tokens the policy sampled and 0 at tokens an environment inserted (default: all sampled)."""
    rows = [list(p) + list(r) for p, r in zip(prompts, responses, strict=True)]
    width = max(len(r) for r in rows)
    r_width = max(max((len(r) for r in responses), default=0), 1)
    batch = len(rows)
    input_ids = torch.full((batch, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((batch, width), dtype=torch.long)
    targets = torch.zeros((batch, r_width), dtype=torch.long)
    response_mask = torch.zeros((batch, r_width), dtype=torch.float32)
    for b, (row, resp) in enumerate(zip(rows, responses, strict=True)):
        input_ids[b, : len(row)] = torch.tensor(row)
        attention[b, : len(row)] = 1
        if resp:
            targets[b, : len(resp)] = torch.tensor(list(resp))
            if masks is None:
                response_mask[b, : len(resp)] = 1.0
            else:
                if len(masks[b]) != len(resp):
                    raise ValueError(f"response {b} has {len(resp)} tokens but its mask {len(masks[b])}")
                response_mask[b, : len(resp)] = torch.tensor(list(masks[b]), dtype=torch.float32)
    starts = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.long)
    positions = torch.arange(width).unsqueeze(0).expand(batch, width).contiguous()
    return PackedResponses(input_ids, attention, positions, targets, response_mask, starts)


def _response_log_softmax(model: torch.nn.Module, packed: PackedResponses, temperature: float) -> torch.Tensor:
    """``log softmax(logits / T)`` over the vocabulary at each response position, ``(B, R, V)`` in float32.

    Only the response positions' logits are gathered, so the ``(B, T, V)`` log-softmax is never materialised beyond
    the logits the model returns.
    """
    # No KV cache: scoring needs none, and a cache would be appended to again when a checkpointed layer replays.
    out = model(
        input_ids=packed.input_ids,
        attention_mask=packed.attention_mask,
        position_ids=packed.position_ids,
        use_cache=False,
    )
    logits = out.logits
    r_width = packed.targets.shape[1]
    index = packed.starts.unsqueeze(1) + torch.arange(r_width, device=logits.device).unsqueeze(0)
    index = index.clamp(max=logits.shape[1] - 1)
    picked = logits.gather(1, index.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    if temperature not in (0.0, 1.0):
        picked = picked / temperature
    return torch.log_softmax(picked.float(), dim=-1)


def _gather_targets(log_probs: torch.Tensor, packed: PackedResponses) -> torch.Tensor:
    """The sampled tokens' log-probs ``(B, R)``, zero where padded."""
    logp = log_probs.gather(-1, packed.targets.unsqueeze(-1)).squeeze(-1)
    return logp * packed.response_mask


def token_entropy(log_probs: torch.Tensor) -> torch.Tensor:
    """``H = −Σ_v p_v log p_v`` of each position's distribution, ``(B, R)``, from its log-probs ``(B, R, V)``.

    One row at a time, so the transient ``p`` is ``(R, V)``, not another ``(B, R, V)``; ``p = 0`` adds nothing.
    """
    rows = []
    for row in log_probs.detach():
        p = row.exp()
        rows.append(-(p * torch.where(p > 0, row, torch.zeros_like(row))).sum(dim=-1))
    return torch.stack(rows) if rows else log_probs.new_zeros(log_probs.shape[:2])


def response_logprobs(
    model: torch.nn.Module, packed: PackedResponses, temperature: float = 1.0, chunk: int | None = None
) -> torch.Tensor:
    """``log softmax(logits / T)`` of each response token, ``(B, R)``, zero where padded.

    Runs with whatever grad mode the caller set: under ``torch.no_grad`` for the pre-update π_train, with
    grad for the loss. ``chunk``: the output projection and log-softmax ``chunk`` tokens at a time, with no
    ``(B, R, V)`` tensor (:func:`~logra_pl.train.chunked_logprobs.chunked_response_scores`); None: all at once.
    """
    if chunk is not None:
        return chunked_response_scores(model, packed, temperature, chunk)[0]
    return _gather_targets(_response_log_softmax(model, packed, temperature), packed)


def response_logprobs_and_entropy(
    model: torch.nn.Module, packed: PackedResponses, temperature: float = 1.0, chunk: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The response tokens' log-probs (as :func:`response_logprobs`) and the policy's entropy at each response
    position (:func:`token_entropy`, zero where padded), both ``(B, R)``, from one forward pass (``chunk``: as
    :func:`response_logprobs`)."""
    if chunk is not None:
        return chunked_response_scores(model, packed, temperature, chunk)
    log_probs = _response_log_softmax(model, packed, temperature)
    return _gather_targets(log_probs, packed), token_entropy(log_probs) * packed.response_mask
