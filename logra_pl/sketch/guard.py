"""Deciding, before a merge, whether an update is safe to merge (the divergence guard's arithmetic).

An update is judged from exact quantities that exist before anything is written: per matrix the weight norm
``‖W_i‖_F`` and the update norm ``‖ΔW_i‖_F = ‖F_i P_i‖_F`` (the bf16 factor that *would* be merged, through the
r × r Gram of its projection). Two rules:

- **size**: ``sqrt(Σ‖ΔW_i‖² / Σ‖W_i‖²) ≤ max_relative`` — one update may not move the trained weights by more than
  this fraction of their norm;
- **finite result**: every ``‖W_i‖`` and ``‖ΔW_i‖`` is finite and ``‖W_i‖_F + ‖ΔW_i‖_F`` stays below the largest
  value of the weight dtype. Every entry of ``W_i − ΔW_i`` is bounded by that sum, so the merge cannot create an
  inf or NaN: checking this bound *is* checking the merged weights, without a pass over them.

A rejected update is never merged, so "rolling it back" is exact by construction: no undo, no rounding.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch


def relative_update(weight_sq_norms: Mapping[str, float], update_sq_norms: Mapping[str, float]) -> float:
    """``sqrt(Σ‖ΔW_i‖² / Σ‖W_i‖²)`` over the matrices of ``update_sq_norms`` (inf when the weights are all zero)."""
    w = sum(float(weight_sq_norms[n]) for n in update_sq_norms)
    u = sum(float(v) for v in update_sq_norms.values())
    if not (math.isfinite(w) and math.isfinite(u)):
        return math.nan
    if w == 0.0:
        return 0.0 if u == 0.0 else math.inf
    return math.sqrt(u / w)


def rejection_reason(
    weight_sq_norms: Mapping[str, float],
    update_sq_norms: Mapping[str, float],
    max_relative: float | None,
    dtype: torch.dtype = torch.float32,
) -> str | None:
    """Why the update must not be merged, or ``None`` when it is safe (see the module docstring)."""
    bad_w = [n for n in update_sq_norms if not math.isfinite(float(weight_sq_norms[n]))]
    if bad_w:
        return f"the weights of {len(bad_w)} matrices are already non-finite, e.g. {bad_w[0]!r}"
    bad_u = [n for n, v in update_sq_norms.items() if not math.isfinite(float(v))]
    if bad_u:
        return f"non-finite update of {len(bad_u)} matrices, e.g. {bad_u[0]!r}"
    limit = float(torch.finfo(dtype).max) if dtype.is_floating_point else math.inf
    for name, u in update_sq_norms.items():
        if math.sqrt(float(weight_sq_norms[name])) + math.sqrt(float(u)) >= limit:
            return f"merging {name!r} could overflow {dtype} (‖W‖ + ‖ΔW‖ ≥ {limit:.3g})"
    rel = relative_update(weight_sq_norms, update_sq_norms)
    if max_relative is not None and rel > max_relative:
        return f"update size ‖ΔW‖/‖W‖ = {rel:.3g} exceeds the guard's max_update_ratio {max_relative:g}"
    return None
