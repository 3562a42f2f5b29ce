"""How much of a dense gradient a rank-r sketch keeps (LoGRA paper, appendix D.3; algorithm.md §11).

Given the dense gradient ``G`` (d_out × d_in) of one selected matrix and the projection ``P`` (r × d_in) its sketch
uses, two numbers in ``[0, 1]``:

- ``recon_cosine = cos(G, G Pᵀ P)`` (Frobenius): the alignment of the unbiased reconstruction ``G Pᵀ P`` — the
  direction an SGD sketch step moves the weights in — with the true gradient;
- ``captured_energy = ‖G Q‖ / ‖G‖`` with ``Q`` (d_in × r) an orthonormal basis of ``P``'s row space: the fraction
  of ``G``'s norm that lies in the sketch's subspace.

``P``'s rows are not orthonormal (only ``E[PᵀP] = I``), so the two differ. For a random ``G`` with iid entries and
each row ``g``: ``E‖g Q‖² = r`` against ``E‖g‖² = d_in``, so ``captured_energy ≈ sqrt(r/d_in)``; and
``<g, g Pᵀ P> = ‖g Pᵀ‖²`` with ``E‖g Pᵀ‖² = ‖P‖² = d_in``, ``E‖g Pᵀ P‖² = ‖P Pᵀ‖² ≈ d_in²/r + d_in``, so
``recon_cosine ≈ d_in / sqrt(d_in (d_in²/r + d_in)) = sqrt(r/(d_in + r))``. They agree for ``r ≪ d_in``.
``P`` is drawn without looking at ``G`` and its row space is a uniformly random subspace (exactly for Gaussian
``P``, nearly for Rademacher), so the same expectations hold for any fixed ``G``; the gradient's structure changes
only the spread around them (a rank-1 ``G`` varies about ten times more from draw to draw than an isotropic one).

A Hadamard ``P`` (algorithm.md §2) has orthogonal rows of equal norm, ``P Pᵀ = (d_in/r)·I``: then
``G Pᵀ P = (d_in/r)·G Q Qᵀ`` is a scaled orthogonal projection, and ``recon_cosine = captured_energy`` (to
rounding), both ``≈ sqrt(r/d_in)`` since ``E‖G Q‖² = (r/d_in)·E‖G Pᵀ‖² = (r/d_in)·‖G‖²`` for any fixed ``G``. Its
row space is a random subspace of a structured family (for ``d_in = 2^k·m`` with ``m > 1``, each row spans one of
``m`` random ``2^k``-input blocks), so the spread around that value depends more on ``G``'s structure.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class SketchFidelity(NamedTuple):
    """``recon_cosine`` and ``captured_energy`` of one matrix (both NaN for a zero gradient)."""

    recon_cosine: float
    captured_energy: float


def sketch_fidelity(
    gradient: torch.Tensor, projection: torch.Tensor, dtype: torch.dtype = torch.float64
) -> SketchFidelity:
    """``cos(G, G Pᵀ P)`` and ``‖G Q‖ / ‖G‖`` of a dense gradient ``G`` under a projection ``P``.

    Neither forms a d_out × d_in product beyond ``G`` itself: with ``S = G Pᵀ`` (d_out × r),
    ``<G, G Pᵀ P> = ‖S‖²`` and ``‖G Pᵀ P‖² = Σ (S (P Pᵀ)) ⊙ S`` (an r × r Gram matrix), and ``Q`` comes from the
    reduced QR decomposition of ``Pᵀ`` (d_in × r).

    Arguments:
        gradient: ``G``, shape ``(d_out, d_in)``, any float dtype and device.
        projection: ``P``, shape ``(r, d_in)``, full row rank (as :func:`~logra_pl.sketch.make_projection` draws it).
        dtype: the dtype the arithmetic runs in (float64 by default).
    """
    if gradient.dim() != 2 or projection.dim() != 2 or gradient.shape[1] != projection.shape[1]:
        raise ValueError(
            f"gradient (d_out, d_in) and projection (r, d_in) must share d_in: got {tuple(gradient.shape)} and "
            f"{tuple(projection.shape)}"
        )
    with torch.no_grad():
        g = gradient.detach().to(dtype)
        p = projection.detach().to(device=g.device, dtype=dtype)
        g_sq = float(torch.linalg.vector_norm(g)) ** 2
        if g_sq == 0.0 or not torch.isfinite(torch.tensor(g_sq)):
            return SketchFidelity(float("nan"), float("nan"))
        s = g @ p.T
        s_sq = float((s * s).sum())
        lifted_sq = float(((s @ (p @ p.T)) * s).sum())
        cosine = s_sq / (g_sq**0.5 * lifted_sq**0.5) if lifted_sq > 0 else 0.0
        q, _ = torch.linalg.qr(p.T, mode="reduced")
        captured = float(torch.linalg.vector_norm(g @ q)) / g_sq**0.5
    return SketchFidelity(cosine, captured)
