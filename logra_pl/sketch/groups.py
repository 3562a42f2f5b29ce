"""Matrices of one shape, stacked: the unit of the grouped sketch step (algorithm.md §4-5).

A decoder has few distinct target shapes (Qwen2: ``q/o``, ``k/v``, ``gate/up``, ``down``), so the sketcher keeps the
per-matrix state of same-shaped matrices in stacked buffers — sketches ``(k, d_out, r)``, projections
``(k, r, d_in)``, row statistics ``(k, d_out, 1)``, first moments ``(k, d_out, r)`` — and runs every formula of the
update once per group on the stack instead of once per matrix. Each matrix's own tensors (``MatrixSketch.sketch``,
``MatrixSketch.projection``, ``LoGRASketcher.row_stats[name]``, ...) are views of its row, so per-matrix readers
(the forward/backward hooks, checkpoints, diagnostics, a data-parallel strategy's all-reduce) see no difference.

A group holds at most :data:`GROUP_SKETCH_BYTES` of sketches, which bounds the transient memory of its batched
formulas (a stack-sized temporary or two), and it never mixes weight dtypes or devices. The float64 formulas (the
Gram matrices, ``‖D P‖²``, ``‖W‖``, the moment transfer) run on as many matrices of a stack at a time as their
float64 temporaries fit the merge's budget (:func:`~logra_pl.sketch.merge.float64_budget`: 32 MiB on a CPU, 1 GiB
on a GPU), at least one, in scratch blocks (:func:`~logra_pl.sketch.merge.float64_scratch`) where they are large:
a process never holds several matrices' float64 copies beyond that.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from logra_pl.sketch.config import matrix_rank
from logra_pl.sketch.merge import float64_scratch, per_batch
from logra_pl.sketch.projection import PackedProjections
from logra_pl.sketch.side import INPUTS, sketch_dims
from logra_pl.sketch.update import matrix_sum, transfer_moment

# Most bytes of fp32 sketches one group stacks (larger sets of same-shaped matrices split into several groups). The
# RowAdam formulas hold one or two stack-sized temporaries, so this also bounds their transient memory.
GROUP_SKETCH_BYTES = 256 * 2**20


def buffer_device(weight: torch.Tensor) -> torch.device:
    """Where a matrix's LoGRA buffers live: its weight's device (a meta weight gives meta buffers: shapes only)."""
    return weight.device


@dataclass
class MatrixGroup:
    """Same-shaped target matrices and their stacked LoGRA state.

    Arguments:
        names: canonical module names, in the model's order.
        linears: their ``nn.Linear`` modules.
        rank: sketch rank ``r``.
        sketch: ``(k, d_out, r)`` fp32 sketches ``S`` (zero between updates).
        row_stats: ``(k, d_out, 1)`` fp32 RowAdam row statistics ``v``.
        moments: ``(k, d_out, r)`` first moments ``m`` in their storage dtype (``logra.beta1 > 0``), else ``None``.
        second_moments: ``(k, d_out, r)`` per-entry second moments ``V`` in the same dtype (``update_rule: adam``),
            else ``None``.
        grams: ``(k, r, r)`` fp32 Grams ``Γ = Σ z zᵀ`` of the update's projected inputs (``input_precondition:
            gram``; zero between updates, all-reduced with the sketches), else ``None``.
        gram_tokens: ``(k,)`` fp32 token counts of those Grams, else ``None``.
        projection: ``(k, r, d_in)`` fp32 projections of the current update (empty until the first is drawn;
            replaced, not overwritten, when a new basis is drawn, so a proposal keeps the ``P`` it was made with);
            ``None`` with ``logra.projection_storage: packed``, where ``packed`` holds them. Readers of the whole
            stack call :meth:`projections`.
        packed: with ``projection_storage: packed``, the projections as their draws
            (:class:`~logra_pl.sketch.projection.PackedProjections`, replaced like ``projection``), else ``None``.
        signs: ``(k, r, d_in)`` bf16 ``sign(P)`` with ``logra.sketch_operands: bfloat16``, else ``None``.
        scales: ``max |P|`` of each matrix (``P = scale·signs``), with the signs, else ``None``.
        input_sq: ``(k, d_in)`` fp32 sums of the update's squared layer inputs (``logra.input_scaling: rms``; zero
            between updates, all-reduced with the sketches), else ``None``.
        input_tokens: ``(k,)`` fp32 token counts of those sums, else ``None``.
        input_ema: ``(k, d_in)`` fp32 EMA of the inputs' per-channel mean squares across updates, else ``None``.
        input_scale: ``(k, d_in)`` fp32 (bf16-valued) per-channel scales ``s`` of the current update (ones until the
            first statistics; replaced, not overwritten, like ``projection``), else ``None``.
        side: ``logra.sketch_side``. On the outputs' side every ``d_out`` above reads ``d_in`` and every ``d_in``
            reads ``d_out`` (the sketch ``Tᵀ`` is ``(k, d_in, r)``, the projections ``R`` are ``(k, r, d_out)``:
            :mod:`logra_pl.sketch.side`); the matrices' weights are merged as ``Wᵀ``.
    """

    names: list[str]
    linears: list[nn.Linear]
    rank: int
    sketch: torch.Tensor
    row_stats: torch.Tensor
    moments: torch.Tensor | None
    projection: torch.Tensor | None
    second_moments: torch.Tensor | None = None
    grams: torch.Tensor | None = None
    gram_tokens: torch.Tensor | None = None
    signs: torch.Tensor | None = None
    scales: list[float] | None = None
    input_sq: torch.Tensor | None = None
    input_tokens: torch.Tensor | None = None
    input_ema: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None
    side: str = INPUTS
    packed: PackedProjections | None = None

    def projections(self) -> torch.Tensor:
        """The ``(k, r, d_in)`` fp32 projections: the stack itself, or (packed) built now, bit for bit, for the
        caller to use and let go."""
        if self.packed is not None:
            return self.packed.expand()
        assert self.projection is not None
        return self.projection

    @property
    def basis(self) -> PackedProjections | torch.Tensor | None:
        """What the current projections are held as (the stack or the packed draws): a new basis is a new object,
        so comparing identities tells whether the basis changed."""
        return self.packed if self.packed is not None else self.projection

    @property
    def size(self) -> int:
        """Matrices in the group."""
        return len(self.names)

    @property
    def d_out(self) -> int:
        """The sketch's rows: the matrices' ``d_out`` (inputs' side) or ``d_in`` (outputs')."""
        return self.sketch.shape[1]

    @property
    def d_in(self) -> int:
        """The projection's width: the matrices' ``d_in`` (inputs' side) or ``d_out`` (outputs')."""
        linear = self.linears[0]
        return sketch_dims(linear.out_features, linear.in_features, self.side)[1]

    @property
    def device(self) -> torch.device:
        return self.sketch.device


def group_matrices(
    linears: Mapping[str, nn.Linear],
    rank: int,
    moment_dtype: torch.dtype | None,
    max_sketch_bytes: int = GROUP_SKETCH_BYTES,
    clip_rank: bool = False,
    second_moment_dtype: torch.dtype | None = None,
    grams: bool = False,
    input_stats: bool = False,
    side: str = INPUTS,
) -> list[MatrixGroup]:
    """Stack ``linears`` by ``(d_out, d_in, weight dtype, device)``, each group in the model's order and within
    ``max_sketch_bytes`` of sketches; groups in the order of their first matrix.

    Arguments:
        linears: ``{canonical name: nn.Linear}`` of the target matrices, in the model's order.
        rank: sketch rank ``r``.
        moment_dtype: storage dtype of the first moments, or ``None`` for none (``logra.beta1 = 0``).
        max_sketch_bytes: the most fp32 sketch bytes one group holds (at least one matrix per group).
        clip_rank: a group's rank is ``min(rank, d_in)`` (:func:`~logra_pl.sketch.config.matrix_rank`).
        second_moment_dtype: storage dtype of per-entry second moments, or ``None`` for none (``update_rule`` not
            ``adam``).
        grams: keep the projected inputs' Gram per matrix (``input_precondition: gram``).
        input_stats: keep the inputs' per-channel statistics and scales (``input_scaling: rms``).
        side: ``logra.sketch_side``: on the outputs' side each group's ``d_out`` and ``d_in`` are its matrices' ``d_in``
            and ``d_out`` (:mod:`logra_pl.sketch.side`).
    """
    keyed: dict[tuple[object, ...], list[str]] = {}
    for name, linear in linears.items():
        w = linear.weight
        rows, width = sketch_dims(linear.out_features, linear.in_features, side)
        keyed.setdefault((rows, width, w.dtype, buffer_device(w)), []).append(name)
    groups: list[MatrixGroup] = []
    for (d_out, d_in, _, device), names in keyed.items():
        r = matrix_rank(rank, d_in, clip_rank)
        per_group = max(1, max_sketch_bytes // (d_out * r * 4))
        for start in range(0, len(names), per_group):
            part = names[start : start + per_group]
            k = len(part)
            groups.append(
                MatrixGroup(
                    names=part,
                    linears=[linears[n] for n in part],
                    rank=r,
                    sketch=torch.zeros(k, d_out, r, dtype=torch.float32, device=device),
                    row_stats=torch.zeros(k, d_out, 1, dtype=torch.float32, device=device),
                    moments=None
                    if moment_dtype is None
                    else torch.zeros(k, d_out, r, dtype=moment_dtype, device=device),
                    projection=torch.empty(0, device=device),
                    second_moments=None
                    if second_moment_dtype is None
                    else torch.zeros(k, d_out, r, dtype=second_moment_dtype, device=device),
                    grams=torch.zeros(k, r, r, dtype=torch.float32, device=device) if grams else None,
                    gram_tokens=torch.zeros(k, dtype=torch.float32, device=device) if grams else None,
                    input_sq=torch.zeros(k, d_in, dtype=torch.float32, device=device) if input_stats else None,
                    input_tokens=torch.zeros(k, dtype=torch.float32, device=device) if input_stats else None,
                    input_ema=torch.zeros(k, d_in, dtype=torch.float32, device=device) if input_stats else None,
                    input_scale=torch.ones(k, d_in, dtype=torch.float32, device=device) if input_stats else None,
                    side=side,
                )
            )
    return groups


def stack_weight_norms(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """``‖W_i‖`` in float64 of same-shaped weights (local rows), as a ``(k,)`` tensor on their device.

    On a GPU one multi-tensor kernel reads the float32 weights and sums their squares in float64
    (``torch._foreach_norm`` with a float64 result): no float64 copy, one or two launches for all. On a CPU a
    float64 norm copies its input to float64 first (``vector_norm(W, dtype=float64)`` does, and the multi-tensor
    kernel is a loop of those); here the copies go into one scratch block
    (:func:`~logra_pl.sketch.merge.float64_scratch`), as many whole matrices at a time as
    :func:`~logra_pl.sketch.merge.per_batch` allows (at least one), and one call norms them all: each matrix's
    norm is the same float64 reduction of the same values as its own ``vector_norm(W_i, dtype=float64)`` (the same
    bits).
    """
    with torch.no_grad():
        device = weights[0].device
        if device.type != "cpu":
            return torch.stack(torch._foreach_norm(list(weights), 2, dtype=torch.float64))
        count, (rows, width) = len(weights), tuple(weights[0].shape)
        batch = per_batch(count, 8 * rows * width, device)
        scratch = float64_scratch(batch * rows * width, device)
        norms = []
        for i0 in range(0, count, batch):
            i1 = min(count, i0 + batch)
            copies = scratch[: (i1 - i0) * rows * width].view(i1 - i0, rows, width)
            for w, c in zip(weights[i0:i1], copies.unbind(0), strict=True):
                c.copy_(w)  # float64(W), exact
            norms.append(torch.linalg.vector_norm(copies, dim=(-2, -1)))
        return norms[0] if len(norms) == 1 else torch.cat(norms)


def stack_grams(projections: torch.Tensor, exact: bool = True, col_scales: torch.Tensor | None = None) -> torch.Tensor:
    """``P_i P_iᵀ`` in float64 (:func:`~logra_pl.sketch.update.projection_gram`) of a ``(k, r, d_in)`` stack:
    ``(k, r, r)``. The float64 copies of ``P`` live in one scratch block
    (:func:`~logra_pl.sketch.merge.float64_scratch`), a budget's worth of matrices at a time. ``col_scales``
    (``(k, d_in)``, ``input_scaling: rms``): the Grams ``Q Qᵀ`` of ``Q = P·diag(s)`` instead (``Q`` exact in
    float64; its sums round, so each matrix gets its own GEMM).

    ``exact``: the entries of ``P`` are ``±c`` (Rademacher, Hadamard), so every sum of the product is exact and one
    batched GEMM gives each matrix its own product's bits. With Gaussian entries the sums round, and a CPU's batched
    GEMM of ``P Pᵀ`` added them in another order than one matrix's (tiny:medium's 64 × 640 projections, in batches
    of 3): then each matrix's Gram is its own GEMM."""
    count, rank, d_in = projections.shape
    batch = per_batch(count, 8 * rank * d_in, projections.device)
    scratch = float64_scratch(batch * rank * d_in, projections.device)
    out = torch.empty(count, rank, rank, dtype=torch.float64, device=projections.device)
    for i0 in range(0, count, batch):
        i1 = min(count, i0 + batch)
        p64 = scratch[: (i1 - i0) * rank * d_in].view(i1 - i0, rank, d_in).copy_(projections[i0:i1])  # exact
        if col_scales is not None:
            p64.mul_(col_scales[i0:i1].unsqueeze(-2))  # ±c (fp32) times bf16-valued s: exact in float64
        if exact and col_scales is None:
            torch.bmm(p64, p64.mT, out=out[i0:i1])  # what projection_gram computes
        else:
            for p, g in zip(p64.unbind(0), out[i0:i1].unbind(0), strict=True):
                torch.mm(p, p.mT, out=g)  # projection_gram's own GEMM
    return out


def stack_lifted_sq_norms(directions: torch.Tensor, grams: torch.Tensor) -> torch.Tensor:
    """``‖D_i P_i‖²`` (:func:`~logra_pl.sketch.update.lifted_sq_norm`) of a ``(k, d_out, r)`` stack (any float dtype)
    through its Grams: ``(k,)`` float64. ``D`` in float64 and ``D·(P Pᵀ)`` live in one scratch block
    (:func:`~logra_pl.sketch.merge.float64_scratch`), a budget's worth of matrices at a time; every entry is the
    value ``lifted_sq_norm`` computes (the product formed in place, the same sum)."""
    count, d_out, rank = directions.shape
    batch = per_batch(count, 16 * d_out * rank, directions.device)
    size = batch * d_out * rank
    scratch = float64_scratch(2 * size, directions.device)
    parts = []
    for i0 in range(0, count, batch):
        i1 = min(count, i0 + batch)
        n = (i1 - i0) * d_out * rank
        d64 = scratch[:n].view(i1 - i0, d_out, rank).copy_(directions[i0:i1])  # exact
        product = torch.bmm(d64, grams[i0:i1], out=scratch[size : size + n].view(i1 - i0, d_out, rank))
        parts.append(matrix_sum(product.mul_(d64)))  # each matrix's bits, in any batch (see matrix_sum)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def stack_transfer(moments: torch.Tensor, old: torch.Tensor, new: torch.Tensor, squared: bool = False) -> torch.Tensor:
    """First moments ``(k, d_out, r)`` (with ``squared``, per-entry second moments) carried from projections ``old``
    to ``new`` (each ``(k, r, d_in)``) by :func:`~logra_pl.sketch.update.transfer_moment`, a budget's worth of
    matrices at a time; in ``moments``' dtype."""
    count, d_out, rank = moments.shape
    batch = per_batch(count, 8 * (2 * rank * old.shape[-1] + d_out * rank), moments.device)
    parts = [
        transfer_moment(moments[i0 : i0 + batch], old[i0 : i0 + batch], new[i0 : i0 + batch], squared)
        for i0 in range(0, count, batch)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)
