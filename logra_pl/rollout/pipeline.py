"""``RolloutPipeline``: rollouts of later updates sampled while this update trains, in one ordered engine worker.

Every engine call of an asynchronous run — weight changes, generate requests, validation — goes through one
worker thread in the order it was submitted (``concurrent.futures.ThreadPoolExecutor`` with one thread), so the
engine applies update ``t``'s change after every request that names the weights before it and before every
request that names the weights after it. Which batch is sampled by which weights is therefore a fixed function
of the schedule (:mod:`logra_pl.rollout.staleness`), never of timing, and a run is reproducible bit for bit.

The pipeline holds, per batch index, the version that sampled it and its rollout (finished) or the future of it
(in flight). A checkpoint waits for the requests in flight (:meth:`drain`) and stores every finished, unused
rollout with its version (:meth:`state_dict`): after a kill, the resumed run trains the same responses in the same
updates. Waiting costs one pipeline bubble per checkpoint; rebuilding old weights by subtracting merged factors
instead would not be exact in floating point, and keeping old weights costs a model copy per version.

A served engine that refuses a request (409: it holds other weights) is not a failure: the error comes back in the
request's future, and the trainer repairs the engine on its own thread (where its ranks can agree) and asks again.

The worker runs engine calls only: no collectives (all ranks' agreements stay on the main thread) and nothing
that touches the trainer's live weights (the arguments of a weight change are taken on the main thread when it
is submitted).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import torch

from logra_pl.errors import StaleEngineError
from logra_pl.rollout.base import Rollout
from logra_pl.rollout.staleness import StaleKL

T = TypeVar("T")


@dataclass
class Requested:
    """One requested batch: the version that samples it, its prompts' keys, and its rollout (or the future of it)."""

    version: int
    keys: list[str]
    result: Rollout | Future[Rollout]


class RolloutPipeline:
    """Batches requested ahead, by version, and the ordered worker that samples them.

    Arguments:
        stale_kl: the KL ledger and its bound (``max_stale_kl``), saved with the rollouts.
    """

    def __init__(self, stale_kl: StaleKL) -> None:
        self.stale_kl = stale_kl
        threads = torch.get_num_threads()  # the worker computes with the trainer's thread count: the same bits
        self._pool = ThreadPoolExecutor(1, "logra-rollout", initializer=torch.set_num_threads, initargs=(threads,))
        self.batches: dict[int, Requested] = {}
        self.dropped = 0  # batches dropped for their stale KL and sampled again
        self.error: BaseException | None = None  # the first engine call that failed; later calls do not run
        self.wait_s = 0.0  # the trainer's wait for its last batch
        self._busy_s = 0.0  # the worker's time in engine calls, summed
        self._clock = time.perf_counter()

    # -------------------------------------------------------------------------------------------- worker
    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        """Run ``fn(*args, **kwargs)`` on the worker after every call submitted before it."""

        def timed() -> T:
            if self.error is not None:  # a weight change that failed leaves the engine on unknown weights
                raise RuntimeError(f"not run: an earlier engine call failed ({self.error!r})") from self.error
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            except StaleEngineError:
                raise  # the engine holds other weights: the trainer repairs it on its own thread and asks again
            except BaseException as err:
                self.error = self.error or err
                raise
            finally:
                self._busy_s += time.perf_counter() - t0

        return self._pool.submit(timed)

    def check(self) -> None:
        """Raise the first failed engine call's error (a weight change nobody waits for fails here, not silently)."""
        if self.error is not None:
            raise self.error

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``submit`` and wait: an engine call that must see every earlier one (validation, a full sync)."""
        result = self.submit(fn, *args, **kwargs).result()
        self.check()
        return result

    def engine_idle_s(self) -> float:
        """Seconds the worker made no engine call since the last time this was asked (then reset)."""
        now = time.perf_counter()
        wall, busy = now - self._clock, self._busy_s
        self._clock, self._busy_s = now, 0.0
        return max(0.0, wall - busy)

    # ------------------------------------------------------------------------------------------- batches
    def request(self, batch: int, version: int, keys: list[str], generate: Callable[[], Rollout]) -> None:
        """Sample ``batch`` (its prompts' ``keys``) on the worker, by the weights it holds when the call runs
        (``version``: the weight changes submitted before this request make it)."""
        if batch in self.batches:
            raise RuntimeError(f"batch {batch} was requested twice")
        self.batches[batch] = Requested(version, list(keys), self.submit(generate))

    def has(self, batch: int) -> bool:
        return batch in self.batches

    def take(self, batch: int) -> tuple[Requested, Rollout]:
        """The request and rollout of ``batch`` (waiting for it), removed from the pipeline."""
        entry = self.batches.pop(batch)
        t0 = time.perf_counter()
        rollout = entry.result.result() if isinstance(entry.result, Future) else entry.result
        self.wait_s = time.perf_counter() - t0
        self.check()
        return entry, rollout

    def drain(self) -> None:
        """Wait for every request in flight (a checkpoint stores their rollouts)."""
        for entry in self.batches.values():
            if isinstance(entry.result, Future):
                entry.result = entry.result.result()
        self.call(lambda: None)  # and for the weight changes submitted after them

    def discard(self) -> None:
        """Forget every requested batch, cancelling those not started (a repair, the end of fit)."""
        for entry in self.batches.values():
            if isinstance(entry.result, Future):
                entry.result.cancel()
        self.batches.clear()

    def close(self) -> None:
        """Stop the worker after the calls already submitted."""
        self.discard()
        self._pool.shutdown(wait=True, cancel_futures=True)

    # ---------------------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The finished, unused rollouts with their versions, and the KL ledger (call :meth:`drain` first)."""
        if any(isinstance(entry.result, Future) for entry in self.batches.values()):
            raise RuntimeError("drain the pipeline before saving it: requests are in flight")
        rollouts = {
            str(b): {"version": e.version, "keys": e.keys, "rollout": asdict(e.result)}
            for b, e in sorted(self.batches.items())
        }
        return {"rollouts": rollouts, "stale_kl": self.stale_kl.state_dict(), "dropped": self.dropped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.discard()
        for b, entry in state["rollouts"].items():
            self.batches[int(b)] = Requested(int(entry["version"]), list(entry["keys"]), Rollout(**entry["rollout"]))
        self.stale_kl.load_state_dict(state["stale_kl"])
        self.dropped = int(state.get("dropped", 0))
