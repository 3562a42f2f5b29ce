"""Policy-gradient losses and advantage baselines (algorithm.md §8), as objects chosen by ``class_path``.

Shapes: ``logp``, ``ref_logp``, ``mask`` are ``(batch, response_len)``; ``advantages`` and ``weights`` are
``(batch,)``. Every loss is a *sum* over valid tokens of ``weights``-scaled terms divided by ``num_tokens`` — the
token count of the whole update — so that summing microbatch losses gives the update's loss exactly. The
aggregation modes (token mean, sequence mean of token means, Dr.GRPO's constant normaliser) enter through that one
seam: :meth:`Loss.row_scale` turns the whole update's token and sequence counts into a per-response factor of
``weights`` (:func:`aggregation_scale`), so every loss — the built-in ones and yours — aggregates every way.

A loss is a :class:`Loss`: which reference log-probs it is given, the updates one rollout makes (:meth:`Loss.plan`),
the loss itself, the token statistics it logs, the per-response length weights, and the settings every loss shares
(aggregation, ``mask_truncated``, the KL-to-reference penalty). The menu: :class:`ReinforceTIS` (default),
:class:`PPOClip` (with DAPO's clip-higher), :class:`GSPO`, :class:`CISPO`. A baseline is an
:class:`AdvantageBaseline`: rewards → advantages, with its own state. Both are selected in YAML by
``class_path``/``init_args`` or by a short name (``ppo``, ``gspo``, ``rloo``); :func:`build_loss` and
:func:`build_baseline` turn what a config or a caller gives into the object.

The registry of the previous layout (:class:`LossSpec`, :func:`register_loss`, ``LossConfig(kind=...)``) and
``Baseline(kind=...)`` remain as deprecated adapters: old checkpoints pickle them, and they build the objects.
"""

from __future__ import annotations

import inspect
import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypedDict

import torch

from logra_pl.errors import ConfigError, check_choice, check_int, check_range, import_dotted

OutcomeMode = Literal["outcome", "reward"]
BaselineKind = Literal["running", "group", "rloo"]
Reference = Literal["rollout", "trainer"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
KLEstimator = Literal["k1", "k2", "k3"]
ReferenceDevice = Literal["cpu", "same"]
AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
REFERENCE_DEVICES: tuple[str, ...] = ("cpu", "same")
REFERENCE_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16", "float64")


# ------------------------------------------------------------------------------------------ the arithmetic
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


def _bounds(clip_eps: float, eps_low: float | None, eps_high: float | None) -> tuple[float, float]:
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
    low, high = _bounds(clip_eps, eps_low, eps_high)
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
    low, high = _bounds(clip_eps, eps_low, eps_high)
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


@dataclass(frozen=True)
class SharedSettings:
    """The settings every loss shares, as :class:`Loss` keeps them (``loss.shared``); see :class:`Loss` for each.

    Kept apart from a loss's own attributes, so that a loss of your own with an attribute of the same name (its own
    ``kl_coef``, say) never turns these on: only :meth:`Loss._shared` sets them.
    """

    aggregation: str = "token_mean"
    aggregation_length: int | None = None
    mask_truncated: bool = False
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    reference_device: str = "cpu"
    reference_dtype: str | None = None


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


# ------------------------------------------------------------------------------------- configured objects
class _Configured:
    """An object a config builds by ``class_path``/``init_args``: it can say so again (:meth:`to_config`)."""

    def init_args(self) -> dict[str, Any]:
        """The constructor's arguments, read back from the attributes of the same names (those it keeps)."""
        params = inspect.signature(type(self).__init__).parameters.values()
        keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        names = [p.name for p in params if p.name != "self" and p.kind in keyword]
        return {name: getattr(self, name) for name in names if hasattr(self, name)}

    def to_config(self, short: bool = False) -> dict[str, Any]:
        """``{"class_path": ..., "init_args": ...}``: the YAML that builds this object (resumes compare it).
        ``short``: without the keyword-only arguments at their defaults (the same object; for messages)."""
        cls = type(self)
        args = self._short_args() if short else self.init_args()
        return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": args}

    def _short_args(self) -> dict[str, Any]:
        """The arguments, less keyword-only ones at their defaults (the settings every loss shares, when unused)."""
        params = inspect.signature(type(self).__init__).parameters
        return {
            k: v
            for k, v in self.init_args().items()
            if not (params[k].kind is inspect.Parameter.KEYWORD_ONLY and v == params[k].default)
        }

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._short_args().items())
        return f"{type(self).__name__}({args})"


def _check_length_reference(value: float | None) -> None:
    if value is not None:
        check_range("loss.length_reference", value, 0.0, low_open=True)


def _check_eps(name: str, value: float | None, high: float | None = None) -> None:
    if value is not None:
        check_range(f"loss.{name}", value, 0.0, high, low_open=True, high_open=high is not None)


class Loss(_Configured, ABC):
    """A policy-gradient loss: the whole contract the module uses (subclass it to select yours by ``class_path``).

    Attributes and methods:
        reference: whose log-probs weigh the tokens — ``"rollout"`` (the engine's, per sampled token) or
            ``"trainer"`` (the trainer's before this rollout's first update, as PPO's ``π_old``).
        length_reference: per-response reweighting ``length_reference / L`` (algorithm.md §8 uses 1024); None: off.
        plan(rows, generator_seed): the updates one rollout makes, as lists of row indices; each list is one
            optimizer step. Default: one update over all rows.
        __call__(logp, ref_logp, advantages, mask, num_tokens, weights): the loss of one microbatch — the sum over
            valid tokens of terms scaled by ``weights`` divided by ``num_tokens`` (the whole update's loss-token
            count over all ranks).
        stats(logp, ref_logp, mask): ``{name: (numerator, denominator)}`` summed over microbatches and logged as
            ``train/<name>``; default none.
        weights(lengths): the per-response weights passed to ``__call__``; default from ``length_reference``.

    The settings every loss shares, implemented here once and kept in ``shared`` (:class:`SharedSettings`): a
    subclass offers them by taking them as keyword-only arguments and passing them to :meth:`_shared`, as the
    built-in losses do; one that does not has the defaults (token mean, no masking, no penalty), whatever
    attributes of its own it has:
        aggregation: how token terms become the update's loss (:func:`aggregation_scale`): ``token_mean``,
            ``seq_mean_token_mean`` or ``seq_mean_token_sum_norm`` (Dr.GRPO) — :meth:`row_scale`.
        aggregation_length: Dr.GRPO's constant ``C``; None: the rollout's ``max_new_tokens``.
        mask_truncated: responses that hit the length limit without EOS are left out of the loss and of its
            normalisers (:meth:`token_mask`); they still count in the baseline and the advantages.
        kl_coef: weight of the KL-to-reference penalty (:meth:`penalty`); 0: off (no reference policy is kept).
        kl_estimator: ``k1``, ``k2`` or ``k3`` (:func:`kl_estimate`).
        reference_device: where the reference policy's weights live: ``cpu`` (host memory; streamed to the
            policy's device for its forward when that is an accelerator) or ``same`` (the policy's device).
        reference_dtype: the reference's dtype (``bfloat16`` halves an fp32 copy); None: the policy's.

    A subclass defines ``__call__``, stores each constructor argument under its own name (``to_config`` and
    ``repr`` read them back) and checks them in ``__init__``, so a bad value fails before any model loads. The class
    is abstract, so a config section without a ``class_path`` never builds it.
    """

    reference: ClassVar[Reference] = "rollout"
    length_reference: float | None = None
    shared: SharedSettings = SharedSettings()  # the defaults until _shared() sets this loss's own

    def _shared(
        self,
        aggregation: Aggregation,
        aggregation_length: int | None,
        mask_truncated: bool,
        kl_coef: float,
        kl_estimator: KLEstimator,
        reference_device: ReferenceDevice,
        reference_dtype: str | None,
    ) -> None:
        """Check and keep the settings every loss shares (called by the built-in losses' ``__init__``; call it from
        yours to offer them): in ``self.shared``, which the base class reads, and under their own names, which
        ``to_config`` and ``repr`` read back."""
        check_choice("loss.aggregation", aggregation, AGGREGATIONS)
        if aggregation_length is not None:
            check_int("loss.aggregation_length", aggregation_length, 1)
            if aggregation != "seq_mean_token_sum_norm":
                raise ConfigError(
                    f"loss.aggregation_length={aggregation_length} is Dr.GRPO's constant, used only by aggregation "
                    f"seq_mean_token_sum_norm (this loss aggregates by {aggregation}): remove it, or set that mode"
                )
        if not isinstance(mask_truncated, bool):
            raise ConfigError(f"loss.mask_truncated must be true or false, got {mask_truncated!r}")
        check_range("loss.kl_coef", kl_coef, 0.0, hint="0 turns the KL-to-reference penalty off")
        check_choice("loss.kl_estimator", kl_estimator, KL_ESTIMATORS)
        check_choice("loss.reference_device", reference_device, REFERENCE_DEVICES)
        if reference_dtype is not None:
            check_choice("loss.reference_dtype", reference_dtype, REFERENCE_DTYPES)
        self.shared = SharedSettings(
            aggregation, aggregation_length, mask_truncated, kl_coef, kl_estimator, reference_device, reference_dtype
        )
        self.aggregation = aggregation
        self.aggregation_length = aggregation_length
        self.mask_truncated = mask_truncated
        self.kl_coef = kl_coef
        self.kl_estimator = kl_estimator
        self.reference_device = reference_device
        self.reference_dtype = reference_dtype

    def plan(self, rows: int, generator_seed: int) -> list[list[int]]:
        """The updates of one rollout of ``rows`` responses: here one, over every row."""
        return [list(range(rows))]

    @abstractmethod
    def __call__(
        self,
        logp: torch.Tensor,
        ref_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        num_tokens: int,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The loss of one microbatch: the sum over valid tokens divided by ``num_tokens``."""

    def stats(self, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, tuple[float, float]]:
        """Token statistics of one microbatch as (numerator, denominator); none by default."""
        return {}

    def weights(self, lengths: torch.Tensor) -> torch.Tensor:
        """Per-response weights from the response lengths: ``length_reference / L``, or ones."""
        return length_weights(lengths, self.length_reference)

    def token_mask(self, response_mask: torch.Tensor, truncated: Sequence[bool]) -> torch.Tensor:
        """The tokens the loss counts: every valid response token, less truncated responses with
        ``mask_truncated`` (TRL's ``mask_truncated_completions``, DAPO's overlong filtering)."""
        return truncation_mask(response_mask, truncated) if self.shared.mask_truncated else response_mask

    def row_scale(self, lengths: torch.Tensor, totals: UpdateTotals) -> torch.Tensor | None:
        """Factor of each response's weight that makes ``Σ (w·term) / totals.tokens`` this loss's aggregation
        (:func:`aggregation_scale`); ``lengths`` are the responses' loss tokens. None: token mean (no factor)."""
        return aggregation_scale(self.shared.aggregation, lengths, totals, self.shared.aggregation_length)

    @property
    def needs_reference_policy(self) -> bool:
        """Whether the module must keep the initial policy as ``π_ref`` (a KL penalty is on)."""
        return self.shared.kl_coef > 0

    def penalty(
        self,
        logp: torch.Tensor,
        ref_policy_logp: torch.Tensor,
        mask: torch.Tensor,
        num_tokens: int,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The KL-to-reference term of one microbatch, aggregated as the loss (:func:`kl_penalty`)."""
        shared = self.shared
        return kl_penalty(logp, ref_policy_logp, mask, num_tokens, weights, shared.kl_coef, shared.kl_estimator)

    def penalty_stats(
        self, logp: torch.Tensor, ref_policy_logp: torch.Tensor, mask: torch.Tensor
    ) -> dict[str, tuple[float, float]]:
        """``kl_reference``: the estimator's token mean (numerator, tokens), logged as ``train/kl_reference``."""
        k = kl_estimate(logp.detach(), ref_policy_logp, self.shared.kl_estimator)
        return {"kl_reference": (float((k * mask).sum()), float(mask.sum()))}


class ReinforceTIS(Loss):
    """REINFORCE with truncated importance sampling (algorithm.md §8 default; the authors' form).

    ``loss = Σ −A·w·min(π/π_rollout, tis_cap).detach()·log π / num_tokens``, one update per rollout.

    Arguments:
        tis_cap: truncation of the rollout importance ratio ``π_train/π_rollout`` (2.0).
        length_reference: reweight each response by ``length_reference / L``; None: off.
        aggregation, aggregation_length, mask_truncated, kl_coef, kl_estimator, reference_device, reference_dtype:
            the settings every loss shares (:class:`Loss`).
    """

    reference: ClassVar[Reference] = "rollout"

    def __init__(
        self,
        tis_cap: float = 2.0,
        length_reference: float | None = None,
        *,
        aggregation: Aggregation = "token_mean",
        aggregation_length: int | None = None,
        mask_truncated: bool = False,
        kl_coef: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        reference_device: ReferenceDevice = "cpu",
        reference_dtype: str | None = None,
    ) -> None:
        check_range("loss.tis_cap", tis_cap, 0.0, low_open=True, hint="a cap of 0 zeroes every token's weight")
        _check_length_reference(length_reference)
        self.tis_cap = tis_cap
        self.length_reference = length_reference
        self._shared(
            aggregation, aggregation_length, mask_truncated, kl_coef, kl_estimator, reference_device, reference_dtype
        )

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


class PPOClip(Loss):
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
        aggregation, aggregation_length, mask_truncated, kl_coef, kl_estimator, reference_device, reference_dtype:
            the settings every loss shares (:class:`Loss`).
    """

    reference: ClassVar[Reference] = "trainer"

    def __init__(
        self,
        clip_eps: float | None = None,
        epochs: int = 2,
        minibatches: int = 2,
        length_reference: float | None = None,
        *,
        eps_low: float | None = None,
        eps_high: float | None = None,
        aggregation: Aggregation = "token_mean",
        aggregation_length: int | None = None,
        mask_truncated: bool = False,
        kl_coef: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        reference_device: ReferenceDevice = "cpu",
        reference_dtype: str | None = None,
    ) -> None:
        _check_eps("clip_eps", clip_eps, 1.0)
        _check_eps("eps_low", eps_low, 1.0)
        _check_eps("eps_high", eps_high)
        if clip_eps is not None and (eps_low not in (None, clip_eps) or eps_high not in (None, clip_eps)):
            raise ConfigError(
                f"loss.clip_eps={clip_eps} is the symmetric spelling of eps_low = eps_high, but eps_low={eps_low} "
                f"and eps_high={eps_high} were given too: remove clip_eps and set eps_low and eps_high (e.g. DAPO's "
                "0.2 and 0.28), or make them equal to clip_eps"
            )
        check_int("loss.epochs", epochs, 1)
        check_int("loss.minibatches", minibatches, 1)
        _check_length_reference(length_reference)
        self.eps_low, self.eps_high = eps_low, eps_high
        default = 0.2 if clip_eps is None else clip_eps
        self.low, self.high = _bounds(default, eps_low, eps_high)
        # clip_eps reads back as the symmetric ε when the interval is symmetric (so PPOClip() says clip_eps=0.2).
        self.clip_eps = self.low if self.low == self.high else None
        self.epochs = epochs
        self.minibatches = minibatches
        self.length_reference = length_reference
        self._shared(
            aggregation, aggregation_length, mask_truncated, kl_coef, kl_estimator, reference_device, reference_dtype
        )

    def plan(self, rows: int, generator_seed: int) -> list[list[int]]:
        """``epochs`` seeded permutations of the rows, each cut into ``minibatches`` updates."""
        return shuffled_plan(rows, generator_seed, self.epochs, self.minibatches)

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


class GSPO(Loss):
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

    reference: ClassVar[Reference] = "trainer"

    def __init__(
        self,
        eps_low: float = 3e-4,
        eps_high: float = 4e-4,
        epochs: int = 1,
        minibatches: int = 4,
        length_reference: float | None = None,
        *,
        aggregation: Aggregation = "seq_mean_token_mean",
        aggregation_length: int | None = None,
        mask_truncated: bool = False,
        kl_coef: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        reference_device: ReferenceDevice = "cpu",
        reference_dtype: str | None = None,
    ) -> None:
        _check_eps("eps_low", eps_low, 1.0)
        _check_eps("eps_high", eps_high)
        check_int("loss.epochs", epochs, 1)
        check_int("loss.minibatches", minibatches, 1)
        _check_length_reference(length_reference)
        self.eps_low, self.eps_high = eps_low, eps_high
        self.epochs, self.minibatches = epochs, minibatches
        self.length_reference = length_reference
        self._shared(
            aggregation, aggregation_length, mask_truncated, kl_coef, kl_estimator, reference_device, reference_dtype
        )

    def plan(self, rows: int, generator_seed: int) -> list[list[int]]:
        """``epochs`` seeded permutations of the rows, each cut into ``minibatches`` updates."""
        return shuffled_plan(rows, generator_seed, self.epochs, self.minibatches)

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


class CISPO(Loss):
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
        aggregation, aggregation_length, mask_truncated, kl_coef, kl_estimator, reference_device, reference_dtype:
            the settings every loss shares (:class:`Loss`).
    """

    reference: ClassVar[Reference] = "trainer"

    def __init__(
        self,
        eps_high: float = 0.28,
        eps_low: float | None = None,
        epochs: int = 1,
        minibatches: int = 4,
        length_reference: float | None = None,
        *,
        aggregation: Aggregation = "token_mean",
        aggregation_length: int | None = None,
        mask_truncated: bool = False,
        kl_coef: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        reference_device: ReferenceDevice = "cpu",
        reference_dtype: str | None = None,
    ) -> None:
        _check_eps("eps_high", eps_high)
        _check_eps("eps_low", eps_low, 1.0)
        check_int("loss.epochs", epochs, 1)
        check_int("loss.minibatches", minibatches, 1)
        _check_length_reference(length_reference)
        self.eps_high, self.eps_low = eps_high, eps_low
        self.epochs, self.minibatches = epochs, minibatches
        self.length_reference = length_reference
        self._shared(
            aggregation, aggregation_length, mask_truncated, kl_coef, kl_estimator, reference_device, reference_dtype
        )

    def plan(self, rows: int, generator_seed: int) -> list[list[int]]:
        """``epochs`` seeded permutations of the rows, each cut into ``minibatches`` updates."""
        return shuffled_plan(rows, generator_seed, self.epochs, self.minibatches)

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


class SpecLoss(Loss):
    """A loss of the deprecated registry (:class:`LossSpec`) as a :class:`Loss`: what ``LossConfig(kind=...)``
    builds for a kind that is not built in, and the YAML form of such a loss while it is being ported.

    Arguments:
        spec: a registered name or the dotted path of a :class:`LossSpec`.
        params: the hyper-parameters the spec lists (passed to its ``fn`` and ``stats``).
        epochs: passes over each rollout when the spec's reference is ``"trainer"``.
        minibatches: updates per pass (likewise).
        length_reference: reweight each response by ``length_reference / L``; None: off.
    """

    def __init__(
        self,
        spec: str,
        params: dict[str, float] | None = None,
        epochs: int = 2,
        minibatches: int = 2,
        length_reference: float | None = None,
    ) -> None:
        resolved = resolve_loss(spec)
        params = dict(params or {})
        missing = [name for name in resolved.params if name not in params]
        if missing:
            raise ConfigError(f"loss {spec!r} needs the hyper-parameter {missing[0]!r}: set loss.params.{missing[0]}")
        check_int("loss.epochs", epochs, 1)
        check_int("loss.minibatches", minibatches, 1)
        _check_length_reference(length_reference)
        self.spec_name = spec
        self.params = params
        self.epochs = epochs
        self.minibatches = minibatches
        self.length_reference = length_reference
        self.registered = resolved

    def init_args(self) -> dict[str, Any]:
        return {
            "spec": self.spec_name,
            "params": dict(self.params),
            "epochs": self.epochs,
            "minibatches": self.minibatches,
            "length_reference": self.length_reference,
        }

    @property
    def reference(self) -> Reference:  # type: ignore[override]
        return self.registered.reference

    @property
    def spec(self) -> LossSpec:
        return self.registered

    def hyper_parameters(self) -> dict[str, Any]:
        return {name: self.params[name] for name in self.registered.params}

    def plan(self, rows: int, generator_seed: int) -> list[list[int]]:
        if self.reference == "rollout":
            return [list(range(rows))]
        return shuffled_plan(rows, generator_seed, self.epochs, self.minibatches)

    def __call__(
        self,
        logp: torch.Tensor,
        ref_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        num_tokens: int,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.registered.fn(logp, ref_logp, advantages, mask, num_tokens, weights, **self.hyper_parameters())

    def stats(self, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, tuple[float, float]]:
        if self.registered.stats is None:
            return {}
        return self.registered.stats(logp, ref_logp, mask, **self.hyper_parameters())


class AdvantageBaseline(_Configured, ABC):
    """Rewards → advantages (algorithm.md §8): the contract the module uses, and the outcome mapping all share.

    ``outcome = success_value if the response succeeded else failure_value`` (mode ``"outcome"``) or the plain
    reward (mode ``"reward"``). A response succeeds when the verifier calls it correct — its ``correct``, else
    ``reward >= scoring.correct_threshold`` (the notion pass@k uses; algorithm.md §10) — or, with a
    ``success_threshold`` set, when ``reward >= success_threshold``. Every baseline tracks the global running mean
    ``b ← momentum·b + (1−momentum)·mean(outcome)`` (logged as ``train/baseline``, saved in checkpoints); a subclass
    says in :meth:`compare_to` what each outcome is compared with (and may override :meth:`advantages` altogether).
    The class is abstract, so a config section without a ``class_path`` never builds it.

    Attributes and methods:
        needs_groups: whether it compares a prompt's responses with each other (the module then requires
            ``rollout.responses_per_prompt >= 2``).
        value: the running baseline ``b`` (0 at the start).
        advantages(rewards, all_reduce_sum, groups, correct): this batch's advantages; then ``b`` moves. Only scored
            responses reach it (a response the verifier failed on has no reward: the module leaves it out).
        state_dict() / load_state_dict(state): ``{"value": b}``, as checkpoints of every version hold it.

    Arguments:
        momentum: EMA factor of ``b`` (0.9).
        mode: ``"outcome"`` (algorithm.md §8 default) or ``"reward"``.
        success_threshold: reward at or above which a response counts as a success; None (default): the verifier's
            correctness (``correct``), which is ``reward >= scoring.correct_threshold`` (1.0) unless the verifier
            defines its own, so a [0, 1] verifier gives the same outcomes as a threshold of 1.0.
        success_value: outcome of a success (1.0).
        failure_value: outcome of a failure (−0.01).
    """

    needs_groups: ClassVar[bool] = False

    def __init__(
        self,
        momentum: float = 0.9,
        mode: OutcomeMode = "outcome",
        success_threshold: float | None = None,
        success_value: float = 1.0,
        failure_value: float = -0.01,
    ) -> None:
        check_choice("baseline.mode", mode, ("outcome", "reward"))
        check_range("baseline.momentum", momentum, 0.0, 1.0, high_open=True)
        for name, value in (
            ("success_threshold", 0.0 if success_threshold is None else success_threshold),
            ("success_value", success_value),
            ("failure_value", failure_value),
        ):
            check_range(f"baseline.{name}", value)
        self.momentum = momentum
        self.mode = mode
        self.success_threshold = success_threshold
        self.success_value = success_value
        self.failure_value = failure_value
        self.value = 0.0

    def outcomes(self, rewards: torch.Tensor, correct: torch.Tensor | None = None) -> torch.Tensor:
        """Map verifier rewards to outcomes (float64).

        Arguments:
            rewards: the rewards, ``(N,)``.
            correct: ``(N,)`` bool, the verifier's correctness of each response; None: ``reward >= 1.0`` (the default
                ``scoring.correct_threshold``). Ignored when :attr:`success_threshold` is set.
        """
        rewards = rewards.to(torch.float64)
        if self.mode == "reward":
            return rewards
        if self.success_threshold is not None:
            success = rewards >= self.success_threshold
        else:
            success = rewards >= 1.0 if correct is None else correct.to(torch.bool)
        return torch.where(success, self.success_value, self.failure_value).to(torch.float64)

    @abstractmethod
    def compare_to(self, outcome: torch.Tensor, groups: list[int] | torch.Tensor | None) -> torch.Tensor | float:
        """What each outcome is compared with (``A = outcome − compare_to(...)``)."""

    def advantages(
        self,
        rewards: torch.Tensor,
        all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
        groups: list[int] | torch.Tensor | None = None,
        correct: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The advantages of this batch, then update ``b`` from this batch's mean outcome.

        ``groups`` gives each response's prompt (rows of one prompt share a value); group baselines need it. A
        prompt's responses are always on one rank, so group means need no communication. ``all_reduce_sum``
        sums ``[Σ outcome, count]`` over data-parallel ranks, so every rank moves ``b`` by the global batch mean
        and the baseline stays identical everywhere. ``correct``: the verifier's correctness per response
        (:meth:`outcomes`). Every rank calls this once per update, with no rows when none of its responses scored.
        """
        outcome = self.outcomes(rewards, correct)
        adv = outcome - self.compare_to(outcome, groups)
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

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in [*self.init_args().items(), ("value", self.value)])
        return f"{type(self).__name__}({args})"


class RunningBaseline(AdvantageBaseline):
    """The global running baseline (algorithm.md §8 default): ``A = outcome − b``, with ``b`` from previous batches
    only (it moves after this batch's advantages are formed)."""

    def compare_to(self, outcome: torch.Tensor, groups: list[int] | torch.Tensor | None) -> float:
        return self.value


class GroupBaseline(AdvantageBaseline):
    """GRPO-style (mean only, no division by the standard deviation): ``A = outcome − mean(outcomes of the same
    prompt)``. Needs several responses per prompt; ``b`` is still tracked and logged, but not used."""

    needs_groups: ClassVar[bool] = True

    def compare_to(self, outcome: torch.Tensor, groups: list[int] | torch.Tensor | None) -> torch.Tensor:
        return group_baseline(outcome, groups, leave_one_out=False)


class RLOOBaseline(AdvantageBaseline):
    """Leave-one-out: ``A = outcome − mean(outcomes of the prompt's other responses)``. Needs at least 2 responses
    per prompt; ``b`` is still tracked and logged, but not used."""

    needs_groups: ClassVar[bool] = True

    def compare_to(self, outcome: torch.Tensor, groups: list[int] | torch.Tensor | None) -> torch.Tensor:
        return group_baseline(outcome, groups, leave_one_out=True)


# The short names a config may give instead of a class_path (with default arguments).
LOSS_ALIASES: dict[str, type[Loss]] = {"reinforce_tis": ReinforceTIS, "ppo": PPOClip, "gspo": GSPO, "cispo": CISPO}
BASELINE_ALIASES: dict[str, type[AdvantageBaseline]] = {
    "running": RunningBaseline,
    "group": GroupBaseline,
    "rloo": RLOOBaseline,
}


# --------------------------------------------------------------------------------- from a config to an object
class LegacyBaselineSettings(TypedDict, total=False):
    """The keys of the old ``baseline: {kind: ..., momentum: ...}`` section (deprecated). Old configs and the
    hyper-parameters of old CLI checkpoints hold it; :func:`build_baseline` reads it with a ``FutureWarning`` that
    gives the ``class_path`` form, and refuses it without a ``kind``."""

    kind: str
    momentum: float
    mode: str
    success_threshold: float
    success_value: float
    failure_value: float
    value: float


def _flow(value: Any) -> str:
    """A value as YAML flow text (``{class_path: x, init_args: {a: 1}}``), for messages."""
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _import_class(path: str, setting: str, aliases: Mapping[str, type]) -> type:
    by_name = {cls.__name__: cls for cls in aliases.values()}
    if path in aliases or path in by_name:
        return aliases.get(path) or by_name[path]
    found = import_dotted(path, setting)
    if not inspect.isclass(found):
        raise ConfigError(f"{setting} class_path {path!r} is not a class")
    return found


def _construct(cls: type, init_args: Mapping[str, Any] | None, setting: str) -> Any:
    """``cls(**init_args)``; arguments it does not take are a :class:`ConfigError` listing those it does."""
    init_args = dict(init_args or {})
    params = [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    unknown = sorted(set(init_args) - {p.name for p in params})
    if unknown and not takes_any:
        raise ConfigError(
            f"{setting}: {cls.__module__}.{cls.__qualname__} does not take {', '.join(map(repr, unknown))}; its "
            f"arguments are {', '.join(p.name for p in params) or 'none'}"
        )
    return cls(**init_args)


def _from_text(text: str, setting: str, aliases: Mapping[str, type], builtin: str) -> Any:
    """A short name, a class name, a dotted path (class or instance), or a ``{class_path: ...}`` mapping as text."""
    text = text.strip()
    if text.startswith("{"):  # a mapping given on the command line that jsonargparse could not take as an object
        import yaml

        try:
            mapping = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigError(f"{setting} {text!r} is not a valid mapping: {err}") from None
        if not isinstance(mapping, Mapping):
            raise ConfigError(f"{setting} {text!r} is not a mapping")
        return mapping
    by_name = {cls.__name__: cls for cls in aliases.values()}
    if text in aliases or text in by_name:
        return (aliases.get(text) or by_name[text])()
    found = import_dotted(text, setting)
    if found is None:
        names = ", ".join(repr(k) for k in aliases)
        raise ConfigError(
            f"unknown {setting} {text!r}: use one of {names}, a class_path such as {builtin}, or the dotted path of "
            "your own class"
        )
    return found() if inspect.isclass(found) else found


def build_loss(value: Any = None, setting: str = "model.loss") -> Loss:
    """The :class:`Loss` a config or a caller gives, checked.

    Accepted: None (:class:`ReinforceTIS`), a loss object, a short name (``reinforce_tis``, ``ppo``, ``gspo``,
    ``cispo``), a class name
    (``PPOClip``), a dotted path (to a class, built with its defaults, or an instance), a ``{class_path, init_args}``
    mapping, and the deprecated forms — a ``LossConfig`` (what old checkpoints hold), a name or dotted path of the
    loss registry, and the old section ``{kind: ..., tis_cap: ...}`` (old configs, and what old CLI checkpoints
    hold: read with a ``FutureWarning`` giving its ``class_path`` form; without a ``kind`` it is refused).
    """
    from logra_pl.train.settings import LossConfig  # settings imports this module

    if value is None:
        loss = ReinforceTIS()
    elif isinstance(value, LossConfig):
        loss = value.build()
    elif isinstance(value, str):
        name = value.strip()
        if name not in LOSS_ALIASES and name in LOSSES:  # a name of the deprecated registry (register_loss)
            return build_loss(SpecLoss(name), setting)
        if "." in name and not name.startswith("{") and isinstance(import_dotted(name, setting), LossSpec):
            return build_loss(SpecLoss(name), setting)
        return build_loss(_from_text(value, setting, LOSS_ALIASES, "logra_pl.losses.PPOClip"), setting)
    elif isinstance(value, Mapping):
        if "class_path" not in value:
            from logra_pl.train.settings import LossConfig

            return build_loss(_legacy_section(LossConfig, value, setting), setting)
        cls = _import_class(str(value["class_path"]), setting, LOSS_ALIASES)
        loss = _construct(cls, value.get("init_args"), setting)
    else:
        loss = value
    check_loss(loss, setting)
    return loss


def _describe(obj: Any) -> str:
    """``module.Name`` of a class or function, else of the object's class."""
    named = obj if inspect.isclass(obj) or inspect.isroutine(obj) else type(obj)
    return f"{named.__module__}.{named.__qualname__}"


def check_loss(loss: Any, setting: str = "model.loss") -> None:
    """Raise :class:`ConfigError` unless ``loss`` has the whole :class:`Loss` contract."""
    name = _describe(loss)
    if inspect.isclass(loss):
        raise ConfigError(f"{setting} {name} is a class, not an instance (in YAML: class_path + init_args)")
    methods = ("plan", "stats", "weights", "token_mask", "row_scale", "penalty", "penalty_stats")
    missing = [m for m in methods if not callable(getattr(loss, m, None))]
    missing += [a for a in ("shared", "needs_reference_policy") if not hasattr(loss, a)]
    if not callable(loss):
        missing.insert(0, "__call__")
    if missing:
        raise ConfigError(
            f"{setting} {name} is not a loss: it lacks {', '.join(missing)} (subclass logra_pl.losses.Loss)"
        )
    reference = getattr(loss, "reference", None)
    if reference not in ("rollout", "trainer"):
        raise ConfigError(f"{setting} {name}: reference must be 'rollout' or 'trainer', got {reference!r}")


def _legacy_section(legacy: type, value: Mapping[str, Any], setting: str) -> Any:
    """The object an old ``{kind: ..., <arguments>}`` section means (deprecated: a ``FutureWarning`` gives the
    ``class_path`` form to write). A mapping without ``kind`` is refused: it is more likely arguments given after a
    short name (``--model.loss ppo --model.loss.clip_eps 0.1``), which would otherwise be silently dropped."""
    what = setting.rpartition(".")[2]
    given = _flow(dict(value))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            built = legacy(**dict(value)).build()
    except TypeError as err:
        raise ConfigError(f"{setting} {given}: {err}; write {what}: {{class_path: ..., init_args: {{...}}}}") from None
    translated = _flow(built.to_config(short=True))
    if "kind" not in value:
        flags = " ".join(f"--{setting}.{k} {_flow(v)}" for k, v in value.items())
        raise ConfigError(
            f"{setting} {given} gives arguments but no class_path. A short name takes none: name the class instead "
            f"(--{setting} CLASS {flags}, or {what}: {{class_path: CLASS, init_args: {{...}}}}). A section of the "
            f"old form names its kind; without one, these settings would mean {what}: {translated}"
        )
    warnings.warn(
        f"{setting} {{kind: {value['kind']}, ...}} is the deprecated form (an old config or checkpoint); it is read as "
        f"{what}: {translated}, the form to write from now on",
        FutureWarning,
        stacklevel=4,
    )
    return built


def build_baseline(value: Any = None, setting: str = "model.baseline") -> AdvantageBaseline:
    """The baseline a config or a caller gives, checked: None (:class:`RunningBaseline`), an object, a short name
    (``running``, ``group``, ``rloo``), a class name or dotted path, a ``{class_path, init_args}`` mapping, or the
    deprecated ``Baseline(kind=...)`` (what old checkpoints hold), or the old section ``{kind: ..., momentum: ...}``
    (read with a ``FutureWarning`` giving its ``class_path`` form; without a ``kind`` it is refused)."""
    if value is None:
        baseline = RunningBaseline()
    elif isinstance(value, Baseline):
        baseline = value.build()
    elif isinstance(value, str):
        return build_baseline(_from_text(value, setting, BASELINE_ALIASES, "logra_pl.losses.RLOOBaseline"), setting)
    elif isinstance(value, Mapping):
        if "class_path" not in value:
            return build_baseline(_legacy_section(Baseline, value, setting), setting)
        cls = _import_class(str(value["class_path"]), setting, BASELINE_ALIASES)
        baseline = _construct(cls, value.get("init_args"), setting)
    else:
        baseline = value
    check_baseline(baseline, setting)
    return baseline


def check_baseline(baseline: Any, setting: str = "model.baseline") -> None:
    """Raise :class:`ConfigError` unless ``baseline`` has the whole :class:`AdvantageBaseline` contract."""
    name = _describe(baseline)
    if inspect.isclass(baseline):
        raise ConfigError(f"{setting} {name} is a class, not an instance (in YAML: class_path + init_args)")
    missing = [m for m in ("advantages", "state_dict", "load_state_dict") if not callable(getattr(baseline, m, None))]
    missing += [a for a in ("value", "needs_groups") if not hasattr(baseline, a)]
    if missing:
        raise ConfigError(
            f"{setting} {name} is not a baseline: it lacks {', '.join(missing)} "
            "(subclass logra_pl.losses.AdvantageBaseline)"
        )


def canonical_settings(value: Any, kind: Literal["loss", "baseline"]) -> Any:
    """A loss or baseline setting as ``{class_path, init_args}`` (plain data), whichever form it was written in —
    short name, object, the deprecated classes, the old ``{kind: ...}`` section — so that a resume compares like
    with like. A ``class_path`` mapping is kept as it is; what cannot be built is returned unchanged."""
    if isinstance(value, Mapping) and "class_path" in value:
        return value
    build = build_loss if kind == "loss" else build_baseline
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            if isinstance(value, Mapping):  # the old section: what its dataclass would have built
                from logra_pl.train.settings import LossConfig

                legacy = LossConfig if kind == "loss" else Baseline
                return legacy(**dict(value)).to_config()
            return build(value).to_config()
    except (ConfigError, TypeError, ValueError, AttributeError, ImportError):
        return value


# ------------------------------------------------------------------------------- the deprecated registry
@dataclass(frozen=True)
class LossSpec:
    """Deprecated — a loss is now a :class:`Loss` object. One loss of the old registry.

    Arguments:
        fn: ``fn(logp, reference, advantages, mask, num_tokens, weights, **params) -> loss`` (a scalar tensor; the
            token sum divided by ``num_tokens``).
        reference: the log-probs ``fn`` is given as ``reference``: ``"rollout"`` or ``"trainer"`` (the rollout is
            then used for ``ppo_epochs × ppo_minibatches`` updates).
        params: names of ``fn``'s hyper-parameters, read from ``LossConfig`` fields or ``LossConfig.params``.
        stats: optional ``stats(logp, reference, mask, **params) -> {name: (numerator, denominator)}``.
    """

    fn: Callable[..., torch.Tensor]
    reference: Reference
    params: tuple[str, ...] = ()
    stats: Callable[..., dict[str, tuple[float, float]]] | None = None


LOSSES: dict[str, LossSpec] = {}


def register_loss(name: str, spec: LossSpec) -> LossSpec:
    """Deprecated — subclass :class:`Loss` instead. Add a loss under ``name`` (``LossConfig(kind=name)``)."""
    warnings.warn(
        "register_loss/LossSpec are deprecated: write a logra_pl.losses.Loss subclass and select it by class_path",
        DeprecationWarning,
        stacklevel=2,
    )
    return _register(name, spec)


def _register(name: str, spec: LossSpec) -> LossSpec:
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
        return _register(kind, spec)
    raise ConfigError(
        f"unknown loss.kind {kind!r}: use one of {sorted(LOSSES)}, or the dotted path of a LossSpec "
        "(e.g. my_package.losses.MY_LOSS); losses are now chosen by class_path (logra_pl.losses.PPOClip)"
    )


_register("reinforce_tis", LossSpec(reinforce_tis_loss, "rollout", ("tis_cap",)))
_register("ppo", LossSpec(ppo_clip_loss, "trainer", ("clip_eps",), stats=ppo_stats))
_BUILTIN_SPECS = {name: LOSSES[name] for name in ("reinforce_tis", "ppo")}


@dataclass
class Baseline:
    """Deprecated — use :class:`RunningBaseline`, :class:`GroupBaseline` or :class:`RLOOBaseline`. The baseline as
    one settings block with a ``kind``; old checkpoints pickle it, and the module builds the new object from it.

    Arguments:
        kind: ``"running"``, ``"group"`` or ``"rloo"``.
        momentum, mode, success_threshold, success_value, failure_value: as :class:`AdvantageBaseline`.
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
        warnings.warn(
            f"Baseline(kind=...) is deprecated: use logra_pl.losses.{BASELINE_ALIASES[self.kind].__name__}"
            if self.kind in BASELINE_ALIASES
            else "Baseline(kind=...) is deprecated: use RunningBaseline, GroupBaseline or RLOOBaseline",
            DeprecationWarning,
            stacklevel=3,
        )
        check_choice("baseline.kind", self.kind, tuple(BASELINE_ALIASES))
        check_range("baseline.value", self.value)
        self.build()

    def build(self) -> AdvantageBaseline:
        """The baseline object of ``kind``, with these settings and the current ``value``."""
        check_choice("baseline.kind", self.kind, tuple(BASELINE_ALIASES))
        baseline = BASELINE_ALIASES[self.kind](
            momentum=self.momentum,
            mode=self.mode,
            success_threshold=self.success_threshold,
            success_value=self.success_value,
            failure_value=self.failure_value,
        )
        baseline.value = float(self.value)
        return baseline

    def to_config(self) -> dict[str, Any]:
        """The ``class_path`` form of these settings (what a resume compares; ``value`` is state, not a setting)."""
        return self.build().to_config()

    def outcomes(self, rewards: torch.Tensor) -> torch.Tensor:
        return self.build().outcomes(rewards)

    def advantages(
        self,
        rewards: torch.Tensor,
        all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
        groups: list[int] | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As the object of ``kind`` would (and ``value`` moves the same way)."""
        baseline = self.build()
        adv = baseline.advantages(rewards, all_reduce_sum, groups)
        self.value = baseline.value
        return adv

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
