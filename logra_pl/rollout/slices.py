"""Where a trainer matrix lives inside an inference engine's fused, tensor-parallel weights (algorithm.md §9).

Engines such as vLLM fuse ``q/k/v`` into one ``qkv_proj`` and ``gate/up`` into one ``gate_up_proj`` (row blocks
of one tensor), and with tensor parallelism split rows (column-parallel layers) or columns (``o_proj``,
``down_proj``). A LoGRA update ``ΔW = −F P`` is applied to such a slice exactly: rows ``[r0, r1)`` of the
trainer matrix need rows ``[r0, r1)`` of ``F``; columns ``[c0, c1)`` need columns ``[c0, c1)`` of ``P``. The
merge (:func:`logra_pl.sketch.merge.merge_stack_`, the trainer's) forms every entry from the same exact float64
sums, so a sliced receiver ends bit-identical to the trainer's whole matrix. On the outputs' side
(``logra.sketch_side: outputs``, ``ΔWᵀ = −F R``) the block's transpose is merged: its columns ``[c0, c1)`` are rows
of ``Wᵀ`` and need rows ``[c0, c1)`` of ``F``; its rows ``[r0, r1)`` need columns ``[r0, r1)`` of ``R``, drawn at
``d_out``.

Pure PyTorch: the vLLM worker extension reads the shapes from vLLM's layers and calls these functions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from logra_pl.sketch.merge import merge_stack_
from logra_pl.sketch.payload import Payload, stacked_factors, stacked_scales
from logra_pl.sketch.projection import make_projections
from logra_pl.sketch.side import INPUTS, merge_span, oriented


@dataclass(frozen=True)
class EngineSlice:
    """One trainer matrix's block inside an engine parameter, on one tensor-parallel rank.

    Arguments:
        param: the engine parameter's name (e.g. ``model.layers.0.self_attn.qkv_proj.weight``).
        rows: global rows ``[r0, r1)`` of the trainer matrix held on this rank.
        local_row: the engine parameter row where ``rows[0]`` sits.
        cols: global columns ``[c0, c1)`` of the trainer matrix held on this rank.
        d_in: the trainer matrix's full input width (``P`` is drawn at this width, then sliced).
        d_out: the trainer matrix's full output height (an outputs-side ``R`` is drawn at this width); 0: unknown,
            and an outputs-side payload is refused on this slice.
    """

    param: str
    rows: tuple[int, int]
    local_row: int
    cols: tuple[int, int]
    d_in: int
    d_out: int = 0

    @property
    def num_rows(self) -> int:
        """Rows of the block."""
        return self.rows[1] - self.rows[0]


def column_parallel_slices(
    param: str, parts: Sequence[tuple[str, int, int]], d_in: int, tp_rank: int, tp_size: int
) -> dict[str, EngineSlice]:
    """Slices of the matrices fused (stacked by rows) into one column-parallel parameter.

    Each rank holds, for every part in order, one contiguous row shard of that part. A part with ``replicas > 1``
    (grouped-query ``k``/``v`` when there are fewer KV heads than ranks) has ``tp_size // replicas`` distinct
    shards, and rank ``t`` holds shard ``t // replicas``.

    Arguments:
        param: engine parameter name.
        parts: ``(trainer matrix name, its total rows, replicas)`` in fused order (``q, k, v`` / ``gate, up``).
        d_in: input width (every rank holds all columns).
        tp_rank: this rank.
        tp_size: tensor-parallel ranks.
    """
    out: dict[str, EngineSlice] = {}
    local = 0
    for name, total, replicas in parts:
        if tp_size % replicas or total % (tp_size // replicas):
            raise ValueError(f"{name}: {total} rows do not split over {tp_size} ranks with {replicas} replicas")
        size = total // (tp_size // replicas)
        shard = tp_rank // replicas
        out[name] = EngineSlice(param, (shard * size, (shard + 1) * size), local, (0, d_in), d_in, total)
        local += size
    return out


def row_parallel_slice(param: str, d_out: int, d_in: int, tp_rank: int, tp_size: int) -> EngineSlice:
    """Slice of a row-parallel parameter (``o_proj``, ``down_proj``): all rows, one column shard."""
    if d_in % tp_size:
        raise ValueError(f"{param}: {d_in} columns do not split over {tp_size} ranks")
    per = d_in // tp_size
    return EngineSlice(param, (0, d_out), 0, (tp_rank * per, (tp_rank + 1) * per), d_in, d_out)


def apply_payload_to_slices(
    payload: Payload,
    slices: Mapping[str, EngineSlice],
    params: Mapping[str, torch.Tensor],
    chunk_rows: int | None = None,
) -> list[str]:
    """``W ← W − F P`` for every matrix of ``payload`` (outputs' side: ``Wᵀ ← Wᵀ − F R``), on its slice of the
    engine's parameters, in place.

    ``params`` maps engine parameter names to tensors (any device and dtype). Return the matrices merged.
    A payload matrix without a slice is an error: the engine would otherwise silently keep old weights.
    """
    missing = [name for name in payload.factors if name not in slices]
    if missing:
        raise KeyError(
            f"payload matrices {missing[:5]}{'...' if len(missing) > 5 else ''} have no slice in the engine; "
            "was the payload made for another model, or is this layer type not supported for factor sync?"
        )
    outputs = payload.sketch_side != INPUTS
    unsized = [name for name in payload.factors if outputs and slices[name].d_out <= 0]
    if unsized:
        raise ValueError(
            f"an outputs-side payload draws R at each matrix's d_out, which the slices of {unsized[:3]} do not give: "
            "build them with column_parallel_slices / row_parallel_slice, or pass EngineSlice(..., d_out=...)"
        )
    # Blocks of one shape at the same place in their matrices (the same layer kind on every layer) merge together.
    groups: dict[tuple[Any, ...], list[str]] = {}
    for name, factor in payload.factors.items():
        sl, weight = slices[name], params[slices[name].param]
        key = (tuple(factor.shape), sl.num_rows, sl.rows, sl.cols, sl.d_in, sl.d_out, weight.dtype, weight.device)
        groups.setdefault(key, []).append(name)
    for names in groups.values():
        first = slices[names[0]]
        device = params[first.param].device
        blocks = [
            params[slices[n].param].data[slices[n].local_row : slices[n].local_row + slices[n].num_rows] for n in names
        ]
        width = first.d_out if outputs else first.d_in  # the projection's
        projections = make_projections(
            [payload.seed(n) for n in names],
            payload.matrix_rank(width),
            width,
            payload.distribution,
            device=device,
        )
        merge_stack_(
            [oriented(block, payload.sketch_side) for block in blocks],
            stacked_factors(payload, names),
            projections,
            payload.distribution,
            **merge_span(first.rows, first.cols, payload.sketch_side),
            chunk_rows=chunk_rows,
            col_scales=stacked_scales(payload, names, device=device),
        )
    return list(payload.factors)
