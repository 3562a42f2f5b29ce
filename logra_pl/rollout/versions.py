"""Weight versions of served engines: every rule in one place, for the engine and for the trainer.

A served engine's weights carry a version string. A fresh engine holds ``base:<engine id>`` (:func:`base_version`),
so a restarted engine is recognised; every weight change the trainer makes creates ``<run id>/<n>``
(:func:`run_version`), counted on every training rank, so all ranks know the version the engines must hold without
a message. The rules:

- a change names the version it applies to and the one it creates; applied when the engine holds the former
  (:meth:`VersionLedger.admit`);
- a change that names another version (an update was lost, the engine restarted) is refused with 409: nothing is
  applied twice or on the wrong weights;
- a repeated change whose answer was lost finds its new version in place: answered ``applied: false``, not applied
  again;
- a full load (every served tensor) replaces the weights whatever they were: accepted from any version — it is how
  an engine is repaired; chunks of a load arrive in order (:meth:`VersionLedger.admit_chunk`);
- a generate request that names another version than the engine's is refused with 409
  (:meth:`VersionLedger.check_generate`): nothing is sampled from unexpected weights. Asynchronous trainers add
  two waits, both bounded: a request for a *later* version of the run the engine holds may wait for it
  (``wait_s``, :meth:`VersionLedger.may_arrive`), and a change may wait until the engine has served ``hold_for``
  requests at the version it replaces (:meth:`VersionLedger.holds`), so a slow rank's request is not overtaken.

:class:`VersionLedger` is the engine's side (``logra-pl serve``), :class:`ExpectedVersions` the trainer's
(:class:`~logra_pl.rollout.remote.RemoteEngine`). Both are plain state machines: no I/O, no locks, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from logra_pl.rollout.protocol import NEW_HEADER


def base_version(engine_id: str) -> str:
    """The version of a fresh engine's weights (the model it was started with)."""
    return f"base:{engine_id}"


def run_version(run_id: str, n: int) -> str:
    """The version the ``n``-th weight change of run ``run_id`` creates."""
    return f"{run_id}/{n}"


def run_sequence(version: str | None) -> tuple[str, int] | None:
    """``(run id, n)`` of a :func:`run_version` string; None for any other version (a fresh or partial engine)."""
    if not version or version.startswith(("base:", "partial:")) or "/" not in version:
        return None
    run_id, _, n = version.rpartition("/")
    return (run_id, int(n)) if n.isdigit() else None


def partial_version(new: str) -> str:
    """The version an engine holds while a change to ``new`` is under way (no trainer expects it)."""
    return f"partial:{new}"


class VersionError(Exception):
    """A request the version rules refuse: ``status`` 409 (other weights than it expects) or 400 (malformed)."""

    def __init__(self, status: int, message: str, version: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.version = version


# ------------------------------------------------------------------------------------------------- the engine
class VersionLedger:
    """The weights version one engine holds, and which changes and generate requests it accepts.

    Arguments:
        version: the version held now (a fresh engine: :func:`base_version`).

    Attributes:
        loading: the chunked load in progress, ``{"version", "next", "total"}``, or None.
    """

    def __init__(self, version: str) -> None:
        self.version = version
        self.loading: dict[str, Any] | None = None
        self.served = 0  # generate requests admitted at the current version (what a held change waits for)

    @classmethod
    def fresh(cls, engine_id: str) -> VersionLedger:
        """The ledger of an engine just started with the model's own weights."""
        return cls(base_version(engine_id))

    def check_generate(self, expect: str | None) -> None:
        """Refuse (409) a generate request that expects other weights than the engine holds; None expects any."""
        if expect is not None and expect != self.version:
            raise VersionError(
                409, f"the engine holds weights {self.version!r}, the request expects {expect!r}", self.version
            )

    def admit_generate(self, expect: str | None) -> None:
        """:meth:`check_generate`, then count the request as served by the current version."""
        self.check_generate(expect)
        self.served += 1

    def may_arrive(self, expect: str | None) -> bool:
        """Whether a generate request for ``expect`` can be served by waiting: ``expect`` is a later version of the
        run whose weights the engine holds (an asynchronous trainer's request that overtook the change it needs)."""
        want, have = run_sequence(expect), run_sequence(self.version)
        return want is not None and have is not None and want[0] == have[0] and want[1] > have[1]

    def holds(self, expect: str | None, hold_for: int) -> bool:
        """Whether a change from ``expect`` must still wait: the engine holds ``expect`` and has served fewer than
        ``hold_for`` generate requests at it (the requests asynchronous trainers sampled at that version)."""
        return hold_for > 0 and self.version == expect and self.served < hold_for

    def admit(self, expect: str | None, new: str | None) -> bool:
        """True when a change from ``expect`` to ``new`` must be applied; False when it already was (a repeat).

        Raises :class:`VersionError`: 400 without ``new``, 409 when ``expect`` is not the engine's version.
        """
        if not new:
            raise VersionError(400, f"a weight change needs the {NEW_HEADER} header (the version it creates)")
        if self.version == new:
            return False
        if expect != self.version:
            raise VersionError(
                409,
                f"the engine holds weights {self.version!r}; this change applies to {expect!r}: an update was lost "
                "or the engine restarted — resend the full weights",
                self.version,
            )
        return True

    def admit_chunk(self, expect: str | None, new: str | None, index: int, total: int, full: bool) -> bool:
        """Whether chunk ``index`` of ``total`` of a load creating ``new`` is applied (False: a repeated load).

        Chunk 0 opens the transfer: a ``full`` load is accepted from any version, a partial one (some tensors only)
        must name the engine's version, like a payload. Every later chunk must continue the open transfer in
        order, else 409 (the trainer restarts from chunk 0).
        """
        if index == 0:
            if not new:
                raise VersionError(400, f"a weight change needs the {NEW_HEADER} header (the version it creates)")
            if self.version == new:
                return False
            if not full:
                self.admit(expect, new)
            self.loading = {"version": new, "next": 0, "total": total}
            return True
        if self.loading is None or self.loading["version"] != new or self.loading["next"] != index:
            raise VersionError(
                409,
                f"chunk {index}/{total} of weights {new!r} does not continue the transfer in progress "
                f"({self.loading}): restart the transfer from chunk 0",
                self.version,
            )
        return True

    def begin(self, new: str) -> None:
        """A change to ``new`` is being applied: an error inside the engine leaves a version no trainer expects."""
        self.version = partial_version(new)

    def commit(self, new: str) -> None:
        """The change to ``new`` is complete."""
        self.version = str(new)
        self.served = 0

    def chunk_loaded(self, index: int) -> bool:
        """Chunk ``index`` of the open transfer is in the engine; True when it was the last one."""
        assert self.loading is not None, "no transfer in progress"
        self.loading["next"] = index + 1
        return index + 1 == self.loading["total"]

    def finish_load(self, new: str) -> None:
        """The last chunk's load is complete: the engine holds ``new``."""
        self.commit(new)
        self.loading = None


# ------------------------------------------------------------------------------------------------ the trainer
@dataclass
class ExpectedVersions:
    """What one training rank knows of the served engines' versions.

    Arguments:
        run_id: the same string on every rank; it names this run's versions.

    Attributes:
        seq: weight changes counted so far (every rank counts the ones it took part in).
        expected: the version every engine should hold; None before the first change.
        stale: engines known (on this rank) to hold other weights, until a load they accept.
    """

    run_id: str
    seq: int = 0
    expected: str | None = None
    stale: set[str] = field(default_factory=set)

    def next(self) -> tuple[str | None, str]:
        """A new weight change: ``(the version it applies to, the version it creates)``; the latter is expected."""
        self.seq += 1
        prev, self.expected = self.expected, run_version(self.run_id, self.seq)
        return prev, self.expected

    @property
    def never_synced(self) -> bool:
        """No weight change was made yet: the engines hold weights this run never sent."""
        return self.expected is None

    def current(self) -> bool:
        """True when, as far as this rank knows, every engine holds the expected weights."""
        return self.expected is not None and not self.stale

    def refused(self, engine: str) -> None:
        """``engine`` refused a request (409): it holds other weights until a load it accepts."""
        self.stale.add(engine)

    def accepted(self, engine: str) -> None:
        """``engine`` took a load: it holds the expected weights."""
        self.stale.discard(engine)
