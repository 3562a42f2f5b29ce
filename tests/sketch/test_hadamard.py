"""Hadamard projections (algorithm.md §2): a subsampled randomized Hadamard transform, exact merges, same bits.

The reference construction here is written independently of the package: ``H`` by Sylvester's recursion
``[[H, H], [H, −H]]`` (not the popcount rule the package evaluates with integer ops), ``B = I_m ⊗ H`` row by row,
and the generator's draws in the order the spec names them.
"""

from __future__ import annotations

import pytest
import torch

from logra_pl.sketch import (
    LoGRAConfig,
    lifted_sq_norm,
    make_projection,
    merge_operand,
    merge_rows_,
    projection_gram,
    sketch_fidelity,
)

# (rank, d_in): powers of two (a true SRHT), 2^k·m with m odd (Qwen2.5-1.5B's 1536 = 512·3), odd d_in (k = 0).
SHAPES = [(1, 1), (3, 7), (16, 64), (64, 64), (12, 96), (32, 200), (256, 1536), (64, 8960)]


def _split(d_in: int) -> tuple[int, int]:
    """``(2^k, m)`` with ``d_in = 2^k·m``, ``m`` odd, by repeated halving."""
    block = 1
    while d_in % 2 == 0:
        d_in //= 2
        block *= 2
    return block, d_in


def _sylvester(block: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def reference_signs(seed: int, rank: int, d_in: int) -> torch.Tensor:
    """``M = P / c`` of the spec, float64: rows ``randperm(d_in)[:r]`` of ``I_m ⊗ H``, columns ``π``, signs ``d``."""
    block, _ = _split(d_in)
    h = _sylvester(block)
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randperm(d_in, generator=gen)[:rank]
    perm = torch.randperm(d_in, generator=gen)
    flips = torch.randint(0, 2, (d_in,), generator=gen)
    b_rows = torch.zeros(rank, d_in, dtype=torch.float64)
    for a, row in enumerate(rows.tolist()):
        start = (row // block) * block
        b_rows[a, start : start + block] = h[row % block]
    return b_rows[:, perm] * (1.0 - 2.0 * flips.double())


def reference_scale(rank: int, d_in: int) -> float:
    """``c = fp32(sqrt(m / r))``."""
    _, m = _split(d_in)
    return float(torch.tensor((m / rank) ** 0.5, dtype=torch.float32))


@pytest.mark.parametrize(("rank", "d_in"), SHAPES)
def test_hadamard_is_the_spec_construction(rank: int, d_in: int) -> None:
    for seed in (0, 5, 2**61 + 3):
        p = make_projection(seed, rank, d_in, "hadamard")
        assert p.dtype == torch.float32 and p.shape == (rank, d_in)
        assert torch.equal(p.double(), reference_signs(seed, rank, d_in) * reference_scale(rank, d_in)), seed


@pytest.mark.parametrize(("rank", "d_in"), SHAPES)
def test_rows_are_orthogonal_with_norm_d_in_over_r(rank: int, d_in: int) -> None:
    """``M Mᵀ = 2^k·I`` exactly (0/±1 entries, float64); ``P Pᵀ = (d_in/r)·I`` to fp32 rounding of ``c``."""
    block, m = _split(d_in)
    p = make_projection(9, rank, d_in, "hadamard")
    c = reference_scale(rank, d_in)
    signs = p.double() / c
    assert set(signs.unique().tolist()) <= {-1.0, 0.0, 1.0}
    assert torch.equal((signs != 0).sum(dim=1), torch.full((rank,), block))  # each row touches 2^k inputs
    assert torch.equal(signs @ signs.T, block * torch.eye(rank, dtype=torch.float64))
    gram = p.double() @ p.double().T
    torch.testing.assert_close(gram, (d_in / rank) * torch.eye(rank, dtype=torch.float64), rtol=1e-6, atol=1e-6)
    # Two rows touch the same 2^k inputs (one block of B, permuted) or disjoint ones: m random blocks in all.
    support = signs != 0
    overlap = support.double() @ support.double().T
    assert set(overlap.unique().tolist()) <= {0.0, float(block)}
    assert len({tuple(row.nonzero().flatten().tolist()) for row in support}) <= m


@pytest.mark.parametrize(("rank", "d_in"), [(8, 16), (8, 24), (4, 12)])
def test_hadamard_is_unbiased(rank: int, d_in: int) -> None:
    """``E[PᵀP] = I``: the mean over many seeds approaches the identity at the Monte-Carlo rate."""
    draws = 4000
    _, m = _split(d_in)
    acc = torch.zeros(d_in, d_in, dtype=torch.float64)
    for seed in range(draws):
        p = make_projection(seed, rank, d_in, "hadamard").double()
        acc += p.T @ p
    mean = acc / draws
    eye = torch.eye(d_in, dtype=torch.bool)
    # Off the diagonal, an entry of PᵀP is ±c² per shared row: variance about 1/r, as for Rademacher.
    assert float(mean[~eye].abs().max()) < 6 / (rank * draws) ** 0.5
    # On it, c² times the number of chosen rows in the input's block: exactly 1 for m = 1, variance < m/r else.
    diag = torch.diag(mean)
    if m == 1:
        torch.testing.assert_close(diag, torch.ones(d_in, dtype=torch.float64), rtol=1e-6, atol=0)
    else:
        assert float((diag - 1).abs().max()) < 6 * (m / (rank * draws)) ** 0.5


def test_same_seed_same_bits_other_seed_differs() -> None:
    a, b = make_projection(11, 16, 96, "hadamard"), make_projection(11, 16, 96, "hadamard")
    assert torch.equal(a, b)
    assert not torch.equal(a, make_projection(12, 16, 96, "hadamard"))
    assert torch.equal(make_projection(11, 16, 96, "hadamard", device="cpu"), a)
    # Every part of the draw matters: the rows, the permutation and the signs all change with the seed.
    supports = {tuple((make_projection(s, 4, 96, "hadamard") != 0).flatten().tolist()) for s in range(8)}
    assert len(supports) == 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("rank", "d_in"), [(16, 64), (256, 1536), (256, 8960)])
def test_cuda_draw_is_bit_identical_to_cpu(rank: int, d_in: int) -> None:
    cpu = make_projection(3, rank, d_in, "hadamard")
    cuda = make_projection(3, rank, d_in, "hadamard", device="cuda")
    assert cuda.device.type == "cuda" and torch.equal(cuda.cpu(), cpu)
    operand, scale = merge_operand(3, rank, d_in, "hadamard", device="cuda")
    cpu_operand, cpu_scale = merge_operand(3, rank, d_in, "hadamard")
    assert scale == cpu_scale and torch.equal(operand.cpu(), cpu_operand)


@pytest.mark.parametrize(
    ("d_out", "d_in", "rank", "dtype"),
    [
        (300, 96, 12, torch.float32),  # m/r = 3/12 = 1/4: c = 1/2, folded into the 0/±1 operand
        (300, 1000, 12, torch.float32),  # 1000 = 8·125: c = sqrt(125/12) multiplies the exact sums
        (257, 640, 32, torch.bfloat16),  # low-precision weights: still one rounding, from float64
        (64, 1536, 256, torch.float32),  # Qwen2.5-1.5B's hidden width
    ],
)
def test_merge_is_exact(d_out: int, d_in: int, rank: int, dtype: torch.dtype) -> None:
    """``W − F P`` with the reference ``P = c·M``: the float64 sums ``F M`` (exact) times ``c``, rounded once."""
    gen = torch.Generator().manual_seed(d_in)
    weight = torch.randn(d_out, d_in, generator=gen).to(dtype)
    factor = (torch.randn(d_out, rank, generator=gen) * torch.logspace(-6, 0, d_out).unsqueeze(1)).bfloat16()
    delta = (factor.double() @ reference_signs(4, rank, d_in)) * reference_scale(rank, d_in)
    expected = (weight.double() - delta).to(dtype)
    operand, scale = merge_operand(4, rank, d_in, "hadamard")
    assert scale == reference_scale(rank, d_in) and torch.equal(operand, reference_signs(4, rank, d_in))
    for chunk_rows in (1, 7, d_out, None):
        merged = weight.clone()
        merge_rows_(merged, factor, operand, scale, chunk_rows=chunk_rows)
        assert torch.equal(merged, expected), chunk_rows
    cut = d_out // 3
    top, bottom = weight[:cut].clone(), weight[cut:].clone()  # two row shards merge the same rows
    merge_rows_(top, factor, operand, scale, row_offset=0)
    merge_rows_(bottom, factor, operand, scale, row_offset=cut)
    assert torch.equal(torch.cat([top, bottom]), expected)


def test_gram_lifted_norm_and_fidelity_hold_for_orthogonal_rows() -> None:
    """``projection_gram`` = ``(d_in/r)·I``, ``lifted_sq_norm`` = ``‖D P‖²``, ``recon_cosine = captured_energy``."""
    rank, d_in, d_out = 32, 1536, 40
    gen = torch.Generator().manual_seed(1)
    p = make_projection(2, rank, d_in, "hadamard")
    gram = projection_gram(p)
    torch.testing.assert_close(gram, (d_in / rank) * torch.eye(rank, dtype=torch.float64), rtol=1e-6, atol=1e-6)
    direction = torch.randn(d_out, rank, generator=gen)
    explicit = float((direction.double() @ p.double()).square().sum())
    assert float(lifted_sq_norm(direction, p)) == pytest.approx(explicit, rel=1e-12)
    assert float(lifted_sq_norm(direction, gram=gram)) == pytest.approx(
        (d_in / rank) * float(direction.double().square().sum()), rel=1e-6
    )
    gradient = torch.randn(d_out, d_in, generator=gen)
    fid = sketch_fidelity(gradient, p)
    assert fid.recon_cosine == pytest.approx(fid.captured_energy, rel=1e-9)
    assert fid.captured_energy == pytest.approx((rank / d_in) ** 0.5, rel=0.2)
    # The reconstruction G Pᵀ P is (d_in/r) times the orthogonal projection of G onto P's row space.
    q, _ = torch.linalg.qr(p.double().T)
    g64 = gradient.double()
    torch.testing.assert_close(g64 @ p.double().T @ p.double(), (d_in / rank) * (g64 @ q @ q.T), rtol=1e-6, atol=1e-9)


def test_config_accepts_hadamard_and_keeps_the_rank_check() -> None:
    assert LoGRAConfig(distribution="hadamard").distribution == "hadamard"
    with pytest.raises(ValueError, match="exceeds the input dimension 10"):
        make_projection(0, 11, 10, "hadamard")
    with pytest.raises(ValueError, match="'rademacher', 'gaussian', 'hadamard'"):
        LoGRAConfig(distribution="srht")
