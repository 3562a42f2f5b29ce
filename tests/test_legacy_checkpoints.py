"""Checkpoints written before the package was regrouped into wings load and resume bit for bit.

``tests/behaviour/legacy/`` holds a CLI checkpoint and a notebook checkpoint (its hyper-parameters pickle settings
objects under their old module paths) written by the code before the move, each with the record of resuming it to
update 4 on that code (:mod:`tests.behaviour.legacy`). Here both are resumed by today's code in a child process with
one thread: the weights, the checkpoint's contents and (CLI) every logged scalar must equal the record on the CPU kind
it was written on; elsewhere the structure is compared and the test says why the values were not.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.behaviour.additions import drop_additions
from tests.behaviour.legacy import LEGACY, run_cli, run_notebook_resume
from tests.behaviour.scenarios import capture, diff, fingerprint, structure

pytestmark = pytest.mark.slow


def _compare(ref: dict, mine: dict) -> None:
    assert sorted(mine["weights"]) == sorted(ref["weights"]), "the policy's tensors changed"
    assert diff(structure(ref["checkpoint"]), structure(mine["checkpoint"])) == []
    if ref["fingerprint"] != fingerprint():
        pytest.skip(
            f"structure checked; values were recorded on {ref['fingerprint']} and this machine is {fingerprint()}"
        )
    for key in ("weights", "checkpoint", "scalars", "reward", "global_step"):
        if key in ref:
            assert diff(ref[key], mine[key]) == [], key


def test_a_cli_checkpoint_of_the_old_layout_resumes_bit_for_bit(tmp_path: Path) -> None:
    ref = json.loads((LEGACY / "cli_update4.json").read_text())
    ckpt = tmp_path / "cli_update2.ckpt"  # resumed from a copy: the run writes beside nothing of the repository
    shutil.copy(LEGACY / "cli_update2.ckpt", ckpt)
    mine = capture(run_cli(tmp_path / "resumed", 4, ckpt=ckpt))
    drop_additions(ref, mine)  # what was added since the record, checked at its listed value and set aside
    assert sorted(mine["scalars"]) == sorted(ref["scalars"]), "logged scalar tags changed"
    resumed = {tag: set(steps) for tag, steps in mine["scalars"].items() if tag != "hp_metric"}
    assert all(steps <= {"2", "3"} for steps in resumed.values()), resumed  # updates 3 and 4 only (steps from 0)
    _compare(ref, mine)


def test_a_notebook_checkpoint_of_the_old_layout_loads_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    """Its hyper-parameters pickle settings objects under the module paths of the old layout."""
    raw = torch.load(LEGACY / "notebook_update2.ckpt", map_location="cpu", weights_only=False)
    assert type(raw["hyper_parameters"]["rollout"]).__name__ == "RolloutSettings"  # unpickled through old paths
    assert raw["hyper_parameters"]["rollout"].max_new_tokens == 8
    ckpt = tmp_path / "notebook_update2.ckpt"
    shutil.copy(LEGACY / "notebook_update2.ckpt", ckpt)
    mine = run_notebook_resume(ckpt, tmp_path)
    ref = json.loads((LEGACY / "notebook_update4.json").read_text())
    assert mine["global_step"] == ref["global_step"] == 4
    drop_additions(ref, mine)
    _compare(ref, mine)
