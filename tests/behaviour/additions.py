"""What the code logs or saves beyond the behaviour records, added since they were written.

Every addition is listed with the value it must take in the reference runs (they use none of the new options) and why
it exists; :func:`drop_additions` checks those values and removes them, so that everything else compares bit for bit.
Used by ``tests/test_behaviour.py`` and ``tests/test_legacy_checkpoints.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


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
    # issue 52: the class path of the method that wrote the checkpoint (the records' runs use the built-in ones)
    "method": frozenset(f"logra_pl.methods.{c}" for c in ("LoGRAMethod", "DenseAdamW", "LoRAMethod", "DenseSGD")),
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


def drop_additions(ref: dict[str, Any], mine: dict[str, Any]) -> None:
    """Check the additions in ``mine`` (a run of today's code) against their listed values and remove them from both
    records (``ref`` holds them when it was written after the addition: those scalars are compared as any other)."""
    for tag, (_, check) in ADDED_SCALARS.items():
        # recorded after the addition: compared as every other tag (a notebook record has no scalars)
        if "scalars" not in mine or tag in ref.get("scalars", {}):
            continue
        values = mine["scalars"].pop(tag, None)
        assert values is None or check(list(values.values())), (tag, values)
    found: dict[str, list[object]] = {}
    mine["checkpoint"] = _without_additions(mine["checkpoint"], found)
    ref["checkpoint"] = _without_additions(ref["checkpoint"], {})  # a record made after the additions holds them
    for key, values in found.items():
        allowed = ADDED_KEYS[key]
        allowed = allowed if isinstance(allowed, frozenset) else (allowed, str(allowed))
        assert all(v in allowed for v in values), (
            key,
            values,
        )  # the new options at their defaults
