"""benchmarks/gpu_e2e.py in its CPU mode (``--cpu``): ``logra-pl fit`` child processes on the tiny model, killed with
SIGKILL and resumed, for LoGRA, dense AdamW and ``logra_fsdp`` — every check of the GPU run, on a CPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from logra_pl.models.load import load_policy

pytestmark = [pytest.mark.system, pytest.mark.cores(2)]  # the system tier (make test-system); two jobs: runs alone

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_e2e.py"
SCENARIOS = ("logra", "adamw", "logra_fsdp")
# What each scenario must check: a word of each check's name.
CHECKS = ("uninterrupted run", "SIGKILL", "resumed", "weights", "optimizer state", "rewards", "deterministic scalar",
          "responses", "KL calibration", "MemoryMonitor", "RolloutMismatch", "timings", "global step")  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_gpu_e2e_cpu_mode_passes_every_check(tmp_path: Path) -> None:
    out, report_path = tmp_path / "e2e", tmp_path / "e2e.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path]), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(SCRIPT), "--cpu", "--out", str(out), "--json", str(report_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=2300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    checks = report["checks"]
    assert checks and all(c["pass"] for c in checks)
    assert f"{len(checks)}/{len(checks)} checks passed" in proc.stdout
    for scenario in SCENARIOS:
        names = [c["check"] for c in checks if c["check"].startswith(f"{scenario}: ")]
        for word in CHECKS:
            assert sum(word in n for n in names) >= 1, (scenario, word)
        numbers = report[scenario]
        assert all(v > 0 for v in numbers["median_s"].values()), numbers["median_s"]
        assert numbers["peaks_gib"]["memory/peak_rss_bytes"] > 0
        assert max(numbers["kl"]["rel_error"].values()) < 0.10

    # Independently of the script: the resume happened where the kill left it, and training moved the weights the
    # two runs agree on (bit-identical weights of an untrained policy would prove nothing).
    policy = next(out.glob("policy-*"))
    start = load_policy(str(policy))[0].state_dict()
    for scenario in SCENARIOS:
        runs = {kind: out / "runs" / f"{scenario}-{kind}" for kind in ("straight", "resumed")}
        assert [p.name for p in runs["resumed"].iterdir()] == ["version_0"]  # the resume continued the killed run
        assert (out / "logs" / f"{scenario}-resumed-1-killed.log").is_file()
        final = {
            kind: torch.load(run / "version_0" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
            for kind, run in runs.items()
        }
        a, b = (final[k]["state_dict"] for k in ("straight", "resumed"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        moved = [k for k in a if k.endswith("proj.weight") and not torch.equal(a[k], start[k.removeprefix("policy.")])]
        assert len(moved) == 14, scenario  # every q/k/v/o/gate/up/down matrix of both layers
        assert all(math.isfinite(float(v.float().abs().max())) for v in a.values())
