"""A loss: REINFORCE plus a k2 penalty that keeps the trainer's log-probs near the rollout's.

``loss = Σ (−A·w·log π + kl_coef · ½ (log π − log π_rollout)²) / num_tokens``. Selected by name after import
(``loss.kind: reinforce_k2``) or by dotted path (``loss.kind: k2_loss.REINFORCE_K2``), with ``loss.params.kl_coef``.
"""

from __future__ import annotations

import torch

from logra_pl.losses import LossSpec, register_loss


def reinforce_k2_loss(
    logp: torch.Tensor,
    reference: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    num_tokens: int,
    weights: torch.Tensor | None = None,
    kl_coef: float = 0.1,
) -> torch.Tensor:
    """The token sum of the surrogate divided by ``num_tokens`` (the token count of the whole update)."""
    per_seq = advantages.to(logp.dtype) * (weights.to(logp.dtype) if weights is not None else 1.0)
    k2 = 0.5 * (logp - reference) ** 2
    per_token = -per_seq.unsqueeze(1) * logp + kl_coef * k2
    return (per_token * mask).sum() / num_tokens


def k2_stats(
    logp: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor, kl_coef: float = 0.1
) -> dict[str, tuple[float, float]]:
    """Mean k2 over valid tokens, as (sum, count): summed over microbatches and logged as ``train/k2``."""
    k2 = 0.5 * (logp - reference) ** 2
    return {"k2": (float((k2 * mask).sum()), float(mask.sum()))}


REINFORCE_K2 = LossSpec(reinforce_k2_loss, reference="rollout", params=("kl_coef",), stats=k2_stats)
register_loss("reinforce_k2", REINFORCE_K2)
