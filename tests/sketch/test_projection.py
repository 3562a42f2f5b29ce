"""Seeded projections (algorithm.md §2): reproducible anywhere, unbiased, refreshed or fixed as configured."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from logra_pl.sketch import LoGRAConfig, LoGRASketcher, make_projection, name_hash, projection_seed

_CHILD = """
import sys, torch
from logra_pl.sketch import make_projection, projection_seed
seed = projection_seed(7, 12, sys.argv[1])
torch.save({"seed": seed, "P": make_projection(seed, 32, 200, sys.argv[2])}, sys.argv[3])
"""


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian"])
def test_projection_is_bit_identical_in_another_process(tmp_path, distribution: str) -> None:
    name = "model.layers.3._checkpoint_wrapped_module.mlp.up_proj"
    out = tmp_path / "p.pt"
    env = dict(os.environ, PYTHONHASHSEED="12345")  # a salted hash() would differ here
    subprocess.run([sys.executable, "-c", _CHILD, name, distribution, str(out)], check=True, env=env)
    child = torch.load(out)
    seed = projection_seed(7, 12, "model.layers.3.mlp.up_proj")  # wrapper part stripped
    assert child["seed"] == seed
    assert torch.equal(child["P"], make_projection(seed, 32, 200, distribution))


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
