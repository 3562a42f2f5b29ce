"""The merge's row chunking changes no bit: any chunk size gives ``W − F P`` as written out here in float64."""

from __future__ import annotations

import pytest
import torch

from logra_pl.sketch import make_projection, merge_chunk_rows, merge_operand, merge_rows_
from logra_pl.sketch import merge as merge_module


def explicit_merge(weight: torch.Tensor, factor: torch.Tensor, seed: int, rank: int, distribution: str) -> torch.Tensor:
    """algorithm.md §5 in one float64 expression: ``W − F P``, rounded once to ``W``'s dtype.

    A Rademacher ``P`` is ``c·M`` with ``M = ±1``, a Hadamard one with ``M`` of ``0``/``±1``: the exact sums ``F M``
    are scaled by ``c`` (the entries' one magnitude) once.
    """
    p = make_projection(seed, rank, weight.shape[1], distribution).double()
    if distribution in ("rademacher", "hadamard"):
        delta = (factor.double() @ torch.sign(p)) * float(p.abs().max())
    else:
        delta = factor.double() @ p
    return (weight.double() - delta).to(weight.dtype)


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian", "hadamard"])
@pytest.mark.parametrize(
    ("d_out", "d_in", "rank", "dtype"),
    [
        (700, 96, 16, torch.float32),  # power-of-two rank: the scale is folded into the ±1 operand
        (300, 1000, 12, torch.float32),  # not a power of two: the scale multiplies the exact sums
        (257, 640, 32, torch.bfloat16),  # low-precision weights: still one rounding, from float64
    ],
)
def test_merge_is_bit_identical_for_every_chunk_size(d_out, d_in, rank, dtype, distribution: str) -> None:
    gen = torch.Generator().manual_seed(d_out + rank)
    weight = torch.randn(d_out, d_in, generator=gen).to(dtype)
    # Factor rows of very different magnitudes, as real RowAdam factors have.
    factor = (torch.randn(d_out, rank, generator=gen) * torch.logspace(-6, 0, d_out).unsqueeze(1)).bfloat16()
    expected = explicit_merge(weight, factor, 3, rank, distribution)
    operand, scale = merge_operand(3, rank, d_in, distribution)
    for chunk_rows in (1, 7, 256, d_out - 1, d_out, 10 * d_out, None):
        merged = weight.clone()
        merge_rows_(merged, factor, operand, scale, chunk_rows=chunk_rows)
        assert torch.equal(merged, expected), chunk_rows


def test_automatic_chunks_split_large_matrices(monkeypatch) -> None:
    """The automatic chunk fills the device's float64 budget; a small budget still merges the same bits."""
    assert merge_chunk_rows(1536, 8960, "cpu") == merge_module.MERGE_BUFFER_BYTES_CPU // (8 * 8960)
    assert merge_chunk_rows(1536, 8960, "cuda") == min(1536, merge_module.MERGE_BUFFER_BYTES // (8 * 8960))
    assert merge_chunk_rows(256, 1536, "cuda") == 256  # whole matrix: one GEMM
    assert merge_chunk_rows(4, 2**40, "cpu") == 1  # never zero rows
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(500, 96, generator=gen)
    factor = (torch.randn(500, 16, generator=gen) * torch.logspace(-6, 0, 500).unsqueeze(1)).bfloat16()
    operand, scale = merge_operand(5, 16, 96, "rademacher")
    whole = weight.clone()
    merge_rows_(whole, factor, operand, scale)  # the default budget holds all 500 rows
    monkeypatch.setattr(merge_module, "MERGE_BUFFER_BYTES_CPU", 8 * 96 * 37)  # 37 rows per chunk
    assert merge_chunk_rows(500, 96, "cpu") == 37
    chunked = weight.clone()
    merge_rows_(chunked, factor, operand, scale)
    assert torch.equal(chunked, whole)
    assert torch.equal(whole, explicit_merge(weight, factor, 5, 16, "rademacher"))


@pytest.mark.parametrize("fused", [True, False], ids=["gemm-subtracts", "delta"])
@pytest.mark.parametrize(
    ("count", "d_out", "d_in", "rank", "budget_rows"),
    [
        (5, 96, 80, 16, None),  # the whole stack in one batched GEMM
        (3, 300, 64, 16, 50),  # one matrix per GEMM, in row chunks of 50
        (7, 40, 64, 4, 40),  # a few whole matrices per batched GEMM, the last batch short
    ],
)
def test_stack_merge_subtracts_in_the_gemm_to_the_same_bits(
    monkeypatch, fused: bool, count: int, d_out: int, d_in: int, rank: int, budget_rows
) -> None:
    """On a CPU the stack merge lets the GEMM subtract from W's float64 copy where the BLAS adds C once; either way
    every matrix gets ``W − F P`` rounded once (written out here), and the norms of the merged weights."""
    monkeypatch.setattr(merge_module, "gemm_subtracts_once", lambda *args, **kwargs: fused)
    if budget_rows is not None:  # the float64 budget of a CPU chunk: its delta and the copy of W
        monkeypatch.setattr(merge_module, "MERGE_BUFFER_BYTES_CPU", 2 * 8 * d_in * budget_rows)
    gen = torch.Generator().manual_seed(count + d_out)
    weights = [torch.randn(d_out, d_in, generator=gen) for _ in range(count)]
    factors = (torch.randn(count, d_out, rank, generator=gen) * torch.logspace(-6, 0, d_out).unsqueeze(1)).bfloat16()
    projections = torch.stack([make_projection(seed, rank, d_in, "rademacher") for seed in range(count)])
    merged = [w.clone() for w in weights]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        norms = merge_module.merge_stack_(merged, factors, projections, "rademacher", norms=True)
    for i, (w, m) in enumerate(zip(weights, merged, strict=True)):
        assert torch.equal(m, explicit_merge(w, factors[i], i, rank, "rademacher")), i
    names = {e.name for e in prof.events()}
    assert bool(names & {"aten::addmm_", "aten::baddbmm_"}) == fused
    assert ("aten::sub_" in names) != fused
    if budget_rows is None or budget_rows >= d_out:  # whole matrices per chunk: the merge gives their norms
        assert norms is not None
        expected = torch.stack([torch.linalg.vector_norm(m, dtype=torch.float64) for m in merged])
        assert torch.equal(norms, expected)
    else:
        assert norms is None


@pytest.mark.parametrize("batched", [False, True])
def test_gemm_subtraction_probe_shows_every_extra_rounding(batched: bool) -> None:
    """The values :func:`gemm_subtracts_once` checks a BLAS on: a GEMM that starts its sums from C, or that adds C
    after each of two blocks of the inner dimension, gives other bits than ``C − A B`` rounded once."""
    a, b, c, expected = merge_module.subtraction_probe(64, 96, 32, batched)
    assert torch.equal(c - (a @ b), expected)  # the exact product, one rounding
    from_c = c.clone()
    for k in range(a.shape[-1]):  # every product added to C as it comes: one rounding per term
        from_c -= a[..., k : k + 1] * b[..., k : k + 1, :]
    assert not torch.equal(from_c, expected)
    two_blocks = c - a[..., :16] @ b[..., :16, :]
    two_blocks -= a[..., 16:] @ b[..., 16:, :]
    assert not torch.equal(two_blocks, expected)
    first = merge_module.gemm_subtracts_once(64, 96, 32, batched)  # measured once per shape class and process
    hits = merge_module._subtracts_once.cache_info().hits
    assert merge_module.gemm_subtracts_once(64, 96, 32, batched) is first
    assert merge_module._subtracts_once.cache_info().hits == hits + 1
