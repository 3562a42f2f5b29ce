"""``MachineShare``: which tests may run at the same time on pytest-xdist's workers (tests/conftest.py takes it)."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


class MachineShare:
    """Who may run now, across pytest-xdist's workers: a test marked ``cores(2)`` keeps two processes busy (FSDP
    ranks, two engines, a grid's two jobs) and runs alone; any other test shares the machine with one more.

    A readers-writer lock on two files (``flock``): shared for ordinary tests, exclusive for ``cores(2)``. The
    turnstile is held while the lock is being taken, so a waiting exclusive test is not starved by the other worker
    taking shared turns back to back.

    Arguments:
        folder: a folder every worker of this run sees (the same ``testrunuid``).
    """

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.turnstile = (folder / "turnstile").open("a+")
        self.machine = (folder / "machine").open("a+")

    @contextlib.contextmanager
    def hold(self, exclusive: bool) -> Iterator[None]:
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self.machine, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(self.turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self.machine, fcntl.LOCK_UN)
