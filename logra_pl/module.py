"""``LoGRAPolicyModule``: one ``training_step`` is one rollout and its policy update(s) (algorithm.md §8).

The Lightning hooks and the orchestration of a step: rollout (:mod:`logra_pl.train.engine_link`) → rewards →
advantages → pre-update log-probs (:mod:`logra_pl.train.step`) → microbatched backward (:mod:`logra_pl.train.backward`)
→ the update method's step (:mod:`logra_pl.methods`) → the engine receives the update. Callbacks read the step's
data from :attr:`LoGRAPolicyModule.step_context` and the module through :class:`~logra_pl.train.step.PolicyModuleView`.
"""

from __future__ import annotations

import time
import warnings
from concurrent.futures import Future
from typing import Any, Literal

import lightning.pytorch as pl
import torch

from logra_pl import methods
from logra_pl.callbacks.progress import replace_default_callbacks
from logra_pl.data.schema import prompt_key
from logra_pl.envs.base import Environment, check_environment
from logra_pl.envs.episodes import Episodes, episode_metrics, episode_scores, run_episodes
from logra_pl.errors import ConfigError, PolicyDivergedError, check_int
from logra_pl.losses import AdvantageBaseline, LegacyBaselineSettings, Loss, build_baseline, build_loss
from logra_pl.methods import UpdateMethod
from logra_pl.methods.adamw import AdamWConfig
from logra_pl.methods.guard import DivergenceGuard, RejectionCount
from logra_pl.methods.lora import LoRAConfig
from logra_pl.rewards import BoundedVerifier, ReasoningGymVerifier, Verifier, check_verifier
from logra_pl.rewards.failures import FailurePolicy, Scores, merge_scores, verifier_label
from logra_pl.rollout.base import Rollout, SamplingConfig
from logra_pl.rollout.registry import EngineSpec, build_engine, engine_spec
from logra_pl.runtime import compat
from logra_pl.runtime.checkpointing import enable_activation_checkpointing
from logra_pl.runtime.console import quiet_noise
from logra_pl.runtime.heap import release_free_heap
from logra_pl.runtime.ranks import all_reduce_max, all_reduce_sum, any_rank
from logra_pl.sketch import LoGRAConfig
from logra_pl.sketch.config import DEFAULT_TARGETS
from logra_pl.sketch.memory import MemoryReport
from logra_pl.train.async_rollouts import AsyncRollouts
from logra_pl.train.backward import backward_over, update_totals
from logra_pl.train.batching import encode_prompts, microbatches, select_rows
from logra_pl.train.engine_link import EngineLink
from logra_pl.train.logprobs import PackedResponses, response_logprobs, response_logprobs_and_entropy
from logra_pl.train.policy_setup import engine_request, load_training_policy, rank_zero_first, training_source
from logra_pl.train.reference import ReferencePolicy
from logra_pl.train.settings import (  # LossConfig: old code
    LegacyLossSettings,
    LossConfig,
    RolloutSettings,
    ScoringSettings,
)
from logra_pl.train.shaping import Drawn, RefillStream, dynamic_batch, overlong_penalty
from logra_pl.train.state import module_state, restore_module_state
from logra_pl.train.step import (
    StepContext,
    assemble_step,
    sampling_seed,
    score_tensors,
    scored_advantages,
    scored_mask,
    step_metrics,
)
from logra_pl.train.validation import ValidationMetrics, item_task
from logra_pl.train.warm_start import WarmStart, check_demonstrations

# The policy stays in eval mode on purpose: trainer and engine must compute the same distribution (no dropout),
# or the importance ratios and the mismatch estimate measure dropout noise.
warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode at the start of training.*")
quiet_noise()

__all__ = ["LoGRAPolicyModule", "LossConfig", "RolloutSettings", "ScoringSettings", "StepContext", "item_task"]


def _trains(trainer: Any) -> bool:
    """Whether ``trainer`` is fitting (or absent: a module set up by hand); validation needs no reference policy."""
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    return fn is None or fn == "fit"


class LoGRAPolicyModule(pl.LightningModule):
    """RL post-training of a causal LM with LoGRA (or a baseline update method).

    Arguments:
        policy: ``tiny[:preset]``, ``smollm2``, a ``.gguf`` file, a ``save_pretrained`` folder or a hub id.
        warm_start: optional supervised warm start (cached) before RL; eval questions are excluded.
        method: the update method (:mod:`logra_pl.methods`), by ``class_path`` or short name ``logra | adamw | lora``;
            None: built from ``optimizer`` and its section.
        targets: the matrices every method trains (last name parts of ``nn.Linear`` modules); None: attention + MLP.
        optimizer: short form of ``method`` (``logra``, ``adamw``, ``lora``), with ``logra``/``adamw``/``lora``.
        logra: LoGRA hyper-parameters (``optimizer="logra"``).
        adamw: AdamW and its schedule (``optimizer="adamw"``, or on LoRA's adapters).
        lora: adapter settings (``optimizer="lora"``).
        loss: the surrogate, a :class:`~logra_pl.losses.Loss` by ``class_path`` or short name ``reinforce_tis | ppo |
            gspo | cispo``, with the settings every loss shares (aggregation, ``mask_truncated``, KL penalty).
        baseline: the advantage baseline (:class:`~logra_pl.losses.AdvantageBaseline`): ``running`` (algorithm.md
            §8), or per-prompt ``group`` / ``rloo``, or any by ``class_path``.
        rollout: sampling settings.
        microbatch_size: responses per forward/backward pass (at most).
        max_tokens_per_microbatch: token budget of one pass (rows × longest row); None: ``microbatch_size`` rows.
        activation_checkpointing: recompute each decoder layer in backward (:mod:`logra_pl.runtime.checkpointing`).
        attn_implementation: transformers' attention kernel; None: its default (the KL probe uses eager).
        answer_format: how the default verifier reads answers (``auto``/``tags``/``plain``).
        dtype: parameter dtype of the policy (fp32 master weights by default).
        seed: seed of sampling (mixed with the update index).
        engine: the rollout engine and its settings: a spec (``HFSettings``, ``VLLMSettings``, ``RemoteSettings`` for
            ``logra-pl serve`` engines; YAML ``{class_path: ..., init_args: {...}}``), a short name ``hf | vllm |
            remote`` (default settings), a registered name, or a spec class's or builder's dotted path.
        guard: the divergence guard: oversized or non-finite updates never reach the weights.
        scoring: how the verifier runs: per-call time limit, worker processes, answer-length cap; what counts as
            correct; when a failing verifier stops the run.
        verifier: the reward, any ``__call__(response, item) -> float`` (:class:`~logra_pl.rewards.Verifier`:
            optionally ``correct``, ``score_batch``); default ``ReasoningGymVerifier``.
        env: a multi-turn environment (:class:`~logra_pl.envs.Environment`, by ``class_path``): each prompt becomes
            a conversation of at most ``env.max_turns`` replies (tool results, feedback in between), trained on the
            policy's tokens only; the verifier scores the final reply unless ``env.verify_final`` is False. None:
            one reply per prompt.
    """

    def __init__(
        self,
        policy: str = "tiny",
        warm_start: WarmStart | None = None,
        method: str | UpdateMethod | None = None,
        targets: list[str] | None = None,
        optimizer: Literal["logra", "adamw", "lora"] = "logra",
        logra: LoGRAConfig | None = None,
        adamw: AdamWConfig | None = None,
        lora: LoRAConfig | None = None,
        loss: str | Loss | LegacyLossSettings | None = None,
        baseline: str | AdvantageBaseline | LegacyBaselineSettings | None = None,
        rollout: RolloutSettings | None = None,
        microbatch_size: int = 16,
        max_tokens_per_microbatch: int | None = None,
        activation_checkpointing: bool = False,
        attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] | None = None,
        answer_format: Literal["auto", "tags", "plain"] = "auto",
        dtype: Literal["float32", "bfloat16", "float64"] = "float32",
        seed: int = 0,
        engine: str | EngineSpec = "hf",
        guard: DivergenceGuard | None = None,
        scoring: ScoringSettings | None = None,
        verifier: Verifier | None = None,
        env: Environment | None = None,
    ) -> None:
        super().__init__()
        check_int("microbatch_size", microbatch_size, 1)
        check_int("max_tokens_per_microbatch", 1 if max_tokens_per_microbatch is None else max_tokens_per_microbatch, 1)
        self.engine_spec = engine_spec(engine)  # an unknown engine fails here, before any model is loaded
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.policy_source, self.warm_start, self.dtype_name, self.seed = policy, warm_start, dtype, seed
        self.method = methods.resolve_method(method, optimizer, logra, adamw, lora)  # an unknown name fails here
        self.targets = tuple(targets or (logra.targets if logra is not None else DEFAULT_TARGETS))
        self.loss_config = build_loss(loss)
        self.baseline = build_baseline(baseline)
        self.rollout_settings = rollout or RolloutSettings()
        self.rollout_settings.check_baseline(self.baseline)
        self.microbatch_size, self.max_tokens_per_microbatch = microbatch_size, max_tokens_per_microbatch
        self.activation_checkpointing, self.attn_implementation = activation_checkpointing, attn_implementation
        self.scoring = scoring or ScoringSettings()
        verifier = verifier or ReasoningGymVerifier(answer_format, max_answer_chars=self.scoring.max_answer_chars)
        check_verifier(verifier)
        self.verifier = verifier
        sc = self.scoring
        self.scorer = BoundedVerifier(self.verifier, sc.timeout_s, sc.workers, sc.correct_threshold)
        if env is not None:
            check_environment(env)
            if self.rollout_settings.max_staleness > 0:
                raise ConfigError(
                    "rollout.max_staleness >= 1 (asynchronous rollouts) samples one reply per prompt ahead of the "
                    "trainer; a multi-turn env runs its conversations with the trainer's engine calls: set "
                    "rollout.max_staleness: 0, or drop model.env"
                )
        if warm_start is not None:
            check_demonstrations(warm_start, env)
        self.env = env
        self._env_episodes: list[Episodes] = []  # the current update's multi-turn trajectories, all rounds
        self.failures = FailurePolicy(sc.max_failure_rate, sc.max_failed_updates)
        self._update_scores: list[Scores] = []  # every response scored for the current update, all rounds
        self.guard = guard or DivergenceGuard()
        self.rejections = RejectionCount(self.guard.max_consecutive)
        self.set_launch(run_config=None, resume_from=None, resume_checked=False)  # outside the CLI
        self.policy: torch.nn.Module | None = None
        self.reference_policy: ReferencePolicy | None = None  # π_ref of a KL penalty (not a submodule: never saved)
        self.policy_folder: str | None = None  # where the policy was loaded from (the warm start's folder, or none)
        self.tokenizer: Any = None
        self.engine: Any = None
        self.link: EngineLink | None = None
        self.sync_owner: object | None = None  # a callback that sends each update to the engine (PolicySync)
        self.step_context: StepContext | None = None
        self.async_rollouts: AsyncRollouts | None = None  # rollout.max_staleness >= 1, from on_train_start
        self._async_state: dict[str, Any] | None = None  # a checkpoint's pipeline, until on_train_start
        self.refill: RefillStream | None = None  # rollout.dynamic_sampling's further prompts, from on_train_start
        self._refill_state: dict[str, int] | None = None  # a checkpoint's refill position, until on_train_start
        self.validation = ValidationMetrics(self.rollout_settings.pass_at(), self.rollout_settings.val_responses)

    def set_launch(self, run_config: dict[str, Any] | None, resume_from: str | None, resume_checked: bool) -> None:
        """The CLI's resolved config (kept in checkpoints), the checkpoint a resume starts from (the warm start is
        then skipped), and whether the CLI already compared that checkpoint's settings with these."""
        self.run_config: dict[str, Any] | None = run_config
        self.resume_from: str | None = resume_from
        self.resume_checked = resume_checked

    @property
    def sketcher(self) -> Any:
        """The LoGRA sketcher of a sketching method (None otherwise)."""
        return self.method.sketcher

    # ------------------------------------------------------------------------------------------- setup
    def configure_model(self) -> None:
        """Load the policy (after the optional warm start) and give the rollout engine its own copy; for training
        with a KL penalty, load the reference policy too (also when an earlier ``validate`` loaded the policy)."""
        trainer = compat.trainer_of(self)
        dm = getattr(trainer, "datamodule", None)
        if self.policy is None:
            self._load_policy(trainer, dm)
        if self.reference_policy is None and self.loss_config.needs_reference_policy and _trains(trainer):
            self.reference_policy = self._load_reference(trainer, self.policy_folder, dm)

    def _load_policy(self, trainer: Any, dm: Any) -> None:
        """The policy from its source (warm-started unless resuming), the engine's copy, the method's preparation."""
        source = rank_zero_first(
            trainer,
            lambda: training_source(self.policy_source, self.warm_start, self.resume_from, dm, self.env),
            lambda: self.method.check_fits(self.policy_source, self.targets),
        )
        self.policy, self.tokenizer, eos = load_training_policy(source, self.dtype_name, self.attn_implementation)
        self.policy_folder = source
        args = (self.policy, self.tokenizer, eos, self.rollout_settings, self.dtype_name, list(self.targets))
        request = engine_request(trainer, source, *args)
        self.engine = build_engine(self.engine_spec, request)
        self.link = EngineLink(self.engine, self.method, self.policy, lambda: compat.trainer_of(self))
        self.method.prepare_policy(self.policy, self.targets)  # after the engine's copy: it holds plain matrices
        if self.activation_checkpointing:  # after the engine's copy: it generates without recomputation
            enable_activation_checkpointing(self.policy)

    def _load_reference(self, trainer: Any, source: str, datamodule: Any) -> ReferencePolicy:
        """The KL penalty's ``π_ref``: the policy as RL starts, loaded from the folder the policy came from — on a
        resume (which loads the base policy and then the checkpoint's weights) from the warm start's folder again
        (cached; rebuilt if the cache is gone), checked against the checkpoint's digest in ``on_load_checkpoint``."""
        if self.resume_from is not None and self.warm_start is not None:
            source = rank_zero_first(
                trainer, lambda: training_source(self.policy_source, self.warm_start, None, datamodule, self.env)
            )
        shared = self.loss_config.shared
        dtype = shared.reference_dtype or self.dtype_name
        return ReferencePolicy.load(source, dtype, shared.reference_device, self.attn_implementation)

    def configure_optimizers(self) -> Any:
        """The update method's optimizer (and schedule) for the target matrices."""
        self.configure_model()
        return self.method.configure_optimizers(self.policy, self.targets, self.guard)

    def on_train_start(self) -> None:
        """The engine samples from weights equal to the trainer's (after any checkpoint restore); with
        ``rollout.max_staleness`` ≥ 1 the asynchronous pipeline starts (with a checkpoint's unused rollouts)."""
        self.sync_engine(full=True)
        if self.rollout_settings.dynamic_sampling:
            self.refill = self._refill_stream()
        k = self.rollout_settings.max_staleness
        if k:
            AsyncRollouts.check(self, self.trainer)
            self.async_rollouts = AsyncRollouts(self, k, self.rollout_settings.max_stale_kl)
            self.async_rollouts.connect(self.trainer)
            if self._async_state is not None:
                self.async_rollouts.load_state_dict(self._async_state)
                self._async_state = None
            self.link.pipeline = self.async_rollouts.pipeline

    def _refill_stream(self) -> RefillStream:
        """Dynamic sampling's stream of further prompts over the training loader's dataset (a checkpoint's position
        restored)."""
        trainer, loader = self.trainer, self.trainer.train_dataloader
        dataset, per_rank = getattr(loader, "dataset", None), getattr(loader, "batch_size", None)
        if dataset is None or not per_rank or not hasattr(dataset, "__getitem__"):
            raise ConfigError(
                "rollout.dynamic_sampling samples further prompts from the training loader's dataset, but this loader "
                "has no indexable dataset with a batch size (use the project's data modules, whose loaders do, or turn "
                "dynamic_sampling off)"
            )
        sampler = getattr(loader, "sampler", None)
        stream = RefillStream(dataset, trainer.world_size, trainer.global_rank, per_rank, getattr(sampler, "seed", 0))
        if self._refill_state is not None:
            stream.load_state_dict(self._refill_state)
            self._refill_state = None
        return stream

    def on_validation_start(self) -> None:
        """Validation samples from the engine too: it must hold the current weights. Per-task pass@1 when the
        evaluation problems mix tasks (their macro mean is the RG-Hard score)."""
        if self.engine is not None and self.link.place(self.device):
            self.sync_engine(full=True)
        self.validation.start(getattr(self.trainer.datamodule, "eval_items", None) or [], self.device)

    def teardown(self, stage: str) -> None:
        """Stop the scoring processes (they restart on the next ``score``) and the asynchronous worker."""
        self.scorer.close()
        self._stop_pipeline()

    def _stop_pipeline(self) -> None:
        """End the asynchronous pipeline (its unused rollouts are dropped); the engine is called inline again."""
        if self.async_rollouts is not None:
            self.async_rollouts.pipeline.close()
            self.async_rollouts = None
            self.link.pipeline, self.link.before_change = None, None

    # ---------------------------------------------------------------------------------------- engine
    def attach_sync(self, owner: object) -> None:
        """A sync callback (``PolicySync``) sends each update to the engine from now on (None: the module again)."""
        self.sync_owner = owner

    def sync_engine(self, full: bool = False) -> None:
        """Bring the engine to the trainer's weights: the last merged payload, the changed tensors, or all."""
        if self.link is not None:
            self.link.sync(self.device, full=full, payload=self.link.last_payload)

    def engine_call(self, fn: Any, *args: Any, changes_weights: bool = False, **kwargs: Any) -> Future:
        """Run an engine call in order with every other (``EngineLink.submit``): on the asynchronous worker, or
        now; a Future either way. ``changes_weights``: it changes the engine's weights (a sync)."""
        return self.link.submit(fn, *args, changes_weights=changes_weights, **kwargs)

    def generate_rollout(
        self, prompts: list[list[int]], sampling: SamplingConfig, prompt_seeds: list[int] | None = None
    ) -> Rollout:
        """``engine.generate``; an engine found stale is repaired on every rank and asked again (EngineLink)."""
        return self.link.generate(self.device, prompts, sampling, prompt_seeds)

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every tensor of the policy, gathered whole, as an engine holds it."""
        return dict(self.method.full_state(self.policy))

    def trained_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors an update changes, whole, named as an engine holds them."""
        return self.method.trained_tensors(self.policy)

    # ----------------------------------------------------------------------------------------- rollout
    def encode_prompts(self, items: list[dict[str, Any]]) -> list[list[int]]:
        """Chat-template each item's ``messages`` and tokenize."""
        return encode_prompts(self.tokenizer, items)

    def score(self, rollout: Rollout, items: list[dict[str, Any]]) -> Scores:
        """Verifier reward, correctness and failure of every response (each call bounded by ``scoring.timeout_s``;
        scoring stops once the batch is certain to fail: ``FailurePolicy.cut``)."""
        return self.scorer.score_rollout(self.tokenizer, rollout, items, self.failures.cut(len(rollout)))

    def check_scores(self, scores: Scores, validation_batch: int | None = None) -> float:
        """Count the responses without a reward over all ranks; one console line when there are any; stop a run whose
        verifier keeps failing (:class:`~logra_pl.rewards.failures.FailurePolicy`), before anything trains on it.
        Returns this rank's share of responses without a reward."""
        counts = self._all_reduce_sum(torch.tensor([float(scores.failed), float(len(scores))], dtype=torch.float64))
        failed, total = int(counts[0]), int(counts[1])
        ckpt = getattr(self.trainer.checkpoint_callback, "last_model_path", "") or "the last checkpoint"
        args = (scores, failed, total, verifier_label(self.verifier), ckpt, self.trainer.is_global_zero)
        if validation_batch is None:
            self.failures.record(self.global_step + 1, *args)
        else:
            self.failures.check_validation(validation_batch, *args)
        return scores.failed / len(scores) if len(scores) else 0.0

    def _sampling_seed(self, split: str, key: str = "") -> int:
        return sampling_seed(self.seed, split, self.global_step, key)

    def _all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(compat.trainer_of(self), t, self.device)

    def _microbatches(self, rows: list[int], packed: PackedResponses | None = None) -> tuple[list[list[int]], int]:
        """The microbatches of ``rows``, as many on every rank: a rank with fewer (token budgets cut ranks' rows
        differently) repeats its first row in padding microbatches at the end, whose loss counts zero. Sharded
        parameters are gathered once per forward on every rank (FSDP), so unequal forward counts would hang. Returns
        the microbatches and how many of them at the end are padding."""
        groups = microbatches(rows, self.microbatch_size, self.max_tokens_per_microbatch, packed)
        agreed = all_reduce_max(compat.trainer_of(self), len(groups), self.device)
        padding = agreed - len(groups)
        return groups + [groups[0][:1]] * padding, padding

    def _parts(self, packed: PackedResponses) -> tuple[list[PackedResponses], int]:
        """The packed batch in the microbatches of every scoring pass (rows × tokens within the budget), as many on
        every rank (:meth:`_microbatches`), and how many at the end are padding (their outputs are dropped)."""
        trim, rows = self.max_tokens_per_microbatch is not None, list(range(packed.input_ids.shape[0]))
        groups, padding = self._microbatches(rows, packed)
        return [select_rows(packed, mb, trim) for mb in groups], padding

    @torch.no_grad()
    def trainer_logprobs(self, packed: PackedResponses, temperature: float) -> torch.Tensor:
        """The trainer's log-probs of the packed responses, microbatched, without grad."""
        parts, padding = self._parts(packed)
        scored = [response_logprobs(self.policy, p.to(self.device), temperature) for p in parts]
        return torch.cat(scored[: len(scored) - padding]).cpu()

    @torch.no_grad()
    def trainer_scores(self, packed: PackedResponses, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The trainer's log-probs and entropy at each response position, from one pass without grad."""
        parts, padding = self._parts(packed)
        scored = [response_logprobs_and_entropy(self.policy, p.to(self.device), temperature) for p in parts]
        scored = scored[: len(scored) - padding]
        return torch.cat([s[0] for s in scored]).cpu(), torch.cat([s[1] for s in scored]).cpu()

    def reference_logprobs(self, packed: PackedResponses, temperature: float) -> torch.Tensor:
        """The reference policy's log-probs of the packed responses (once per rollout, without grad; a sharded
        reference runs the padding microbatches too, as the policy does)."""
        self.reference_policy.place(self.device)
        parts, padding = self._parts(packed)
        scored = [self.reference_policy.logprobs(p, temperature) for p in parts]
        return torch.cat(scored[: len(scored) - padding])

    def make_step_context(self, items: list[dict[str, Any]]) -> StepContext:
        """Rollout → rewards → advantages → pre-update trainer log-probs."""
        rs = self.rollout_settings
        staleness, shaping = 0, {}
        self._update_scores, self._env_episodes = [], []
        try:
            if self.async_rollouts is not None:  # sampled ahead by the worker (or again, when too stale)
                rollout, staleness = self.async_rollouts.rollout(items)
                drawn = self._scored(items, rollout)
            else:
                drawn = self._draw(items, "train")
                if rs.dynamic_sampling:  # only prompts whose responses' raw rewards differ (DAPO)
                    rounds = rs.max_sampling_rounds
                    picked = dynamic_batch(drawn, self._draw_refill, len(items), rounds, self._any_short)
                    drawn, shaping = picked.batch, picked.metrics()
            items, rollout, rewards, correct = drawn.items, drawn.rollout, drawn.rewards, drawn.correct
        except PolicyDivergedError as err:
            raise PolicyDivergedError(f"policy diverged before update {self.global_step + 1}: {err}") from None
        # A failed response is never trained on; a verifier that keeps failing stops the run here, before training.
        failure_rate = self.check_scores(merge_scores(self._update_scores))
        scored = ~torch.isnan(rewards)  # a response without a reward has NaN (rewards/failures.py)
        shaped = rewards
        if rs.overlong_buffer:  # DAPO's soft overlong punishment: on the advantages' reward, never on the raw one
            lengths = torch.tensor([len(r) for r in rollout.response_ids])
            penalty = overlong_penalty(lengths, rs.max_new_tokens, rs.overlong_buffer, rs.overlong_penalty)
            shaped = rewards + penalty
            shaping["shaping/overlong_penalty"] = float(penalty.mean())
            shaping["shaping/overlong_rate"] = float((penalty < 0).double().mean())
        groups = list(rollout.prompt_index)
        advantages = scored_advantages(self.baseline, shaped, scored, correct, groups, self._all_reduce_sum)
        t_logp, pad = (rs.temperature if rs.temperature > 0 else 1.0), self.tokenizer.pad_token_id
        reference = self.reference_logprobs if self.reference_policy is not None else None
        ctx = assemble_step(
            self.global_step, items, rollout, rewards, advantages, pad, self.trainer_scores, t_logp, reference
        )
        ctx.scored, ctx.correct = scored, correct
        # The loss's tokens: less truncated responses (loss.mask_truncated), less the responses without a reward.
        ctx.loss_mask = scored_mask(self.loss_config.token_mask(ctx.packed.response_mask, rollout.truncated), scored)
        ctx.staleness, ctx.shaping, ctx.shaped_rewards = staleness, shaping, shaped
        ctx.metrics["verifier/failure_rate"] = failure_rate  # over every response scored for the update
        if self._env_episodes:  # multi-turn: every round's trajectories' turns, truncation and environment counts
            ctx.metrics |= episode_metrics(self._env_episodes)
        return ctx

    def _any_short(self, short: bool) -> bool:
        """Is any rank's dynamic batch still short (one all-reduce; every rank then draws the next round or none)?
        An update already certain to fail draws no further round: it will not train on them."""
        scored = merge_scores(self._update_scores)
        failing = self.failures.fails(scored.failed, len(scored))
        return any_rank(compat.trainer_of(self), short and not failing)

    def _draw(self, items: list[dict[str, Any]], split: str) -> Drawn:
        """Sample and score ``items`` with the training settings; one seed per prompt (from its question and
        ``split``): a prompt's responses do not depend on batch or ranks."""
        sampling = self.rollout_settings.training_sampling(self._sampling_seed(split))
        seeds = [self._sampling_seed(split, prompt_key(it)) for it in items]
        if self.env is not None:
            episodes = self.run_episodes(items, sampling, seeds)
            return self._scored(items, episodes.rollout, episodes)
        rollout = self.generate_rollout(self.encode_prompts(items), sampling, prompt_seeds=seeds)
        return self._scored(items, rollout)

    def run_episodes(self, items: list[dict[str, Any]], sampling: SamplingConfig, seeds: list[int]) -> Episodes:
        """``sampling.n`` conversations per item with ``env`` on the engine (:func:`~logra_pl.envs.run_episodes`)."""
        budget = int(getattr(self.env, "max_tokens", 1024))
        return run_episodes(self.generate_rollout, self.tokenizer, self.env, items, sampling, seeds, budget)

    def _scored(self, items: list[dict[str, Any]], rollout: Rollout, episodes: Episodes | None = None) -> Drawn:
        """``rollout`` scored: raw rewards (NaN without one) and correctness; kept for the update's failure count.
        Multi-turn ``episodes``: the environment's rewards plus the verifier's score of each final reply."""
        if episodes is None:
            scores = self.score(rollout, items)
        else:
            scores = episode_scores(episodes, self.scorer, items, self.failures.cut(len(rollout)))
            self._env_episodes.append(episodes)
        self._update_scores.append(scores)
        rewards, _, correct = score_tensors(scores)
        return Drawn(items, rollout, rewards, correct)

    def _draw_refill(self, round_index: int) -> Drawn:
        """Dynamic sampling's round ``round_index`` (≥ 1): the next prompts of the refill stream, sampled and
        scored (their seeds keyed by the round, so a prompt drawn again samples other responses)."""
        return self._draw(self.refill.next_items(), f"train/refill{round_index}")

    # ---------------------------------------------------------------------------------------- training
    def training_step(self, batch: list[dict[str, Any]], batch_idx: int) -> None:
        """One rollout and its update(s): one for REINFORCE+TIS, ``epochs × minibatches`` for PPO."""
        t0 = time.perf_counter()
        ctx = self.step_context = self.make_step_context(batch)
        t_rollout = time.perf_counter() - t0
        plan = self.loss_config.plan(len(ctx.rollout), self._sampling_seed("ppo"))  # one update, or PPO's several
        results = [self._update(ctx, part) for part in plan]
        step_s = time.perf_counter() - t0
        metrics = step_metrics(ctx, results, t_rollout, step_s, self.baseline, self.scorer) | ctx.shaping
        metrics["verifier/failure_rate"] = ctx.metrics.get("verifier/failure_rate", metrics["verifier/failure_rate"])
        metrics |= {k: v for k, v in ctx.metrics.items() if k.startswith("env/")}  # multi-turn episodes' counts
        if self.async_rollouts is not None:
            metrics |= self.async_rollouts.metrics()
        metrics["guard/rejected_updates"] = float(self.rejections.total)
        metrics |= self.method.metrics()
        metrics.update(getattr(self.trainer.strategy, "stats", {}))  # LoGRAStrategy: all-reduce bytes and time
        metrics["memory/persistent_state_bytes"] = float(self.state_memory().persistent)
        metrics |= {f"train/{name}": num / den if den else 0.0 for name, (num, den) in ctx.loss_stats.items()}
        ctx.metrics.update(metrics)
        bs = len(ctx.rollout)
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=bs)
        self.log("reward", metrics["train/reward_mean"], prog_bar=True, logger=False, batch_size=bs)
        self.log("step_s", step_s, prog_bar=True, logger=False, batch_size=bs)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """``sync/engine_resyncs`` after the step's callbacks: a repair made by ``PolicySync``'s probe in this step
        (an engine restarted during the last update) counts at this step, not one step late. An asynchronous run
        records the update's KL and requests the batch ``max_staleness + 1`` ahead, now that the callbacks ran."""
        if self.async_rollouts is not None:
            self.async_rollouts.finish()
        if self.link.can_go_stale:
            self.link.logged_resyncs = self.link.resyncs
            bs = len(self.step_context.rollout) if self.step_context is not None else 1
            self.log("sync/engine_resyncs", float(self.link.resyncs), on_step=True, on_epoch=False, batch_size=bs)

    def on_train_end(self) -> None:
        """A repair after the last logged step (the final verification's probe) still reaches the loggers."""
        self._stop_pipeline()
        if self.link.can_go_stale and self.link.resyncs != self.link.logged_resyncs and self.trainer.is_global_zero:
            for logger in self.trainer.loggers:
                logger.log_metrics({"sync/engine_resyncs": float(self.link.resyncs)}, step=self.global_step)
                logger.save()

    def _update(self, ctx: StepContext, rows: list[int]) -> tuple[float, float, float, float]:
        """Microbatched loss/backward over ``rows``, then one update through the method and the engine sync."""
        t0 = time.perf_counter()
        # The loss tokens and sequences of the whole update, over all ranks: microbatch and rank losses add up to the
        # update's loss under every aggregation.
        totals = update_totals(ctx, rows, self.rollout_settings.max_new_tokens, self._all_reduce_sum)
        (groups, padding), trim = self._microbatches(rows, ctx.packed), self.max_tokens_per_microbatch is not None
        total = backward_over(
            self.policy, ctx, groups, self.loss_config, totals, self.manual_backward, self.device, trim, padding
        )
        t1 = time.perf_counter()
        # What the rollout and the backward freed goes back to the OS before the step's temporaries (every method).
        release_free_heap()
        result = self.method.step(self.optimizers(), self.lr_schedulers(), self._all_reduce_sum)
        if result.payload is not None:
            ctx.payloads.append(result.payload)
        ckpt = getattr(self.trainer.checkpoint_callback, "last_model_path", "") or "the last checkpoint"
        self.rejections.record(
            result.rejected, self.global_step, self.method.step_knob, ckpt, self.trainer.is_global_zero
        )
        self.link.last_payload = result.payload
        if self.sync_owner is None:
            self.link.sync(self.device, payload=result.payload)
        return total, t1 - t0, time.perf_counter() - t1, result.update_norm

    # -------------------------------------------------------------------------------------- validation
    def validation_step(self, batch: list[dict[str, Any]], batch_idx: int) -> None:
        """Sample ``val_responses`` per problem at the validation settings; accumulate reward and pass@j."""
        rs = self.rollout_settings
        sampling = rs.validation_sampling(self._sampling_seed(f"val{batch_idx}"))
        if self.env is None:
            rollout = self.generate_rollout(self.encode_prompts(batch), sampling)
            scores = self.score(rollout, batch)
        else:  # the whole conversation, scored as in training (the final reply, plus the environment's reward)
            seeds = [self._sampling_seed(f"val{batch_idx}", prompt_key(it)) for it in batch]
            episodes = self.run_episodes(batch, sampling, seeds)
            rollout = episodes.rollout
            scores = episode_scores(episodes, self.scorer, batch, None)
        self.check_scores(scores, validation_batch=batch_idx)
        rewards, scored, correct = score_tensors(scores)
        texts = []
        if batch_idx == 0:
            texts = self.tokenizer.batch_decode(rollout.response_ids[: 4 * rs.val_responses], skip_special_tokens=True)
        self.validation.update(batch, rewards, texts, self.device, correct=correct, scored=scored)
        self.log("val/reward_mean", self.validation.reward, on_step=False, on_epoch=True, batch_size=len(rewards))

    def on_validation_epoch_end(self) -> None:
        """Log ``val/pass@j`` (and per-task pass@1 with its macro mean), then a text panel of samples."""
        out = self.validation.compute()
        if out is None:
            return
        self.log("val/pass@1", out.pop("val/pass@1"), prog_bar=True)
        self.log_dict(out)
        if self.trainer.is_global_zero:
            self.validation.show(self.logger, self.global_step)

    # -------------------------------------------------------------------------------------- checkpoint
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The module's own state (the rest is in the optimizer state) and the run's settings, for honest resumes."""
        checkpoint["logra_pl"] = module_state(self)
        if self.refill is not None:  # where dynamic sampling's further prompts continue
            checkpoint["logra_pl"]["refill"] = self.refill.state_dict()
        if self.async_rollouts is not None:  # wait for the requests in flight: their rollouts are saved too
            self.async_rollouts.finish()
            checkpoint["logra_pl"]["async"] = self.async_rollouts.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint written under structurally different settings (before Lightning loads the optimizer
        state, so a resume under another method gets a message, not a ``KeyError``); restore the module's state."""
        restore_module_state(self, checkpoint)
        self._async_state = (checkpoint.get("logra_pl") or {}).get("async")
        self._refill_state = (checkpoint.get("logra_pl") or {}).get("refill")

    # ------------------------------------------------------------------------------------------ console
    def configure_callbacks(self) -> list[pl.Callback]:
        """Show progress in updates and an honest model summary (replacing Lightning's defaults of those kinds)."""
        trainer = compat.trainer_of(self)
        return replace_default_callbacks(trainer.callbacks if trainer is not None else [])

    def state_memory(self) -> MemoryReport:
        """Training state by kind: the update method's, and the KL penalty's reference policy (``reference_policy``,
        wherever it is kept: a ``cpu`` copy is host memory)."""
        report = self.method.memory(self.policy)
        if self.reference_policy is not None:
            report.reference_policy = self.reference_policy.nbytes  # this rank's (its shard, when sharded)
        return report

    def trained_parameter_count(self) -> int:
        """Parameters the update method changes."""
        return 0 if self.policy is None else self.method.trained_parameter_count(self.policy)

    def training_report(self) -> str:
        """One line on what this run trains and the optimizer state it holds for it."""
        return "" if self.policy is None else self.method.report(self.policy, self.targets)
