"""Response log-probs without vocabulary-sized activations: the output projection and log-softmax in chunks of tokens.

The plain path (:func:`logra_pl.train.logprobs.response_logprobs`) takes the model's ``(B, T, V)`` logits, gathers
the response positions and keeps a float32 ``(B, R, V)`` log-softmax for the backward: on Qwen's 151,936-token
vocabulary a 4,096-token response's alone is 2.5 GB. Here the policy's final hidden states ``h`` (``(N, H)``, the
sampled response positions only) meet the output projection ``W`` (``(V, H)``) ``chunk`` tokens at a time::

    z = h Wᵀ / T (float32) ;  lse = logsumexp(z) ;  log p(y) = z_y − lse ;  H = lse − Σ_v softmax(z)_v z_v

Only ``lse`` (``N`` floats) is kept; the backward recomputes each chunk's ``z`` and forms
``∂log p(y)/∂z = onehot(y) − softmax(z)``, so the largest activation is ``chunk × V`` floats, whatever the response
length. The entropy is computed from the same chunks (no gradient flows through it: it is a diagnostic).

The hidden states are read where the model itself applies its output projection: :func:`chunked_response_scores`
runs the model's own forward with the projection's ``forward`` replaced for that call, so sharded (FSDP2) weights
are gathered as in any forward, and activation checkpointing and adapters are untouched. Models that change the
logits after the projection (``final_logit_softcapping``) are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from logra_pl.train.packed import PackedResponses


class ChunkedTokenLogprobs(torch.autograd.Function):
    """``(log p(y), H)`` per token from hidden states ``h`` ``(N, H)`` and the projection ``W`` ``(V, H)``
    (``bias`` ``(V,)`` or None), ``chunk`` tokens at a time; the backward recomputes each chunk's logits."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        chunk: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        for lo in range(0, n, chunk):
            z = _logits(hidden[lo : lo + chunk], weight, bias, temperature)
            lse_c = torch.logsumexp(z, dim=-1)
            lse[lo : lo + chunk] = lse_c
            logp[lo : lo + chunk] = z.gather(-1, targets[lo : lo + chunk, None]).squeeze(-1) - lse_c
            p = torch.softmax(z, dim=-1)
            entropy[lo : lo + chunk] = lse_c - (p * z).sum(dim=-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor, _grad_entropy: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        need_h, need_w, need_b = (
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            bias is not None and ctx.needs_input_grad[2],
        )
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        for lo in range(0, hidden.shape[0], chunk):
            h = hidden[lo : lo + chunk]
            z = _logits(h, weight, bias, temperature)
            # ∂ log p(y) / ∂ z = onehot(y) − softmax(z), times the incoming gradient, then through z = (hWᵀ + b)/T.
            g = torch.exp(z - lse[lo : lo + chunk, None]).neg_()
            g.scatter_add_(-1, targets[lo : lo + chunk, None], torch.ones_like(g[:, :1]))
            g.mul_(grad_logp[lo : lo + chunk, None].float() / temperature)
            if need_h:
                grad_h[lo : lo + chunk] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                grad_w.addmm_(g.t(), h.float())
            if need_b:
                grad_b.add_(g.sum(dim=0))
        return (
            grad_h,
            grad_w.to(weight.dtype) if grad_w is not None else None,
            grad_b.to(bias.dtype) if grad_b is not None else None,
            None,
            None,
            None,
        )


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """``(h Wᵀ + b) / T`` of one chunk in float32 (the projection in the weights' dtype, as the model computes it)."""
    z = torch.nn.functional.linear(h, weight, bias).float()
    return z / temperature if temperature not in (0.0, 1.0) else z


def token_scores(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p(y), H)`` of each row of ``hidden`` ``(N, H)`` under the output projection ``head`` (an
    ``nn.Linear``), ``chunk`` rows at a time (:class:`ChunkedTokenLogprobs`)."""
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1 token, got {chunk}")
    weight, bias = head.weight, getattr(head, "bias", None)
    return ChunkedTokenLogprobs.apply(hidden, weight, bias, targets, float(temperature), int(chunk))


def _check_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model's output projection, or a clear refusal when chunking would change the log-probs."""
    config = getattr(model, "config", None)
    if getattr(config, "final_logit_softcapping", None):
        raise ValueError(
            f"chunked log-probs need the logits to be the output projection's: {type(model).__name__} applies "
            "final_logit_softcapping after it; set model.logprob_chunk_tokens: null"
        )
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(
            f"chunked log-probs need an nn.Linear output projection; {type(model).__name__}'s is "
            f"{type(head).__name__}: set model.logprob_chunk_tokens: null"
        )
    return head


def chunked_response_scores(
    model: torch.nn.Module, packed: PackedResponses, temperature: float = 1.0, chunk: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """The response tokens' log-probs and the entropy at each response position, both ``(B, R)`` and zero where
    padded, with no ``(B, R, V)`` (or ``(B, T, V)``) tensor: the model's forward runs with its output projection
    replaced, for this call, by the chunked scores of the response positions (:func:`token_scores`)."""
    head = _check_model(model)
    b, r = packed.targets.shape
    valid = packed.response_mask > 0
    index = packed.starts.unsqueeze(1) + torch.arange(r, device=packed.starts.device).unsqueeze(0)
    found: dict[str, torch.Tensor] = {}

    def scores(hidden: torch.Tensor) -> torch.Tensor:
        at = index.clamp(max=hidden.shape[1] - 1).to(hidden.device)
        picked = hidden.gather(1, at.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))  # (B, R, H)
        mask = valid.to(hidden.device)
        logp, entropy = token_scores(picked[mask], head, packed.targets.to(hidden.device)[mask], temperature, chunk)
        found["logp"], found["entropy"] = logp, entropy
        return logp  # what the model returns as its "logits" (it is not read as such)

    with _replaced_forward(head, scores):
        model(
            input_ids=packed.input_ids,
            attention_mask=packed.attention_mask,
            position_ids=packed.position_ids,
            use_cache=False,
        )
    mask = valid.to(found["logp"].device)
    logp = found["logp"].new_zeros(b, r).masked_scatter(mask, found["logp"])
    entropy = found["entropy"].new_zeros(b, r).masked_scatter(mask, found["entropy"])
    return logp, entropy


class _replaced_forward:
    """``module.forward`` is ``fn`` inside the ``with`` block (an instance attribute, removed on exit)."""

    def __init__(self, module: torch.nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.module, self.fn = module, fn

    def __enter__(self) -> None:
        self.module.forward = self.fn  # type: ignore[method-assign]

    def __exit__(self, *exc: object) -> None:
        del self.module.forward
