"""Merging a factor into a weight (algorithm.md §5): ``W ← W − F P`` with ``F = bf16(U·α)``, in row chunks.

Works on any row range of ``W``: a rank holding rows ``[o, o+n)`` of a dim-0 shard passes those rows and
``row_offset=o`` and gets exactly the rows a whole-matrix merge would produce. Exactness: the product
``F P`` is formed in float64 from the low-precision factor, and Rademacher and Hadamard projections are applied
as ``±1`` (and ``0``) entries times one scale, so every partial sum is exact and the result does not depend on
how rows are chunked or sharded, nor on the BLAS kernel. ``W`` is rounded once, from float64 to its own dtype.

Chunks are as large as a float64 budget allows (:func:`merge_chunk_rows`): on a GPU most matrices merge in one
GEMM and the largest in a few, instead of dozens of small kernels, each with its launch cost on the host.

:func:`merge_stack_` merges a stack of same-shaped matrices (a group, :mod:`logra_pl.sketch.groups`) with batched
GEMMs, as many matrices per GEMM as the budget holds: every entry is the same exact sum, so each matrix gets the
bits a merge of it alone gives. It is the merge of the trainer and of every receiver; :func:`merge_rows_` merges
one matrix, as the per-matrix reference step does. On a CPU, with an exact ``0``/``±1`` operand and no scale left,
``merge_stack_`` lets the GEMM subtract its exact sums from ``W``'s float64 copy (``addmm_``/``baddbmm_`` with
``alpha = −1``) where this process's BLAS is measured to add ``C`` once (:func:`gemm_subtracts_once`): the same
value, rounded once, without writing and re-reading a float64 delta.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from logra_pl.runtime.heap import advise_huge_pages
from logra_pl.sketch.projection import make_projection, sign_scale

# The float64 temporaries of one merge batch (the ``rows × d_in`` deltas, and on a CPU the float64 copies of W's
# rows) stay within this many bytes. GPUs: large chunks, few launches. CPUs: 32 MiB, in one scratch block (see
# :func:`float64_scratch`): whole matrices of a 50M-parameter model merge in one batched GEMM.
MERGE_BUFFER_BYTES = 1024 * 2**20
MERGE_BUFFER_BYTES_CPU = 32 * 2**20
# glibc's malloc serves a block of at least its mmap threshold with a mapping of its own and unmaps it when freed;
# the threshold is dynamic (freeing a mapped block raises it to that block's size) up to 32 MiB on 64-bit systems.
# Freed blocks below it stay in the heap, where they fragment: LoGRA's peak RSS in a 50M-parameter run was 1,186 MiB
# with 32 MiB temporaries from the heap and 923 MiB with 4 MiB ones (benchmarks/compare.py --model-size medium).
# A CPU scratch block asks for more than the ceiling: glibc serves it from a free heap chunk large enough when it
# has one (memory the process holds anyway), else maps it on its own and unmaps it when freed. Either way it never
# raises the threshold and never grows the heap; pages it does not touch are never resident.
MMAP_CEILING_BYTES = 32 * 2**20 + 2**16


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rows this process holds: a DTensor's local shard (FSDP2 shards dim 0), else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor's shards all-gathered (a collective: every rank calls it), else the tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def merge_operand(
    seed: int,
    rank: int,
    d_in: int,
    distribution: str,
    device: torch.device | str | None = None,
    projection: torch.Tensor | None = None,
) -> tuple[torch.Tensor, float]:
    """``(M, c)`` in float64 with ``P = c·M`` exactly as :func:`make_projection` draws it.

    Rademacher: ``M`` holds ``±1`` and ``c = fp32(1/sqrt(r))``. Hadamard: ``M`` holds ``0`` and ``±1`` and
    ``c = fp32(sqrt(m/r))`` (``m`` the odd part of ``d_in``). Both: the sums ``F M`` are exact and ``c`` multiplies
    once (:func:`~logra_pl.sketch.projection.sign_scale`). Gaussian: ``M = P``, ``c = 1``.

    Arguments:
        seed, rank, d_in, distribution: what :func:`make_projection` draws ``P`` from.
        device: where ``P`` is drawn and ``M`` is formed (the weight's device avoids a float64 copy).
        projection: ``P`` already drawn from this seed (the sketcher's, for the update being merged): reused
            instead of drawing it again. ``M`` is derived from it by the same exact ops, so ``(M, c)`` is
            bit-identical either way.
    """
    if projection is None:
        proj = make_projection(seed, rank, d_in, distribution, device=device)
    elif tuple(projection.shape) != (rank, d_in):
        raise ValueError(f"cached projection has shape {tuple(projection.shape)}, expected {(rank, d_in)}")
    else:
        proj = projection if device is None else projection.to(device)
    scale = sign_scale(distribution, rank, d_in)
    if scale is not None:  # every entry is 0 or ±c: sign() recovers M exactly
        return torch.sign(proj).to(torch.float64), scale
    return proj.to(torch.float64), 1.0


def float64_budget(device: torch.device | str) -> int:
    """Bytes of float64 temporaries one step of the merge (or of the grouped sketch step) may hold on ``device``:
    :data:`MERGE_BUFFER_BYTES_CPU` on a CPU, :data:`MERGE_BUFFER_BYTES` elsewhere. Shape and device type only, never
    free memory, so processes on the same kind of device cut their work alike."""
    return MERGE_BUFFER_BYTES_CPU if torch.device(device).type == "cpu" else MERGE_BUFFER_BYTES


def float64_scratch(numel: int, device: torch.device | str) -> torch.Tensor:
    """An uninitialised float64 buffer of ``numel`` entries on ``device``, for temporaries that live one step.

    On a CPU the allocation asks for at least :data:`MMAP_CEILING_BYTES`, above glibc's largest dynamic mmap
    threshold: glibc reuses a free heap chunk of that size if it holds one, else maps the block on its own and
    unmaps it when freed; it never raises the threshold (as freeing a mapped block below the ceiling does, after
    which every smaller temporary of the process comes from, and stays in, the heap). Only the ``numel`` entries
    used are ever touched, so only they become resident.
    """
    device = torch.device(device)
    if device.type != "cpu":
        return torch.empty(numel, dtype=torch.float64, device=device)
    block = torch.empty(max(numel, MMAP_CEILING_BYTES // 8 + 1), dtype=torch.float64, device=device)[:numel]
    advise_huge_pages(block)  # 2 MiB pages: a fresh mapping's first touch faults once per 2 MiB, not per 4 KiB
    return block


def per_batch(count: int, item_bytes: int, device: torch.device | str) -> int:
    """How many of ``count`` items, each with ``item_bytes`` of float64 temporaries, one batch takes within
    :func:`float64_budget` (at least one, at most ``count``)."""
    return max(1, min(count, float64_budget(device) // max(item_bytes, 1)))


def merge_chunk_rows(num_rows: int, d_in: int, device: torch.device | str = "cpu") -> int:
    """Rows per merge chunk on ``device``: as many as keep the float64 ``rows × d_in`` delta within its budget.

    The budget is :data:`MERGE_BUFFER_BYTES_CPU` on a CPU, :data:`MERGE_BUFFER_BYTES` elsewhere; at least one row.
    It depends on the shape and the device type only, never on free memory, so processes merging the same rows on
    the same kind of device chunk them alike. With Rademacher or Hadamard projections every sum is exact and
    chunking cannot change a bit; with Gaussian ones only a BLAS that picks another summation order for another
    shape could.
    """
    return max(1, min(num_rows, float64_budget(device) // (8 * d_in)))


def merge_rows_(
    weight_rows: torch.Tensor,
    factor: torch.Tensor,
    operand: torch.Tensor,
    scale: float,
    row_offset: int = 0,
    chunk_rows: int | None = None,
) -> None:
    """In place: ``weight_rows[i] -= (factor[row_offset + i] @ M) · c`` for every local row ``i``.

    Arguments:
        weight_rows: the local rows of ``W`` (the whole matrix, or one dim-0 shard).
        factor: the full ``(d_out, r)`` factor ``bf16(U·α)``.
        operand: ``M`` from :func:`merge_operand`, float64, ``(r, d_in)``.
        scale: ``c`` from :func:`merge_operand`.
        row_offset: global index of ``weight_rows[0]``.
        chunk_rows: rows per chunk; bounds the temporary float64 ``chunk × d_in`` delta. ``None`` (default):
            :func:`merge_chunk_rows`, the most rows within the device's float64 budget.
    """
    n = weight_rows.shape[0]
    if row_offset < 0 or row_offset + n > factor.shape[0]:
        raise ValueError(
            f"rows [{row_offset}, {row_offset + n}) lie outside the factor's {factor.shape[0]} rows: "
            "pass the shard's global row offset"
        )
    if weight_rows.shape[1] != operand.shape[1] or factor.shape[1] != operand.shape[0]:
        raise ValueError(
            f"shape mismatch: weight rows {tuple(weight_rows.shape)}, factor {tuple(factor.shape)}, "
            f"projection {tuple(operand.shape)}"
        )
    if chunk_rows is None:
        chunk_rows = merge_chunk_rows(n, operand.shape[1], weight_rows.device)
    operand = operand.to(weight_rows.device)
    if scale != 1.0 and power_of_two(scale):
        # A power-of-two scale (Rademacher r = 4, 16, 64...; Hadamard m/r a power of 4) commutes exactly with the
        # exact sums: fold it into the 0/±1 operand.
        operand, scale = operand * scale, 1.0
    with torch.no_grad():
        buffer = torch.empty(min(chunk_rows, n), operand.shape[1], dtype=torch.float64, device=weight_rows.device)
        for start in range(0, n, chunk_rows):
            stop = min(start + chunk_rows, n)
            f = factor[row_offset + start : row_offset + stop].to(device=weight_rows.device, dtype=torch.float64)
            delta = torch.mm(f, operand, out=buffer[: stop - start])
            if scale != 1.0:
                delta.mul_(scale)
            rows = weight_rows[start:stop]
            torch.sub(rows, delta, out=delta)  # float64(W) − ΔW, one rounding, into the same buffer
            rows.copy_(delta)  # rounded once to W's dtype


def power_of_two(scale: float) -> bool:
    """Whether ``scale`` is a power of two: multiplying the exact sums ``F M`` by it is exact, so it is folded into
    the ``0``/``±1`` operand (Rademacher at ``r`` = 4, 16, 64, ...; Hadamard when ``m/r`` is a power of 4)."""
    return math.frexp(scale)[0] == 0.5


def folded_scale(distribution: str, rank: int, d_in: int) -> float | None:
    """``c`` left over after :func:`stack_operand` forms ``M`` (a power-of-two ``c`` is folded into ``M``: 1.0);
    ``None`` where ``M`` is not made of exact ``0``/``±1`` entries (Gaussian: the sums ``F M`` round)."""
    scale = sign_scale(distribution, rank, d_in)
    if scale is None:
        return None
    return 1.0 if power_of_two(scale) else scale


def gemm_subtracts_once(rows: int, width: int, rank: int, batched: bool) -> bool:
    """Whether this process's CPU BLAS forms ``C − A B`` in one call (``C.addmm_(A, B, alpha=-1)``, or
    ``baddbmm_`` when ``batched``) as the two-step ``C − (A B)`` does, when every partial sum of ``A B`` is exact:
    the exact product added to ``C`` with one rounding.

    A GEMM kernel sums ``A B`` in registers and adds ``C`` once per block of the inner dimension; the inner
    dimension here is the sketch rank (tens to hundreds), one block for the BLAS libraries torch ships with, but
    the standard leaves the order open: a kernel that starts its sums from ``C``, or that cuts ``r`` into several
    blocks, would round several times. So the answer is measured, once per process, thread count and shape class
    (the real rank and at most 256 × 2048 of the rows and columns: large enough for a BLAS's packed GEMM path, at
    most 4 MiB per operand), on values where every extra rounding shows: bf16 factors over 21 binades, ``±1``
    operands, full-mantissa float64 ``C``.
    """
    return _subtracts_once(min(rows, 256), min(width, 2048), rank, batched, torch.get_num_threads())


@functools.cache
def _subtracts_once(rows: int, width: int, rank: int, batched: bool, threads: int) -> bool:
    """:func:`gemm_subtracts_once` for one shape class and thread count (``threads``: part of the cache key)."""
    a, b, c, expected = subtraction_probe(rows, width, rank, batched)
    return torch.equal((c.baddbmm_ if batched else c.addmm_)(a, b, alpha=-1), expected)


def subtraction_probe(
    rows: int, width: int, rank: int, batched: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(A, B, C, C − A B)`` in float64 for :func:`gemm_subtracts_once` (two matrices each when ``batched``):
    bf16 ``A`` spread over 21 binades, ``±1`` ``B`` (so ``A B`` is exact: at most 34 significant bits), full-mantissa
    ``C``, and the expected result rounded once. A GEMM that rounds more than once differs from it almost surely."""
    gen = torch.Generator().manual_seed(0)
    lead = (2,) if batched else ()
    binades = torch.randint(-20, 1, (*lead, rows, rank), generator=gen)
    a = torch.ldexp(torch.randn(*lead, rows, rank, generator=gen), binades).bfloat16().to(torch.float64)
    b = torch.randint(0, 2, (*lead, rank, width), generator=gen).to(torch.float64).mul_(2).sub_(1)
    c = torch.randn(*lead, rows, width, generator=gen, dtype=torch.float64)
    return a, b, c, c - torch.matmul(a, b)


def stack_operand(
    projections: torch.Tensor, distribution: str, d_in: int, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, float]:
    """``(M, c)`` of a stack of projections ``(k, r, width)`` (``width`` ≤ ``d_in``: a column slice): float64
    ``M`` with ``P = c·M`` entry for entry, as :func:`merge_operand` forms it for one matrix.

    Rademacher and Hadamard: ``M = sign(P)`` (``0``/``±1``) and ``c`` from
    :func:`~logra_pl.sketch.projection.sign_scale` at the full width ``d_in``; a power-of-two ``c`` is folded into
    ``M`` (exact), leaving ``c = 1``. Gaussian: ``M = P`` in float64, ``c = 1``. ``out``: a float64 buffer of
    ``projections``' shape to form ``M`` in (the values are the same: every step is exact).
    """
    rank = projections.shape[-2]
    scale = sign_scale(distribution, rank, d_in)
    operand = projections.to(torch.float64) if out is None else out.copy_(projections)
    if scale is None:
        return operand, 1.0
    operand.sign_()
    if scale != 1.0 and power_of_two(scale):
        return operand.mul_(scale), 1.0
    return operand, scale


def merge_stack_(
    weights: Sequence[torch.Tensor],
    factors: torch.Tensor,
    projections: torch.Tensor,
    distribution: str,
    *,
    row_offset: int = 0,
    chunk_rows: int | None = None,
    cols: tuple[int, int] | None = None,
    norms: bool = False,
    col_scales: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """In place, for every ``i``: ``weights[i][j] -= (factors[i, row_offset + j] @ M_i) · c`` over its local rows ``j``.

    Arguments:
        weights: same-shaped local rows of ``W`` (whole matrices, dim-0 shards or engine blocks), one dtype and device.
        factors: ``(k, d_out, r)`` factors ``bf16(U·α)``, row ``i`` for ``weights[i]``.
        projections: ``(k, r, d_in)`` fp32 projections, as drawn (:func:`~logra_pl.sketch.projection.make_projections`).
        distribution: what the projections were drawn from (the exact ``0``/``±1`` operand of §5, or Gaussian).
        row_offset: global index of every weight's first local row (a shard's offset; the same for the stack).
        chunk_rows: rows per chunk (``None``: :func:`merge_chunk_rows`, the most within the device's budget).
        cols: ``[c0, c1)`` of ``P``'s columns the weights hold (a tensor-parallel column shard); default all.
        norms: also return ``‖W_i‖`` (float64, ``(k,)``) of the merged weights when the merge holds their float64
            values anyway (on a CPU, whole matrices per chunk): the norms
            :func:`~logra_pl.sketch.groups.stack_weight_norms` computes, bit for bit, without another pass over the
            weights. ``None`` otherwise.
        col_scales: ``(k, d_in)`` bf16-valued per-column scales ``s`` (``logra.input_scaling: rms``: the step is
            ``F P diag(s)``): each delta column is multiplied by the float64 ``c·s_j`` (exact: fp32 times bf16)
            instead of by ``c``, still one rounding after the exact sums; ``None``: no column scale.

    Matrices are merged several at a time (one batched GEMM per chunk of rows): the deltas (and on a CPU the
    float64 copies of W's rows) of a batch within :func:`float64_budget`, plus the stack's operands (``O(k·d_in·r)``,
    converted once) and the batch's factors in float64, all in one :func:`float64_scratch` block. On a CPU, where
    :func:`gemm_subtracts_once` holds for an exact operand with no scale left, the GEMM subtracts from the copies
    of W itself and no delta is formed (the chunks are cut as if it were). ``W`` is rounded once, from
    ``float64(W) − F M c``. Each matrix's result does not depend on the others in the stack, on the chunking, on the
    batching or on which of the two forms ran: with Rademacher and Hadamard projections every sum is exact.
    """
    count = len(weights)
    if count == 0:
        return None
    if factors.shape[0] != count or projections.shape[0] != count:
        raise ValueError(
            f"{count} weights, {factors.shape[0]} factors and {projections.shape[0]} projections: "
            "one of each per matrix"
        )
    n, width = weights[0].shape
    d_in = projections.shape[-1]
    c0, c1 = cols if cols is not None else (0, d_in)
    if any(tuple(w.shape) != (n, width) for w in weights) or len({(w.dtype, w.device) for w in weights}) != 1:
        raise ValueError("merge_stack_ merges weights of one shape, dtype and device; group them first")
    if row_offset < 0 or row_offset + n > factors.shape[1]:
        raise ValueError(
            f"rows [{row_offset}, {row_offset + n}) lie outside the factors' {factors.shape[1]} rows: "
            "pass the shard's global row offset"
        )
    if width != c1 - c0 or factors.shape[2] != projections.shape[1]:
        raise ValueError(
            f"shape mismatch: weight rows {(n, width)}, factors {tuple(factors.shape)}, "
            f"projections {tuple(projections.shape)}, columns {(c0, c1)}"
        )
    device = weights[0].device
    rank = factors.shape[2]
    whole = (c0, c1) == (0, d_in)
    # A CPU subtraction of float32 W from a float64 delta first copies W to float64 (TensorIterator promotes inputs
    # by copying on a CPU): the copies go into a buffer of the batch's rows instead. CUDA kernels cast as they read:
    # there W is subtracted from the delta matrix by matrix.
    copy_w = device.type == "cpu"
    copies = 2 if copy_w else 1  # float64 values per entry of a chunk: the delta (and the copy of W)
    budget = float64_budget(device)
    rows = max(1, min(n, budget // (8 * width * copies) if chunk_rows is None else chunk_rows))
    batch = max(1, min(count, budget // (8 * width * copies * rows)))  # the chunks of a batch of matrices
    # A budget that holds one matrix at a time (tiny:medium's MLP matrices on a CPU): 2-D factors and a plain GEMM
    # per matrix. A CPU ``bmm`` shares its work between threads matrix by matrix, so a batch of one ran on one
    # thread (2 cores: a 2048 × 64 · 64 × 640 float64 product took 4.7 ms through bmm, 2.4 through mm).
    single = batch == 1
    # On a CPU, with an exact 0/±1 operand and no scale left, the GEMM subtracts its exact sums from W's float64
    # copy itself (beta = 1, alpha = −1: one rounding, the value of the two-step float64(W) − F M, where this BLAS
    # is measured to add C once): no delta is written and read back, and the chunks stay what the budget gives the
    # two-step form, so a matrix is cut alike either way. The per-matrix reference and CUDA keep the delta.
    fused = copy_w and col_scales is None and folded_scale(distribution, rank, d_in) == 1.0
    fused = fused and gemm_subtracts_once(rows, width, rank, batched=not single)
    with torch.no_grad():
        # One float64 block: the operands of the whole stack (converted once), then a batch's factors (their local
        # rows), deltas (unless fused) and copies of W (on a CPU).
        op_size, f_size, chunk = count * rank * width, batch * n * rank, batch * rows * width
        delta_size = 0 if fused else chunk
        scratch = float64_scratch(op_size + f_size + delta_size + (chunk if copy_w else 0), device)
        p = projections if whole else projections[:, :, c0:c1]
        operands, scale = stack_operand(p, distribution, d_in, out=scratch[:op_size].view(count, rank, width))
        column = None  # float64 c·s_j of the weights' columns: (k, 1, width)
        if col_scales is not None:
            if tuple(col_scales.shape) != (count, d_in):
                raise ValueError(f"col_scales has shape {tuple(col_scales.shape)}, expected {(count, d_in)}")
            column = col_scales[:, c0:c1].to(device=device, dtype=torch.float64).mul_(scale).unsqueeze(-2)
        f_buf = scratch[op_size : op_size + f_size]
        delta_buf = scratch[op_size + f_size : op_size + f_size + delta_size]
        w64_buf = scratch[op_size + f_size + delta_size :]
        f = factors if (row_offset, n) == (0, factors.shape[1]) else factors[:, row_offset : row_offset + n]
        with_norms = norms and copy_w and rows == n
        out_norms = []
        lead = () if single else (batch,)  # the leading (stack) dimension of factors and deltas
        # The views of a full batch (of whole-row chunks), made once and reused by every such batch.
        full = batch * rows * width
        full_f64 = f_buf.view(*lead, n, rank)
        full_delta = None if fused else delta_buf[:full].view(*lead, rows, width)
        full_current = w64_buf[:full].view(batch, rows, width) if copy_w else None
        full_slots = full_current.unbind(0) if full_current is not None else ()
        for i0 in range(0, count, batch):
            i1 = min(count, i0 + batch)
            k = i1 - i0
            batch_weights = weights[i0:i1]
            every_matrix = (i0, i1) == (0, count)
            if single:
                operand = operands[i0]
                f_batch = full_f64.copy_(f[i0])  # bf16 → float64, exact
            else:
                operand = operands if every_matrix else operands[i0:i1]
                f_out = full_f64 if k == batch else f_buf[: k * n * rank].view(k, n, rank)
                f_batch = f_out.copy_(f if every_matrix else f[i0:i1])  # bf16 → float64, exact
            for start in range(0, n, rows):
                stop = min(start + rows, n)
                size = (stop - start) * width
                every_row = (start, stop) == (0, n)
                reuse = k == batch and stop - start == rows
                f_rows = f_batch if every_row else f_batch[..., start:stop, :]
                w_rows = batch_weights if every_row else [w[start:stop] for w in batch_weights]
                delta = None
                if not fused:
                    # single: (rows, width), subtracted from the (1, rows, width) copy of W by broadcasting
                    delta = (torch.mm if single else torch.bmm)(
                        f_rows,
                        operand,
                        out=full_delta
                        if reuse
                        else delta_buf[: k * size].view(*(() if single else (k,)), stop - start, width),
                    )
                    if column is not None:  # one rounding: the exact sums times the exact c·s_j
                        delta.mul_(column[i0] if single else column[i0:i1])
                    elif scale != 1.0:
                        delta.mul_(scale)
                if not copy_w:
                    for w, d in zip(w_rows, (delta,) if single else delta.unbind(0), strict=True):
                        torch.sub(w, d, out=d)  # float64(W) − ΔW, one rounding
                        w.copy_(d)  # rounded once to W's dtype
                    continue
                if reuse:
                    current, slots = full_current, full_slots
                else:
                    current = w64_buf[: k * size].view(k, stop - start, width)
                    slots = current.unbind(0)
                for w, c in zip(w_rows, slots, strict=True):
                    c.copy_(w)  # float64(W), exact
                if delta is not None:
                    current.sub_(delta)  # float64(W) − ΔW, one rounding
                elif single:
                    slots[0].addmm_(f_rows, operand, alpha=-1)  # the same, in the GEMM
                else:
                    current.baddbmm_(f_rows, operand, alpha=-1)
                for w, c in zip(w_rows, slots, strict=True):
                    w.copy_(c)  # rounded once to W's dtype
                    if with_norms:
                        c.copy_(w)  # float64 of the rounded W, exact
                if with_norms:
                    out_norms.append(torch.linalg.vector_norm(current, dim=(-2, -1)))
    if not with_norms:
        return None
    return out_norms[0] if len(out_norms) == 1 else torch.cat(out_norms)
