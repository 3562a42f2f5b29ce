"""Seeded projections (algorithm.md §2): reproducible anywhere, unbiased, refreshed or fixed as configured."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from logra_pl.sketch import LoGRAConfig, LoGRASketcher, make_projection, name_hash, projection_seed
from logra_pl.sketch.projection import rademacher_words

_CHILD = """
import sys, torch
from logra_pl.sketch import make_projection, projection_seed
seed = projection_seed(7, 12, sys.argv[1])
torch.save({"seed": seed, "P": make_projection(seed, 32, 200, sys.argv[2])}, sys.argv[3])
"""


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian", "hadamard"])
def test_projection_is_bit_identical_in_another_process(tmp_path, distribution: str) -> None:
    name = "model.layers.3._checkpoint_wrapped_module.mlp.up_proj"
    out = tmp_path / "p.pt"
    env = dict(os.environ, PYTHONHASHSEED="12345")  # a salted hash() would differ here
    subprocess.run([sys.executable, "-c", _CHILD, name, distribution, str(out)], check=True, env=env)
    child = torch.load(out)
    seed = projection_seed(7, 12, "model.layers.3.mlp.up_proj")  # wrapper part stripped
    assert child["seed"] == seed
    assert torch.equal(child["P"], make_projection(seed, 32, 200, distribution))


def _numpy_rademacher(seed: int, rank: int, d_in: int) -> np.ndarray:
    """The spec's Rademacher ``P`` (algorithm.md §2), written independently of the package: the words come from a
    CPU generator, and numpy reads entry ``k`` as bit ``k mod 64`` of word ``k // 64`` (LSB first, set bit = +)."""
    gen = torch.Generator().manual_seed(seed)
    n = rank * d_in
    words = torch.empty((n + 63) // 64, dtype=torch.int64).random_(-(2**63), None, generator=gen).numpy()
    bits = (words.view(np.uint64)[:, None] >> np.arange(64, dtype=np.uint64)) & np.uint64(1)
    scale = np.float32(1.0 / rank**0.5)
    return np.where(bits.reshape(-1)[:n] == 1, scale, -scale).astype(np.float32).reshape(rank, d_in)


@pytest.mark.parametrize(("rank", "d_in"), [(1, 1), (3, 5), (8, 24), (7, 100), (64, 128), (256, 1536)])
def test_rademacher_is_the_packed_bits_unpacked(rank: int, d_in: int) -> None:
    """P is the generator's 64-bit words read bit by bit: entries exactly ±fp32(1/sqrt(r)), in the spec's order."""
    for seed in (0, 1, 2**61 + 12345):
        p = make_projection(seed, rank, d_in)
        assert p.dtype == torch.float32 and p.shape == (rank, d_in)
        np.testing.assert_array_equal(p.numpy(), _numpy_rademacher(seed, rank, d_in))
        assert torch.equal(p.abs(), torch.full_like(p, np.float32(1.0 / rank**0.5)))
    assert rademacher_words(5, rank, d_in).shape == ((rank * d_in + 63) // 64,)


def test_rademacher_signs_are_balanced_and_uncorrelated() -> None:
    """Signs are fair coins: every row and column sum is within a few standard deviations of 0."""
    rank, d_in = 256, 1536
    signs = torch.sign(make_projection(3, rank, d_in)).to(torch.float64)
    assert abs(float(signs.sum())) < 5 * (rank * d_in) ** 0.5
    assert float(signs.sum(dim=1).abs().max()) < 5 * d_in**0.5
    assert float(signs.sum(dim=0).abs().max()) < 5 * rank**0.5
    # Neighbouring entries (same word, adjacent words) do not repeat each other.
    flat = signs.reshape(-1)
    for lag in (1, 8, 63, 64, 65):
        assert abs(float((flat[lag:] * flat[:-lag]).mean())) < 5 / flat.numel() ** 0.5


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian"])
def test_same_seed_same_projection_other_seed_differs(distribution: str) -> None:
    a, b = make_projection(11, 16, 40, distribution), make_projection(11, 16, 40, distribution)
    assert torch.equal(a, b)
    assert not torch.equal(a, make_projection(12, 16, 40, distribution))
    assert torch.equal(make_projection(11, 16, 40, distribution, device="cpu"), a)


def test_gaussian_is_the_generators_normal_draw_scaled() -> None:
    """A Gaussian P is torch.randn from the seeded CPU generator, times fp32(1/sqrt(r)) (values unchanged)."""
    rank, d_in = 12, 50
    expected = torch.randn((rank, d_in), generator=torch.Generator().manual_seed(21)) * (1.0 / rank**0.5)
    assert torch.equal(make_projection(21, rank, d_in, "gaussian"), expected)


def test_seed_mixes_base_update_and_name() -> None:
    base = projection_seed(1, 5, "a.q_proj")
    assert base == (1 * 1_000_003 + 5 * 7_919 + name_hash("a.q_proj")) % 2**62
    others = {projection_seed(2, 5, "a.q_proj"), projection_seed(1, 6, "a.q_proj"), projection_seed(1, 5, "a.k_proj")}
    assert base not in others and len(others) == 3
    assert projection_seed(1, 5, "_orig_mod.a.q_proj") == base
    assert projection_seed(1, 5, "module.a._fsdp_wrapped_module.q_proj") == base


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian"])
def test_projection_is_unbiased(distribution: str) -> None:
    """E[PᵀP] = I: the mean over many seeds approaches the identity at the Monte-Carlo rate."""
    rank, d_in, draws = 8, 24, 4000
    acc = torch.zeros(d_in, d_in, dtype=torch.float64)
    for seed in range(draws):
        p = make_projection(seed, rank, d_in, distribution).to(torch.float64)
        acc += p.T @ p
    mean = acc / draws
    eye = torch.eye(d_in, dtype=torch.float64)
    # Each off-diagonal entry of PᵀP has variance 1/r; its mean over `draws` has std 1/sqrt(r·draws) ≈ 0.0056.
    assert float((mean - eye).abs().max()) < 6 / (rank * draws) ** 0.5
    if distribution == "rademacher":
        p = make_projection(0, rank, d_in, distribution)
        assert torch.equal(p.abs(), torch.full_like(p, rank**-0.5))
        assert torch.allclose(torch.diag(p.T @ p), torch.ones(d_in))  # exactly 1 on the diagonal
    else:
        diag = torch.diag(mean)
        assert float((diag - 1).abs().max()) < 6 * (2 / (rank * draws)) ** 0.5


@pytest.mark.parametrize("refresh", [True, False])
def test_refresh_changes_projection_every_update(qwen2_factory, refresh: bool) -> None:
    model = qwen2_factory(seed=0)
    sketcher = LoGRASketcher(model, LoGRAConfig(rank=8, refresh=refresh))
    name = "model.layers.1.mlp.gate_proj"
    seen = []
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    for _ in range(3):
        seen.append(sketcher.matrices[name].projection.clone())
        model(input_ids=ids, labels=ids).loss.backward()
        assert sketcher.step() is not None
    assert sketcher.update_index == 3
    same = [torch.equal(seen[0], p) for p in seen[1:]]
    assert same == ([False, False] if refresh else [True, True])
