"""Score responses in worker processes with a per-call time limit: a scorer that hangs costs one reward, not a run.

Some scorers can run for minutes on one adversarial answer (sympy evaluating ``9**9**9`` is a single big-integer
power in C), and neither a thread nor a signal interrupts C code. :class:`BoundedVerifier` therefore runs the
wrapped verifier in a small pool of worker processes (`pebble <https://pypi.org/project/Pebble/>`_): a call that
exceeds ``timeout_s`` gives its response no reward (a timeout), and its worker is killed and replaced. A verifier
that scores whole batches (``score_batch``: a reward model, a judge) is called in this process instead, once per
batch. Every response without a reward is reported with why (:mod:`logra_pl.rewards.failures`).

The workers are started by a ``forkserver`` — a clean, single-threaded process that imports the verifier's module
and the main script's imports once and forks the workers from itself — never forked from the trainer, which holds
torch/OpenMP threads and maybe an in-process vLLM engine. A worker starts in ~0.1 s and shares those imports' memory
with the forkserver. Each worker receives the verifier once, when it starts (pool initializer), not once per call.
Counters kept by the verifier inside a worker (``errors``, ``long_answers``) come back with every result and are
added to the wrapped verifier in the calling process, which stays their single source of truth. A verifier with a
``components(response, item)`` method sends its named parts back with each reward too, and
``BoundedVerifier.last_components`` holds their means over the last batch.

A script that uses the pool must guard its entry point with ``if __name__ == "__main__":`` (each worker imports
the main module, as with any ``forkserver``/``spawn`` multiprocessing).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
import pickle
import signal
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from logra_pl.errors import LoGRAError
from logra_pl.rewards.base import Verifier, ask_correct, batch_scorer, read_counter
from logra_pl.rewards.failures import Failure, Scores, exception_failure
from logra_pl.runtime.workers import WorkerPool, main_imports

log = logging.getLogger(__name__)

COUNTERS = ("errors", "timeouts", "long_answers", "nan")

# ------------------------------------------------------------------------------------------------------------------
# Inside a worker process.

_worker_verifier: Verifier | None = None


def _install_verifier(verifier: Verifier) -> None:
    """Pool initializer: keep this worker's copy of the verifier; make SIGTERM kill at once, even inside C code."""
    global _worker_verifier
    # pebble stops a timed-out worker with SIGTERM and falls back to SIGKILL seconds later; its Python-level
    # handler cannot run while a C routine (a big-int power) holds the interpreter, so use the default action.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _worker_verifier = verifier


def _components(verifier: object, response: str, item: Mapping[str, Any]) -> dict[str, float] | None:
    """The verifier's named reward parts for this call, or None when it does not report any."""
    components = getattr(verifier, "components", None)
    if not callable(components):
        return None
    parts = components(response, item)
    if not isinstance(parts, Mapping):
        raise TypeError(f"components() returned a {type(parts).__name__}, not a mapping of name -> float")
    return {str(name): float(value) for name, value in parts.items()}


def _score_in_worker(response: str, item: Mapping[str, Any]) -> _Outcome:
    """One call of the installed verifier (see :func:`_score_call`)."""
    verifier = _worker_verifier
    if verifier is None:
        raise RuntimeError("no verifier installed in this worker process")
    return _score_call(verifier, response, item, count=True)


# What one call sends back: (reward, correct or None, errors added, long answers added, components or None, failure
# as (kind, message, traceback) or None). Plain values, so that any exception of the verifier comes back as text,
# picklable or not.
_Outcome = tuple[float, bool | None, int, int, dict[str, float] | None, tuple[str, str, str] | None]


def _failed(kind: str, message: str, trace: str = "") -> _Outcome:
    """The outcome of a call that gave no reward."""
    return math.nan, None, 0, 0, None, (kind, message, trace)


_UNSCORED = _failed("unscored", "not scored: the batch was already certain to fail")


def _score_call(verifier: Any, response: str, item: Mapping[str, Any], count: bool) -> _Outcome:
    """Call ``verifier(response, item)``, then its ``components`` and ``correct`` when it has them; a raise or a
    non-finite reward is returned as a failure. A :class:`~logra_pl.errors.LoGRAError` (a verifier that cannot work
    at all: a missing model, a bad setting) is raised: it stops the run at once. ``count``: report how much the
    verifier's own counters moved (a worker's copy; in the calling process they moved on the verifier itself)."""
    before = read_counter(verifier, "errors"), read_counter(verifier, "long_answers")
    reward, correct, parts, failure = math.nan, None, None, None
    try:
        reward = float(verifier(response, item))
        if math.isfinite(reward):
            parts = _components(verifier, response, item)
            correct = ask_correct(verifier, response, item, reward)
        else:
            failure = ("nan", f"returned {reward}", "")
    except LoGRAError:
        raise
    except Exception as err:
        found = exception_failure(err, "", skip_file=__file__)
        reward, parts, correct, failure = math.nan, None, None, ("errors", found.message, found.traceback)
    after = read_counter(verifier, "errors"), read_counter(verifier, "long_answers")
    if not count:
        return reward, correct, 0, 0, parts, failure
    return reward, correct, after[0] - before[0], after[1] - before[1], parts, failure


# ------------------------------------------------------------------------------------------------------------------
# In the calling process.


def _preload_modules(verifier: Verifier) -> list[str]:
    """Modules the forkserver imports once, so that each worker starts in a fraction of a second.

    This module, the module that defines the verifier (for ReasoningGymVerifier: reasoning_gym with it; for a
    combination, its parts' modules too), and what each worker would otherwise import anew when multiprocessing
    re-runs the main script in it — under the ``logra-pl`` console script that is ``logra_pl.cli`` with torch and
    Lightning. (Python 3.11's forkserver ignores its own ``__main__`` preload, so without this every worker start
    costs that import and its memory.)
    """
    names = [__name__, *_verifier_modules(verifier), *main_imports()]
    return [n for n in dict.fromkeys(names) if isinstance(n, str) and n not in ("__main__", "__mp_main__")]


def _verifier_modules(verifier: object) -> list[str]:
    """The verifier's module, and those of the verifiers it holds (e.g. the parts of a ``WeightedRewards``)."""
    names = [getattr(verifier, "__module__", None) or type(verifier).__module__]
    parts = getattr(verifier, "verifiers", None)
    if isinstance(parts, Mapping):
        names += [getattr(part, "__module__", None) or type(part).__module__ for part in parts.values()]
    return names


def _task_name(item: object) -> str:
    """The item's task in log lines: :func:`logra_pl.data.schema.item_task` (``"all"`` when it has none).

    Imported on the first failure, in the calling process: the scoring workers import this module, and importing
    ``logra_pl.data`` would bring the data modules (datasets, Lightning) into every one of them.
    """
    from logra_pl.data.schema import item_task

    return item_task(item)


def _mean_components(parts: Sequence[dict[str, float] | None]) -> dict[str, float]:
    """Per name, the mean over the scored calls of a batch (a failed call reports none and is left out, as it is of
    the reward mean); a scored call that did not report a name, or reported a non-finite value, counts 0 for it."""
    reported = [p for p in parts if p is not None]
    if not reported:
        return {}
    names = dict.fromkeys(name for p in reported for name in p)
    return {
        name: math.fsum(v for p in reported if math.isfinite(v := p.get(name, 0.0))) / len(reported) for name in names
    }


class BoundedVerifier:
    """Score responses — per call in a pool of worker processes, each call under a time limit, or in one batch call
    in this process — and report every response without a reward.

    Arguments:
        verifier: the reward (:class:`~logra_pl.rewards.Verifier`): any picklable callable ``(response, item) ->
            float``, e.g. a :class:`~logra_pl.rewards.ReasoningGymVerifier`. Its ``errors`` and ``long_answers``
            counters, when it has them, are the ones this object reads and updates. A verifier with a callable
            ``score_batch`` (a reward model, a judge) is called through it, once per batch, in this process.
        timeout_s: seconds one per-call verifier call may run before its worker is killed and replaced and the
            response counts as a timeout (the clock starts when a worker picks the call up; it is pebble's, on wall
            time, so a step of the system clock moves it). ``None`` scores in the calling process without a limit
            (for debugging).
        workers: number of worker processes.
        correct_threshold: a response is correct (pass@k) when ``reward >= correct_threshold``, unless the verifier
            says otherwise with its own ``correct(response, item, reward)``.

    Rewards are the verifier's, any finite float (no clamp). A response has no reward — NaN in :attr:`Scores.rewards
    <logra_pl.rewards.failures.Scores>`, its :class:`~logra_pl.rewards.failures.Failure` in ``failures`` — when its
    call timed out (:attr:`timeouts`), raised or its worker died (:attr:`errors`), or returned a non-finite value
    (:attr:`nan`); each failure is logged at debug level only (the module prints one line per update). The pool
    starts on the first :meth:`score` and is restarted if it was closed or broke; :meth:`close` (or leaving a
    ``with`` block) stops it, and a pool that is never closed is stopped at interpreter exit.

    A :class:`~logra_pl.errors.LoGRAError` raised by the verifier (it cannot work at all: a missing reward model, a
    bad setting) is not a failure of one response: it propagates and stops the run with its message.

    When the verifier has a ``components(response, item)`` method (see :class:`~logra_pl.rewards.Verifier`), it is
    called after each reward, in the same worker, and :attr:`last_components` is ``{name: mean}`` over the last
    batch's scored responses (``{}`` for a verifier without components). A ``components`` that raises fails its
    call, and so does a ``correct`` that raises.

    Example::

        with BoundedVerifier(ReasoningGymVerifier("tags"), timeout_s=5.0, workers=2) as bounded:
            scores = bounded.run(responses, items)
    """

    def __init__(
        self,
        verifier: Verifier,
        timeout_s: float | None = 5.0,
        workers: int = 2,
        correct_threshold: float = 1.0,
    ) -> None:
        if not callable(verifier):
            raise TypeError(f"verifier must be callable as verifier(response, item), got {type(verifier).__name__}")
        if timeout_s is not None:
            if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float):
                raise TypeError(f"timeout_s must be a number of seconds or None, got {timeout_s!r}")
            if not math.isfinite(timeout_s) or timeout_s <= 0:
                raise ValueError(f"timeout_s must be finite and > 0 (or None for no limit), got {timeout_s!r}")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
        if isinstance(correct_threshold, bool) or not isinstance(correct_threshold, int | float):
            raise TypeError(f"correct_threshold must be a number, got {correct_threshold!r}")
        if timeout_s is not None and batch_scorer(verifier) is None:
            try:
                pickle.dumps(verifier)
            except Exception as err:
                raise TypeError(
                    f"verifier {verifier!r} cannot be pickled ({type(err).__name__}: {err}), so it cannot be sent to "
                    "worker processes: use a module-level function or class instance (not a lambda or closure), "
                    "or timeout_s=None to score in this process"
                ) from err
        self.verifier = verifier
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        self.workers = workers
        self.correct_threshold = float(correct_threshold)
        self.timeouts = 0
        self.nan = 0
        self.last_components: dict[str, float] = {}
        self._own_counts = {"errors": 0, "long_answers": 0}  # for verifiers without counters of their own
        self._pool = WorkerPool(
            _install_verifier, (verifier,), _preload_modules(verifier), workers, self.timeout_s, "verifier"
        )

    # -- counters ---------------------------------------------------------------------------------------------------

    def _get(self, name: str) -> int:
        if isinstance(getattr(self.verifier, name, None), int):
            return getattr(self.verifier, name)
        return self._own_counts[name]

    def _set(self, name: str, value: int) -> None:
        if isinstance(getattr(self.verifier, name, None), int):
            setattr(self.verifier, name, value)
        else:
            self._own_counts[name] = value

    @property
    def errors(self) -> int:
        """Calls that raised or whose worker died, plus the failures the verifier counts itself (its ``errors``)."""
        return self._get("errors")

    @errors.setter
    def errors(self, value: int) -> None:
        self._set("errors", value)

    @property
    def long_answers(self) -> int:
        """Answers over the wrapped verifier's length cap (its ``long_answers`` counter)."""
        return self._get("long_answers")

    @long_answers.setter
    def long_answers(self, value: int) -> None:
        self._set("long_answers", value)

    def counters(self) -> dict[str, int]:
        """``{"errors": …, "timeouts": …, "long_answers": …, "nan": …}``, totals since construction (or the loaded
        state)."""
        return {name: int(getattr(self, name)) for name in COUNTERS}

    def state_dict(self) -> dict[str, int]:
        """The counters, for a checkpoint."""
        return self.counters()

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Restore counters saved by :meth:`state_dict` (a missing counter restarts from 0)."""
        for name in COUNTERS:
            setattr(self, name, int(state.get(name, 0)))

    # -- scoring ----------------------------------------------------------------------------------------------------

    def __call__(self, response: str, item: Mapping[str, Any]) -> float:
        """Score one response (a batch of one; prefer :meth:`run` for batches, whose calls run in parallel); NaN when
        it has no reward."""
        return self.score([response], [item])[0]

    def score(self, responses: Sequence[str], items: Sequence[Mapping[str, Any]]) -> list[float]:
        """The reward of ``responses[i]`` against ``items[i]``, in order; NaN for a response without one (see
        :meth:`run` for why, and for correctness)."""
        return self.run(responses, items).rewards

    def run(self, responses: Sequence[str], items: Sequence[Mapping[str, Any]], stop_at: int | None = None) -> Scores:
        """Score a batch: rewards, correctness and failures (:class:`~logra_pl.rewards.failures.Scores`).

        Arguments:
            responses: the model's responses.
            items: the matching task items (for reasoning-gym: entries with ``metadata.source_dataset``).
            stop_at: once this many responses failed, the batch is certain to fail
                (:meth:`~logra_pl.rewards.failures.FailurePolicy.cut`): per-call scoring cancels the calls not yet
                done, and their responses are ``unscored``. None: score every response.
        """
        if len(responses) != len(items):
            raise ValueError(f"got {len(responses)} responses but {len(items)} items")
        if not responses:
            outcomes: list[_Outcome | None] = []
        elif (batch := batch_scorer(self.verifier)) is not None:
            outcomes = list(self._score_batch(batch, responses, items))
        elif self.timeout_s is None:
            outcomes, failed = [], 0
            for response, item in zip(responses, items, strict=True):
                outcome = None if stop_at is not None and failed >= stop_at else self._here(response, item)
                failed += outcome is not None and outcome[5] is not None
                outcomes.append(outcome)
        else:
            outcomes = self._score_in_pool(responses, items, stop_at)
        return self._collect(outcomes, items)

    def score_rollout(
        self, tokenizer: Any, rollout: Any, items: Sequence[Mapping[str, Any]], stop_at: int | None = None
    ) -> Scores:
        """:meth:`run` on a rollout's responses (decoded with ``tokenizer``), each against the item of its prompt."""
        texts = tokenizer.batch_decode(rollout.response_ids, skip_special_tokens=True)
        return self.run(texts, [items[i] for i in rollout.prompt_index], stop_at)

    def _collect(self, outcomes: Sequence[_Outcome | None], items: Sequence[Mapping[str, Any]]) -> Scores:
        """Count each outcome and build the batch's :class:`Scores` (``None``: a call cancelled, unscored)."""
        rewards: list[float] = []
        correct: list[bool] = []
        failures: list[Failure | None] = []
        parts: list[dict[str, float] | None] = []
        for outcome, item in zip(outcomes, items, strict=True):
            reward, says, errors, long_answers, components, failed = outcome or _UNSCORED
            self.errors += errors
            self.long_answers += long_answers
            failure = None
            if failed is not None:
                kind, message, trace = failed
                if kind != "unscored":
                    setattr(self, kind, getattr(self, kind) + 1)
                failure = Failure(kind, message, trace, _task_name(item))  # type: ignore[arg-type]
                log.debug("verifier failed (%s): %s", kind, failure.describe())
            rewards.append(reward if failure is None else math.nan)
            correct.append(failure is None and (bool(says) if says is not None else reward >= self.correct_threshold))
            failures.append(failure)
            parts.append(components if failure is None else None)
        self.last_components = _mean_components(parts)
        return Scores(rewards, correct, failures, dict(self.last_components))

    def _here(self, response: str, item: Mapping[str, Any]) -> _Outcome:
        return _score_call(self.verifier, response, item, count=False)

    def _score_batch(
        self, batch: Callable[..., Any], responses: Sequence[str], items: Sequence[Mapping[str, Any]]
    ) -> list[_Outcome]:
        """One ``score_batch`` call in this process. An element that is an exception fails its response (a
        ``TimeoutError`` as a timeout); a raise fails every response of the batch."""
        n = len(responses)
        try:
            values = list(batch(list(responses), list(items)))
            if len(values) != n:
                raise ValueError(f"score_batch returned {len(values)} values for {n} responses")
        except LoGRAError:
            raise
        except Exception as err:
            found = exception_failure(err, "", skip_file=__file__)
            values = [err] * n
            failure_all: tuple[str, str, str] | None = ("errors", found.message, found.traceback)
        else:
            failure_all = None
        # (The verifier's own counters moved on the verifier itself: nothing to add.)
        return [self._batch_outcome(v, r, i, failure_all) for v, r, i in zip(values, responses, items, strict=True)]

    def _batch_outcome(
        self,
        value: Any,
        response: str,
        item: Mapping[str, Any],
        failure_all: tuple[str, str, str] | None,
    ) -> _Outcome:
        if failure_all is not None:
            return _failed(*failure_all)
        if isinstance(value, BaseException):
            found = exception_failure(value, "", skip_file=__file__)
            kind = "timeouts" if isinstance(value, TimeoutError) else "errors"
            return _failed(kind, found.message, found.traceback)
        try:
            reward = float(value)
            if not math.isfinite(reward):
                return _failed("nan", f"returned {reward}")
            parts = _components(self.verifier, response, item)
            correct = ask_correct(self.verifier, response, item, reward)
        except LoGRAError:
            raise
        except Exception as err:
            found = exception_failure(err, "", skip_file=__file__)
            return _failed("errors", found.message, found.traceback)
        return reward, correct, 0, 0, parts, None

    def _score_in_pool(
        self, responses: Sequence[str], items: Sequence[Mapping[str, Any]], stop_at: int | None
    ) -> list[_Outcome | None]:
        """Per-call scoring in the workers; stops once ``stop_at`` calls failed (the rest stay ``None``: unscored)."""
        outcomes: dict[int, _Outcome] = {}
        failed = 0
        with contextlib.closing(self._pool.results(_score_in_worker, list(zip(responses, items, strict=True)))) as done:
            for k, future in done:
                if future is None:  # the pool stopped answering (it was restarted)
                    outcomes[k] = _failed("errors", "the scoring pool gave no result")
                    continue
                outcomes[k] = outcome = self._result(future)
                failed += outcome[5] is not None
                if stop_at is not None and failed >= stop_at:
                    break  # the calls not yet done are cancelled
        return [outcomes.get(k) for k in range(len(responses))]

    def _result(self, future: concurrent.futures.Future) -> _Outcome:
        """A finished call's outcome: its own, or a timeout, or an error when the worker raised outside the verifier
        or died."""
        try:
            return future.result()
        except LoGRAError:
            raise
        except TimeoutError:
            return _failed("timeouts", f"no reward within scoring.timeout_s = {self.timeout_s:g} s")
        except Exception as err:  # the worker died, or the pool broke
            found = exception_failure(err, "", skip_file=__file__)
            return _failed("errors", found.message, found.traceback)

    # -- lifetime ---------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the worker pool (idempotent); the next :meth:`score` starts a new one."""
        self._pool.close()

    def __enter__(self) -> BoundedVerifier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.verifier!r}, timeout_s={self.timeout_s}, workers={self.workers})"
