"""``LoGRAPolicyModule``: one ``training_step`` is one rollout and its policy update(s) (algorithm.md §8).

The Lightning hooks and the orchestration of a step, each part an object of its own wing: the sampler (``train/``)
draws and scores responses, the step is built from them, the backward runs by microbatches, the update method
(``methods/``) takes the update and the engine link sends it. Callbacks read :attr:`~LoGRAPolicyModule.step_context`
and the module through :class:`~logra_pl.callbacks.contract.PolicyModuleView`.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Literal

import lightning.pytorch as pl
import torch

from logra_pl.callbacks.progress import replace_default_callbacks
from logra_pl.envs.base import Environment, check_environment
from logra_pl.errors import check_int
from logra_pl.losses import AdvantageBaseline, Loss, build_baseline, build_loss
from logra_pl.methods import UpdateMethod, resolve_method
from logra_pl.methods.guard import DivergenceGuard, RejectionCount
from logra_pl.rewards import BoundedVerifier, ReasoningGymVerifier, Verifier, check_verifier
from logra_pl.rewards.failures import FailurePolicy
from logra_pl.rollout.registry import EngineSpec, build_engine, engine_spec
from logra_pl.runtime import compat
from logra_pl.runtime.checkpointing import enable_activation_checkpointing
from logra_pl.runtime.console import quiet_noise
from logra_pl.runtime.heap import release_free_heap
from logra_pl.runtime.ranks import Ranks
from logra_pl.sketch.config import DEFAULT_TARGETS
from logra_pl.sketch.memory import MemoryReport
from logra_pl.train.backward import backward_over, update_totals
from logra_pl.train.engine_link import EngineLink
from logra_pl.train.passes import TrainerPasses
from logra_pl.train.policy_setup import engine_request, load_training_policy, rank_zero_first, training_source
from logra_pl.train.reference import ReferencePolicy
from logra_pl.train.sampler import Sampler, score_tensors
from logra_pl.train.settings import RolloutSettings, ScoringSettings
from logra_pl.train.state import module_state, restore_module_state
from logra_pl.train.step import StepContext, build_step, step_metrics
from logra_pl.train.validation import ValidationMetrics, item_task
from logra_pl.train.warm_start import WarmStart, check_demonstrations

# The policy stays in eval mode on purpose: trainer and engine must compute the same distribution (no dropout),
# or the importance ratios and the mismatch estimate measure dropout noise.
warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode at the start of training.*")
quiet_noise()

__all__ = ["LoGRAPolicyModule", "RolloutSettings", "ScoringSettings", "StepContext", "item_task"]


class LoGRAPolicyModule(pl.LightningModule):
    """RL post-training of a causal LM with LoGRA (or a baseline update method).

    Arguments:
        policy: ``tiny[:preset]``, ``smollm2``, a ``.gguf`` file, a ``save_pretrained`` folder or a hub id.
        warm_start: optional supervised warm start (cached) before RL; eval questions are excluded.
        method: the update method (:mod:`logra_pl.methods`): ``{class_path, init_args}`` (LoGRA's knobs under
            ``init_args.logra``, AdamW's under ``adamw``...), a short name (``logra | adamw | lora | sgd``, with its
            defaults) or an object; None: LoGRA with its defaults.
        targets: the matrices every method trains (``nn.Linear`` name ends); None: the method's, or attention + MLP.
        loss: the surrogate (:class:`~logra_pl.losses.Loss`) by class_path or ``reinforce_tis | ppo | gspo | cispo``.
        baseline: the advantage baseline (:class:`~logra_pl.losses.AdvantageBaseline`): ``running | group | rloo``.
        rollout: sampling settings.
        microbatch_size: responses per forward/backward pass (at most).
        max_tokens_per_microbatch: token budget of one pass (rows × longest row); None: ``microbatch_size`` rows.
        logprob_chunk_tokens: score response tokens this many at a time, with no ``(B, R, V)`` tensor; None: at once.
        activation_checkpointing: recompute each decoder layer in backward (:mod:`logra_pl.runtime.checkpointing`).
        attn_implementation: transformers' attention kernel; None: its default (the KL probe uses eager).
        answer_format: how the default verifier reads answers (``auto``/``tags``/``plain``).
        dtype: parameter dtype of the policy (fp32 master weights by default).
        seed: seed of sampling (mixed with the update index).
        engine: the rollout engine and its settings (``HFSettings``, ``VLLMSettings``, ``RemoteSettings`` for
            ``logra-pl serve`` engines) by ``class_path``, or a short name ``hf | vllm | remote`` (its defaults).
        guard: the divergence guard: oversized or non-finite updates never reach the weights.
        scoring: how the verifier runs (time limit, workers, answer cap), what is correct, when failures stop a run.
        verifier: the reward, any ``__call__(response, item) -> float`` (:class:`~logra_pl.rewards.Verifier`:
            optionally ``correct``, ``score_batch``); default ``ReasoningGymVerifier``.
        env: a multi-turn environment (:class:`~logra_pl.envs.Environment`, by ``class_path``): each prompt becomes
            a conversation of at most ``env.max_turns`` replies, trained on the policy's tokens only; None: one reply.
    """

    def __init__(
        self,
        policy: str = "tiny",
        warm_start: WarmStart | None = None,
        method: str | UpdateMethod | None = None,
        targets: list[str] | None = None,
        loss: str | Loss | None = None,
        baseline: str | AdvantageBaseline | None = None,
        rollout: RolloutSettings | None = None,
        microbatch_size: int = 16,
        max_tokens_per_microbatch: int | None = None,
        logprob_chunk_tokens: int | None = None,
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
        check_int("logprob_chunk_tokens", 1 if logprob_chunk_tokens is None else logprob_chunk_tokens, 1)
        self.engine_spec = engine_spec(engine)  # an unknown engine fails here, before any model is loaded
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.policy_source, self.warm_start, self.dtype_name, self.seed = policy, warm_start, dtype, seed
        self.method = resolve_method(method)  # an unknown one fails here
        self.targets = tuple(targets or self.method.targets or DEFAULT_TARGETS)
        self.loss_config, self.baseline = build_loss(loss), build_baseline(baseline)
        self.rollout_settings = rollout or RolloutSettings()
        self.rollout_settings.check_baseline(self.baseline)
        self.microbatch_size, self.max_tokens_per_microbatch = microbatch_size, max_tokens_per_microbatch
        self.activation_checkpointing, self.attn_implementation = activation_checkpointing, attn_implementation
        self.scoring = sc = scoring or ScoringSettings()
        self.verifier = verifier or ReasoningGymVerifier(answer_format, max_answer_chars=sc.max_answer_chars)
        check_verifier(self.verifier)
        self.scorer = BoundedVerifier(self.verifier, sc.timeout_s, sc.workers, sc.correct_threshold)
        self.failures = FailurePolicy(sc.max_failure_rate, sc.max_failed_updates)
        if env is not None:
            check_environment(env)
            self.rollout_settings.check_env(env)
        if warm_start is not None:
            check_demonstrations(warm_start, env)
        self.env = env
        self.guard = guard or DivergenceGuard()
        self.rejections = RejectionCount(self.guard.max_consecutive)
        self.set_launch(run_config=None, resume_from=None, resume_checked=False)  # outside the CLI
        self.ranks = Ranks(lambda: compat.trainer_of(self), lambda: self.device)
        self.policy: torch.nn.Module | None = None
        self.reference_policy: ReferencePolicy | None = None  # π_ref of a KL penalty (not a submodule: never saved)
        self.policy_folder: str | None = None  # where the policy was loaded from (the warm start's folder, or none)
        self.tokenizer: Any = None
        self.engine: Any = None
        self.link: EngineLink | None = None  # the engine, kept on the trainer's weights (from configure_model)
        self.sampler: Sampler | None = None  # draws and scores the responses (from configure_model)
        self.passes: TrainerPasses | None = None  # the trainer's no-grad passes (from configure_model)
        self.step_context: StepContext | None = None
        self._sampler_state: dict[str, Any] = {}  # a checkpoint's refill position and pipeline, until on_train_start
        self.validation = ValidationMetrics(self.rollout_settings.pass_at(), self.rollout_settings.val_responses)

    def set_launch(self, run_config: dict[str, Any] | None, resume_from: str | None, resume_checked: bool) -> None:
        """The CLI's resolved config (kept in checkpoints), the checkpoint a resume starts from (the warm start is
        then skipped), and whether the CLI already compared that checkpoint's settings with these."""
        self.run_config, self.resume_from, self.resume_checked = run_config, resume_from, resume_checked

    # ------------------------------------------------------------------------------------------- setup
    def configure_model(self) -> None:
        """Load the policy (after the optional warm start), give the rollout engine its own copy, and build the
        parts of an update on them; for training with a KL penalty, load the reference policy too (also when an
        earlier ``validate`` loaded the policy): the policy as RL starts — on a resume with a warm start, the warm
        start's folder again (cached; rebuilt if the cache is gone), checked against the checkpoint's digest."""
        trainer = compat.trainer_of(self)
        dm = getattr(trainer, "datamodule", None)

        def source(resume_from: str | None) -> str:
            return training_source(self.policy_source, self.warm_start, resume_from, dm, self.env)

        if self.policy is None:
            check = lambda: self.method.check_fits(self.policy_source, self.targets)  # noqa: E731
            self.policy_folder = rank_zero_first(trainer, lambda: source(self.resume_from), check)
            loaded = load_training_policy(self.policy_folder, self.dtype_name, self.attn_implementation)
            self.policy, self.tokenizer, eos = loaded
            args = (self.policy, self.tokenizer, eos, self.rollout_settings, self.dtype_name, list(self.targets))
            self.engine = build_engine(self.engine_spec, engine_request(trainer, self.policy_folder, *args))
            self.link = EngineLink(self.engine, self.method, self.policy, self.ranks)
            self.method.prepare_policy(self.policy, self.targets)  # after the engine's copy: it holds plain matrices
            if self.activation_checkpointing:  # after the engine's copy: it generates without recomputation
                enable_activation_checkpointing(self.policy)
            sc = (self.scorer, self.failures, self.verifier, self.ranks)
            self.sampler = Sampler(self.link, self.tokenizer, self.rollout_settings, *sc, self.seed, self.env)
        fitting = getattr(getattr(trainer, "state", None), "fn", None) in (None, "fit")  # validation needs no π_ref
        if self.reference_policy is None and self.loss_config.needs_reference_policy and fitting:
            rebuilt = self.resume_from is not None and self.warm_start is not None
            folder = rank_zero_first(trainer, lambda: source(None)) if rebuilt else self.policy_folder
            self.reference_policy = ReferencePolicy.of_loss(
                self.loss_config, folder, self.dtype_name, self.attn_implementation
            )
        mb, budget, chunk = self.microbatch_size, self.max_tokens_per_microbatch, self.hparams.logprob_chunk_tokens
        self.passes = TrainerPasses(self.policy, mb, budget, self.ranks, self.reference_policy, chunk)

    def configure_optimizers(self) -> Any:
        """The update method's optimizer (and schedule) for the target matrices."""
        self.configure_model()
        return self.method.configure_optimizers(self.policy, self.targets, self.guard)

    def on_train_start(self) -> None:
        """The engine samples from the trainer's weights (after any checkpoint restore); dynamic sampling and, with
        ``rollout.max_staleness`` ≥ 1, the asynchronous pipeline start where a checkpoint left them."""
        self.link.sync_full()
        self.sampler.start(self.trainer, self._sampler_state)
        self._sampler_state = {}

    def on_validation_start(self) -> None:
        """The engine holds the current weights for validation; per-task pass@1 when problems mix tasks (RG-Hard)."""
        if self.link is not None and self.link.place():
            self.link.sync_full()
        self.validation.start(getattr(self.trainer.datamodule, "eval_items", None) or [], self.device)

    def teardown(self, stage: str) -> None:
        """Stop the scoring processes (they restart on the next ``score``) and the asynchronous worker."""
        self.scorer.close()
        if self.sampler is not None:
            self.sampler.stop()

    # ---------------------------------------------------------------------------------------- training
    def training_step(self, batch: list[dict[str, Any]], batch_idx: int) -> None:
        """One rollout and its update(s): one for REINFORCE+TIS, ``epochs × minibatches`` for PPO."""
        t0, update, rs, pad = time.perf_counter(), self.global_step, self.rollout_settings, self.tokenizer.pad_token_id
        sampled = self.sampler.training_batch(batch, update)  # rollout → rewards → advantages → pre-update log-probs
        plan = self.loss_config.plan(len(sampled.drawn.rollout), self.sampler.seed_of("ppo", update))  # 1, or PPO's
        args = (update, sampled, self.baseline, self.loss_config, rs, self.passes, pad, self.ranks.sum)
        self.step_context = ctx = build_step(*args, single_pass=len(plan) == 1)  # 1 update: π_old from its forward
        t_rollout = time.perf_counter() - t0
        results = [self._update(ctx, part) for part in plan]
        self.link.updated(ctx.payloads)  # the engine gets the step's changes before any callback looks at it
        step_s = time.perf_counter() - t0
        metrics = step_metrics(ctx, results, t_rollout, step_s, self.baseline, self.scorer)
        if self.sampler.pipeline is not None:
            metrics |= self.sampler.pipeline.metrics()
        metrics["guard/rejected_updates"] = float(self.rejections.total)
        metrics |= self.method.metrics()
        metrics.update(getattr(self.trainer.strategy, "stats", {}))  # LoGRAStrategy: all-reduce bytes and time
        metrics["memory/persistent_state_bytes"] = float(self.state_memory().persistent)
        ctx.metrics.update(metrics)
        bs = len(ctx.rollout)
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=bs)
        self.log("reward", metrics["train/reward_mean"], prog_bar=True, logger=False, batch_size=bs)
        self.log("step_s", step_s, prog_bar=True, logger=False, batch_size=bs)

    def _update(self, ctx: StepContext, rows: list[int]) -> tuple[float, float, float, float]:
        """Microbatched loss/backward over ``rows``, then one update through the method and the engine sync."""
        t0 = time.perf_counter()
        # The whole update's loss tokens and sequences, over all ranks: its parts add up under every aggregation.
        totals = update_totals(ctx, rows, self.rollout_settings.max_new_tokens, self.ranks.sum)
        passes, loss = self.passes, self.loss_config
        (groups, padding), trim = passes.microbatches(rows, ctx.packed), passes.trim
        score = passes.forward if ctx.pending_scores is None else passes.forward_and_entropy
        total = backward_over(score, ctx, groups, loss, totals, self.manual_backward, self.device, trim, padding)
        t1 = time.perf_counter()
        # What the rollout and the backward freed goes back to the OS before the step's temporaries (every method).
        release_free_heap()
        result = self.method.step(self.optimizers(), self.lr_schedulers(), self.ranks.sum)
        if result.payload is not None:
            ctx.payloads.append(result.payload)
        knob, ckpt = self.method.step_knob, self.ranks.last_checkpoint
        self.rejections.record(result.rejected, self.global_step, knob, ckpt, self.trainer.is_global_zero)
        return total, t1 - t0, time.perf_counter() - t1, result.update_norm

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """``sync/engine_resyncs`` after the step's callbacks: a repair made by ``PolicySync``'s probe in this step
        (an engine restarted during the last update) counts at this step, not one step late. An asynchronous run
        records the update's KL and requests the batch ``max_staleness + 1`` ahead, now that the callbacks ran."""
        self.sampler.finish(self.step_context.update_kls if self.step_context is not None else [])
        if self.link.can_go_stale:
            self.link.logged_resyncs = self.link.resyncs
            bs = len(self.step_context.rollout) if self.step_context is not None else 1
            self.log("sync/engine_resyncs", float(self.link.resyncs), on_step=True, on_epoch=False, batch_size=bs)

    def on_train_end(self) -> None:
        """A repair after the last logged step (the final verification's probe) still reaches the loggers."""
        self.sampler.stop()
        self.link.flush_resyncs(self.trainer, self.global_step)

    # -------------------------------------------------------------------------------------- validation
    def validation_step(self, batch: list[dict[str, Any]], batch_idx: int) -> None:
        """Sample ``val_responses`` per problem at the validation settings; accumulate reward and pass@j."""
        rollout, scores = self.sampler.validation_batch(batch, batch_idx, self.global_step)
        rewards, scored, correct = score_tensors(scores)
        texts = self.validation.panel_texts(rollout, self.tokenizer) if batch_idx == 0 else []
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
        """The module's own state (the rest is in the optimizer state), the run's settings (for honest resumes), and
        where sampling continues: dynamic sampling's position, the asynchronous pipeline's requests."""
        checkpoint["logra_pl"] = module_state(self)
        if self.sampler is not None:
            kls = self.step_context.update_kls if self.step_context is not None else []
            checkpoint["logra_pl"] |= self.sampler.state_dict(kls)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint written under structurally different settings (before Lightning loads the optimizer
        state, so a resume under another method gets a message, not a ``KeyError``); restore the module's state."""
        restore_module_state(self, checkpoint)
        state = checkpoint.get("logra_pl") or {}
        self._sampler_state = {key: state.get(key) for key in ("refill", "async")}

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
