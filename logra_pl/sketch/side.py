"""Which side of a weight the sketch's projection mixes (algorithm.md §3b), and how the other side maps onto the first.

On the inputs' side (the paper's) a ``d_out × d_in`` matrix ``W`` has the sketch ``S = G Pᵀ`` (``d_out × r``) and the
step ``ΔW = −U P``. On the outputs' side it has ``T = R G`` (``r × d_in``) and ``ΔW = −Rᵀ Uᵀ``... which is the
inputs' side of ``Wᵀ``: ``Tᵀ = Gᵀ Rᵀ`` and ``ΔWᵀ = −U R``. So the sketcher keeps ``Tᵀ`` (``d_in × r``) where it kept
``S``, draws ``R`` (``r × d_out``) where it drew ``P``, and runs every formula of the update unchanged on them; only
the backward's product (:mod:`~logra_pl.sketch.accumulate`), the merge (on ``Wᵀ``, a view) and the probe's layer
change (:mod:`~logra_pl.sketch.probe`) know the side. A dim-0 shard of ``W`` (FSDP) holds rows ``[o, o + n)``: on the
outputs' side those are columns ``[o, o + n)`` of ``Wᵀ``, merged with the same columns of ``R``.
"""

from __future__ import annotations

from typing import Any

import torch

INPUTS, OUTPUTS = "inputs", "outputs"


def sketch_dims(d_out: int, d_in: int, side: str) -> tuple[int, int]:
    """``(rows, width)``: the sketch is ``rows × r`` and its projection ``r × width``."""
    return (d_out, d_in) if side == INPUTS else (d_in, d_out)


def oriented(weight: torch.Tensor, side: str) -> torch.Tensor:
    """The matrix the sketch's step is merged into: ``W`` (inputs), or the view ``Wᵀ`` (outputs)."""
    return weight if side == INPUTS else weight.mT


def merge_span(rows: tuple[int, int], cols: tuple[int, int] | None, side: str) -> dict[str, Any]:
    """The ``row_offset``/``cols`` keyword arguments of :func:`~logra_pl.sketch.merge.merge_stack_` for a block of
    ``W`` holding its rows ``[r0, r1)`` and columns ``cols`` (``None``: all of them): a dim-0 shard, an engine's slice,
    or the whole matrix. On the outputs' side the block's transpose is merged: its columns are rows of ``Wᵀ`` (rows
    of ``F``) and its rows are columns of ``Wᵀ`` (columns of ``R``)."""
    if side == INPUTS:
        return {"row_offset": rows[0], "cols": cols}
    return {"row_offset": 0 if cols is None else cols[0], "cols": rows}
