"""Forming the update from the sketches (algorithm.md §4): RowAdam or SGD directions, then one global scale.

Each function is one formula of the spec, on plain tensors: ``S`` is a (d_out × r) sketch, ``v`` the
(d_out × 1) RowAdam row statistic, ``P`` the (r × d_in) projection.
"""

from __future__ import annotations

import torch

TINY = torch.finfo(torch.float32).tiny


def rowadam_direction(
    sketch: torch.Tensor, row_stat: torch.Tensor, step: int, beta2: float = 0.95, eps: float = 1e-8
) -> tuple[torch.Tensor, torch.Tensor]:
    """One RowAdam step on one matrix; returns ``(D, v_new)`` and leaves the inputs untouched.

    ::

        v    ← β2·v + (1−β2)·mean_j(S_ij²)
        root = sqrt(v / (1 − β2^t))
        den  = root + max(ε·mean(root), tiny)
        s    = min(den) / den ;  s ← s / sqrt(mean(s²))
        D    = s ⊙ S ;  D ← D · ‖S‖_F / ‖D‖_F

    ``t`` (``step``) counts row-statistic updates from 1. A zero sketch gives ``D = 0``.
    """
    if step < 1:
        raise ValueError(f"RowAdam step count starts at 1, got {step}")
    s32 = sketch.to(torch.float32)
    v_new = beta2 * row_stat + (1.0 - beta2) * s32.square().mean(dim=1, keepdim=True)
    root = torch.sqrt(v_new / (1.0 - beta2**step))
    den = root + torch.clamp(eps * root.mean(), min=TINY)
    scale = den.min() / den
    scale = scale / torch.sqrt(scale.square().mean())
    direction = scale * s32
    d_norm = torch.linalg.vector_norm(direction)
    s_norm = torch.linalg.vector_norm(s32)
    # ``if d_norm > 0`` on the device (no host sync): a zero direction is multiplied by 1, which changes no bit.
    restore = torch.where(d_norm > 0, s_norm / d_norm, torch.ones_like(d_norm))
    return direction * restore, v_new


def sgd_direction(sketch: torch.Tensor) -> torch.Tensor:
    """SGD mode: ``D = S``."""
    return sketch.to(torch.float32).clone()


def projection_gram(projection: torch.Tensor) -> torch.Tensor:
    """``P Pᵀ`` in float64, the r × r Gram matrix through which :func:`lifted_sq_norm` measures ``‖D P‖``.

    It depends only on ``P``, so a caller measuring several factors against one projection (the proposal, then
    the guard before the merge) forms it once.
    """
    p64 = projection.to(torch.float64)
    return p64 @ p64.T


def lifted_sq_norm(
    direction: torch.Tensor, projection: torch.Tensor | None = None, *, gram: torch.Tensor | None = None
) -> torch.Tensor:
    """``‖D P‖_F²`` without forming the d_out × d_in product: ``Σ (D (P Pᵀ)) ⊙ D``, an r × r Gram matrix.

    Pass ``projection`` (``P``), or ``gram``: ``P Pᵀ`` from :func:`projection_gram` (the same value, not recomputed).
    Returns a 0-dim float64 tensor on ``D``'s device (reading it is the caller's choice: it syncs the device).
    """
    if gram is None:
        if projection is None:
            raise ValueError("lifted_sq_norm needs the projection or its Gram matrix")
        gram = projection_gram(projection)
    d64 = direction.to(torch.float64)
    return ((d64 @ gram) * d64).sum()


def ratio_scale(
    weight_sq_norm: float | torch.Tensor, lifted_sq_norm_total: float | torch.Tensor, ratio: float
) -> float:
    """``c = update_ratio · sqrt(Σ‖W‖² / Σ‖D P‖²)`` so that ``‖c·D P‖ = update_ratio·‖W‖`` over all matrices.

    A zero total direction (all sketches zero) gives ``c = 0``: no step, never ``0·inf``.
    """
    w = float(weight_sq_norm)
    d = float(lifted_sq_norm_total)
    if d == 0.0:
        return 0.0
    return ratio * (w / d) ** 0.5
