"""``StepContext``: what one training step produced, for callbacks to read, and how an update's sampled responses
become it (:func:`build_step`: shaped rewards → advantages → the trainer's pre-update log-probs); the step's scalars.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from logra_pl.rollout.base import Rollout
from logra_pl.sketch.payload import Payload
from logra_pl.train.batching import padded_logprobs
from logra_pl.train.logprobs import PackedResponses, pack_responses
from logra_pl.train.sampler import Sampled
from logra_pl.train.settings import RolloutSettings
from logra_pl.train.shaping import overlong_penalty


@dataclass
class StepContext:
    """What one training step produced, for callbacks (KL control, mismatch, sync) to read.

    ``logp_rollout``/``logp_trainer``/``packed.response_mask`` are ``(N, R)`` over the ``N`` responses;
    ``logp_trainer`` is the trainer's log-prob of each sampled token *before* this step's update. ``entropy`` is the
    policy's entropy at each response position from that same pass (None when the caller gave only log-probs).
    A single-pass update (``pending_scores`` set: :func:`build_step` with ``single_pass``) takes both from its
    training forward, which runs at the same weights, instead of a separate pass (the backward fills them in,
    :func:`~logra_pl.train.backward.backward_over`); read before that, they are computed by the separate pass then,
    so every reader gets the pre-update values whenever it reads (on several ranks, every rank must read alike: that
    pass gathers sharded weights),
    ``logp_reference`` the reference policy's log-probs (None without a KL penalty), and ``loss_mask`` the tokens
    the loss counts (the response mask, less truncated responses under ``loss.mask_truncated``, less the responses
    without a reward: ``scored`` False, a failed verifier call, never trained on: algorithm.md §10; set it through
    :func:`scored_mask`).
    """

    update_index: int
    items: list[dict[str, Any]]
    rollout: Rollout
    rewards: torch.Tensor
    advantages: torch.Tensor
    packed: PackedResponses
    logp_rollout: torch.Tensor
    logp_trainer: torch.Tensor | None
    temperature: float
    metrics: dict[str, float] = field(default_factory=dict)
    payloads: list[Payload] = field(default_factory=list)  # merged factor updates of this step, in order
    loss_stats: dict[str, list[float]] = field(default_factory=dict)  # loss statistics: [numerator, denominator]
    staleness: int = 0  # updates between the weights that sampled the rollout and the trainer's (asynchronous)
    update_kls: list[float] = field(default_factory=list)  # each update's KL as a step controller priced it
    scored: torch.Tensor | None = None  # (N,) bool: the response has a reward (None: all have); rewards are NaN else
    correct: torch.Tensor | None = None  # (N,) bool: the verifier calls the response correct (None: not recorded)
    shaping: dict[str, float] = field(default_factory=dict)  # batch shaping's counts (logra_pl.train.shaping)
    shaped_rewards: torch.Tensor | None = None  # the rewards the advantages saw (rewards + overlong penalty)
    padded_microbatches: int = 0  # zero-loss microbatches that kept this rank's forward count equal to the others'
    # (N, R) policy entropy before the update, zero where padded. A factory, not a class attribute: a single-pass
    # step's unset entropy must reach __getattr__.
    entropy: torch.Tensor | None = field(default_factory=lambda: None)
    logp_reference: torch.Tensor | None = None  # (N, R) reference-policy log-probs (a KL penalty is on)
    loss_mask: torch.Tensor | None = None  # (N, R) the tokens the loss counts; None: packed.response_mask
    # A single-pass update's separate pre-update pass, run only if logp_trainer/entropy are read before its backward.
    pending_scores: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None

    def __post_init__(self) -> None:
        if self.loss_mask is None:
            self.loss_mask = self.packed.response_mask
        self.loss_mask = scored_mask(self.loss_mask, self.scored)
        if self.pending_scores is not None:  # unset until the training forward (or a reader) provides them
            del self.logp_trainer, self.entropy

    def __getattr__(self, name: str) -> Any:
        """Called only for an attribute that is not set: a single-pass step's ``logp_trainer``/``entropy`` read
        before its training forward filled them in; the separate pre-update pass computes them now."""
        pending = self.__dict__.get("pending_scores")
        if name not in ("logp_trainer", "entropy") or pending is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        self.fill_trainer_scores(*pending())
        return self.__dict__[name]

    def fill_trainer_scores(self, logp_trainer: torch.Tensor, entropy: torch.Tensor | None) -> None:
        """Set the pre-update log-probs and entropy (a single-pass update's, from its training forward)."""
        self.logp_trainer, self.entropy, self.pending_scores = logp_trainer, entropy, None

    @property
    def eos_terminated(self) -> torch.Tensor:
        """``(N,)`` bool: responses that ended with EOS (not truncated)."""
        return torch.tensor([not t for t in self.rollout.truncated])

    @property
    def all_scored(self) -> bool:
        """Every response has a reward."""
        return self.scored is None or bool(self.scored.all())


def assemble_step(
    update: int,
    items: list[dict[str, Any]],
    rollout: Rollout,
    rewards: torch.Tensor,
    advantages: torch.Tensor,
    pad_id: int,
    trainer_logprobs: Callable[[PackedResponses, float], torch.Tensor | tuple[torch.Tensor, torch.Tensor]],
    temperature: float,
    reference_logprobs: Callable[[PackedResponses, float], torch.Tensor] | None = None,
    scored: torch.Tensor | None = None,
    correct: torch.Tensor | None = None,
    single_pass: bool = False,
) -> StepContext:
    """A step's context from its rollout, rewards and advantages: the responses packed for the trainer, the rollout
    log-probs padded alike, and the trainer's pre-update log-probs of the same tokens (``trainer_logprobs``: the
    log-probs, or ``(log-probs, entropy)`` from the same pass) and, with ``reference_logprobs``, the reference
    policy's; ``scored``/``correct`` as :class:`StepContext` keeps them (the loss mask then leaves out the responses
    without a reward). ``single_pass``: the update is one pass over the batch, whose training forward provides the
    pre-update log-probs; ``trainer_logprobs`` then runs only if they are read before it (``pending_scores``)."""
    packed = pack_responses(rollout.prompt_ids, rollout.response_ids, pad_id, rollout.response_masks)

    def scores() -> tuple[torch.Tensor, torch.Tensor | None]:
        computed = trainer_logprobs(packed, temperature)
        return computed if isinstance(computed, tuple) else (computed, None)

    logp_trainer, entropy = (None, None) if single_pass else scores()
    logp_rollout = padded_logprobs(rollout.logprobs, packed.response_mask)
    ctx = StepContext(
        update, items, rollout, rewards, advantages, packed, logp_rollout, logp_trainer, temperature,
        pending_scores=scores if single_pass else None,
    )  # fmt: skip
    if not single_pass:
        ctx.entropy = entropy
    if reference_logprobs is not None:
        ctx.logp_reference = reference_logprobs(packed, temperature)
    ctx.scored, ctx.correct = scored, correct
    ctx.loss_mask = scored_mask(ctx.loss_mask, scored)
    return ctx


def scored_mask(mask: torch.Tensor, scored: torch.Tensor | None) -> torch.Tensor:
    """``mask`` (N, R) with the rows of responses without a reward zeroed (``scored`` False); ``mask`` itself when
    every response has one (or ``scored`` is None), so a run without failures computes exactly as before."""
    if scored is None or bool(scored.all()):
        return mask
    return mask * scored.to(mask.dtype).unsqueeze(1)


def scored_advantages(
    baseline: Any,
    rewards: torch.Tensor,
    scored: torch.Tensor,
    correct: torch.Tensor | None,
    groups: list[int],
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The advantages of a batch in which some responses may have no reward: the baseline sees only the scored ones
    (its statistics, group means and running value leave the others out) and the others get advantage 0.

    Arguments:
        baseline: the :class:`~logra_pl.losses.AdvantageBaseline`.
        rewards: ``(N,)`` float64, NaN where ``scored`` is False.
        scored: ``(N,)`` bool.
        correct: ``(N,)`` bool, the verifier's correctness (the baselines' outcome); None: ``reward >= 1``.
        groups: each response's prompt.
        all_reduce_sum: the ranks' sum (every rank calls the baseline once, with no rows when none scored).

    A group baseline needs others to compare with: a scored response whose prompt has no other scored response gets
    advantage 0 and stays out of the baseline (a group mean of itself is 0 anyway; leave-one-out has none).
    """
    keep = scored.clone()
    if baseline.needs_groups and not bool(scored.all()):
        g = torch.as_tensor(groups, dtype=torch.long)
        per_group = torch.zeros(int(g.max()) + 1 if g.numel() else 0, dtype=torch.long).index_add_(0, g, scored.long())
        keep &= per_group[g] >= 2
    if bool(keep.all()):
        return _call_baseline(baseline, rewards, correct, groups, all_reduce_sum)
    rows = keep.nonzero().flatten()
    advantages = torch.zeros(len(rewards), dtype=torch.float64)
    verdicts = correct[rows] if correct is not None else None
    chosen = _call_baseline(baseline, rewards[rows], verdicts, [groups[i] for i in rows.tolist()], all_reduce_sum)
    advantages[rows] = chosen.to(torch.float64)
    return advantages


def _call_baseline(
    baseline: Any,
    rewards: torch.Tensor,
    correct: torch.Tensor | None,
    groups: list[int],
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``baseline.advantages``, given the correctness when it takes it (a baseline written before it existed does
    not: it then sees rewards and groups only)."""
    params = inspect.signature(baseline.advantages).parameters
    if "correct" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return baseline.advantages(rewards, all_reduce_sum, groups=groups, correct=correct)
    return baseline.advantages(rewards, all_reduce_sum, groups=groups)


def build_step(
    update: int,
    sampled: Sampled,
    baseline: Any,
    loss: Any,
    settings: RolloutSettings,
    passes: Any,
    pad_id: int,
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor],
    single_pass: bool = False,
) -> StepContext:
    """The step context of one update's sampled responses: DAPO's overlong penalty on the rewards the advantages see
    (never on the raw ones), the baseline's advantages over the scored responses, the responses packed for the
    trainer with its pre-update log-probs and entropy (``passes``: :class:`~logra_pl.train.passes.TrainerPasses`,
    and the reference policy's log-probs with a KL penalty), and the loss mask (``loss.token_mask``, less the
    responses without a reward). ``single_pass``: the step's one update takes the pre-update log-probs and entropy
    from its training forward (:func:`assemble_step`)."""
    drawn = sampled.drawn
    items, rollout, rewards, correct = drawn.items, drawn.rollout, drawn.rewards, drawn.correct
    scored = ~torch.isnan(rewards)  # a response without a reward has NaN (rewards/failures.py)
    shaped, shaping = rewards, dict(sampled.shaping)
    if settings.overlong_buffer:  # DAPO's soft overlong punishment: on the advantages' reward, never on the raw one
        lengths = torch.tensor([len(r) for r in rollout.response_ids])
        buffer, factor = settings.overlong_buffer, settings.overlong_penalty
        penalty = overlong_penalty(lengths, settings.max_new_tokens, buffer, factor)
        shaped = rewards + penalty
        shaping["shaping/overlong_penalty"] = float(penalty.mean())
        shaping["shaping/overlong_rate"] = float((penalty < 0).double().mean())
    advantages = scored_advantages(baseline, shaped, scored, correct, list(rollout.prompt_index), all_reduce_sum)
    temperature = settings.temperature if settings.temperature > 0 else 1.0
    reference = passes.reference_logprobs if passes.reference is not None else None
    ctx = assemble_step(
        update, items, rollout, rewards, advantages, pad_id, passes.scores, temperature, reference,
        single_pass=single_pass,
    )  # fmt: skip
    ctx.scored, ctx.correct = scored, correct
    # The loss's tokens: less truncated responses (loss.mask_truncated), less the responses without a reward.
    ctx.loss_mask = scored_mask(loss.token_mask(ctx.packed.response_mask, rollout.truncated), scored)
    ctx.staleness, ctx.shaping, ctx.shaped_rewards = sampled.staleness, shaping, shaped
    ctx.metrics["verifier/failure_rate"] = sampled.failure_rate  # over every response scored for the update
    ctx.metrics |= sampled.episodes  # multi-turn: every round's trajectories' turns, truncation and environment counts
    return ctx


def step_metrics(
    ctx: StepContext,
    results: list[tuple[float, float, float, float]],
    rollout_s: float,
    step_s: float,
    baseline: Any,
    scorer: Any,
) -> dict[str, float]:
    """The per-update scalars of one step: reward and advantages, response lengths, the policy's entropy, loss and
    update size, times, verifier counts, reward components and shaping, a multi-turn step's ``env/*`` counts, the
    loss's statistics. ``results`` holds ``(loss, train_s, update_s,
    update_norm)`` per update. Reward and advantage means are over the scored responses (NaN reward mean when none
    scored); the ``verifier/*`` counts are run totals (``errors``, ``timeouts``, ``nan``, ``long_answers``),
    ``verifier/failure_rate`` this update's share of responses without a reward."""
    rows = ctx.scored if not ctx.all_scored else slice(None)  # a response without a reward is left out of the means
    rewards, advantages = ctx.rewards[rows], ctx.advantages[rows]
    metrics = {
        "train/reward_mean": float(rewards.mean()) if len(rewards) else math.nan,
        "train/baseline": baseline.value,
        "train/advantage_mean": float(advantages.mean()) if len(advantages) else 0.0,
        "train/advantage_std": float(advantages.std()) if len(advantages) > 1 else 0.0,
        "train/response_length": float(ctx.packed.lengths.float().mean()),
        "train/truncation_rate": float(sum(ctx.rollout.truncated)) / max(len(ctx.rollout), 1),
        "train/loss": sum(r[0] for r in results) / len(results),
        "train/update_norm": results[-1][3],
        "train/padded_microbatches": float(ctx.padded_microbatches),
        "time/rollout_s": rollout_s,
        "time/train_s": sum(r[1] for r in results),
        "time/update_s": sum(r[2] for r in results),
        "time/tokens_per_s": ctx.rollout.num_response_tokens / max(step_s, 1e-9),
        "time/step_s": step_s,
        "verifier/errors": float(scorer.errors),
        "verifier/timeouts": float(scorer.timeouts),
        "verifier/nan": float(scorer.nan),
        "verifier/long_answers": float(scorer.long_answers),
        "verifier/failure_rate": 0.0 if ctx.all_scored else 1.0 - float(ctx.scored.double().mean()),
    }
    if ctx.entropy is not None:
        metrics["train/entropy"] = mean_entropy(ctx)
    metrics |= {f"reward/{name}": value for name, value in scorer.last_components.items()} | ctx.shaping
    # A multi-turn step counted its own failures and its episodes (env/*); the loss statistics as ratios.
    metrics["verifier/failure_rate"] = ctx.metrics.get("verifier/failure_rate", metrics["verifier/failure_rate"])
    metrics |= {k: v for k, v in ctx.metrics.items() if k.startswith("env/")}
    return metrics | {f"train/{name}": num / den if den else 0.0 for name, (num, den) in ctx.loss_stats.items()}


def mean_entropy(ctx: StepContext) -> float:
    """The policy's mean entropy per response token of this step (before its update)."""
    mask = ctx.packed.response_mask
    return float((ctx.entropy * mask).sum() / mask.sum().clamp(min=1))
