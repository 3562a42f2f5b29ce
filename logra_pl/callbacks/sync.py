"""``PolicySync``: ship each update to the rollout engine, measure it, and verify it (algorithm.md §9).

``factors`` sends what LoGRA merged — per matrix the bf16 ``U·α`` and a seed, ``O(d_out·r)`` bytes — and the
engine rebuilds ``P`` and applies the same merge. ``full`` sends every changed tensor, as dense RL frameworks do.
Sync bugs are silent (an engine that keeps old weights, a stale prefix cache still samples fluent text), so every
``verify_every`` updates the callback compares the engine's greedy log-probs with the trainer's on a fixed probe
whose prompts are longer than one KV block; beyond ``tolerance`` it resyncs the full weights and says so.

The module's engine link is the one sender of every update (right after the step, before any callback runs); this
callback configures what it sends (:meth:`~logra_pl.train.engine_link.EngineLink.configure`), measures it and
verifies it.
"""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from logra_pl.callbacks.contract import require_view
from logra_pl.rollout.base import SamplingConfig
from logra_pl.runtime import compat
from logra_pl.train.batching import padded_logprobs
from logra_pl.train.logprobs import pack_responses


class PolicySync(pl.Callback):
    """Owns the engine's weight updates for a :class:`~logra_pl.module.LoGRAPolicyModule` run.

    Logged per update: ``sync/payload_bytes`` (bytes sent, over all engines), ``sync/full_bytes`` (what sending
    the changed matrices in bf16 to the same engines would take — the dense frameworks' cost, for comparison),
    ``sync/seconds``, and on verification ``sync/max_logprob_diff`` and ``sync/full_resyncs`` (running count).
    With asynchronous rollouts (``rollout.max_staleness``) an update is sent in order with the engine's other
    calls on the pipeline's worker; its bytes and seconds are logged at the first update after it was applied, and
    a verification waits for every call before it (one pipeline bubble every ``verify_every`` updates).

    Arguments:
        mode: ``"factors"`` (LoGRA payloads; needs ``optimizer="logra"``) or ``"full"`` (changed tensors).
        verify_every: verify after every N updates; 0 never.
        tolerance: largest accepted |engine − trainer| log-prob on the probe; fp32 engines agree to ~1e-5,
            bf16 engines need a looser value (~0.1).
        probe_lengths: token lengths of the probe prompts (keep some above the engine's KV block size).
        probe_new_tokens: greedy tokens generated and compared per probe prompt.
        resync_on_mismatch: do a full resync when verification fails (else only log and warn).
        wire_dtype: dtype of the tensors ``full`` mode sends: ``auto`` follows the engine (bf16 to a bf16 engine,
            as dense frameworks send; the trainer's dtype to a master copy), or ``float32``/``bfloat16``/``float16``.
    """

    # What it reads of the policy contract (docs/extending.md), checked at setup.
    READS = ("policy", "tokenizer", "method", "step_context", "rollout_settings", "link", "sampler", "passes")

    def __init__(
        self,
        mode: Literal["factors", "full"] = "factors",
        verify_every: int = 50,
        tolerance: float = 1e-3,
        probe_lengths: tuple[int, ...] | list[int] = (48, 160, 320),
        probe_new_tokens: int = 8,
        resync_on_mismatch: bool = True,
        wire_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto",
    ) -> None:
        if mode not in ("factors", "full"):
            raise ValueError(f"unknown sync mode {mode!r}: use 'factors' or 'full'")
        if verify_every < 0:
            raise ValueError(f"verify_every must be >= 0, got {verify_every}")
        if tolerance <= 0:
            raise ValueError(f"tolerance must be > 0, got {tolerance}")
        if not probe_lengths or min(probe_lengths) < 1:
            raise ValueError(f"probe_lengths must be positive token counts, got {probe_lengths}")
        self.mode = mode
        self.verify_every = verify_every
        self.tolerance = tolerance
        self.probe_lengths = [int(n) for n in probe_lengths]
        self.probe_new_tokens = probe_new_tokens
        self.resync_on_mismatch = resync_on_mismatch
        if wire_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unknown wire_dtype {wire_dtype!r}: use auto, float32, bfloat16 or float16")
        self.wire_dtype = wire_dtype
        self.probe: list[list[int]] | None = None
        self.full_resyncs = 0
        self.syncs = 0
        self.last_diff: float | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        require_view(pl_module, "PolicySync", self.READS)
        if self.mode == "factors" and not pl_module.method.ships_factors:
            raise ValueError(
                "PolicySync(mode='factors') ships LoGRA factor payloads, but the module's update method "
                f"({type(pl_module.method).__name__}) changes tensors without factors: use mode='full'"
            )
        if pl_module.rollout_settings.share_weights:
            raise ValueError(
                "PolicySync has nothing to send: rollout.share_weights makes the engine generate with the trainer's "
                "weights; remove PolicySync or set share_weights to false"
            )

    # ----------------------------------------------------------------------------------------------- sync
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """From the first update on, the link sends each update in this callback's mode and wire dtype, and keeps
        what it sent for :meth:`on_train_batch_end` to measure."""
        wire = "engine" if self.wire_dtype == "auto" else getattr(torch, self.wire_dtype)
        pl_module.link.configure("factors" if self.mode == "factors" else "tensors", wire, measured=True)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """The link goes back to its method's own defaults, unmeasured (a module may be fitted again without it)."""
        if getattr(pl_module, "link", None) is not None:
            pl_module.link.configure()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        ctx, link = pl_module.step_context, pl_module.link
        if ctx is None or link is None:
            return
        if self.probe is None and self.verify_every:
            self.probe = self.build_probe(pl_module, ctx.items)
        engine = link.engine
        # What the link sent of this step (at the step's end, in order with every other engine call: then, or after
        # the requests already on the asynchronous worker); an asynchronous send counts once the worker applied it.
        sent, seconds = link.shipped()
        self.syncs += 1
        checks: dict[str, float] = {}
        if self.verify_every and (self.syncs == 1 or self.syncs % self.verify_every == 0):
            checks = self.verify_and_repair(pl_module)
        metrics = {
            "sync/payload_bytes": sent,
            "sync/full_bytes": float(self.full_bf16_bytes(pl_module) * engine.receivers),
            "sync/seconds": seconds,
            "sync/full_resyncs": float(self.full_resyncs),
        }
        bs = len(ctx.rollout)
        for key, value in metrics.items():
            pl_module.log(key, value, on_step=True, on_epoch=False, batch_size=bs)
        # Verification runs every N updates: write it to the loggers at this step only (a value logged through
        # ``self.log`` would be repeated at every following step of the epoch).
        if checks and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(checks, step=trainer.global_step)
        ctx.metrics.update(metrics | checks)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The last update is verified too, whatever ``verify_every`` is: a run never ends on unchecked weights."""
        if not self.verify_every or self.probe is None or pl_module.link is None or self.syncs == 0:
            return
        if self.syncs == 1 or self.syncs % self.verify_every == 0:
            return  # this update was verified in on_train_batch_end
        checks = self.verify_and_repair(pl_module)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(checks, step=trainer.global_step)

    def verify_and_repair(self, pl_module: Any) -> dict[str, float]:
        """Compare engine and trainer on the probe; on a mismatch beyond tolerance, full resync and re-check."""
        diff = self.max_logprob_diff(pl_module)
        out = {"sync/max_logprob_diff": diff}
        if diff > self.tolerance:
            if self.resync_on_mismatch:
                pl_module.link.sync_full()
                self.full_resyncs += 1
                after = self.max_logprob_diff(pl_module)
                rank_zero_warn(
                    f"PolicySync: engine and trainer log-probs differed by {diff:.3g} (> {self.tolerance:g}) at "
                    f"update {pl_module.global_step}; full weights resent, now {after:.3g}"
                )
                out["sync/max_logprob_diff_after_resync"] = after
            else:
                rank_zero_warn(f"PolicySync: engine and trainer log-probs differ by {diff:.3g} (> {self.tolerance:g})")
        self.last_diff = diff
        return out

    # ---------------------------------------------------------------------------------------------- probe
    def build_probe(self, pl_module: Any, items: list[dict[str, Any]]) -> list[list[int]]:
        """Fixed probe prompts: this run's first prompts, concatenated and cut to ``probe_lengths`` tokens."""
        stream: list[int] = []
        for ids in pl_module.sampler.encode(items):
            stream += ids
        if not stream:
            raise ValueError("PolicySync needs non-empty prompts to build its probe")
        limit = int(getattr(pl_module.link.engine, "context_limit", 1 << 30)) - self.probe_new_tokens
        probe = []
        for k, n in enumerate(self.probe_lengths):
            n = min(n, limit)
            reps = -(-(n + k) // len(stream))
            probe.append((stream * (reps + 1))[k : k + n])  # different starts, so prompts share no prefix
        return probe

    @torch.no_grad()
    def max_logprob_diff(self, pl_module: Any) -> float:
        """Max |engine − trainer| log-prob over the probe's greedy response tokens."""
        if self.probe is None:
            raise RuntimeError("the probe is built at the first training batch; verify after it")
        sampling = SamplingConfig(temperature=0.0, max_new_tokens=self.probe_new_tokens)
        rollout = pl_module.sampler.generate(self.probe, sampling)
        packed = pack_responses(
            rollout.prompt_ids, rollout.response_ids, pl_module.tokenizer.pad_token_id, rollout.response_masks
        )
        trainer_lp = pl_module.passes.logprobs(packed, 1.0).to(torch.float64)
        engine_lp = padded_logprobs(rollout.logprobs, trainer_lp)
        mask = packed.response_mask.to(torch.bool)
        diff = (engine_lp - trainer_lp).abs()[mask].max()
        trainer = compat.trainer_of(pl_module)
        if trainer is not None and trainer.world_size > 1:
            # Every rank probes its own engine; they must agree on whether to resync (a collective).
            diff = trainer.strategy.reduce(diff.to(pl_module.device), reduce_op="max")
        return float(diff)

    @staticmethod
    def full_bf16_bytes(pl_module: Any) -> int:
        """Bytes of the tensors an update changes, in bf16 (global shapes; nothing is gathered)."""
        return 2 * pl_module.method.changed_numel(pl_module.policy)

    # ---------------------------------------------------------------------------------------- checkpoint
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"full_resyncs": self.full_resyncs, "syncs": self.syncs, "probe": self.probe}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.full_resyncs = int(state_dict.get("full_resyncs", 0))
        self.syncs = int(state_dict.get("syncs", 0))
        self.probe = state_dict.get("probe")
