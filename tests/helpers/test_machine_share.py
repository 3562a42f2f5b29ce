"""tests/helpers/machine.py: two ordinary tests share the machine, a ``cores(2)`` test has it alone, and a waiting
``cores(2)`` test is not starved by ordinary tests taken back to back (real processes, real ``flock``)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HOLDER = """
import sys, time
sys.path.insert(0, {tests!r})
from pathlib import Path
from helpers.machine import MachineShare

share = MachineShare(Path({folder!r}))
log = Path({log!r})
for _ in range({turns}):
    with share.hold(exclusive={exclusive}):
        with log.open("a") as f:
            f.write(f"{{time.monotonic():.4f}} in {name}\\n")
        time.sleep({hold_s})
        with log.open("a") as f:
            f.write(f"{{time.monotonic():.4f}} out {name}\\n")
"""
TESTS = str(Path(__file__).resolve().parents[1])  # tests/, where helpers/ lies


def _start(folder: Path, log: Path, name: str, exclusive: bool, turns: int = 1, hold_s: float = 1.0):
    code = HOLDER.format(
        tests=TESTS, folder=str(folder), log=str(log), turns=turns, exclusive=exclusive, name=name, hold_s=hold_s
    )
    return subprocess.Popen([sys.executable, "-c", code])


def _intervals(log: Path) -> dict[str, list[tuple[float, float]]]:
    """Each holder's (in, out) times, from the log the holders wrote."""
    opened: dict[str, float] = {}
    out: dict[str, list[tuple[float, float]]] = {}
    for line in log.read_text().splitlines():
        t, kind, name = line.split()
        if kind == "in":
            opened[name] = float(t)
        else:
            out.setdefault(name, []).append((opened.pop(name), float(t)))
    return out


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_shared_holders_overlap_and_an_exclusive_one_runs_alone(tmp_path: Path) -> None:
    log = tmp_path / "log"
    readers = [_start(tmp_path / "lock", log, f"r{i}", exclusive=False, hold_s=1.5) for i in range(2)]
    time.sleep(0.5)  # both readers are in before the writer asks
    writer = _start(tmp_path / "lock", log, "w", exclusive=True, hold_s=0.5)
    assert [p.wait(timeout=60) for p in (*readers, writer)] == [0, 0, 0]
    spans = _intervals(log)
    assert _overlap(spans["r0"][0], spans["r1"][0])  # two ordinary tests at once
    assert not any(_overlap(spans["w"][0], spans[r][0]) for r in ("r0", "r1"))  # the cores(2) test alone


def test_a_waiting_exclusive_holder_is_not_starved(tmp_path: Path) -> None:
    """A reader that takes turn after turn (the other worker's many fast tests) lets the writer in after at most
    the turn it holds when the writer asks."""
    log = tmp_path / "log"
    reader = _start(tmp_path / "lock", log, "r", exclusive=False, turns=8, hold_s=0.5)
    time.sleep(1.0)
    writer = _start(tmp_path / "lock", log, "w", exclusive=True, hold_s=0.2)
    assert writer.wait(timeout=60) == 0 and reader.wait(timeout=60) == 0
    spans = _intervals(log)
    after = [s for s in spans["r"] if s[0] > spans["w"][0][1]]
    assert len(after) >= 3  # the writer got in while the reader still had turns to take
