"""``LoGRAPolicyModule``: one ``training_step`` is one rollout and its policy update(s) (algorithm.md §8).

Flow of a step: the rollout engine samples responses (token ids + the log-probs of what it sampled) →
the verifier scores them → the running baseline gives advantages → the trainer's log-probs of the sampled
tokens (no grad, pre-update) → microbatched loss + ``manual_backward`` → ``opt.step()`` (LoGRA: proposal →
``on_before_optimizer_step`` callbacks → merge) → the engine receives the update. Callbacks read the step's
data from :attr:`LoGRAPolicyModule.step_context`, never from each other.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary, RichProgressBar, TQDMProgressBar
from torchmetrics import MeanMetric

from logra_pl import resume
from logra_pl.callbacks.progress import (
    LoGRAModelSummary,
    LoGRARichModelSummary,
    RichUpdateProgressBar,
    UpdateProgressBar,
)
from logra_pl.checkpointing import enable_activation_checkpointing
from logra_pl.console import quiet_noise
from logra_pl.data.schema import prompt_key
from logra_pl.errors import ConfigError, PolicyDivergedError, ResumeMismatchError, StaleEngineError, check_int
from logra_pl.guard import DivergenceGuard
from logra_pl.logprobs import PackedResponses, pack_responses, response_logprobs
from logra_pl.lora import LoRAConfig, MergedState, attach_lora, lora_layers, merged_tensors
from logra_pl.losses import AdvantageBaseline, LegacyBaselineSettings, Loss, build_baseline, build_loss
from logra_pl.metrics import MacroMean, MacroPassAt1, PassAtK
from logra_pl.models.load import load_policy, resolve_source
from logra_pl.optim import AdamWConfig, LoGRAOptimizer, adamw_step_preview, adamw_update_norm
from logra_pl.rewards import BoundedVerifier, ReasoningGymVerifier, Verifier, check_verifier
from logra_pl.rollout.base import GatheredState, Rollout, RolloutEngine, SamplingConfig, cast_floats
from logra_pl.rollout.registry import EngineRequest, resolve_engine
from logra_pl.rollout.remote import RemoteSettings
from logra_pl.rollout.vllm import VLLMSettings
from logra_pl.settings import (
    LegacyLossSettings,
    LossConfig,  # noqa: F401  (deprecated; re-exported for old code and checkpoints)
    RolloutSettings,
    ScoringSettings,
)
from logra_pl.sketch import LoGRAConfig, LoGRASketcher, memory_report, select_targets
from logra_pl.sketch.merge import full_tensor
from logra_pl.sketch.payload import Payload
from logra_pl.warm_start import WarmStart, warm_start_policy

# The policy stays in eval mode on purpose: trainer and engine must compute the same distribution (no dropout),
# or the importance ratios and the mismatch estimate measure dropout noise.
warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode at the start of training.*")
quiet_noise()

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "logra-pl/module/v2"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass
class StepContext:
    """What one training step produced, for callbacks (KL control, mismatch, sync) to read.

    ``logp_rollout``/``logp_trainer``/``packed.response_mask`` are ``(N, R)`` over the ``N`` responses;
    ``logp_trainer`` is the trainer's log-prob of each sampled token *before* this step's update.
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
    payloads: list[Payload] = field(default_factory=list)  # merged LoGRA updates of this step, in order
    loss_stats: dict[str, list[float]] = field(default_factory=dict)  # loss statistics: [numerator, denominator]

    @property
    def eos_terminated(self) -> torch.Tensor:
        """``(N,)`` bool: responses that ended with EOS (not truncated)."""
        return torch.tensor([not t for t in self.rollout.truncated])


class LoGRAPolicyModule(pl.LightningModule):
    """RL post-training of a causal LM with LoGRA (or the dense AdamW baseline).

    Arguments:
        policy: ``tiny[:preset]``, ``smollm2``, a ``.gguf`` file, a ``save_pretrained`` folder or a hub id.
        warm_start: optional supervised warm start (cached) before RL; eval questions are excluded.
        optimizer: ``"logra"`` (sketches, merged updates), ``"adamw"`` (dense baseline) or ``"lora"`` (peft
            adapters on the same matrices, trained by ``adamw``'s AdamW; the engine receives merged weights).
        logra: LoGRA hyper-parameters (``optimizer="logra"``).
        adamw: AdamW hyper-parameters and schedule (``optimizer="adamw"``).
        loss: the surrogate, a :class:`~logra_pl.losses.Loss`: ``reinforce_tis`` (default) or ``ppo`` by short name,
            any loss by ``class_path`` (:func:`~logra_pl.losses.build_loss`; the deprecated ``LossConfig`` too).
        baseline: the advantage baseline: ``running`` (algorithm.md §8), or per-prompt ``group`` / ``rloo``, or any
            :class:`~logra_pl.losses.AdvantageBaseline` by ``class_path`` (:func:`~logra_pl.losses.build_baseline`).
        rollout: sampling settings.
        microbatch_size: responses per forward/backward pass (at most).
        max_tokens_per_microbatch: token budget of one forward/backward pass (rows × longest row, padding
            included): consecutive responses are grouped while they fit, so a few long responses get small
            microbatches instead of running out of memory; None: ``microbatch_size`` responses each time.
        activation_checkpointing: recompute each decoder layer in backward instead of keeping its activations
            (:mod:`logra_pl.checkpointing`; works in eval mode, unlike transformers' own switch).
        attn_implementation: transformers' attention kernel (``eager``, ``sdpa``, ``flash_attention_2``); None:
            its default. The KL probe's forward-mode pass always uses eager attention.
        answer_format: how the verifier reads answers (``auto``/``tags``/``plain``).
        dtype: parameter dtype of the policy (fp32 master weights by default).
        seed: seed of sampling (mixed with the update index).
        engine: rollout engine: ``"hf"`` (transformers, a private copy of the policy), ``"vllm"``, ``"remote"``
            (engines served by ``logra-pl serve``), another name registered with
            :func:`~logra_pl.rollout.registry.register_engine`, or a builder's dotted path.
        vllm: vLLM engine settings (``engine="vllm"``).
        remote: served engines (``engine="remote"``): URLs of ``logra-pl serve`` engines, API key, retries.
        guard: the divergence guard: updates too large or non-finite are rejected before they touch the weights,
            and too many in a row stop the run.
        scoring: how the verifier runs: per-call time limit, worker processes, answer-length cap.
        verifier: the reward: any object with ``__call__(response, item) -> float`` (see
            :class:`~logra_pl.rewards.Verifier`; from YAML ``verifier: {class_path: ..., init_args: ...}``). Default:
            :class:`~logra_pl.rewards.ReasoningGymVerifier` with ``answer_format`` and ``scoring.max_answer_chars``.
    """

    def __init__(
        self,
        policy: str = "tiny",
        warm_start: WarmStart | None = None,
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
        engine: str = "hf",
        vllm: VLLMSettings | None = None,
        remote: RemoteSettings | None = None,
        guard: DivergenceGuard | None = None,
        scoring: ScoringSettings | None = None,
        verifier: Verifier | None = None,
    ) -> None:
        super().__init__()
        if optimizer not in ("logra", "adamw", "lora"):
            raise ValueError(f"unknown optimizer {optimizer!r}: use 'logra', 'adamw' or 'lora'")
        if microbatch_size < 1:
            raise ValueError(f"microbatch_size must be >= 1, got {microbatch_size}")
        resolve_engine(engine)  # an unknown engine fails here, before any model is loaded
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.policy_source = policy
        self.warm_start = warm_start
        self.optimizer_name = optimizer
        self.logra_config = logra or LoGRAConfig()
        self.adamw_config = adamw or AdamWConfig()
        self.lora_config = lora or LoRAConfig()
        self.loss_config = build_loss(loss)
        self.baseline = build_baseline(baseline)
        self.rollout_settings = rollout or RolloutSettings()
        if self.baseline.needs_groups and self.rollout_settings.responses_per_prompt < 2:
            raise ConfigError(
                f"baseline {type(self.baseline).__name__} compares a prompt's responses with each other: set "
                "rollout.responses_per_prompt >= 2 (or use baseline: running)"
            )
        self.microbatch_size = microbatch_size
        if max_tokens_per_microbatch is not None:
            check_int("max_tokens_per_microbatch", max_tokens_per_microbatch, 1)
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        self.activation_checkpointing = activation_checkpointing
        self.attn_implementation = attn_implementation
        self.scoring = scoring or ScoringSettings()
        if verifier is None:
            verifier = ReasoningGymVerifier(answer_format, max_answer_chars=self.scoring.max_answer_chars)
        check_verifier(verifier)
        self.verifier = verifier
        self.scorer = BoundedVerifier(self.verifier, self.scoring.timeout_s, self.scoring.workers)
        self.dtype_name = dtype
        self.seed = seed
        self.engine_kind = engine
        self.vllm_settings = vllm or VLLMSettings()
        self.remote_settings = remote or RemoteSettings()
        self.guard = guard or DivergenceGuard()
        self.run_config: dict[str, Any] | None = None  # set by the CLI: the resolved config, kept in checkpoints
        self.resume_from: str | None = None  # set by the CLI when resuming: the warm start is then not needed
        self.resume_checked = False  # set by the CLI once it compared the checkpoint's settings with these
        self.rejected_updates = 0  # updates not applied (guard rejections and LoGRA skips), over the whole run
        self.rejected_in_a_row = 0
        self.last_relative_update = 0.0
        self.external_sync = False  # set by a PolicySync callback, which then owns engine updates
        self.engine_resyncs = 0  # full resyncs of served engines found stale (lost update, restart)
        self.policy: torch.nn.Module | None = None
        self.tokenizer: Any = None
        self.engine: RolloutEngine | None = None
        self.sketcher: LoGRASketcher | None = None
        self.step_context: StepContext | None = None
        self.val_reward = MeanMetric()
        self.val_pass = PassAtK(ks=self.rollout_settings.pass_at(), samples=self.rollout_settings.val_responses)
        self.val_tasks: MacroPassAt1 | None = None  # built at validation start when the eval set mixes tasks
        self.val_task_rewards: MacroMean | None = None  # per-task mean reward and its macro mean (RG-Hard score)
        self._val_samples: list[tuple[str, str, float]] = []

    # ------------------------------------------------------------------------------------------- setup
    def configure_model(self) -> None:
        """Load the policy (after the optional warm start) and give the rollout engine its own copy."""
        if self.policy is not None:
            return
        trainer = self._trainer
        if trainer is not None and trainer.world_size > 1:
            # Rank 0 builds what is cached on disk (tiny model, warm start) first; the others then read it.
            # (transformers' save_pretrained writes nothing on non-zero ranks of an initialised process group.)
            # An error on rank 0 reaches every rank (the broadcast is also the barrier), so none waits forever.
            error: Exception | None = None
            if trainer.global_rank == 0:
                try:
                    self.check_model_fits()
                    source = self._resolve_source()
                except Exception as err:
                    error = err
            error = trainer.strategy.broadcast(error, src=0)
            if error is not None:
                raise error
            if trainer.global_rank != 0:
                source = self._resolve_source()
        else:
            self.check_model_fits()
            source = self._resolve_source()
        dtype, attn = _DTYPES[self.dtype_name], self.attn_implementation
        model, tokenizer = load_policy(source, dtype=dtype, attn_implementation=attn)
        if tokenizer.chat_template is None:
            raise ValueError(
                f"the tokenizer of policy {source!r} has no chat template: prompts are chats; use an instruct "
                "model or set tokenizer.chat_template in its folder"
            )
        self.policy = model
        self.tokenizer = tokenizer
        eos = {tokenizer.eos_token_id}
        gen_eos = getattr(model.generation_config, "eos_token_id", None)
        eos |= set(gen_eos) if isinstance(gen_eos, list) else ({gen_eos} if gen_eos is not None else set())
        world = trainer.world_size if trainer is not None else 1
        request = EngineRequest(source, model, tokenizer, sorted(eos), self, world)
        self.engine = resolve_engine(self.engine_kind)(request)
        if self.optimizer_name == "lora":  # after the engine's copy: the engine holds plain (merged) matrices
            attach_lora(self.policy, self.logra_config.targets, self.lora_config)
        if self.activation_checkpointing:  # after the engine's copy: it generates without recomputation
            enable_activation_checkpointing(self.policy)

    def check_model_fits(self) -> None:
        """Settings that depend on the model's shapes, read from its config (no weights): ``rank ≤ d_in``.

        Runs before the warm start and the model load, so a rank the model cannot take fails in seconds.
        """
        if self.optimizer_name != "logra":
            return
        from logra_pl.memory import load_config

        resolve_source(self.policy_source)  # a source that cannot exist gets its clear PolicyLoadError here
        config = load_config(self.policy_source)
        with torch.device("meta"):
            from transformers import AutoModelForCausalLM

            skeleton = AutoModelForCausalLM.from_config(config)
        targets = select_targets(skeleton, self.logra_config.targets)
        smallest = min(m.in_features for m in targets.values())
        if self.logra_config.rank > smallest:
            name = next(n for n, m in targets.items() if m.in_features == smallest)
            raise ConfigError(
                f"logra.rank={self.logra_config.rank} exceeds d_in={smallest} of {name!r} in policy "
                f"{self.policy_source!r}: a sketch cannot have more columns than its matrix; use rank <= {smallest}"
            )

    def _resolve_source(self) -> str:
        """The policy folder to load: the tiny build or warm-start output (built and cached on first use)."""
        source = self.policy_source
        if self.warm_start is not None and self.resume_from is not None:
            log.info("resuming from %s: the warm start is skipped (the checkpoint holds the weights)", self.resume_from)
        elif self.warm_start is not None:
            dm = self._datamodule()
            exclude = dm.eval_questions if dm is not None and hasattr(dm, "eval_questions") else set()
            system = getattr(dm, "system_prompt", None)
            source = str(warm_start_policy(source, self.warm_start, exclude, system))
        resolve_source(source)  # builds a tiny model if named; load_policy resolves it again from the cache
        return source

    def _datamodule(self) -> Any:
        trainer = self._trainer
        return getattr(trainer, "datamodule", None) if trainer is not None else None

    def configure_optimizers(self) -> Any:
        """LoGRA: attach sketches and wrap them as an optimizer. AdamW: the dense baseline and its schedule."""
        self.configure_model()
        if self.optimizer_name == "logra":
            self.sketcher = LoGRASketcher(self.policy, self.logra_config)
            return LoGRAOptimizer(self.sketcher)
        cfg = self.adamw_config
        if self.optimizer_name == "lora":
            opt, sched = cfg.build(attach_lora(self.policy, self.logra_config.targets, self.lora_config))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        if cfg.train_all:
            params = [p for p in self.policy.parameters()]
            for p in params:
                p.requires_grad_(True)
        else:
            for p in self.policy.parameters():
                p.requires_grad_(False)
            params = [m.weight for m in select_targets(self.policy, self.logra_config.targets).values()]
            for p in params:
                p.requires_grad_(True)
        opt, sched = cfg.build(params)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_train_start(self) -> None:
        """The engine samples on the trainer's device, from weights equal to the trainer's.

        ``on_train_start`` runs after a checkpoint is restored, so a resumed run's engine holds the restored
        weights (``on_fit_start`` would be too early).
        """
        self.sync_engine(full=True)

    def on_validation_start(self) -> None:
        """Validation samples from the engine too: make sure it holds the current weights."""
        if self.engine is not None and self.engine.place(self.device):
            self.sync_engine(full=True)

    # ----------------------------------------------------------------------------------------- rollout
    def encode_prompts(self, items: list[dict[str, Any]]) -> list[list[int]]:
        """Chat-template each item's ``messages`` and tokenize (no extra special tokens)."""
        texts = [
            self.tokenizer.apply_chat_template(it["messages"], add_generation_prompt=True, tokenize=False)
            for it in items
        ]
        return [self.tokenizer(t, add_special_tokens=False).input_ids for t in texts]

    def score(self, rollout: Rollout, items: list[dict[str, Any]]) -> torch.Tensor:
        """Verifier reward of every response, ``(N,)`` float64 — each call bounded by ``scoring.timeout_s``."""
        texts = self.tokenizer.batch_decode(rollout.response_ids, skip_special_tokens=True)
        rewards = self.scorer.score(texts, [items[i] for i in rollout.prompt_index])
        return torch.tensor(rewards, dtype=torch.float64)

    def teardown(self, stage: str) -> None:
        """Stop the scoring processes (they restart on the next ``score``)."""
        self.scorer.close()

    def _sampling_seed(self, split: str, key: str = "") -> int:
        blob = f"{self.seed}/{split}/{self.global_step}/{key}".encode()
        return int.from_bytes(hashlib.blake2b(blob, digest_size=6).digest(), "little")

    def _all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over data-parallel ranks (identity in one process)."""
        trainer = self._trainer
        if trainer is None or trainer.world_size <= 1:
            return t
        return trainer.strategy.reduce(t.to(self.device), reduce_op="sum").cpu()

    @torch.no_grad()
    def trainer_logprobs(self, packed: PackedResponses, temperature: float) -> torch.Tensor:
        """The trainer's log-probs of the packed responses, microbatched, without grad."""
        out = []
        trim = self.max_tokens_per_microbatch is not None
        for rows in self._microbatches(list(range(packed.input_ids.shape[0])), packed):
            out.append(response_logprobs(self.policy, _select(packed, rows, trim).to(self.device), temperature))
        return torch.cat(out).cpu()

    def _microbatches(self, rows: list[int], packed: PackedResponses | None = None) -> list[list[int]]:
        """Consecutive groups of ``rows``: ``microbatch_size`` each, or while they fit the token budget."""
        budget = self.max_tokens_per_microbatch
        if budget is None or packed is None:
            return [rows[i : i + self.microbatch_size] for i in range(0, len(rows), self.microbatch_size)]
        lengths = packed.attention_mask.sum(dim=1).tolist()
        out: list[list[int]] = []
        current: list[int] = []
        longest = 0
        for row in rows:
            width = max(longest, int(lengths[row]))
            if current and ((len(current) + 1) * width > budget or len(current) >= self.microbatch_size):
                out.append(current)
                current, width = [], int(lengths[row])
            current.append(row)
            longest = width
        if current:
            out.append(current)
        return out

    def generate_rollout(
        self, prompts: list[list[int]], sampling: SamplingConfig, prompt_seeds: list[int] | None = None
    ) -> Rollout:
        """``engine.generate``, made safe for engines that can hold other weights than the trainer's.

        A served engine (:class:`~logra_pl.rollout.remote.RemoteEngine`) refuses to generate from weights other
        than the ones the trainer expects — a lost update, a restarted engine — with
        :class:`~logra_pl.errors.StaleEngineError`. Every rank then agrees (one all-reduce) that a repair is due,
        the full weights are resent (gathered on all ranks, sent by rank 0) and the call is repeated; each repair
        is counted in ``sync/engine_resyncs``. Engines that cannot go stale are called directly.
        """
        engine = self.engine
        if not getattr(engine, "can_go_stale", False):
            return engine.generate(prompts, sampling, prompt_seeds=prompt_seeds)
        last: StaleEngineError | None = None
        for _ in range(3):
            self.ensure_engine_current()
            rollout = None
            try:
                rollout = engine.generate(prompts, sampling, prompt_seeds=prompt_seeds)
            except StaleEngineError as err:  # the engine marked itself stale; every rank hears of it below
                last = err
            if not self._any_rank(rollout is None):
                return rollout
        raise StaleEngineError(f"engines stayed out of sync after 3 full resyncs (last: {last})")

    def ensure_engine_current(self) -> None:
        """Resend the full weights when any rank knows an engine to be stale (collective on all ranks)."""
        if self._any_rank(not self.engine.check_current()):
            first = getattr(self.engine, "expected", "") is None  # never synced: a first sync, not a repair
            stale = ", ".join(sorted(getattr(self.engine, "stale", ()))) or "an engine"
            self.sync_engine(full=True)
            if not first:
                self.engine_resyncs += 1
                if self._trainer is None or self.trainer.is_global_zero:
                    log.warning("%s held other weights than the trainer: full weights resent", stale)

    def _any_rank(self, flag: bool) -> bool:
        """``flag`` OR-ed over the training processes (one all-reduce; none with one process)."""
        trainer = self._trainer
        if trainer is None or trainer.world_size <= 1:
            return bool(flag)
        return bool(trainer.strategy.reduce_boolean_decision(bool(flag), all=False))

    def make_step_context(self, items: list[dict[str, Any]]) -> StepContext:
        """Rollout → rewards → advantages → pre-update trainer log-probs."""
        rs = self.rollout_settings
        prompts = self.encode_prompts(items)
        sampling = SamplingConfig(
            n=rs.responses_per_prompt,
            temperature=rs.temperature,
            top_p=rs.top_p,
            max_new_tokens=rs.max_new_tokens,
            seed=self._sampling_seed("train"),
        )
        # One seed per prompt (from its first user message — a reasoning-gym item's question): a prompt's responses
        # do not depend on batch or rank layout.
        seeds = [self._sampling_seed("train", prompt_key(it)) for it in items]
        try:
            rollout = self.generate_rollout(prompts, sampling, prompt_seeds=seeds)
        except PolicyDivergedError as err:
            raise PolicyDivergedError(f"policy diverged before update {self.global_step + 1}: {err}") from None
        rewards = self.score(rollout, items)
        advantages = self.baseline.advantages(rewards, self._all_reduce_sum, groups=rollout.prompt_index)
        packed = pack_responses(rollout.prompt_ids, rollout.response_ids, self.tokenizer.pad_token_id)
        t_logp = rs.temperature if rs.temperature > 0 else 1.0
        logp_trainer = self.trainer_logprobs(packed, t_logp)
        logp_rollout = torch.zeros_like(packed.response_mask)
        for b, lp in enumerate(rollout.logprobs):
            logp_rollout[b, : len(lp)] = torch.tensor(lp)
        return StepContext(
            update_index=self.global_step,
            items=items,
            rollout=rollout,
            rewards=rewards,
            advantages=advantages,
            packed=packed,
            logp_rollout=logp_rollout,
            logp_trainer=logp_trainer,
            temperature=t_logp,
        )

    # ---------------------------------------------------------------------------------------- training
    def training_step(self, batch: list[dict[str, Any]], batch_idx: int) -> None:
        """One rollout and its update(s): one for REINFORCE+TIS, ``epochs × minibatches`` for PPO."""
        t0 = time.perf_counter()
        ctx = self.make_step_context(batch)
        self.step_context = ctx
        t_rollout = time.perf_counter() - t0
        plan = self.loss_config.plan(len(ctx.rollout), self._sampling_seed("ppo"))  # one update, or PPO's several
        t_train = t_update = 0.0
        losses, norms = [], []
        for part in plan:
            loss, dt_train, dt_update, norm = self._update(ctx, part)
            losses.append(loss)
            norms.append(norm)
            t_train += dt_train
            t_update += dt_update
        step_s = time.perf_counter() - t0
        lengths = ctx.packed.lengths
        metrics = {
            "train/reward_mean": float(ctx.rewards.mean()),
            "train/baseline": self.baseline.value,
            "train/advantage_mean": float(ctx.advantages.mean()),
            "train/advantage_std": float(ctx.advantages.std()) if len(ctx.advantages) > 1 else 0.0,
            "train/response_length": float(lengths.float().mean()),
            "train/truncation_rate": float(sum(ctx.rollout.truncated)) / max(len(ctx.rollout), 1),
            "train/loss": sum(losses) / len(losses),
            "train/update_norm": norms[-1],
            "time/rollout_s": t_rollout,
            "time/train_s": t_train,
            "time/update_s": t_update,
            "time/tokens_per_s": ctx.rollout.num_response_tokens / max(step_s, 1e-9),
            "time/step_s": step_s,
            "verifier/errors": float(self.scorer.errors),
            "verifier/timeouts": float(self.scorer.timeouts),
            "verifier/long_answers": float(self.scorer.long_answers),
        }
        for name, value in self.scorer.last_components.items():
            metrics[f"reward/{name}"] = value
        if getattr(self.engine, "can_go_stale", False):
            metrics["sync/engine_resyncs"] = float(self.engine_resyncs)
        metrics["guard/rejected_updates"] = float(self.rejected_updates)
        metrics["guard/relative_update"] = (
            self.sketcher.last_relative_update if self.sketcher is not None else self.last_relative_update
        )
        if self.sketcher is not None:
            metrics["logra/skipped_updates"] = float(self.sketcher.num_skipped)
            metrics["logra/merge_s"] = self.optimizers().optimizer.last_merge_s
        metrics.update(getattr(self.trainer.strategy, "stats", {}))  # LoGRAStrategy: all-reduce bytes and time
        optimizer = self.optimizers().optimizer if self.optimizer_name != "logra" else None
        metrics["memory/persistent_state_bytes"] = float(
            memory_report(self.policy, optimizer=optimizer, sketcher=self.sketcher).persistent
        )
        for name, (num, den) in ctx.loss_stats.items():
            metrics[f"train/{name}"] = num / den if den else 0.0
        ctx.metrics.update(metrics)
        bs = len(ctx.rollout)
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=bs)
        self.log("reward", metrics["train/reward_mean"], prog_bar=True, logger=False, batch_size=bs)
        self.log("step_s", step_s, prog_bar=True, logger=False, batch_size=bs)

    def _update(self, ctx: StepContext, rows: list[int]) -> tuple[float, float, float, float]:
        """Microbatched loss/backward over ``rows``, then one optimizer step and the engine sync."""
        loss_fn = self.loss_config
        opt = self.optimizers()
        t0 = time.perf_counter()
        # The token count of the whole update, over all ranks: microbatch and rank losses add up to the token mean.
        num_tokens = int(self._all_reduce_sum(ctx.packed.response_mask[rows].sum().double().reshape(1)).item())
        # REINFORCE+TIS weighs by π/π_rollout (capped); PPO by π/π_old with π_old the pre-update trainer.
        reference = ctx.logp_rollout if loss_fn.reference == "rollout" else ctx.logp_trainer
        total = 0.0
        trim = self.max_tokens_per_microbatch is not None
        for mb in self._microbatches(rows, ctx.packed):
            packed = _select(ctx.packed, mb, trim).to(self.device)
            logp = response_logprobs(self.policy, packed, ctx.temperature)
            adv = ctx.advantages[mb].to(self.device)
            weights = loss_fn.weights(packed.lengths)
            ref = reference[mb].to(self.device)
            loss = loss_fn(logp, ref, adv, packed.response_mask, max(num_tokens, 1), weights)
            self.manual_backward(loss)
            total += float(loss.detach())
            for name, (num, den) in loss_fn.stats(logp.detach(), ref, packed.response_mask).items():
                acc = ctx.loss_stats.setdefault(name, [0.0, 0.0])
                acc[0] += num
                acc[1] += den
        t1 = time.perf_counter()
        if self.optimizer_name != "logra":  # dense AdamW, or AdamW on LoRA adapters
            rejected = self._guard_adamw(opt.optimizer)
            opt.step()
            opt.zero_grad(set_to_none=True)
            norm = 0.0 if rejected else adamw_update_norm(opt.optimizer)  # from the state: no copy of the weights
            self.lr_schedulers().step()
        else:
            inner = opt.optimizer
            inner.max_relative_update = self.guard.max_update_ratio if self.guard.enabled else None
            opt.step()
            rejected = self.sketcher.last_skip_reason if inner.last_payload is None else None
            norm = 0.0 if rejected else math.sqrt(self.sketcher.last_update_sq_norm)
            if inner.last_payload is not None:
                ctx.payloads.append(inner.last_payload)
        self._after_update(rejected)
        if not self.external_sync:
            self.sync_engine()
        return total, t1 - t0, time.perf_counter() - t1, norm

    def _guard_adamw(self, optimizer: torch.optim.Optimizer) -> str | None:
        """Preview the AdamW step; if the guard rejects it, drop the gradients so ``step()`` changes nothing."""
        if not self.guard.enabled:
            return None
        upd, w, bad = self._all_reduce_sum(torch.tensor(adamw_step_preview(optimizer), dtype=torch.float64)).tolist()
        self.last_relative_update = math.sqrt(upd / w) if w > 0 else (0.0 if upd == 0 else math.inf)
        if bad:
            reason = f"the step would make {int(bad)} weights non-finite"
        elif not math.isfinite(self.last_relative_update):
            reason = "non-finite update (the gradients hold inf/NaN)"
        elif self.last_relative_update > self.guard.max_update_ratio:
            reason = (
                f"update size ‖ΔW‖/‖W‖ = {self.last_relative_update:.3g} exceeds the guard's max_update_ratio "
                f"{self.guard.max_update_ratio:g}"
            )
        else:
            return None
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None  # torch's AdamW leaves parameters without a gradient (and their state) untouched
        return reason

    def _after_update(self, rejected: str | None) -> None:
        """Count an update that was not applied, say so on the console, and stop a run that keeps diverging."""
        if rejected is None:
            self.rejected_in_a_row = 0
            return
        self.rejected_updates += 1
        self.rejected_in_a_row += 1
        update = self.global_step  # the optimizer step has run: this update's 1-based index
        limit = self.guard.max_consecutive
        if self.trainer.is_global_zero:
            log.warning(
                "update %d not applied (weights unchanged): %s [%d in a row; the run stops at %d]",
                update,
                rejected,
                self.rejected_in_a_row,
                limit,
            )
        if self.rejected_in_a_row >= limit:
            knob = "lr" if self.optimizer_name != "logra" or self.logra_config.step_mode == "lr" else "update_ratio"
            ckpt = getattr(self.trainer.checkpoint_callback, "last_model_path", "") or "the last checkpoint"
            raise PolicyDivergedError(
                f"policy diverged at update {update}: {limit} updates in a row were not applied (last: {rejected}). "
                f"Lower {knob} or enable PredictedKLControl; no rejected update reached the weights, and {ckpt} "
                "holds the last good ones"
            )

    def sync_engine(self, full: bool = False) -> None:
        """Bring the engine to the trainer's weights: the merged payload (LoGRA) or the changed tensors."""
        if self.engine is None or self.policy is None:
            return
        if self.engine.shares_weights:
            return  # the engine generates with the trainer's weights: always current
        if self.engine.place(self.device):
            full = True  # the engine moved: resend everything
        wire = getattr(self.engine, "wire_dtype", None)
        if full:
            if self.optimizer_name == "lora":  # adapters merged into plain matrices, as engines hold them
                self.engine.load_weights(MergedState(self.policy, dtype=wire))
            else:
                self.engine.load_weights(GatheredState(self.policy.state_dict(), dtype=wire))
            return
        if self.optimizer_name == "logra":
            payload = self.optimizers().optimizer.last_payload
            if payload is not None:
                self.engine.apply_payload(payload)
        else:
            self.engine.load_weights(cast_floats(self.trained_tensors(), wire))

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every tensor of the policy, gathered whole (FSDP shards are all-gathered)."""
        if self.optimizer_name == "lora":  # LoRA runs export and sync the merged matrices, not adapters
            return dict(MergedState(self.policy))
        return dict(GatheredState(self.policy.state_dict()))

    def trained_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors an update changes: LoGRA's target matrices, the dense optimizer's parameters, or LoRA's
        merged matrices (under their plain names, as an engine holds them)."""
        if self.optimizer_name == "lora":
            return merged_tensors(self.policy)
        if self.optimizer_name == "logra":
            targets = select_targets(self.policy, self.logra_config.targets)
            params = {f"{n}.weight": m.weight for n, m in targets.items()}
            params.update(self.sketcher.dense if self.sketcher is not None else {})
        else:
            params = {n: p for n, p in self.policy.named_parameters() if p.requires_grad}
        return {n: full_tensor(p).detach() for n, p in params.items()}

    # -------------------------------------------------------------------------------------- validation
    def on_validation_epoch_start(self) -> None:
        """Per-task pass@1 when the evaluation problems mix tasks (their macro mean is the RG-Hard score)."""
        items = getattr(self._datamodule(), "eval_items", None) or []
        tasks = sorted({item_task(it) for it in items})
        if len(tasks) > 1 and (self.val_tasks is None or self.val_tasks.tasks != tuple(tasks)):
            self.val_tasks = MacroPassAt1(tasks).to(self.device)
            self.val_task_rewards = MacroMean(tasks, "reward").to(self.device)
        self._val_samples = []

    def validation_step(self, batch: list[dict[str, Any]], batch_idx: int) -> None:
        """Sample ``val_responses`` per problem at the validation settings; accumulate reward and pass@j."""
        rs = self.rollout_settings
        sampling = SamplingConfig(
            n=rs.val_responses,
            temperature=rs.val_temperature,
            top_p=rs.val_top_p,
            max_new_tokens=rs.max_new_tokens,
            seed=self._sampling_seed(f"val{batch_idx}"),
        )
        rollout = self.generate_rollout(self.encode_prompts(batch), sampling)
        rewards = self.score(rollout, batch)
        correct = (rewards >= 1.0).reshape(len(batch), rs.val_responses)  # rows are grouped by prompt
        self.val_pass.update(correct.to(self.device))
        if self.val_tasks is not None and self.val_task_rewards is not None:
            tasks = [item_task(it) for it in batch]
            self.val_tasks.update(correct.to(self.device), tasks)
            self.val_task_rewards.update(rewards.reshape(len(batch), rs.val_responses), tasks)
        self.val_reward.update(rewards.float())
        self.log("val/reward_mean", self.val_reward, on_step=False, on_epoch=True, batch_size=len(rewards))
        if batch_idx == 0:
            texts = self.tokenizer.batch_decode(rollout.response_ids[: 4 * rs.val_responses], skip_special_tokens=True)
            for k, text in enumerate(texts[:: rs.val_responses][:4]):
                question = prompt_key(batch[k])
                self._val_samples.append((question, text, float(rewards[k * rs.val_responses])))

    def on_validation_epoch_end(self) -> None:
        """Log ``val/pass@j`` (and per-task pass@1 with its macro mean), then a text panel of samples."""
        if self.val_pass.update_count == 0:
            return
        out = {f"val/{name}": value for name, value in self.val_pass.compute().items()}
        for metric in (self.val_tasks, self.val_task_rewards):
            if metric is not None and metric.update_count:
                out |= {f"val/{name}": value for name, value in metric.compute().items()}
                metric.reset()
        self.val_pass.reset()
        self.log("val/pass@1", out.pop("val/pass@1"), prog_bar=True)
        if out:
            self.log_dict(out)
        self._log_samples()

    def _log_samples(self) -> None:
        """A few prompt / response / reward rows as a TensorBoard text panel (``val/samples``)."""
        logger = self.logger
        experiment = getattr(logger, "experiment", None) if logger is not None else None
        if not self._val_samples or not self.trainer.is_global_zero or not hasattr(experiment, "add_text"):
            return
        rows = ["| prompt | response | reward |", "| --- | --- | --- |"]
        for question, text, reward in self._val_samples:
            cells = [c.replace("|", "\\|").replace("\n", " ")[:300] for c in (question, text)]
            rows.append(f"| {cells[0]} | {cells[1]} | {reward:.2f} |")
        experiment.add_text("val/samples", "\n".join(rows), global_step=self.global_step)

    # -------------------------------------------------------------------------------------- checkpoint
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The module's own state (the rest is in the optimizer state) and the run's settings, for honest resumes."""
        checkpoint["logra_pl"] = {
            "format": CHECKPOINT_FORMAT,
            "optimizer": self.optimizer_name,
            "baseline": self.baseline.state_dict(),
            "verifier_errors": self.scorer.errors,
            "scoring": self.scorer.state_dict(),
            "rejected_updates": self.rejected_updates,
            "rejected_in_a_row": self.rejected_in_a_row,
            "settings": resume.plain(self.hparams),
            "run_config": self.run_config,  # the CLI's resolved config (None outside the CLI)
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint written under structurally different settings; restore the module's own state.

        Runs before Lightning loads the optimizer state, so an AdamW checkpoint resumed as LoGRA (or the reverse)
        gets this message, not a ``KeyError`` from deep inside ``load_state_dict``.
        """
        state = checkpoint.get("logra_pl") or {}
        saved_kind = state.get("optimizer") or _optimizer_kind(checkpoint.get("optimizer_states") or [])
        if saved_kind is not None and saved_kind != self.optimizer_name:
            raise ResumeMismatchError(
                resume.mismatch_message([("model.optimizer", saved_kind, self.optimizer_name)], self._ckpt_path_hint())
            )
        saved = state.get("settings") or checkpoint.get("hyper_parameters")
        if saved is not None and not self.resume_checked:  # the CLI already compared (and printed the changes)
            resume.check_resume({"model": saved}, {"model": self.hparams}, self._ckpt_path_hint())
        if state:
            self.baseline.load_state_dict(state["baseline"])
            self.scorer.errors = int(state.get("verifier_errors", 0))
            if "scoring" in state:
                self.scorer.load_state_dict(state["scoring"])
            self.rejected_updates = int(state.get("rejected_updates", 0))
            self.rejected_in_a_row = int(state.get("rejected_in_a_row", 0))

    def _ckpt_path_hint(self) -> str | None:
        trainer = self._trainer
        return None if trainer is None else getattr(trainer, "ckpt_path", None)

    # ------------------------------------------------------------------------------------------ console
    def configure_callbacks(self) -> list[pl.Callback]:
        """Show progress in updates and an honest model summary (replacing Lightning's defaults of those kinds)."""
        trainer = self._trainer
        out: list[pl.Callback] = []
        for cb in trainer.callbacks if trainer is not None else []:
            if type(cb) is TQDMProgressBar:
                out.append(UpdateProgressBar(refresh_rate=cb.refresh_rate, leave=cb._leave))
            elif type(cb) is RichProgressBar:
                out.append(RichUpdateProgressBar(refresh_rate=cb.refresh_rate, leave=cb._leave, theme=cb.theme))
            elif type(cb) is ModelSummary:
                out.append(LoGRAModelSummary(max_depth=cb._max_depth))
            elif type(cb) is RichModelSummary:
                out.append(LoGRARichModelSummary(max_depth=cb._max_depth))
        return out

    def trained_parameter_count(self) -> int:
        """Parameters the optimizer changes: LoGRA's sketched matrices, or AdamW's parameters."""
        if self.policy is None:
            return 0
        if self.sketcher is not None:
            return sum(m.module.weight.numel() for m in self.sketcher.matrices.values())
        return sum(p.numel() for p in self.policy.parameters() if p.requires_grad)

    def training_report(self) -> str:
        """One line on what this run trains and the optimizer state it holds for it."""
        if self.policy is None:
            return ""
        n = self.trained_parameter_count()
        if self.optimizer_name == "lora":
            grad = sum(p.numel() * p.element_size() for p in self.policy.parameters() if p.requires_grad)
            cfg = self.lora_config
            return (
                f"LoRA trains {_count(n)} adapter parameters (rank {cfg.rank}, alpha {cfg.alpha:g}) on "
                f"{len(lora_layers(self.policy))} matrices ({', '.join(self.logra_config.targets)}); the base weights "
                f"are frozen. Its state: {_bytes(grad)} of adapters, as much again of gradients and "
                f"{_bytes(2 * grad)} of Adam moments"
            )
        if self.sketcher is None:
            grad = sum(p.numel() * p.element_size() for p in self.policy.parameters() if p.requires_grad)
            what = "every parameter" if self.adamw_config.train_all else "the attention/MLP matrices"
            return (
                f"dense AdamW trains {_count(n)} parameters ({what}): {_bytes(grad)} of gradients and "
                f"{_bytes(2 * grad)} of Adam moments"
            )
        cfg = self.logra_config
        mats = self.sketcher.matrices.values()
        sketch = sum(m.sketch.numel() * m.sketch.element_size() for m in mats)
        proj = sum(m.projection.numel() * m.projection.element_size() for m in mats)
        rows = sum(v.numel() * v.element_size() for v in self.sketcher.row_stats.values())
        dense = sum(m.module.weight.numel() * 4 for m in mats)
        basis = "refreshed every update" if cfg.refresh else "fixed"
        return (
            f"LoGRA trains {_count(n)} parameters in {len(self.sketcher.matrices)} matrices "
            f"({', '.join(cfg.targets)}) through rank-{cfg.rank} sketches ({cfg.distribution} projections, {basis}); "
            f"everything else is frozen. Its state: {_bytes(sketch)} of sketches + {_bytes(proj)} of projections + "
            f"{_bytes(rows)} of row statistics, in place of {_bytes(dense)} of fp32 dense gradients "
            f"(+ {_bytes(2 * dense)} of Adam moments)"
        )


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return str(n)


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _optimizer_kind(states: list[dict[str, Any]]) -> str | None:
    """``logra`` / ``adamw`` from a checkpoint's optimizer state (checkpoints that predate the recorded kind)."""
    if not states:
        return None
    return "logra" if "logra" in states[0] else ("adamw" if "param_groups" in states[0] else None)


def item_task(item: dict[str, Any]) -> str:
    """The task an item belongs to: its ``task`` (the item schema), a reasoning-gym ``source_dataset``, or ``all``."""
    task = item.get("task") or (item.get("metadata") or {}).get("source_dataset")
    return str(task) if task else "all"


def _select(packed: PackedResponses, rows: list[int], trim: bool = False) -> PackedResponses:
    """Rows of a packed batch. Columns are kept (all-padding tail columns are harmless), or with ``trim`` the
    input columns beyond the longest selected row are dropped (rows are right-padded; response columns stay)."""
    idx = torch.tensor(rows, dtype=torch.long)
    out = PackedResponses(*(getattr(packed, f)[idx] for f in packed.__dataclass_fields__))
    if trim:
        width = max(int(out.attention_mask.sum(dim=1).max()), 1)
        out = dataclasses.replace(
            out,
            input_ids=out.input_ids[:, :width],
            attention_mask=out.attention_mask[:, :width],
            position_ids=out.position_ids[:, :width],
        )
    return out
