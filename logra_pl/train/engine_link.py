"""``EngineLink``: the trainer's side of a rollout engine — keeping it on the trainer's weights, and repairing it.

After every update the engine must hold the trainer's weights bit for bit: LoGRA sends the merged factor payload,
other methods the changed tensors, and a full sync every tensor (at the start of training, after the engine moved
device, or to repair). An engine that can go stale (a served one: a lost update, a restart) refuses to generate
from other weights; the link then has every rank agree that a repair is due, resends the full weights and repeats
the call, counting each repair (``sync/engine_resyncs``). A :class:`~logra_pl.callbacks.PolicySync` callback may
take the per-update sync over (``LoGRAPolicyModule.attach_sync``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from logra_pl.errors import StaleEngineError
from logra_pl.rollout.base import Rollout, RolloutEngine, SamplingConfig, StaleableEngine, cast_floats
from logra_pl.rollout.pipeline import RolloutPipeline
from logra_pl.runtime.ranks import any_rank
from logra_pl.sketch.payload import Payload

log = logging.getLogger(__name__)


class EngineLink:
    """One engine, the method whose updates it receives, and the policy it mirrors.

    Arguments:
        engine: the rollout engine.
        method: the :class:`~logra_pl.methods.UpdateMethod` (what a full or per-update sync sends).
        policy: the trainer's policy.
        trainer: the Trainer the module is attached to now (None outside one): its ranks agree on repairs.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        method: Any,
        policy: torch.nn.Module,
        trainer: Callable[[], Any] = lambda: None,
    ) -> None:
        self.engine = engine
        self.method = method
        self.policy = policy
        self.trainer = trainer
        self.resyncs = 0  # full resyncs of engines found stale (lost update, restart)
        self.logged_resyncs = 0  # the count the loggers last received
        self.last_payload: Payload | None = None  # what the last update merged (factor methods)
        self.pipeline: RolloutPipeline | None = None  # asynchronous rollouts: every engine call on its worker
        self.before_change: Callable[[], None] | None = None  # run on the worker before each weight change

    def place(self, device: torch.device) -> bool:
        """``engine.place``: whether the engine moved (then it needs the full weights); on the worker when there
        is one, after the calls before it."""
        if self.pipeline is not None:
            return self.pipeline.call(self.engine.place, device)
        return self.engine.place(device)

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

    def sync(self, device: torch.device, full: bool = False, payload: Payload | None = None) -> None:
        """Bring the engine to the trainer's weights: ``payload`` (factor methods), the changed tensors, or all."""
        engine = self.engine
        if engine.shares_weights:
            return  # the engine generates with the trainer's weights: always current
        if self.pipeline is not None:  # after the requests before it; the tensors are taken now, on this thread
            self.submit(self._apply, *self._change(full, payload, copy=True), changes_weights=True)
            return
        if engine.place(device):
            full = True  # the engine moved: resend everything
        self._apply(*self._change(full, payload, copy=False))

    def _change(self, full: bool, payload: Payload | None, copy: bool) -> tuple[Payload | None, Any]:
        """What a sync sends: ``(payload, None)`` for a factor update, else ``(None, tensors)`` (None, None: none).
        ``copy``: clone the tensors, for a worker that applies them while the trainer's weights move on."""
        wire = getattr(self.engine, "wire_dtype", None)
        if not full and self.method.ships_factors:
            return payload, None
        if full:  # gathered lazily, one tensor at a time, as the engine reads them
            tensors: Any = self.method.full_state(self.policy, dtype=wire)
        else:
            tensors = cast_floats(self.method.trained_tensors(self.policy), wire)
        return None, ({k: v.detach().clone() for k, v in tensors.items()} if copy else tensors)

    def _apply(self, payload: Payload | None, tensors: Any) -> None:
        if payload is not None:
            self.engine.apply_payload(payload)
        elif tensors is not None:
            self.engine.load_weights(tensors)

    def generate(
        self,
        device: torch.device,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        prompt_seeds: list[int] | None = None,
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
            self.ensure_current(device)
            rollout = None
            try:
                rollout = generate()
            except StaleEngineError as err:  # the engine marked itself stale; every rank hears of it below
                last = err
            if not any_rank(self.trainer(), rollout is None):
                return rollout
        raise StaleEngineError(f"engines stayed out of sync after 3 full resyncs (last: {last})")

    def ensure_current(self, device: torch.device) -> None:
        """Resend the full weights when any rank knows an engine to be stale (collective on all ranks)."""
        engine = self.engine
        if any_rank(self.trainer(), not engine.check_current()):
            first = engine.never_synced  # a first sync, not a repair
            stale = ", ".join(engine.stale_engines()) or "an engine"
            self.sync(device, full=True)
            if not first:
                self.resyncs += 1
                if self.trainer() is None or self.trainer().is_global_zero:
                    log.warning("%s held other weights than the trainer: full weights resent", stale)
