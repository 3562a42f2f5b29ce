"""``Loss``: the contract every policy-gradient loss meets, and the settings every loss shares, declared once.

A loss is chosen in YAML by ``class_path``/``init_args`` or a short name (:mod:`logra_pl.config`); :func:`build_loss`
turns what a config or a caller gives into the object and :func:`check_loss` says what an object lacks.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from logra_pl.config import Registry, class_path_of, init_parameters, resolve, translated
from logra_pl.errors import ConfigError, check_choice, check_int, check_range
from logra_pl.losses.functional import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    UpdateTotals,
    aggregation_scale,
    kl_estimate,
    kl_penalty,
    length_weights,
    truncation_mask,
)
from logra_pl.runtime.dtypes import DTYPES

Reference = Literal["rollout", "trainer"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
KLEstimator = Literal["k1", "k2", "k3"]
ReferenceDevice = Literal["cpu", "same"]
REFERENCE_DEVICES: tuple[str, ...] = ("cpu", "same")
REFERENCE_DTYPES: tuple[str, ...] = tuple(DTYPES)


class Configured:
    """An object a config builds by ``class_path``/``init_args``: it can say so again (:meth:`to_config`).

    Its arguments are its constructor's, and — where that constructor passes ``**kwargs`` on — its base classes'
    (as jsonargparse reads them), each read back from the attribute of the same name.
    """

    @classmethod
    def parameters(cls) -> list[inspect.Parameter]:
        """The named constructor parameters, a ``**kwargs`` followed into the base classes' constructors."""
        return init_parameters(cls)[0]

    def init_args(self) -> dict[str, Any]:
        """The constructor's arguments, read back from the attributes of the same names (those it keeps)."""
        return {p.name: getattr(self, p.name) for p in self.parameters() if hasattr(self, p.name)}

    def to_config(self, short: bool = False) -> dict[str, Any]:
        """``{"class_path": ..., "init_args": ...}``: the YAML that builds this object (resumes compare it).
        ``short``: without the keyword-only arguments at their defaults (the same object; for messages)."""
        return {"class_path": class_path_of(type(self)), "init_args": self._short_args() if short else self.init_args()}

    def _short_args(self) -> dict[str, Any]:
        """The arguments, less keyword-only ones at their defaults (the settings every loss shares, when unused)."""
        defaults = {p.name: p.default for p in self.parameters() if p.kind is inspect.Parameter.KEYWORD_ONLY}
        return {k: v for k, v in self.init_args().items() if not (k in defaults and v == defaults[k])}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._short_args().items())
        return f"{type(self).__name__}({args})"


@dataclass(frozen=True)
class SharedSettings:
    """The settings every loss shares, as :class:`Loss` keeps them (``loss.shared``); see :class:`Loss` for each.

    Kept apart from a loss's own attributes, so that a loss of your own with an attribute of the same name (its own
    ``kl_coef``, say) never turns these on: only :meth:`Loss.__init__` sets them.
    """

    aggregation: str = "token_mean"
    aggregation_length: int | None = None
    mask_truncated: bool = False
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    reference_device: str = "cpu"
    reference_dtype: str | None = None


def check_length_reference(value: float | None) -> None:
    """``length_reference`` is None or a positive number."""
    if value is not None:
        check_range("loss.length_reference", value, 0.0, low_open=True)


def check_eps(name: str, value: float | None, high: float | None = None) -> None:
    """A clip half-width is None or in ``(0, high)``."""
    if value is not None:
        check_range(f"loss.{name}", value, 0.0, high, low_open=True, high_open=high is not None)


class Loss(Configured, ABC):
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

    The settings every loss shares are this class's constructor arguments, implemented here once and kept in
    ``shared`` (:class:`SharedSettings`). A subclass offers them by passing ``**shared`` on to
    ``super().__init__`` (jsonargparse then lists them among its own arguments), as the built-in losses do; one that
    does not has the defaults (token mean, no masking, no penalty), whatever attributes of its own it has.

    Arguments:
        aggregation: how token terms become the update's loss (:func:`~logra_pl.losses.functional.aggregation_scale`):
            ``token_mean``, ``seq_mean_token_mean`` or ``seq_mean_token_sum_norm`` (Dr.GRPO) — :meth:`row_scale`.
        aggregation_length: Dr.GRPO's constant ``C``; None: the rollout's ``max_new_tokens``.
        mask_truncated: responses that hit the length limit without EOS are left out of the loss and of its
            normalisers (:meth:`token_mask`); they still count in the baseline and the advantages.
        kl_coef: weight of the KL-to-reference penalty (:meth:`penalty`); 0: off (no reference policy is kept).
        kl_estimator: ``k1``, ``k2`` or ``k3`` (:func:`~logra_pl.losses.functional.kl_estimate`).
        reference_device: where the reference policy's weights live: ``cpu`` (host memory; streamed to the
            policy's device for its forward when that is an accelerator) or ``same`` (the policy's device).
        reference_dtype: the reference's dtype (``bfloat16`` halves an fp32 copy); None: the policy's.

    A subclass defines ``__call__``, stores each constructor argument under its own name (``to_config`` and
    ``repr`` read them back) and checks them in ``__init__``, so a bad value fails before any model loads. The class
    is abstract, so a config section without a ``class_path`` never builds it.
    """

    registry: ClassVar[Registry]
    reference: ClassVar[Reference] = "rollout"
    length_reference: float | None = None
    shared: SharedSettings = SharedSettings()  # the defaults until __init__ sets this loss's own

    def __init__(
        self,
        *,
        aggregation: Aggregation = "token_mean",
        aggregation_length: int | None = None,
        mask_truncated: bool = False,
        kl_coef: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        reference_device: ReferenceDevice = "cpu",
        reference_dtype: str | None = None,
    ) -> None:
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
        (:func:`~logra_pl.losses.functional.aggregation_scale`); ``lengths`` are the responses' loss tokens. None:
        token mean (no factor)."""
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
        """The KL-to-reference term of one microbatch, aggregated as the loss
        (:func:`~logra_pl.losses.functional.kl_penalty`)."""
        shared = self.shared
        return kl_penalty(logp, ref_policy_logp, mask, num_tokens, weights, shared.kl_coef, shared.kl_estimator)

    def penalty_stats(
        self, logp: torch.Tensor, ref_policy_logp: torch.Tensor, mask: torch.Tensor
    ) -> dict[str, tuple[float, float]]:
        """``kl_reference``: the estimator's token mean (numerator, tokens), logged as ``train/kl_reference``."""
        k = kl_estimate(logp.detach(), ref_policy_logp, self.shared.kl_estimator)
        return {"kl_reference": (float((k * mask).sum()), float(mask.sum()))}


def check_loss(loss: Any, setting: str = "model.loss") -> None:
    """Raise :class:`ConfigError` unless ``loss`` has the whole :class:`Loss` contract."""
    name = class_path_of(loss)
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


Loss.registry = Registry("loss", "model.loss", "logra_pl.losses.PPOClip", check_loss)


def build_loss(value: Any = None, setting: str = "model.loss") -> Loss:
    """The :class:`Loss` a config or a caller gives, checked (:func:`logra_pl.config.resolve`).

    Accepted: None (``reinforce_tis``), a loss object, a short name (``reinforce_tis``, ``ppo``, ``gspo``, ``cispo``),
    a class name (``PPOClip``), a dotted path (to a class, built with its defaults, or an instance), or a
    ``{class_path, init_args}`` mapping; older kinds of value are read through the ``plugin`` translators
    (:func:`logra_pl.config.translated`).
    """
    value = translated("plugin", "reinforce_tis" if value is None else value, Loss.registry, setting)
    return resolve(value, Loss.registry, setting)
