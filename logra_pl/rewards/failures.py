"""Verifier failures: what counts as one, what a batch of scores holds, and the policy that stops a broken reward.

A response *fails* when the runner (:class:`~logra_pl.rewards.BoundedVerifier`) gets no usable reward for it: the
verifier raised (``errors``; a worker that died counts here too), returned a non-finite value (``nan``), or ran past
``scoring.timeout_s`` (``timeouts``). A failed response has no reward: it is left out of the update (advantage and
loss weight zero), of the reward means and of the baseline's statistics (algorithm.md §10). A verifier that catches
its own error and returns a number has given a reward; only what reaches the runner is a failure.

:class:`FailurePolicy` turns the per-update counts into one console line per update (count, kinds, first message)
and stops the run — :class:`~logra_pl.errors.VerifierFailedError`, naming the verifier and printing its first
failure's traceback — once at least ``max_failure_rate`` of an update's responses failed for ``max_failed_updates``
updates in a row. The stop happens before that update trains, so the last checkpoint holds the weights of the
last update that did.
"""

from __future__ import annotations

import inspect
import logging
import math
import traceback
from dataclasses import dataclass, field
from typing import Any, Literal

from logra_pl.errors import VerifierFailedError, check_int, check_range

log = logging.getLogger("logra_pl.module")  # the console lines keep the module's logger name, as the guard's do

FailureKind = Literal["errors", "nan", "timeouts", "unscored"]
# The kinds that are the verifier's failures (counted, logged as verifier/<kind>); "unscored" responses were not
# scored at all: their update was already certain to fail, so the remaining calls were cancelled.
KINDS: tuple[str, ...] = ("errors", "nan", "timeouts")


@dataclass(frozen=True)
class Failure:
    """Why one response has no reward.

    Arguments:
        kind: ``errors`` (raised, or its worker died), ``nan`` (a non-finite value), ``timeouts`` (past the time
            limit), or ``unscored`` (cancelled once the update was certain to fail).
        message: one line: the exception's type and message, the value returned, or the time limit.
        traceback: the formatted traceback of the verifier's exception (the runner's own frames left out), or ``""``.
        task: the task of the item (:func:`logra_pl.data.schema.item_task`), for the message.
    """

    kind: FailureKind
    message: str
    traceback: str = ""
    task: str = "all"

    def describe(self) -> str:
        """The failure in one line, with its task."""
        return f"{self.message} (task {self.task!r})"


def exception_failure(err: BaseException, task: str, skip_file: str | None = None) -> Failure:
    """A :class:`Failure` of kind ``errors`` from an exception: ``Type: message`` (and its notes) as the message, the
    traceback without the frames of ``skip_file`` (the runner's module) as the traceback."""
    notes = "; ".join(str(n) for n in getattr(err, "__notes__", ()))
    message = f"{type(err).__name__}: {err}" + (f" [{notes}]" if notes else "")
    return Failure("errors", " ".join(message.split()), format_traceback(err, skip_file), task)


TRACEBACK_LINES = 8  # the most lines of a failure's traceback a run's stop summary shows


def format_traceback(err: BaseException, skip_file: str | None = None) -> str:
    """``err``'s own traceback as text (not the exceptions it was raised from: its message says what they were),
    without the frames of ``skip_file``, its last ``TRACEBACK_LINES`` lines (the frames nearest the error); a
    traceback sent from a worker process (pebble's ``err.traceback``) is used as it is, cut the same way. An
    unreachable LLM judge's error had three chained tracebacks, 90 lines."""
    remote = getattr(err, "traceback", None)
    if isinstance(remote, str) and remote and err.__traceback__ is None:
        return _last_lines(remote.rstrip())
    found = traceback.TracebackException.from_exception(err)
    if skip_file is not None:
        found.stack = traceback.StackSummary.from_list([f for f in found.stack if f.filename != skip_file])
    return _last_lines("".join(found.format(chain=False)).rstrip())


def _last_lines(text: str) -> str:
    lines = text.splitlines()
    if len(lines) <= TRACEBACK_LINES:
        return text
    return "\n".join([lines[0], "  ...", *lines[-(TRACEBACK_LINES - 2) :]])


@dataclass
class Scores:
    """The outcome of scoring one batch of responses, in order.

    Arguments:
        rewards: the verifier's reward per response, any finite float; NaN where the response has none.
        correct: per response, whether it counts as correct for pass@k: the verifier's ``correct`` when it has one,
            else ``reward >= scoring.correct_threshold``; False where the response has no reward.
        failures: per response, its :class:`Failure`, or None when it was scored.
        components: the verifier's named parts, each the mean over the scored responses (``reward/<name>``).
    """

    rewards: list[float]
    correct: list[bool]
    failures: list[Failure | None]
    components: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rewards)

    @property
    def scored(self) -> list[bool]:
        """Per response: True when it has a reward (it is trained on)."""
        return [f is None for f in self.failures]

    @property
    def failed(self) -> int:
        """Responses without a reward (failed, or left unscored)."""
        return sum(f is not None for f in self.failures)

    def counts(self) -> dict[str, int]:
        """Responses without a reward, by kind (``errors``, ``nan``, ``timeouts``, ``unscored``; zero ones left out)."""
        found = [f.kind for f in self.failures if f is not None]
        return {kind: n for kind in (*KINDS, "unscored") if (n := found.count(kind))}

    def first(self) -> Failure | None:
        """The first failure of the verifier in the batch (an unscored response is not one), or None."""
        return next((f for f in self.failures if f is not None and f.kind != "unscored"), None)


def merge_scores(parts: list[Scores]) -> Scores:
    """Several batches' scores as one (in order), e.g. the rounds of one update; components are left out."""
    return Scores(
        [r for p in parts for r in p.rewards],
        [c for p in parts for c in p.correct],
        [f for p in parts for f in p.failures],
    )


def verifier_label(verifier: Any) -> str:
    """The verifier as a message names it: ``module.Class``, with its ``repr`` when it has one of its own."""
    if inspect.isfunction(verifier) or inspect.ismethod(verifier):
        return f"function {verifier.__module__}.{verifier.__qualname__}"
    cls = type(verifier)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if cls.__repr__ is object.__repr__:
        return name
    text = repr(verifier)
    return name if text == name else f"{name} = {text[:200]}"


def _kinds(counts: dict[str, int]) -> str:
    return ", ".join(f"{kind} {n}" for kind, n in counts.items())


class FailurePolicy:
    """Failing updates in a row; one console line per update with failures; the stop of a run whose reward is broken.

    Arguments:
        max_failure_rate: an update fails when at least this share of its responses have no reward.
        max_failed_updates: failing updates in a row that stop the run.

    State (in checkpoints): failing updates over the run and in a row.
    """

    def __init__(self, max_failure_rate: float = 0.5, max_failed_updates: int = 2) -> None:
        check_range("scoring.max_failure_rate", max_failure_rate, 0.0, 1.0, low_open=True)
        check_int("scoring.max_failed_updates", max_failed_updates, 1)
        self.max_failure_rate = float(max_failure_rate)
        self.max_failed_updates = max_failed_updates
        self.total = 0
        self.in_a_row = 0
        self._first: tuple[int, Failure] | None = None  # the streak's first failure, with its update

    def cut(self, responses: int) -> int:
        """Failures among ``responses`` at which the batch certainly fails: ``⌈max_failure_rate·responses⌉`` (≥ 1).
        The runner stops scoring a batch there (the remaining calls are cancelled, their responses unscored)."""
        return max(1, math.ceil(self.max_failure_rate * responses - 1e-9))

    def fails(self, failed: int, responses: int) -> bool:
        """Whether ``failed`` of ``responses`` is at least the allowed share."""
        return responses > 0 and failed >= self.cut(responses)

    def record(
        self,
        update: int,
        scores: Scores,
        failed: int,
        responses: int,
        verifier: str,
        checkpoint: str,
        say: bool,
    ) -> None:
        """Count update ``update`` (``failed`` of ``responses`` without a reward, over all ranks; ``scores`` is this
        rank's); one console line when any failed (``say``: this rank prints); stop the run when it must.

        Raises:
            VerifierFailedError: this is the ``max_failed_updates``-th failing update in a row.
        """
        first = scores.first()
        if self.fails(failed, responses):
            self.total += 1
            self.in_a_row += 1
            if self._first is None and first is not None:
                self._first = (update, first)
        else:
            self.in_a_row, self._first = 0, None
        if say and failed:
            self._say(f"update {update}", scores, failed, responses, first)
        if self.in_a_row >= self.max_failed_updates:
            what = f"{self.max_failed_updates} updates in a row"
            raise self._stop(what, update, failed, responses, verifier, checkpoint)

    def check_validation(
        self, batch: int, scores: Scores, failed: int, responses: int, verifier: str, checkpoint: str, say: bool
    ) -> None:
        """One console line for a validation batch with failures; stop when at least the allowed share failed (its
        pass@k would be meaningless).

        Raises:
            VerifierFailedError: at least ``max_failure_rate`` of the batch's responses have no reward.
        """
        first = scores.first()
        if say and failed:
            self._say(f"validation batch {batch}", scores, failed, responses, first)
        if self.fails(failed, responses):
            if first is not None:
                self._first = (-1, first)
            raise self._stop("a validation batch", -1, failed, responses, verifier, checkpoint)

    def _say(self, where: str, scores: Scores, failed: int, responses: int, first: Failure | None) -> None:
        streak = f"; {self.in_a_row} failing update(s) in a row, the run stops at {self.max_failed_updates}"
        log.warning(
            "%s: %d of %d responses have no reward (%s), left out of the update; first: %s%s",
            where,
            failed,
            responses,
            _kinds(scores.counts()) or "on another rank",
            first.describe() if first is not None else "on another rank",
            streak if self.in_a_row else "",
        )

    def _stop(
        self, what: str, update: int, failed: int, responses: int, verifier: str, checkpoint: str
    ) -> VerifierFailedError:
        where = "validation" if update < 0 else f"update {update}"
        text = (
            f"the verifier {verifier} failed on at least {self.max_failure_rate:.0%} of the responses of {what} "
            f"({where}: {failed} of {responses} without a reward), so the run stops: its reward is broken. Fix the "
            f"verifier, or raise scoring.max_failure_rate / scoring.max_failed_updates; {checkpoint} holds the last "
            "good weights (no update trained on a failed response)."
        )
        if self._first is not None:
            at, first = self._first
            text += f"\nFirst failure ({'validation' if at < 0 else f'update {at}'}): {first.describe()}"
            if first.traceback:
                text += "\n" + first.traceback
        return VerifierFailedError(text)

    def state_dict(self) -> dict[str, int]:
        return {"failed_updates": self.total, "failed_in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total = int(state.get("failed_updates", 0))
        self.in_a_row = int(state.get("failed_in_a_row", 0))
        self._first = None
