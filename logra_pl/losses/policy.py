"""The policy-gradient losses of the menu (algorithm.md §8): ``ReinforceTIS`` (the default), ``PPOClip`` (with DAPO's
clip-higher), ``GSPO`` and ``CISPO`` — each a :class:`~logra_pl.losses.base.Loss` around one function of
:mod:`logra_pl.losses.functional`, registered under its short name (``reinforce_tis``, ``ppo``, ``gspo``, ``cispo``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from logra_pl.config import register
from logra_pl.errors import ConfigError, check_int, check_range
from logra_pl.losses.base import Aggregation, Loss, Reference, check_eps, check_length_reference
from logra_pl.losses.functional import (
    cispo_loss,
    cispo_stats,
    clip_bounds,
    gspo_loss,
    gspo_stats,
    ppo_clip_loss,
    ppo_stats,
    reinforce_tis_loss,
    shuffled_plan,
)


@register("reinforce_tis")
class ReinforceTIS(Loss):
    """REINFORCE with truncated importance sampling (algorithm.md §8 default; the authors' form).

    ``loss = Σ −A·w·min(π/π_rollout, tis_cap).detach()·log π / num_tokens``, one update per rollout.

    Arguments:
        tis_cap: truncation of the rollout importance ratio ``π_train/π_rollout`` (2.0).
        length_reference: reweight each response by ``length_reference / L``; None: off.
        **shared: the settings every loss shares (:class:`~logra_pl.losses.base.Loss`: ``aggregation``,
            ``mask_truncated``, the KL penalty...).
    """

    reference: ClassVar[Reference] = "rollout"

    def __init__(
        self,
        tis_cap: float = 2.0,
        length_reference: float | None = None,
        **shared: Any,
    ) -> None:
        check_range("loss.tis_cap", tis_cap, 0.0, low_open=True, hint="a cap of 0 zeroes every token's weight")
        check_length_reference(length_reference)
        self.tis_cap = tis_cap
        self.length_reference = length_reference
        super().__init__(**shared)

    def __call__(
        self,
        logp: torch.Tensor,
        ref_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        num_tokens: int,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return reinforce_tis_loss(logp, ref_logp, advantages, mask, num_tokens, weights, tis_cap=self.tis_cap)


class TrainerRatioLoss(Loss):
    """A loss taken against the trainer before the update (``π_old``) in ``epochs × minibatches`` updates per rollout:
    what PPO's clip, GSPO and CISPO share. Each epoch is a seeded random permutation of the rollout cut into
    ``minibatches`` parts; each part is one optimizer step.

    Arguments:
        epochs: passes over each rollout (1; each subclass states its own default).
        minibatches: updates per pass (1).
        length_reference: reweight each response by ``length_reference / L``; None: off.
        **shared: the settings every loss shares (:class:`~logra_pl.losses.base.Loss`).
    """

    reference: ClassVar[Reference] = "trainer"

    def __init__(
        self, epochs: int = 1, minibatches: int = 1, length_reference: float | None = None, **shared: Any
    ) -> None:
        check_int("loss.epochs", epochs, 1)
        check_int("loss.minibatches", minibatches, 1)
        check_length_reference(length_reference)
        self.epochs, self.minibatches = epochs, minibatches
        self.length_reference = length_reference
        super().__init__(**shared)

    def plan(self, rows: int, generator_seed: int) -> list[list[int]]:
        """``epochs`` seeded permutations of the rows, each cut into ``minibatches`` updates."""
        return shuffled_plan(rows, generator_seed, self.epochs, self.minibatches)


@register("ppo")
class PPOClip(TrainerRatioLoss):
    """PPO's clipped surrogate against the trainer before the update, ``epochs × minibatches`` updates per rollout;
    with ``eps_high > eps_low``, DAPO's clip-higher (arXiv 2503.14476).

    ``loss = Σ −min(r·A·w, clip(r, 1−ε_low, 1+ε_high)·A·w) / num_tokens`` with ``r = π/π_old``. Each epoch is a
    seeded random permutation of the rollout cut into ``minibatches`` parts of ``ceil(N / minibatches)`` rows; each
    part is one optimizer step. Logs ``train/clip_fraction``, the share of tokens whose ratio lies outside
    ``[1−ε_low, 1+ε_high]``.

    Arguments:
        clip_eps: the symmetric clip ``ε_low = ε_high = ε`` (0.2 when neither bound is given). Given together with
            ``eps_low`` or ``eps_high``, it must equal them.
        epochs: passes over each rollout (2).
        minibatches: updates per pass (2).
        length_reference: reweight each response by ``length_reference / L``; None: off.
        eps_low: lower half-width ``ε_low`` of the ratio interval; None: ``clip_eps`` (DAPO: 0.2).
        eps_high: upper half-width ``ε_high``; None: ``clip_eps`` (DAPO: 0.28).
        **shared: the settings every loss shares (:class:`~logra_pl.losses.base.Loss`: ``aggregation``,
            ``mask_truncated``, the KL penalty...).
    """

    def __init__(
        self,
        clip_eps: float | None = None,
        epochs: int = 2,
        minibatches: int = 2,
        length_reference: float | None = None,
        *,
        eps_low: float | None = None,
        eps_high: float | None = None,
        **shared: Any,
    ) -> None:
        check_eps("clip_eps", clip_eps, 1.0)
        check_eps("eps_low", eps_low, 1.0)
        check_eps("eps_high", eps_high)
        if clip_eps is not None and (eps_low not in (None, clip_eps) or eps_high not in (None, clip_eps)):
            raise ConfigError(
                f"loss.clip_eps={clip_eps} is the symmetric spelling of eps_low = eps_high, but eps_low={eps_low} "
                f"and eps_high={eps_high} were given too: remove clip_eps and set eps_low and eps_high (e.g. DAPO's "
                "0.2 and 0.28), or make them equal to clip_eps"
            )
        self.eps_low, self.eps_high = eps_low, eps_high
        default = 0.2 if clip_eps is None else clip_eps
        self.low, self.high = clip_bounds(default, eps_low, eps_high)
        # clip_eps reads back as the symmetric ε when the interval is symmetric (so PPOClip() says clip_eps=0.2).
        self.clip_eps = self.low if self.low == self.high else None
        super().__init__(epochs, minibatches, length_reference, **shared)

    def __call__(
        self,
        logp: torch.Tensor,
        ref_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        num_tokens: int,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return ppo_clip_loss(
            logp, ref_logp, advantages, mask, num_tokens, weights, clip_eps=self.low, eps_high=self.high
        )

    def stats(self, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, tuple[float, float]]:
        """``clip_fraction`` as (clipped tokens, valid tokens)."""
        return ppo_stats(logp, ref_logp, mask, clip_eps=self.low, eps_high=self.high)


@register("gspo")
class GSPO(TrainerRatioLoss):
    """Group Sequence Policy Optimization (Zheng et al., arXiv 2507.18071): PPO's clip on one ratio per sequence.

    ``s_i = (π(y_i|x)/π_old(y_i|x))^(1/|y_i|) = exp(mean_t(log π − log π_old))``, and
    ``loss = Σ_i Σ_t −min(s_i·A_i·w_i, clip(s_i, 1−ε_low, 1+ε_high)·A_i·w_i) / num_tokens``: each sequence's term
    on each of its tokens, so with the default ``seq_mean_token_mean`` aggregation the loss is the paper's
    ``−(1/G) Σ_i min(s_i·A_i, clip(s_i)·A_i)`` over the update's sequences. A clipped sequence contributes no
    gradient; an unclipped one ``s_i·A_i·(1/|y_i|) Σ_t ∇log π``. Against the trainer before the update
    (``π_old``), ``epochs × minibatches`` updates per rollout (the paper: the rollout in 4 minibatches, one pass).
    Logs ``train/clip_fraction``: the share of *sequences* whose ``s_i`` lies outside the interval.

    Arguments:
        eps_low: lower half-width (the paper's 3e-4; sequence ratios sit far closer to 1 than token ratios).
        eps_high: upper half-width (the paper's 4e-4).
        epochs: passes over each rollout (1).
        minibatches: updates per pass (4).
        length_reference: reweight each response by ``length_reference / L``; None: off.
        aggregation: default ``seq_mean_token_mean`` (the paper's sequence mean); the other shared settings
            (``aggregation_length``, ``mask_truncated``, ``kl_coef``, ``kl_estimator``, ``reference_device``,
            ``reference_dtype``) as in :class:`Loss`.
    """

    def __init__(
        self,
        eps_low: float = 3e-4,
        eps_high: float = 4e-4,
        epochs: int = 1,
        minibatches: int = 4,
        length_reference: float | None = None,
        *,
        aggregation: Aggregation = "seq_mean_token_mean",
        **shared: Any,
    ) -> None:
        check_eps("eps_low", eps_low, 1.0)
        check_eps("eps_high", eps_high)
        self.eps_low, self.eps_high = eps_low, eps_high
        super().__init__(epochs, minibatches, length_reference, aggregation=aggregation, **shared)

    def __call__(
        self,
        logp: torch.Tensor,
        ref_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        num_tokens: int,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return gspo_loss(logp, ref_logp, advantages, mask, num_tokens, weights, self.eps_low, self.eps_high)

    def stats(self, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, tuple[float, float]]:
        """``clip_fraction`` as (clipped sequences, sequences)."""
        return gspo_stats(logp, ref_logp, mask, self.eps_low, self.eps_high)


@register("cispo")
class CISPO(TrainerRatioLoss):
    """Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv 2506.13585): REINFORCE weighted by the detached,
    clipped token ratio, so no token's gradient is dropped.

    ``r = π/π_old`` per token, ``r̂ = clip(r, 1−ε_low, 1+ε_high)``, and
    ``loss = Σ −sg(r̂)·A·w·log π / num_tokens`` (the paper's token-level normalisation ``1/Σ_i|o_i|`` is the default
    ``token_mean``). The paper writes both bounds and sets no lower one in practice ("setting ε_low^IS to a large
    value"), tuning only ``ε_high^IS``; it does not publish that value. Defaults: ``eps_low=None`` (no lower bound)
    and ``eps_high=0.28``, DAPO's upper bound (arXiv 2503.14476), so CISPO and clip-higher PPO cap a token's
    ratio at the same ``1.28``. Against the trainer before the update (``π_old``), ``epochs × minibatches`` updates
    per rollout. Logs ``train/clip_fraction``: the share of tokens whose weight was clipped.

    Arguments:
        eps_high: upper half-width of the IS-weight clip (0.28).
        eps_low: lower half-width; None: no lower bound (the paper's practice).
        epochs: passes over each rollout (1).
        minibatches: updates per pass (4).
        length_reference: reweight each response by ``length_reference / L``; None: off.
        **shared: the settings every loss shares (:class:`~logra_pl.losses.base.Loss`: ``aggregation``,
            ``mask_truncated``, the KL penalty...).
    """

    def __init__(
        self,
        eps_high: float = 0.28,
        eps_low: float | None = None,
        epochs: int = 1,
        minibatches: int = 4,
        length_reference: float | None = None,
        **shared: Any,
    ) -> None:
        check_eps("eps_high", eps_high)
        check_eps("eps_low", eps_low, 1.0)
        self.eps_high, self.eps_low = eps_high, eps_low
        super().__init__(epochs, minibatches, length_reference, **shared)

    def __call__(
        self,
        logp: torch.Tensor,
        ref_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        num_tokens: int,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return cispo_loss(logp, ref_logp, advantages, mask, num_tokens, weights, self.eps_low, self.eps_high)

    def stats(self, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, tuple[float, float]]:
        """``clip_fraction`` as (tokens whose weight was clipped, valid tokens)."""
        return cispo_stats(logp, ref_logp, mask, self.eps_low, self.eps_high)
