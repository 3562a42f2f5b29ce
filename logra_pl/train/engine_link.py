"""``EngineLink``: the trainer's side of a rollout engine — keeping it on the trainer's weights, and repairing it.

After every update the engine must hold the trainer's weights bit for bit: LoGRA sends the merged factor payload,
other methods the changed tensors, and a full sync every tensor (at the start of training, after the engine moved
device, or to repair). An engine that can go stale (a served one: a lost update, a restart) refuses to generate
from other weights; the link then has every rank agree that a repair is due, resends the full weights and repeats
the call, counting each repair (``sync/engine_resyncs``). What an update changed is built here alone
(:meth:`EngineLink.changes`) and sent from here alone (:meth:`EngineLink.send`), timed and in order with every other
engine call: each step's changes right after the step (:meth:`EngineLink.updated`), every tensor at the start of
training, after the engine moved, and to repair (:meth:`EngineLink.sync_full`). A
:class:`~logra_pl.callbacks.PolicySync` callback configures what a step sends and measures it
(:meth:`EngineLink.configure`, :meth:`EngineLink.shipped`); it sends nothing itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Literal

import torch

from logra_pl.errors import StaleEngineError
from logra_pl.rollout.base import Rollout, RolloutEngine, SamplingConfig, StaleableEngine, SyncReport, cast_floats
from logra_pl.rollout.pipeline import RolloutPipeline
from logra_pl.runtime.ranks import Ranks
from logra_pl.sketch.payload import Payload

log = logging.getLogger(__name__)


# What a sync sends: the update's factor payloads, the tensors an update changes, or every tensor of the policy.
Change = Literal["factors", "tensors", "full"]


def _timed(ship: Callable[[], list[SyncReport]]) -> tuple[list[SyncReport], float]:
    """``ship()`` and its seconds."""
    start = time.perf_counter()
    return ship(), time.perf_counter() - start


class EngineLink:
    """One engine, the method whose updates it receives, and the policy it mirrors.

    Arguments:
        engine: the rollout engine.
        method: the :class:`~logra_pl.methods.UpdateMethod` (what a full or per-update sync sends).
        policy: the trainer's policy.
        ranks: the training processes (their device; every rank agrees on repairs).
    """

    def __init__(self, engine: RolloutEngine, method: Any, policy: torch.nn.Module, ranks: Ranks | None = None) -> None:
        self.engine = engine
        self.method = method
        self.policy = policy
        self.ranks = ranks or Ranks()
        self.change: Change  # what a step sends
        self.wire_dtype: torch.dtype | Literal["engine"] | None  # the dtype of the tensors it sends
        self.sends: list[Future] | None  # the sends a measurer has not read yet; None: nobody measures
        self.resyncs = 0  # full resyncs of engines found stale (lost update, restart)
        self.logged_resyncs = 0  # the count the loggers last received
        self.pipeline: RolloutPipeline | None = None  # asynchronous rollouts: every engine call on its worker
        self.before_change: Callable[[], None] | None = None  # run on the worker before each weight change
        self.configure()  # the method's own form, unmeasured

    def place(self) -> bool:
        """``engine.place``: whether the engine moved (then it needs the full weights); on the worker when there
        is one, after the calls before it."""
        if self.pipeline is not None:
            return self.pipeline.call(self.engine.place, self.ranks.device)
        return self.engine.place(self.ranks.device)

    def submit(self, fn: Callable[..., Any], *args: Any, changes_weights: bool = False, **kwargs: Any) -> Future:
        """Run an engine call after every earlier one: on the asynchronous worker (its Future), or now (a finished
        Future; an error is raised here, as a direct call would). ``changes_weights``: a weight change, which on
        several ranks first waits (on the worker) until every rank's requests at the old weights are answered."""
        if self.pipeline is not None:
            if changes_weights and self.before_change is not None:
                before, call = self.before_change, fn

                def fn(*a: Any, **k: Any) -> Any:
                    before()
                    return call(*a, **k)

            return self.pipeline.submit(fn, *args, **kwargs)
        done: Future = Future()
        done.set_result(fn(*args, **kwargs))
        return done

    @property
    def can_go_stale(self) -> bool:
        """Whether the engine may hold other weights than the trainer expects (it then refuses to generate)."""
        return isinstance(self.engine, StaleableEngine)

    def changes(
        self,
        change: Change,
        payloads: Sequence[Payload | None] = (),
        wire_dtype: torch.dtype | Literal["engine"] | None = "engine",
    ) -> Callable[[], list[SyncReport]]:
        """What an update changed, as the call that sends it to the engine: the factor ``payloads`` (one per update,
        in order; None for an update that merged nothing), or the tensors an update changes, or with ``full`` every
        tensor of the policy — cast to ``wire_dtype`` (``"engine"``: the dtype the engine stores, ``wire_dtype`` of
        the engine). The tensors are taken now; with an asynchronous worker, which sends them later while training
        moves on, they are copies (a full sync's are gathered lazily, one tensor at a time, as the engine reads)."""
        engine = self.engine
        if change == "factors":
            sent = [p for p in payloads if p is not None]
            return lambda: [engine.apply_payload(p) for p in sent]
        wire = getattr(engine, "wire_dtype", None) if wire_dtype == "engine" else wire_dtype
        if change == "full":
            tensors: Any = self.method.full_state(self.policy, dtype=wire)
        else:
            tensors = cast_floats(self.method.trained_tensors(self.policy), wire)
        if self.pipeline is not None:
            tensors = {k: v.detach().clone() for k, v in tensors.items()}
        return lambda: [engine.load_weights(tensors)]

    def configure(
        self,
        change: Change | None = None,
        wire_dtype: torch.dtype | Literal["engine"] | None = "engine",
        measured: bool = False,
    ) -> None:
        """What each step sends from now on: ``change`` (``"factors"`` or ``"tensors"``; None: the method's own),
        its tensors cast to ``wire_dtype``; ``measured``: keep each send for :meth:`shipped` (a sync callback
        configures this; called without arguments, the method's defaults, unmeasured)."""
        if change not in (None, "factors", "tensors"):
            raise ValueError(f"a step sends 'factors' or 'tensors', not {change!r}")
        self.change = change or ("factors" if self.method.ships_factors else "tensors")
        self.wire_dtype = wire_dtype
        self.sends = [] if measured else None

    def updated(self, payloads: Sequence[Payload | None]) -> None:
        """A step was taken (``payloads``: what each of its updates merged, factor methods; None where one merged
        nothing): send its changes to the engine, before anything reads the engine again."""
        future = self.send(self.change, payloads, self.wire_dtype)
        if self.sends is not None:
            self.sends.append(future)

    def shipped(self) -> tuple[float, float]:
        """Bytes and seconds of the sends finished since the last call (every one in a synchronous run; in an
        asynchronous one, those the worker has applied by now); nothing when no measurer asked (:meth:`configure`)."""
        if self.sends is None:
            return 0.0, 0.0
        done = [f for f in self.sends if f.done()]
        self.sends = [f for f in self.sends if not f.done()]
        sent = seconds = 0.0
        for future in done:
            reports, took = future.result()
            sent += sum(r.bytes for r in reports)
            seconds += took
        return sent, seconds

    def sync_full(self) -> None:
        """Bring the engine to the trainer's weights by sending every tensor (after the calls before it, when there is
        an asynchronous worker; its tensors are taken now, on this thread)."""
        self.send("full")

    def flush_resyncs(self, trainer: Any, step: int) -> None:
        """Give the loggers a resync count they have not received (a repair after the last logged step, e.g. the
        final verification's probe), from rank 0."""
        if self.can_go_stale and self.resyncs != self.logged_resyncs and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({"sync/engine_resyncs": float(self.resyncs)}, step=step)
                logger.save()
            self.logged_resyncs = self.resyncs

    def send(
        self,
        change: Change,
        payloads: Sequence[Payload | None] = (),
        wire_dtype: torch.dtype | Literal["engine"] | None = "engine",
    ) -> Future:
        """Send ``change`` (:meth:`changes`) in order with every other engine call: now, or after the requests
        already on the asynchronous worker. A Future of ``(sync reports, seconds)``; an engine that samples with the
        trainer's own weights gets nothing, and one that moved device (a synchronous run) gets every tensor."""
        if self.engine.shares_weights:
            done: Future = Future()
            done.set_result(([], 0.0))
            return done
        if self.pipeline is None and self.engine.place(self.ranks.device):
            change = "full"  # the engine moved: resend everything
        return self.submit(_timed, self.changes(change, payloads, wire_dtype), changes_weights=True)

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, prompt_seeds: list[int] | None = None
    ) -> Rollout:
        """``engine.generate``, made safe for engines that can go stale: repaired and repeated, 3 tries at most."""
        engine, pipe = self.engine, self.pipeline

        def generate() -> Rollout:  # after the weight changes submitted before it, on the worker if there is one
            if pipe is not None:
                return pipe.call(engine.generate, prompts, sampling, prompt_seeds=prompt_seeds)
            return engine.generate(prompts, sampling, prompt_seeds=prompt_seeds)

        if not self.can_go_stale:
            return generate()
        last: StaleEngineError | None = None
        for _ in range(3):
            self.ensure_current()
            rollout = None
            try:
                rollout = generate()
            except StaleEngineError as err:  # the engine marked itself stale; every rank hears of it below
                last = err
            if not self.ranks.any(rollout is None):
                return rollout
        raise StaleEngineError(f"engines stayed out of sync after 3 full resyncs (last: {last})")

    def ensure_current(self) -> None:
        """Resend the full weights when any rank knows an engine to be stale (collective on all ranks)."""
        engine = self.engine
        if self.ranks.any(not engine.check_current()):
            first = engine.never_synced  # a first sync, not a repair
            stale = ", ".join(engine.stale_engines()) or "an engine"
            self.sync_full()
            if not first:
                self.resyncs += 1
                if self.ranks.is_zero:
                    log.warning("%s held other weights than the trainer: full weights resent", stale)
