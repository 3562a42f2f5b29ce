"""``EngineLink``: the trainer's side of a rollout engine — keeping it on the trainer's weights, and repairing it.

After every update the engine must hold the trainer's weights bit for bit: LoGRA sends the merged factor payload,
other methods the changed tensors, and a full sync every tensor (at the start of training, after the engine moved
device, or to repair). An engine that can go stale (a served one: a lost update, a restart) refuses to generate
from other weights; the link then has every rank agree that a repair is due, resends the full weights and repeats
the call, counting each repair (``sync/engine_resyncs``). What an update changed is built here alone
(:meth:`EngineLink.changes`): the module sends it after each update, or a :class:`~logra_pl.callbacks.PolicySync`
callback that took the per-update sync over (:meth:`EngineLink.attach`) sends the step's changes through
:meth:`EngineLink.send`, timed and in order with every other engine call.
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
        self.owner: object | None = None  # a callback that sends each update (PolicySync); None: the module
        self.resyncs = 0  # full resyncs of engines found stale (lost update, restart)
        self.logged_resyncs = 0  # the count the loggers last received
        self.last_payload: Payload | None = None  # what the last update merged (factor methods)
        self.pipeline: RolloutPipeline | None = None  # asynchronous rollouts: every engine call on its worker
        self.before_change: Callable[[], None] | None = None  # run on the worker before each weight change

    def attach(self, owner: object | None) -> None:
        """``owner`` (a sync callback) sends each update to the engine from now on (None: the module again)."""
        self.owner = owner

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

    def sync(self, full: bool = False, payload: Payload | None = None) -> None:
        """Bring the engine to the trainer's weights: ``payload`` (factor methods), the changed tensors, or all."""
        engine = self.engine
        if engine.shares_weights:
            return  # the engine generates with the trainer's weights: always current
        change: Change = "full" if full else ("factors" if self.method.ships_factors else "tensors")
        if self.pipeline is not None:  # after the requests before it; the tensors are taken now, on this thread
            self.submit(self.changes(change, [payload]), changes_weights=True)
            return
        if engine.place(self.ranks.device):
            change = "full"  # the engine moved: resend everything
        self.changes(change, [payload])()

    def updated(self, payload: Payload | None) -> None:
        """An update was taken (``payload``: what it merged, for factor methods): remember it (a later full sync and
        a sync callback read it) and, unless a sync callback owns the sending (:meth:`attach`), send it now."""
        self.last_payload = payload
        if self.owner is None:
            self.sync(payload=payload)

    def flush_resyncs(self, trainer: Any, step: int) -> None:
        """Give the loggers a resync count they have not received (a repair after the last logged step, e.g. the
        final verification's probe), from rank 0."""
        if self.can_go_stale and self.resyncs != self.logged_resyncs and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({"sync/engine_resyncs": float(self.resyncs)}, step=step)
                logger.save()
            self.logged_resyncs = self.resyncs

    def send(
        self, change: Change, payloads: Sequence[Payload], wire_dtype: torch.dtype | Literal["engine"] | None
    ) -> Future:
        """Send a step's changes in order with every other engine call (now, or after the requests already on the
        asynchronous worker): a Future of ``(sync reports, seconds)``."""
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
            self.sync(full=True)
            if not first:
                self.resyncs += 1
                if self.ranks.is_zero:
                    log.warning("%s held other weights than the trainer: full weights resent", stale)
