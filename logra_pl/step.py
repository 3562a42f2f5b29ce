"""``StepContext``: what one training step produced, for callbacks to read; the seeds a step samples with.

``PolicyModuleView`` is what callbacks may read from the module — the whole contract (:class:`LoGRAPolicyModule`
implements it; a module of your own that does can run the same callbacks).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from logra_pl.batching import padded_logprobs
from logra_pl.logprobs import PackedResponses, pack_responses
from logra_pl.rollout.base import Rollout, SamplingConfig
from logra_pl.sketch.payload import Payload


@dataclass
class StepContext:
    """What one training step produced, for callbacks (KL control, mismatch, sync) to read.

    ``logp_rollout``/``logp_trainer``/``packed.response_mask`` are ``(N, R)`` over the ``N`` responses;
    ``logp_trainer`` is the trainer's log-prob of each sampled token *before* this step's update. ``entropy`` is the
    policy's entropy at each response position from that same pass (None when the caller gave only log-probs),
    ``logp_reference`` the reference policy's log-probs (None without a KL penalty), and ``loss_mask`` the tokens
    the loss counts (the response mask, less truncated responses under ``loss.mask_truncated``).
    """

    update_index: int
    items: list[dict[str, Any]]
    rollout: Rollout
    rewards: torch.Tensor
    advantages: torch.Tensor
    packed: PackedResponses
    logp_rollout: torch.Tensor
    logp_trainer: torch.Tensor
    temperature: float
    metrics: dict[str, float] = field(default_factory=dict)
    payloads: list[Payload] = field(default_factory=list)  # merged factor updates of this step, in order
    loss_stats: dict[str, list[float]] = field(default_factory=dict)  # loss statistics: [numerator, denominator]
    staleness: int = 0  # updates between the weights that sampled the rollout and the trainer's (asynchronous)
    update_kls: list[float] = field(default_factory=list)  # each update's KL as a step controller priced it
    shaping: dict[str, float] = field(default_factory=dict)  # batch shaping's counts (logra_pl.shaping)
    shaped_rewards: torch.Tensor | None = None  # the rewards the advantages saw (rewards + overlong penalty)
    padded_microbatches: int = 0  # zero-loss microbatches that kept this rank's forward count equal to the others'
    entropy: torch.Tensor | None = None  # (N, R) policy entropy before the update, zero where padded
    logp_reference: torch.Tensor | None = None  # (N, R) reference-policy log-probs (a KL penalty is on)
    loss_mask: torch.Tensor | None = None  # (N, R) the tokens the loss counts; None: packed.response_mask

    def __post_init__(self) -> None:
        if self.loss_mask is None:
            self.loss_mask = self.packed.response_mask

    @property
    def eos_terminated(self) -> torch.Tensor:
        """``(N,)`` bool: responses that ended with EOS (not truncated)."""
        return torch.tensor([not t for t in self.rollout.truncated])


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
) -> StepContext:
    """A step's context from its rollout, rewards and advantages: the responses packed for the trainer, the rollout
    log-probs padded alike, and the trainer's pre-update log-probs of the same tokens (``trainer_logprobs``: the
    log-probs, or ``(log-probs, entropy)`` from the same pass) and, with ``reference_logprobs``, the reference
    policy's."""
    packed = pack_responses(rollout.prompt_ids, rollout.response_ids, pad_id)
    scored = trainer_logprobs(packed, temperature)
    logp_trainer, entropy = scored if isinstance(scored, tuple) else (scored, None)
    logp_rollout = padded_logprobs(rollout.logprobs, packed.response_mask)
    ctx = StepContext(update, items, rollout, rewards, advantages, packed, logp_rollout, logp_trainer, temperature)
    ctx.entropy = entropy
    if reference_logprobs is not None:
        ctx.logp_reference = reference_logprobs(packed, temperature)
    return ctx


def sampling_seed(seed: int, split: str, update: int, key: str = "") -> int:
    """The seed of one sampling call (or one prompt's responses, keyed by its question): independent of batch and
    rank layout."""
    blob = f"{seed}/{split}/{update}/{key}".encode()
    return int.from_bytes(hashlib.blake2b(blob, digest_size=6).digest(), "little")


@runtime_checkable
class PolicyModuleView(Protocol):
    """What callbacks read from the policy module — the whole contract.

    ``policy`` (the trained causal LM), ``tokenizer``, ``engine`` (the rollout engine, or None before
    ``configure_model``), ``method`` (the :class:`~logra_pl.methods.UpdateMethod`: ``sketcher``,
    ``ships_factors``, ``makes_proposals``, ``keeps_sketches``, and for step controllers ``logit_tangent``,
    ``applied_updates``, ``applied``), ``step_context`` (the current step's :class:`StepContext`, or None),
    ``rollout_settings``, ``microbatch_size``, ``policy_source`` and ``dtype_name``; and the operations below
    (``engine_call``: an engine call in order with every other one, on the asynchronous worker when rollouts
    are sampled ahead; a Future).
    """

    policy: Any
    tokenizer: Any
    engine: Any
    method: Any
    step_context: StepContext | None
    rollout_settings: Any
    microbatch_size: int
    policy_source: str
    dtype_name: str

    def encode_prompts(self, items: list[dict[str, Any]]) -> list[list[int]]: ...

    def generate_rollout(
        self, prompts: list[list[int]], sampling: SamplingConfig, prompt_seeds: list[int] | None = None
    ) -> Rollout: ...

    def trainer_logprobs(self, packed: PackedResponses, temperature: float) -> torch.Tensor: ...

    def sync_engine(self, full: bool = False) -> None: ...

    def engine_call(
        self, fn: Callable[..., Any], *args: Any, changes_weights: bool = False, **kwargs: Any
    ) -> Future: ...

    def attach_sync(self, owner: object) -> None: ...

    def trained_tensors(self) -> dict[str, torch.Tensor]: ...

    def full_state(self) -> dict[str, torch.Tensor]: ...

    def trained_parameter_count(self) -> int: ...

    def training_report(self) -> str: ...


def step_metrics(
    ctx: StepContext,
    results: list[tuple[float, float, float, float]],
    rollout_s: float,
    step_s: float,
    baseline: Any,
    scorer: Any,
) -> dict[str, float]:
    """The per-update scalars of one step: reward and advantages, response lengths, the policy's entropy, loss and
    update size, times, verifier counts and reward components. ``results`` holds ``(loss, train_s, update_s,
    update_norm)`` per update."""
    metrics = {
        "train/reward_mean": float(ctx.rewards.mean()),
        "train/baseline": baseline.value,
        "train/advantage_mean": float(ctx.advantages.mean()),
        "train/advantage_std": float(ctx.advantages.std()) if len(ctx.advantages) > 1 else 0.0,
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
        "verifier/long_answers": float(scorer.long_answers),
    }
    if ctx.entropy is not None:
        metrics["train/entropy"] = mean_entropy(ctx)
    return metrics | {f"reward/{name}": value for name, value in scorer.last_components.items()}


def mean_entropy(ctx: StepContext) -> float:
    """The policy's mean entropy per response token of this step (before its update)."""
    mask = ctx.packed.response_mask
    return float((ctx.entropy * mask).sum() / mask.sum().clamp(min=1))


def view_of(pl_module: Any) -> PolicyModuleView | None:
    """``pl_module`` as a :class:`PolicyModuleView` when it is one (callbacks that also work with other Lightning
    modules do nothing of the policy kind otherwise), else None."""
    return pl_module if isinstance(pl_module, PolicyModuleView) else None
