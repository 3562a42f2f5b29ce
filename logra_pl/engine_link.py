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
from typing import Any

import torch

from logra_pl.errors import StaleEngineError
from logra_pl.ranks import any_rank
from logra_pl.rollout.base import Rollout, RolloutEngine, SamplingConfig, StaleableEngine, cast_floats
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

    @property
    def can_go_stale(self) -> bool:
        """Whether the engine may hold other weights than the trainer expects (it then refuses to generate)."""
        return isinstance(self.engine, StaleableEngine)

    def sync(self, device: torch.device, full: bool = False, payload: Payload | None = None) -> None:
        """Bring the engine to the trainer's weights: ``payload`` (factor methods), the changed tensors, or all."""
        engine = self.engine
        if engine.shares_weights:
            return  # the engine generates with the trainer's weights: always current
        if engine.place(device):
            full = True  # the engine moved: resend everything
        wire = getattr(engine, "wire_dtype", None)
        if full:
            engine.load_weights(self.method.full_state(self.policy, dtype=wire))
        elif self.method.ships_factors:
            if payload is not None:
                engine.apply_payload(payload)
        else:
            engine.load_weights(cast_floats(self.method.trained_tensors(self.policy), wire))

    def generate(
        self,
        device: torch.device,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        prompt_seeds: list[int] | None = None,
    ) -> Rollout:
        """``engine.generate``, made safe for engines that can go stale: repaired and repeated, 3 tries at most."""
        engine = self.engine
        if not self.can_go_stale:
            return engine.generate(prompts, sampling, prompt_seeds=prompt_seeds)
        last: StaleEngineError | None = None
        for _ in range(3):
            self.ensure_current(device)
            rollout = None
            try:
                rollout = engine.generate(prompts, sampling, prompt_seeds=prompt_seeds)
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
