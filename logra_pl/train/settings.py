"""The settings of a policy-update step that are not LoGRA's own or the loss's: sampling and scoring.

Each is a dataclass that checks its values when it is built (``__post_init__``), so a bad value fails before any
model is loaded; LightningCLI builds them from the ``model.rollout`` and ``model.scoring`` sections. The loss is an
object of its own (:mod:`logra_pl.losses`); its former settings block ``LossConfig`` lives in ``logra_pl/_graveyard``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from logra_pl.errors import ConfigError, check_int, check_range
from logra_pl.rollout.base import SamplingConfig

log = logging.getLogger(__name__)


@dataclass
class RolloutSettings:
    """Sampling for training and validation.

    Arguments:
        responses_per_prompt: responses sampled per training prompt (algorithm.md §8: 1).
        temperature: training sampling temperature ``T`` (algorithm.md §10: 1.0); log-probs use the same ``T``.
        top_p: training nucleus mass (1.0 = full distribution).
        max_new_tokens: response length limit; longer responses are truncated (and flagged).
        val_temperature: validation temperature (0 = greedy).
        val_top_p: validation nucleus mass.
        val_responses: responses per validation problem ``k`` (``val/pass@1`` averages over all of them).
        val_pass_at: the ``j`` of the unbiased ``val/pass@j`` estimates (each ≤ ``val_responses``); default: ``k``
            when ``k > 1``.
        max_batch: responses per engine forward batch.
        share_weights: the HF engine generates with the trainer's own weights instead of a private copy (one
            process only): saves one model copy — as when the rollout engine runs elsewhere — and nothing is synced.
        max_staleness: asynchronous rollouts: the engine samples the prompts of the next ``k`` updates while this
            one trains, each batch by weights at most ``k`` updates old (0: synchronous, the default;
            :mod:`logra_pl.train.async_rollouts`).
        max_stale_kl: with ``max_staleness`` ≥ 1, a batch is used only while the KL of the updates merged since its
            weights (summed, as PredictedKLControl priced them) is at most this; else it is sampled again by the
            current weights. None: the staleness bound alone.
        dynamic_sampling: DAPO's dynamic sampling (:mod:`logra_pl.train.shaping`): train only on prompts whose responses
            got different raw rewards, sampling further prompts until the update holds as many such groups as it
            has prompts (needs ``responses_per_prompt`` ≥ 2).
        max_sampling_rounds: with ``dynamic_sampling``, rounds of prompts sampled per update at most (the loader's
            batch counts as the first); a batch still short after them is completed with uniform groups.
        overlong_buffer: DAPO's soft overlong punishment: responses longer than ``max_new_tokens − overlong_buffer``
            tokens get a penalty falling linearly to ``−overlong_penalty`` at ``max_new_tokens``, added to the
            reward the advantages see (the raw reward is logged and filtered on). 0: off.
        overlong_penalty: the penalty's size at ``max_new_tokens``.
    """

    responses_per_prompt: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    val_temperature: float = 0.7
    val_top_p: float = 0.95
    val_responses: int = 1
    val_pass_at: list[int] = field(default_factory=list)
    max_batch: int = 256
    share_weights: bool = False
    max_staleness: int = 0
    max_stale_kl: float | None = None
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 3
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    def training_sampling(self, seed: int) -> SamplingConfig:
        """The sampling of one training rollout."""
        return SamplingConfig(self.responses_per_prompt, self.temperature, self.top_p, self.max_new_tokens, seed=seed)

    def validation_sampling(self, seed: int) -> SamplingConfig:
        """The sampling of one validation batch."""
        return SamplingConfig(self.val_responses, self.val_temperature, self.val_top_p, self.max_new_tokens, seed=seed)

    def check_baseline(self, baseline: Any) -> None:
        """A baseline that compares a prompt's responses with each other needs at least two of them."""
        if baseline.needs_groups and self.responses_per_prompt < 2:
            raise ConfigError(
                f"baseline {type(baseline).__name__} compares a prompt's responses with each other: set "
                "rollout.responses_per_prompt >= 2 (or use baseline: running)"
            )

    def check_env(self, env: Any) -> None:
        """A multi-turn environment runs its conversations with the trainer's engine calls: not ahead of it."""
        if env is not None and self.max_staleness > 0:
            raise ConfigError(
                "rollout.max_staleness >= 1 (asynchronous rollouts) samples one reply per prompt ahead of the "
                "trainer; a multi-turn env runs its conversations with the trainer's engine calls: set "
                "rollout.max_staleness: 0, or drop model.env"
            )

    def pass_at(self) -> list[int]:
        """The ``j`` of every ``val/pass@j`` logged (``pass@1`` always)."""
        wanted = self.val_pass_at or ([self.val_responses] if self.val_responses > 1 else [])
        return sorted({1, *wanted})

    def __post_init__(self) -> None:
        check_int("rollout.responses_per_prompt", self.responses_per_prompt, 1)
        check_range("rollout.temperature", self.temperature, 0.0, hint="0 is greedy; 1.0 samples the policy as is")
        check_range("rollout.top_p", self.top_p, 0.0, 1.0, low_open=True)
        check_int("rollout.max_new_tokens", self.max_new_tokens, 1)
        check_range("rollout.val_temperature", self.val_temperature, 0.0)
        check_range("rollout.val_top_p", self.val_top_p, 0.0, 1.0, low_open=True)
        check_int("rollout.val_responses", self.val_responses, 1)
        for j in self.val_pass_at:
            check_int("rollout.val_pass_at", j, 1)
            if j > self.val_responses:
                raise ConfigError(
                    f"rollout.val_responses={self.val_responses} is smaller than the requested pass@{j}: sample at "
                    f"least {j} responses per validation problem, or drop {j} from rollout.val_pass_at"
                )
        check_int("rollout.max_batch", self.max_batch, 1)
        check_int("rollout.max_staleness", self.max_staleness, 0)
        if self.max_stale_kl is not None:
            check_range("rollout.max_stale_kl", self.max_stale_kl, 0.0, low_open=True, hint="nats per token")
            if self.max_staleness == 0:
                raise ConfigError(
                    "rollout.max_stale_kl bounds stale batches, but rollout.max_staleness is 0 (synchronous: none "
                    "are stale); set max_staleness >= 1, or remove max_stale_kl"
                )
        check_int("rollout.max_sampling_rounds", self.max_sampling_rounds, 1)
        if not isinstance(self.dynamic_sampling, bool):
            raise ConfigError(f"rollout.dynamic_sampling must be true or false, got {self.dynamic_sampling!r}")
        if self.dynamic_sampling and self.responses_per_prompt < 2:
            raise ConfigError(
                "rollout.dynamic_sampling keeps prompts whose responses got different rewards, but "
                f"rollout.responses_per_prompt is {self.responses_per_prompt}: set it to 2 or more (e.g. 4 or 8), or "
                "turn dynamic_sampling off"
            )
        if self.dynamic_sampling and self.max_staleness:
            raise ConfigError(
                "rollout.dynamic_sampling decides each further round from the rewards of the last one, which "
                "asynchronous rollouts (rollout.max_staleness >= 1) sample before the update that trains them: use "
                "one of the two (max_staleness: 0, or dynamic_sampling: false)"
            )
        check_int("rollout.overlong_buffer", self.overlong_buffer, 0)
        if self.overlong_buffer > self.max_new_tokens:
            raise ConfigError(
                f"rollout.overlong_buffer={self.overlong_buffer} is longer than rollout.max_new_tokens="
                f"{self.max_new_tokens}: the penalty would start before the first token; use a buffer of at most "
                "max_new_tokens (DAPO: 4096 of 20480)"
            )
        check_range("rollout.overlong_penalty", self.overlong_penalty, 0.0, hint="the penalty at max_new_tokens")
        if self.temperature == 0:
            log.warning(
                "rollout.temperature is 0: training samples greedily, so every response to a prompt is the same and "
                "the policy gradient has no exploration; RL normally samples at 1.0"
            )


@dataclass
class ScoringSettings:
    """How responses are scored: in worker processes, with a time limit per call and a cap on answer length; which
    responses count as correct; when a failing verifier stops the run (algorithm.md §10).

    Arguments:
        timeout_s: seconds one verifier call may take; a call past it has no reward and counts in
            ``verifier/timeouts`` (its worker is killed and replaced). None scores in the training process without a
            limit (debugging).
        workers: scoring processes.
        max_answer_chars: an extracted answer longer than this scores 0 without reaching the scorer
            (``verifier/long_answers``): scorers such as sympy can take unbounded time on huge inputs.
        correct_threshold: a scored response is correct (``val/pass@k``, per-task pass@1; the baselines' outcome by
            default) when ``reward >= correct_threshold``, unless the verifier has its own ``correct``. 1.0 keeps a
            [0, 1] verifier's meaning: full credit.
        max_failure_rate: an update fails when at least this share of its responses have no reward (the verifier
            raised, returned a non-finite value, or timed out); scoring stops early once that is certain.
        max_failed_updates: failing updates in a row that stop the run (exit ≠ 0, the verifier's first failure
            printed); a validation batch that fails stops it at once.
    """

    timeout_s: float | None = 5.0
    workers: int = 2
    max_answer_chars: int = 1000
    correct_threshold: float = 1.0
    max_failure_rate: float = 0.5
    max_failed_updates: int = 2

    def __post_init__(self) -> None:
        if self.timeout_s is not None:
            check_range("scoring.timeout_s", self.timeout_s, 0.0, low_open=True)
        check_int("scoring.workers", self.workers, 1)
        check_int("scoring.max_answer_chars", self.max_answer_chars, 1)
        check_range("scoring.correct_threshold", self.correct_threshold, hint="any finite reward")
        check_range(
            "scoring.max_failure_rate",
            self.max_failure_rate,
            0.0,
            1.0,
            low_open=True,
            hint="the share of an update's responses without a reward at which the update fails",
        )
        check_int("scoring.max_failed_updates", self.max_failed_updates, 1)
