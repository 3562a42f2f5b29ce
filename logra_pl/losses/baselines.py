"""Advantage baselines (algorithm.md §8): rewards → advantages, with their own state. ``RunningBaseline`` (the
default), ``GroupBaseline`` (GRPO's group mean) and ``RLOOBaseline`` (leave-one-out), registered as ``running``,
``group`` and ``rloo``; :func:`build_baseline` resolves what a config gives.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import torch

from logra_pl.config import Registry, class_path_of, register, resolve, translated
from logra_pl.errors import ConfigError, check_choice, check_range
from logra_pl.losses.base import Configured
from logra_pl.losses.functional import group_baseline

OutcomeMode = Literal["outcome", "reward"]


def check_baseline(baseline: Any, setting: str = "model.baseline") -> None:
    """Raise :class:`ConfigError` unless ``baseline`` has the whole :class:`AdvantageBaseline` contract."""
    name = class_path_of(baseline)
    if inspect.isclass(baseline):
        raise ConfigError(f"{setting} {name} is a class, not an instance (in YAML: class_path + init_args)")
    missing = [m for m in ("advantages", "state_dict", "load_state_dict") if not callable(getattr(baseline, m, None))]
    missing += [a for a in ("value", "needs_groups") if not hasattr(baseline, a)]
    if missing:
        raise ConfigError(
            f"{setting} {name} is not a baseline: it lacks {', '.join(missing)} "
            "(subclass logra_pl.losses.AdvantageBaseline)"
        )


class AdvantageBaseline(Configured, ABC):
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

    registry: ClassVar[Registry]
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


AdvantageBaseline.registry = Registry("baseline", "model.baseline", "logra_pl.losses.RLOOBaseline", check_baseline)


@register("running")
class RunningBaseline(AdvantageBaseline):
    """The global running baseline (algorithm.md §8 default): ``A = outcome − b``, with ``b`` from previous batches
    only (it moves after this batch's advantages are formed)."""

    def compare_to(self, outcome: torch.Tensor, groups: list[int] | torch.Tensor | None) -> float:
        return self.value


@register("group")
class GroupBaseline(AdvantageBaseline):
    """GRPO-style (mean only, no division by the standard deviation): ``A = outcome − mean(outcomes of the same
    prompt)``. Needs several responses per prompt; ``b`` is still tracked and logged, but not used."""

    needs_groups: ClassVar[bool] = True

    def compare_to(self, outcome: torch.Tensor, groups: list[int] | torch.Tensor | None) -> torch.Tensor:
        return group_baseline(outcome, groups, leave_one_out=False)


@register("rloo")
class RLOOBaseline(AdvantageBaseline):
    """Leave-one-out: ``A = outcome − mean(outcomes of the prompt's other responses)``. Needs at least 2 responses
    per prompt; ``b`` is still tracked and logged, but not used."""

    needs_groups: ClassVar[bool] = True

    def compare_to(self, outcome: torch.Tensor, groups: list[int] | torch.Tensor | None) -> torch.Tensor:
        return group_baseline(outcome, groups, leave_one_out=True)


def build_baseline(value: Any = None, setting: str = "model.baseline") -> AdvantageBaseline:
    """The baseline a config or a caller gives, checked (:func:`logra_pl.config.resolve`): None (``running``), an
    object, a short name (``running``, ``group``, ``rloo``), a class name or dotted path, a ``{class_path,
    init_args}`` mapping; older kinds of value are read through the ``plugin`` translators
    (:func:`logra_pl.config.translated`)."""
    value = translated("plugin", "running" if value is None else value, AdvantageBaseline.registry, setting)
    return resolve(value, AdvantageBaseline.registry, setting)
