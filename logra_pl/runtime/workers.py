"""Worker processes that run calls under a time limit: the pool a verifier's calls and a model's tool calls share.

Some calls cannot be trusted to return: sympy evaluating ``9**9**9`` in a verifier, or a model's tool call computing
``10**10**8``, runs for minutes inside one C routine, which neither a thread nor a signal handler interrupts. A
:class:`WorkerPool` runs each call in a `pebble <https://pypi.org/project/Pebble/>`_ worker process under a time limit
(pebble's clock: the wall clock, from when a worker picks the call up); a call past it gets a ``TimeoutError`` and its
worker is killed and replaced. Its users — :class:`~logra_pl.rewards.BoundedVerifier` and
:class:`~logra_pl.envs.tools.ToolRunner` — decide what a result, a timeout or a dead worker means.

The workers come from a ``forkserver``, never from the trainer, which holds torch/OpenMP threads and maybe an
in-process vLLM engine; the forkserver imports the modules the calls need once (``preload``), so a worker starts in
~0.1 s, and each worker runs ``initializer(*initargs)`` once (to receive the verifier or the tools) instead of
receiving them with every call. The pool starts on first use, is restarted if it broke, and is stopped by
:meth:`WorkerPool.close`, when its owner is collected, or at interpreter exit. A copy (pickle, deepcopy) of an owner
carries no pool: it starts its own.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import logging
import math
import multiprocessing
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.context import BaseContext
from typing import Any

from pebble import ProcessPool

log = logging.getLogger(__name__)

# Seconds a batch of calls may take beyond its calls' own limits before the pool is declared stuck: a fresh pool's
# workers must start (forkserver, imports) and results must travel back.
STARTUP_GRACE_S = 60.0
PER_CALL_GRACE_S = 5.0


def pool_context(preload: Sequence[str]) -> BaseContext:
    """A ``forkserver`` context that imports ``preload`` before forking workers (``spawn`` where unavailable).

    The preload list is the forkserver's, shared by the whole process, and only counts before it first starts;
    modules already listed (``__main__`` by default) are kept.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    from multiprocessing import forkserver

    current = list(getattr(forkserver._forkserver, "_preload_modules", None) or [])
    missing = [name for name in preload if name not in current]
    if missing:
        forkserver.set_forkserver_preload(current + missing)
    return multiprocessing.get_context("forkserver")


def main_imports() -> list[str]:
    """The modules a worker imports when multiprocessing re-runs the main module in it (as ``__mp_main__``)."""
    main = sys.modules.get("__main__")
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    if spec_name is not None:  # `python -m name`: re-run by name, except a package's __main__ (never re-run)
        return [] if spec_name.endswith("__main__") else [spec_name]
    if getattr(main, "__file__", None) is None:  # interactive: nothing is re-run
        return []
    names = []
    for value in list(vars(main).values()):
        if inspect.ismodule(value):
            names.append(value.__name__)
        elif inspect.isclass(value) or inspect.isfunction(value):
            names.append(value.__module__)
    return [n for n in names if isinstance(n, str) and n != "builtins"]


def _shutdown(pool: ProcessPool) -> None:
    """Stop ``pool`` without running queued calls; kill its workers (also at interpreter exit)."""
    pool.stop()
    pool.join()


class WorkerPool:
    """A pool of worker processes running calls under a time limit (see the module docstring).

    Arguments:
        initializer: run once in every worker as it starts, with ``initargs`` (a module-level function).
        initargs: its arguments (picklable).
        preload: modules the forkserver imports once, before it forks the workers.
        workers: number of worker processes.
        timeout_s: seconds one call may run before its worker is killed (``TimeoutError`` as its result); None: no
            limit.
        label: what the pool serves, in log lines (``"verifier"``, ``"tool"``).
    """

    def __init__(
        self,
        initializer: Callable[..., None],
        initargs: tuple[Any, ...],
        preload: Sequence[str],
        workers: int,
        timeout_s: float | None,
        label: str,
    ) -> None:
        self.initializer, self.initargs, self.preload = initializer, initargs, list(preload)
        self.workers, self.timeout_s, self.label = workers, timeout_s, label
        self._pool: ProcessPool | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def started(self) -> bool:
        """Worker processes exist (the pool has run calls and was not closed since)."""
        return self._pool is not None

    def results(self, fn: Callable[..., Any], calls: Sequence[tuple[Any, ...]]) -> Iterator[tuple[int, Any]]:
        """Run ``fn(*args)`` for every ``args`` of ``calls``, in parallel; yield ``(index, future)`` as each finishes.

        A finished future holds the call's value or its exception (``TimeoutError``: past ``timeout_s``). When the
        pool gives no result for a whole batch's time (its calls' limits plus grace), it is closed (restarted on the
        next use) and every call still pending is yielded as ``(index, None)``. A caller that stops early (``break``
        and ``close()`` of this generator) cancels the calls not yet done, stopping the workers running them.
        """
        futures = self._submit(fn, calls)
        rounds = math.ceil(len(futures) / self.workers)
        limit = STARTUP_GRACE_S + rounds * ((self.timeout_s or 0.0) + PER_CALL_GRACE_S)
        deadline = time.monotonic() + limit
        index = {future: k for k, future in enumerate(futures)}
        pending = set(futures)
        try:
            while pending:
                done, pending = concurrent.futures.wait(
                    pending,
                    timeout=max(deadline - time.monotonic(), 0.0),
                    return_when=concurrent.futures.FIRST_COMPLETED,
                )
                if not done:  # the pool stopped answering: give up on it, restart on the next call
                    log.warning(
                        "%s pool gave no result for %d calls in %.0f s: restarting it", self.label, len(pending), limit
                    )
                    stuck, pending = sorted(pending, key=index.__getitem__), set()
                    for future in stuck:
                        future.cancel()
                    self.close()
                    for future in stuck:
                        yield index[future], None
                    return
                for future in sorted(done, key=index.__getitem__):
                    yield index[future], future
        finally:
            for future in pending:  # cancelled: a running call's worker is stopped
                future.cancel()

    def _submit(self, fn: Callable[..., Any], calls: Sequence[tuple[Any, ...]]) -> list[concurrent.futures.Future]:
        for attempt in range(2):
            pool = self._ensure_pool()
            futures: list[concurrent.futures.Future] = []
            try:
                for args in calls:
                    futures.append(pool.schedule(fn, args=args, timeout=self.timeout_s))
                return futures
            except RuntimeError:  # the pool broke between the check and the submission
                for future in futures:
                    future.cancel()
                self.close()
                if attempt == 1:
                    raise
        raise AssertionError("unreachable")

    def _ensure_pool(self) -> ProcessPool:
        if self._pool is not None and not self._pool.active:
            log.warning("%s pool is broken: restarting it", self.label)
            self.close()
        if self._pool is None:
            pool = ProcessPool(
                max_workers=self.workers,
                initializer=self.initializer,
                initargs=self.initargs,
                context=pool_context(self.preload),
            )
            self._pool = pool
            # Stops the pool when this object is collected or at interpreter exit, whichever comes first.
            self._finalizer = weakref.finalize(self, _shutdown, pool)
        return self._pool

    def close(self) -> None:
        """Stop the worker processes (idempotent); the next call starts new ones."""
        finalizer, self._finalizer, self._pool = self._finalizer, None, None
        if finalizer is not None:
            finalizer()

    def __getstate__(self) -> dict[str, Any]:
        # A copy gets the settings, never the processes: it starts its own when used.
        state = self.__dict__.copy()
        state["_pool"] = None
        state["_finalizer"] = None
        return state
