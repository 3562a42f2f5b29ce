"""A loss: REINFORCE plus a k2 penalty that keeps the trainer's log-probs near the rollout's.

``loss = Σ (−A·w·log π + kl_coef · ½ (log π − log π_rollout)²) / num_tokens``, one update per rollout. Selected by
class path with its own arguments (``--model.loss k2_loss.ReinforceK2 --model.loss.kl_coef 0.5``), or from Python
as an object (``loss=ReinforceK2(kl_coef=0.5)``).
"""

from __future__ import annotations

import torch

from logra_pl.errors import check_range
from logra_pl.losses import Loss


class ReinforceK2(Loss):
    """REINFORCE with a k2 penalty towards the rollout engine's log-probs.

    Arguments:
        kl_coef: weight of the k2 penalty.
        length_reference: reweight each response by ``length_reference / L``; None: off.
    """

    reference = "rollout"  # ref_logp is the engine's log-prob of each sampled token; one update per rollout

    def __init__(self, kl_coef: float = 0.1, length_reference: float | None = None) -> None:
        check_range("loss.kl_coef", kl_coef, 0.0)  # a bad value fails here, before any model loads
        self.kl_coef = kl_coef  # each argument under its own name: the saved config and repr read it back
        self.length_reference = length_reference  # Loss.weights(lengths): length_reference / L, or ones

    def __call__(
        self,
        logp: torch.Tensor,
        ref_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        num_tokens: int,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The token sum of the surrogate divided by ``num_tokens`` (the token count of the whole update)."""
        per_seq = advantages.to(logp.dtype) * (weights.to(logp.dtype) if weights is not None else 1.0)
        k2 = 0.5 * (logp - ref_logp) ** 2
        per_token = -per_seq.unsqueeze(1) * logp + self.kl_coef * k2
        return (per_token * mask).sum() / num_tokens

    def stats(self, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, tuple[float, float]]:
        """Mean k2 over valid tokens, as (sum, count): summed over microbatches and logged as ``train/k2``."""
        k2 = 0.5 * (logp - ref_logp) ** 2
        return {"k2": (float((k2 * mask).sum()), float(mask.sum()))}
