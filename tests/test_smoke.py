"""The README's run command (the sketch smoke run) prints a real, measured result."""

from __future__ import annotations

import os
import re
import subprocess
import sys


def test_smoke_run_learns_and_ships_exact_payloads() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "logra_pl.smoke", "--updates", "30", "--batch", "32"],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ),
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    out = run.stdout
    before, after = map(float, re.search(r"held-out answer loss: ([\d.]+) -> ([\d.]+)", out).groups())
    assert after < before - 0.3
    assert "30 updates applied, 0 skipped" in out
    assert "bit-identical to the trainer: True" in out
    sync = re.search(r"([\d.]+) MiB of factor payloads vs ([\d.]+) MiB of full bf16", out)
    assert float(sync.group(1)) * 3 < float(sync.group(2))
