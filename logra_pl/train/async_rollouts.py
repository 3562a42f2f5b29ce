"""Asynchronous rollouts: the next updates' batches sampled while this update trains (``rollout.max_staleness: k``),
bounded by staleness and by the KL merged since (algorithm.md §12). The :class:`~logra_pl.train.sampler.Sampler` runs
it and gives it the job that samples a batch; it reads the Trainer's position through the ranks.

What the sampler asks of it, per training step of batch ``b`` (the run's ``b``-th batch):

1. :meth:`AsyncRollouts.rollout` — the rollout of ``b``, sampled by version ``max(e, b − k)`` (``e``: the first
   batch of the epoch). Batches up to ``b + k`` not yet requested are requested now (an epoch's start: the
   prefill). If the KL merged since the batch's version exceeds ``max_stale_kl``, the batch is dropped and
   sampled again by the current weights (``async/dropped``).
2. the update; its weight change goes to the engine through the same ordered worker (``EngineLink.sync``);
3. :meth:`AsyncRollouts.finish` (after the callbacks) — records the batch's KL, ``Σ`` of its updates' entries in
   ``StepContext.update_kls`` (``α²·predicted`` from PredictedKLControl, replaced by the realized KL when it
   calibrates; an update the guard then rejected still counts as proposed: conservative), and requests batch
   ``b + k + 1``, sampled by the weights after update ``b``.

Future batches' prompts come from the training loader itself (``PromptLoader.batch_at``): the order is a function
of the seed and the epoch, and the batch Lightning then delivers is checked to be the one that was sampled.
Sampling seeds are keyed by the batch index (the synchronous path keys them by ``global_step``, equal for one
update per batch), since a request is made before the updates in between.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from logra_pl.data.schema import prompt_key
from logra_pl.errors import ConfigError, StaleEngineError
from logra_pl.rollout.base import Rollout
from logra_pl.rollout.pipeline import RolloutPipeline
from logra_pl.rollout.staleness import StaleKL, StalenessSchedule
from logra_pl.runtime import compat
from logra_pl.runtime.ranks import Ranks
from logra_pl.train.engine_link import EngineLink

# The sampler's job for one batch: given its prompts and index, their keys and the engine call that samples them.
Job = Callable[[list[dict[str, Any]], int], tuple[list[str], Callable[[], Rollout]]]


class AsyncRollouts:
    """The trainer's side of the pipeline: which batches to request and when, and the KL ledger.

    Arguments:
        link: the engine link (its engine, and the repair of a stale one).
        ranks: the training processes (and the Trainer: the loader's batches and the run's position).
        job: the sampler's job for a batch (:data:`Job`).
        max_staleness: ``k`` (≥ 1).
        max_stale_kl: ``δ``, or None for a staleness bound only.
    """

    def __init__(
        self, link: EngineLink, ranks: Ranks, job: Job, max_staleness: int, max_stale_kl: float | None
    ) -> None:
        self.link, self.ranks, self.job = link, ranks, job
        self.schedule = StalenessSchedule(max_staleness)
        self.pipeline = RolloutPipeline(StaleKL(max_stale_kl, window=max(1, max_staleness)))
        self.epoch_start = 0
        self.finished = -1  # the last batch whose update was recorded and whose follow-up request was made
        self.last: tuple[int, float] = (0, 0.0)  # the last batch's staleness and stale KL
        self.restart = 0  # the batch the pipeline last started afresh at (a served engine repaired): no older version

    # --------------------------------------------------------------------------------------------- setup
    @staticmethod
    def check(engine: Any, trainer: Any) -> None:
        """Refuse a setting the pipeline cannot run exactly, naming the fix."""
        if engine.shares_weights:
            raise ConfigError(
                "rollout.max_staleness >= 1 with rollout.share_weights: the engine generates with the trainer's own "
                "weights, which the update changes while it generates; set share_weights: false (a private copy)"
            )
        loader = trainer.train_dataloader
        if not hasattr(loader, "batch_at"):
            raise ConfigError(
                f"rollout.max_staleness >= 1 needs a training loader that names future batches (batch_at): "
                f"{type(loader).__name__} does not; build it with logra_pl.data.loaders.prompt_loader"
            )

    def connect(self, trainer: Any) -> None:
        """Several ranks on shared (served) engines: rank 0 sends every weight change, each rank its own requests.
        Each change then waits, on the worker, for a barrier of all ranks' workers (a gloo group of their own, so
        no collective of the trainer's threads interleaves with it): every rank's requests at the old weights have
        been answered. A request that overtakes the change it needs (its rank passed the barrier first) asks the
        engine to wait for that version (``wait_s``, up to ``retry_for_s``)."""
        link = self.link
        if trainer.world_size < 2 or not link.can_go_stale:
            return
        import torch.distributed as dist

        from logra_pl.rollout.protocol import MAX_WAIT_S

        group = dist.new_group(backend="gloo")  # a collective of the main threads, once
        link.before_change = lambda: dist.barrier(group=group)
        settings = getattr(link.engine, "settings", None)
        link.engine.version_wait_s = min(float(getattr(settings, "retry_for_s", MAX_WAIT_S)), MAX_WAIT_S)

    # ---------------------------------------------------------------------------------------------- step
    def rollout(self, items: list[dict[str, Any]]) -> tuple[Rollout, int]:
        """The rollout of the batch being trained and its staleness (updates since the weights that sampled it)."""
        trainer, pipe = self.ranks.trainer, self.pipeline
        batch, in_epoch = compat.batch_position(trainer)
        self.epoch_start = batch - in_epoch
        end = self.epoch_start + int(trainer.num_training_batches)
        for b in self.schedule.prefill(batch, end):  # an epoch's start (or a resume): whatever is not requested yet
            if not pipe.has(b):
                self._request(b, batch)
        entry, rollout = self._take(batch, end)
        version, expected = entry.version, self.schedule.version_of(batch, max(self.epoch_start, self.restart))
        if version != expected:
            raise RuntimeError(f"batch {batch} was sampled by version {version}, the schedule says {expected}")
        if entry.keys != [prompt_key(it) for it in items]:
            raise RuntimeError(
                f"batch {batch}: the prompts sampled ahead are not the batch the loader delivered; the training "
                "loader's order must be a function of its seed and epoch (PromptLoader)"
            )
        stale_kl = pipe.stale_kl.since(version, batch) if version < batch else 0.0
        if not pipe.stale_kl.keeps(version, batch):
            pipe.dropped += 1
            self._request(batch, batch)
            entry, rollout = self._take(batch, end)
            version, stale_kl = entry.version, 0.0
        self.last = (batch - version, stale_kl)
        return rollout, batch - version

    def finish(self, kls: list[float]) -> None:
        """After the batch's update(s) and callbacks: record its KL (``kls``: each update's, as a step controller
        priced it) and request batch ``b + k + 1`` (once)."""
        trainer = self.ranks.trainer
        batch, _ = compat.batch_position(trainer)
        if batch <= self.finished:
            return
        ledger = self.pipeline.stale_kl
        if ledger.max_stale_kl is not None and not kls:
            raise ConfigError(
                "rollout.max_stale_kl needs each update's KL: add PredictedKLControl (callbacks/kl_measure.yaml "
                "measures it without controlling the step), or remove max_stale_kl"
            )
        # An update the controller could not price (NaN) counts as unbounded: every batch spanning it is dropped.
        ledger.record(batch, math.fsum(math.inf if math.isnan(k) else k for k in kls))
        nxt = self.schedule.request_after(batch, self.epoch_start + int(trainer.num_training_batches))
        if nxt is not None and not self.pipeline.has(nxt):
            self._request(nxt, batch + 1)
        self.finished = batch

    def metrics(self) -> dict[str, float]:
        """``async/*`` of the last batch: its staleness and stale KL, drops so far, the trainer's wait for it, and
        the worker's idle seconds since the last batch."""
        pipe, (staleness, stale_kl) = self.pipeline, self.last
        return {
            "async/staleness": float(staleness),
            "async/stale_kl": stale_kl,
            "async/dropped": float(pipe.dropped),
            "async/trainer_wait_s": pipe.wait_s,
            "async/engine_idle_s": pipe.engine_idle_s(),
        }

    def _take(self, batch: int, end: int) -> tuple[Any, Rollout]:
        """``pipeline.take``; a served engine that refused the request (it holds other weights: restarted, an update
        lost) is repaired with the full weights and every requested batch is sampled again by the current weights
        (the pipeline restarts at ``batch``), 3 tries at most, as the synchronous path does."""
        link, pipe, last = self.link, self.pipeline, None
        for _ in range(3):
            taken = None
            try:
                taken = pipe.take(batch)
            except StaleEngineError as err:
                last = err
            if not self.ranks.any(taken is None):  # every rank restarts, or none
                return taken
            pipe.discard()
            pipe.call(lambda: None)  # the worker is idle: nothing is sampled while the engine is repaired
            link.ensure_current()  # full weights (on the worker), counted in sync/engine_resyncs
            self.restart = batch
            for b in self.schedule.prefill(batch, end):
                self._request(b, batch)
        raise StaleEngineError(f"engines stayed out of sync after 3 full resyncs (last: {last})")

    # ---------------------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Every requested batch's rollout (waiting for those in flight) and the KL ledger."""
        self.pipeline.drain()
        return {"max_staleness": self.schedule.max_staleness, "restart": self.restart, **self.pipeline.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["max_staleness"]) != self.schedule.max_staleness:
            raise ConfigError(
                f"the checkpoint's rollouts were sampled with rollout.max_staleness={state['max_staleness']}, this run "
                f"has {self.schedule.max_staleness}: resume with the checkpoint's setting"
            )
        self.pipeline.load_state_dict(state)
        self.restart = int(state.get("restart", 0))
        trainer = self.ranks.trainer
        self.finished = compat.batch_position(trainer)[0] - 1 if trainer is not None else -1

    # -------------------------------------------------------------------------------------------- helpers
    def _request(self, batch: int, version: int) -> None:
        """Sample ``batch`` on the worker after the weight changes submitted so far (they make ``version``)."""
        trainer = self.ranks.trainer
        items = trainer.train_dataloader.batch_at(trainer.current_epoch, batch - self.epoch_start)
        keys, sample = self.job(items, batch)
        self.pipeline.request(batch, version, keys, sample)
