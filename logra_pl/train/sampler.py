"""``Sampler``: one update's responses — sampled on the engine, played out with a multi-turn environment, scored, and
refilled by dynamic sampling — for training, validation and the asynchronous pipeline alike.

It talks to the engine through the :class:`~logra_pl.train.engine_link.EngineLink` (which repairs an engine found
stale) and to the other training processes through :class:`~logra_pl.runtime.ranks.Ranks`; it never calls back into
the module. Every prompt's responses are sampled with a seed of its own (:func:`sampling_seed` of the run's seed, the
split, the update and the prompt's question), so a prompt's responses do not depend on the batch or the ranks.
Scoring runs each response through the verifier in worker processes (:class:`~logra_pl.rewards.BoundedVerifier`);
the failure policy counts the responses without a reward over all ranks and stops a run whose verifier keeps failing
before anything trains on it (algorithm.md §10).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from logra_pl.data.schema import prompt_key
from logra_pl.envs.episodes import Episodes, episode_metrics, episode_scores, run_episodes
from logra_pl.errors import ConfigError, PolicyDivergedError
from logra_pl.rewards.failures import FailurePolicy, Scores, merge_scores, verifier_label
from logra_pl.rollout.base import Rollout, SamplingConfig
from logra_pl.runtime.ranks import Ranks
from logra_pl.train.async_rollouts import AsyncRollouts
from logra_pl.train.batching import encode_prompts
from logra_pl.train.engine_link import EngineLink
from logra_pl.train.settings import RolloutSettings
from logra_pl.train.shaping import Drawn, RefillStream, dynamic_batch, refill_stream


def sampling_seed(seed: int, split: str, update: int, key: str = "") -> int:
    """The seed of one sampling call (or one prompt's responses, keyed by its question): independent of batch and
    rank layout."""
    blob = f"{seed}/{split}/{update}/{key}".encode()
    return int.from_bytes(hashlib.blake2b(blob, digest_size=6).digest(), "little")


def score_tensors(scores: Scores) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch's :class:`~logra_pl.rewards.failures.Scores` as tensors: rewards ``(N,)`` float64 (NaN where there is
    none), scored and correct ``(N,)`` bool."""
    rewards = torch.tensor(scores.rewards, dtype=torch.float64)
    return rewards, torch.tensor(scores.scored, dtype=torch.bool), torch.tensor(scores.correct, dtype=torch.bool)


@dataclass
class Sampled:
    """What one update sampled.

    Arguments:
        drawn: the prompts trained on, their responses, raw rewards (NaN without one) and correctness.
        staleness: updates between the weights that sampled the responses and the trainer's (asynchronous rollouts).
        shaping: dynamic sampling's ``shaping/*`` counts.
        failure_rate: this rank's share of the update's responses without a reward (every round's).
        episodes: a multi-turn environment's ``env/*`` counts (every round's trajectories).
    """

    drawn: Drawn
    staleness: int = 0
    shaping: dict[str, float] = field(default_factory=dict)
    failure_rate: float = 0.0
    episodes: dict[str, float] = field(default_factory=dict)


class Sampler:
    """Samples and scores responses for the module; what callbacks call to sample too (``encode``, ``generate``).

    Arguments:
        link: the engine link (generation with repair, the asynchronous worker).
        tokenizer: the policy's tokenizer (chat template, left padding).
        settings: the run's sampling settings.
        scorer: the verifier's runner.
        failures: the failure policy (its counts are checkpoint state).
        verifier: the verifier (named in failure messages).
        ranks: the training processes.
        seed: the run's sampling seed (``model.seed``).
        env: a multi-turn environment, or None (one reply per prompt).
    """

    def __init__(
        self,
        link: EngineLink,
        tokenizer: Any,
        settings: RolloutSettings,
        scorer: Any,
        failures: FailurePolicy,
        verifier: Any,
        ranks: Ranks,
        seed: int = 0,
        env: Any = None,
    ) -> None:
        check_context(settings, link.engine)
        self.link, self.tokenizer, self.settings = link, tokenizer, settings
        self.scorer, self.failures, self.verifier = scorer, failures, verifier
        self.ranks, self.seed, self.env = ranks, seed, env
        self.refill: RefillStream | None = None  # rollout.dynamic_sampling's further prompts (from start)
        self.pipeline: AsyncRollouts | None = None  # rollout.max_staleness >= 1 (from start)
        self._scores: list[Scores] = []  # every response scored for the current update, all rounds
        self._episodes: list[Episodes] = []  # the current update's multi-turn trajectories, all rounds

    # -------------------------------------------------------------------------------------- on the engine
    def encode(self, items: list[dict[str, Any]]) -> list[list[int]]:
        """Chat-template each item's ``messages`` and tokenize."""
        return encode_prompts(self.tokenizer, items)

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, prompt_seeds: list[int] | None = None
    ) -> Rollout:
        """``engine.generate``; an engine found stale is repaired on every rank and asked again (EngineLink)."""
        return self.link.generate(prompts, sampling, prompt_seeds)

    def seed_of(self, split: str, update: int, key: str = "") -> int:
        """The sampling seed of ``split`` at ``update`` (of one prompt, with its ``key``)."""
        return sampling_seed(self.seed, split, update, key)

    def score(self, rollout: Rollout, items: list[dict[str, Any]]) -> Scores:
        """Verifier reward, correctness and failure of every response (each call bounded by ``scoring.timeout_s``;
        scoring stops once the batch is certain to fail: ``FailurePolicy.cut``)."""
        return self.scorer.score_rollout(self.tokenizer, rollout, items, self.failures.cut(len(rollout)))

    def check_scores(self, scores: Scores, update: int, validation_batch: int | None = None) -> float:
        """Count the responses without a reward over all ranks; one console line when there are any; stop a run whose
        verifier keeps failing (:class:`~logra_pl.rewards.failures.FailurePolicy`), before anything trains on it.
        Returns this rank's share of responses without a reward."""
        counts = self.ranks.sum(torch.tensor([float(scores.failed), float(len(scores))], dtype=torch.float64))
        failed, total = int(counts[0]), int(counts[1])
        ranks = self.ranks
        args = (scores, failed, total, verifier_label(self.verifier), ranks.last_checkpoint, ranks.is_zero)
        if validation_batch is None:
            self.failures.record(update + 1, *args)
        else:
            self.failures.check_validation(validation_batch, *args)
        return scores.failed / len(scores) if len(scores) else 0.0

    # ------------------------------------------------------------------------------------------ training
    def start(self, trainer: Any, state: Mapping[str, Any] | None = None) -> None:
        """At the start of training (after any restore): dynamic sampling's refill stream, and with
        ``rollout.max_staleness`` ≥ 1 the asynchronous pipeline; ``state`` is a checkpoint's (their positions and
        the rollouts it had sampled ahead)."""
        settings, state = self.settings, state or {}
        if settings.dynamic_sampling:
            self.refill = refill_stream(trainer)
            if state.get("refill") is not None:
                self.refill.load_state_dict(state["refill"])
        if settings.max_staleness:
            AsyncRollouts.check(self.link.engine, trainer)
            pipeline = AsyncRollouts(self.link, self.ranks, self._job, settings.max_staleness, settings.max_stale_kl)
            pipeline.connect(trainer)
            if state.get("async") is not None:
                pipeline.load_state_dict(state["async"])
            self.pipeline, self.link.pipeline = pipeline, pipeline.pipeline

    def training_batch(self, items: list[dict[str, Any]], update: int) -> Sampled:
        """The responses update ``update`` trains on, scored: the loader's prompts sampled now (or ahead, by the
        asynchronous worker), and with dynamic sampling further rounds until the batch holds enough mixed groups."""
        settings, staleness, shaping = self.settings, 0, {}
        self._scores, self._episodes = [], []
        try:
            if self.pipeline is not None:  # sampled ahead by the worker (or again, when too stale)
                rollout, staleness = self.pipeline.rollout(items)
                drawn = self._scored(items, rollout)
            else:
                drawn = self._draw(items, "train", update)
                if settings.dynamic_sampling:  # only prompts whose responses' raw rewards differ (DAPO)

                    def refill(k: int) -> Drawn:  # round k >= 1: seeds keyed by the round (a prompt again: new ones)
                        return self._draw(self.refill.next_items(), f"train/refill{k}", update)

                    rounds = settings.max_sampling_rounds
                    picked = dynamic_batch(drawn, refill, len(items), rounds, self._any_short)
                    drawn, shaping = picked.batch, picked.metrics()
        except PolicyDivergedError as err:
            raise PolicyDivergedError(f"policy diverged before update {update + 1}: {err}") from None
        # A failed response is never trained on; a verifier that keeps failing stops the run here, before training.
        failure_rate = self.check_scores(merge_scores(self._scores), update)
        episodes = episode_metrics(self._episodes) if self._episodes else {}
        return Sampled(drawn, staleness, shaping, failure_rate, episodes)

    def finish(self, update_kls: list[float]) -> None:
        """After the step's callbacks: the asynchronous pipeline records the update's KL and requests the next
        batch (nothing without one)."""
        if self.pipeline is not None:
            self.pipeline.finish(update_kls)

    def stop(self) -> None:
        """End the asynchronous pipeline (its unused rollouts are dropped); the engine is called inline again."""
        if self.pipeline is not None:
            self.pipeline.pipeline.close()
            self.pipeline = None
            self.link.pipeline, self.link.before_change = None, None

    def state_dict(self, update_kls: list[float]) -> dict[str, Any]:
        """Where dynamic sampling's further prompts continue, and the asynchronous pipeline's requests: the update
        (its KL, ``update_kls``) is recorded first, and those in flight are waited for (their rollouts are saved)."""
        state: dict[str, Any] = {}
        if self.refill is not None:
            state["refill"] = self.refill.state_dict()
        if self.pipeline is not None:
            self.pipeline.finish(update_kls)
            state["async"] = self.pipeline.state_dict()
        return state

    # ------------------------------------------------------------------------------------------ validation
    def validation_batch(self, items: list[dict[str, Any]], batch_idx: int, update: int) -> tuple[Rollout, Scores]:
        """``val_responses`` responses per problem at the validation settings, scored (a multi-turn conversation as
        in training: the final reply, plus the environment's reward); a failing batch stops the run."""
        split = f"val{batch_idx}"
        sampling = self.settings.validation_sampling(self.seed_of(split, update))
        if self.env is None:
            rollout = self.generate(self.encode(items), sampling)
            scores = self.score(rollout, items)
        else:
            seeds = [self.seed_of(split, update, prompt_key(it)) for it in items]
            episodes = self._episodes_of(items, sampling, seeds)
            rollout, scores = episodes.rollout, episode_scores(episodes, self.scorer, items, None)
        self.check_scores(scores, update, validation_batch=batch_idx)
        return rollout, scores

    # ------------------------------------------------------------------------------------------ helpers
    def _draw(self, items: list[dict[str, Any]], split: str, update: int) -> Drawn:
        """Sample and score ``items`` with the training settings; one seed per prompt (from its question and
        ``split``): a prompt's responses do not depend on batch or ranks."""
        sampling = self.settings.training_sampling(self.seed_of(split, update))
        seeds = [self.seed_of(split, update, prompt_key(it)) for it in items]
        if self.env is not None:
            episodes = self._episodes_of(items, sampling, seeds)
            return self._scored(items, episodes.rollout, episodes)
        return self._scored(items, self.generate(self.encode(items), sampling, prompt_seeds=seeds))

    def _episodes_of(self, items: list[dict[str, Any]], sampling: SamplingConfig, seeds: list[int]) -> Episodes:
        """``sampling.n`` conversations per item with the environment (:func:`~logra_pl.envs.run_episodes`)."""
        budget = int(getattr(self.env, "max_tokens", 1024))
        return run_episodes(self.generate, self.tokenizer, self.env, items, sampling, seeds, budget)

    def _scored(self, items: list[dict[str, Any]], rollout: Rollout, episodes: Episodes | None = None) -> Drawn:
        """``rollout`` scored: raw rewards (NaN without one) and correctness; kept for the update's failure count.
        Multi-turn ``episodes``: the environment's rewards plus the verifier's score of each final reply."""
        if episodes is None:
            scores = self.score(rollout, items)
        else:
            scores = episode_scores(episodes, self.scorer, items, self.failures.cut(len(rollout)))
            self._episodes.append(episodes)
        self._scores.append(scores)
        rewards, _, correct = score_tensors(scores)
        return Drawn(items, rollout, rewards, correct)

    def _any_short(self, short: bool) -> bool:
        """Is any rank's dynamic batch still short (one all-reduce; every rank then draws the next round or none)?
        An update already certain to fail draws no further round: it will not train on them."""
        scored = merge_scores(self._scores)
        return self.ranks.any(short and not self.failures.fails(scored.failed, len(scored)))

    def _job(self, items: list[dict[str, Any]], batch: int) -> tuple[list[str], Callable[[], Rollout]]:
        """The asynchronous worker's job for training batch ``batch``: its prompts' keys, and the engine call that
        samples them (seeds keyed by the batch index: requests are made before the updates in between)."""
        sampling = self.settings.training_sampling(self.seed_of("train", batch))
        seeds = [self.seed_of("train", batch, prompt_key(it)) for it in items]
        prompts, engine = self.encode(items), self.link.engine
        keys = [prompt_key(it) for it in items]
        return keys, lambda: engine.generate(prompts, sampling, prompt_seeds=seeds)


def check_context(settings: RolloutSettings, engine: Any) -> None:
    """Refuse, before the first update, a response length the engine's context cannot hold with any prompt (known
    once the policy and its engine are loaded; each batch's prompts are checked again as they come)."""
    limit = getattr(engine, "context_limit", None)
    if limit is not None and settings.max_new_tokens >= limit:
        raise ConfigError(
            f"rollout.max_new_tokens={settings.max_new_tokens} leaves no room for a prompt in the engine's context "
            f"of {limit} tokens (the model's, or the engine's max_model_len): lower model.rollout.max_new_tokens"
        )
