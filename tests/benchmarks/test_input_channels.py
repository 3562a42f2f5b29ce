"""benchmarks/input_channels.py: each rule's first step is what its formula says, and the measure finds where a
rotated or projected normalization puts a step when one input channel is loud (the geometry the script reports).

A synthetic gradient and inputs, no model: the quick path of what the script measures on SmolLM2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import input_channels  # noqa: E402

from logra_pl.sketch.projection import make_projection  # noqa: E402


def _loud_layer(d_out: int = 32, d_in: int = 64, tokens: int = 256, loud: int = 5, gain: float = 30.0):
    """Inputs with one channel ``gain``× the others and the gradient ``dYᵀ X`` they give."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, d_in, generator=g, dtype=torch.float64)
    x[:, loud] *= gain
    dy = torch.randn(tokens, d_out, generator=g, dtype=torch.float64)
    return dy.T @ x, x


def test_each_rules_first_step_is_its_formula() -> None:
    grad, x = _loud_layer()
    got = input_channels.steps(grad, x, rank=16, seed=3)
    p = make_projection(3, 16, 64, "hadamard").double()
    h = make_projection(3, 64, 64, "hadamard").double()
    assert torch.allclose(h @ h.T, torch.eye(64, dtype=torch.float64), atol=1e-12)  # full rank: orthogonal
    scale = x.pow(2).mean(0).sqrt()
    assert set(got) == set(input_channels.RULES)
    assert torch.equal(got["dense SGD"], grad)
    assert torch.equal(got["dense AdamW"], torch.sign(grad))
    assert torch.allclose(got["LoGRA default rule"], torch.sign(grad @ p.T) @ p)
    assert torch.allclose(got["rotated Adam, full rank"], torch.sign(grad @ h.T) @ h)
    assert torch.allclose(got["input-scaled rule"], torch.sign(grad @ torch.diag(1 / scale) @ p.T) @ p)
    q = p @ torch.diag(1 / scale)
    assert torch.allclose(got["input-scaled, both sides"], torch.sign(grad @ q.T) @ q)
    half = p @ torch.diag(scale.rsqrt())
    assert torch.allclose(got["input-scaled, √ each side"], torch.sign(grad @ half.T) @ half)
    # The built rule is √ each side up to its floor and normalization: the same signs, the same direction.
    built = got["input_scaling: rms"]
    cos = float(
        (built * got["input-scaled, √ each side"]).sum() / built.norm() / got["input-scaled, √ each side"].norm()
    )
    assert cos > 0.99


def test_a_rotated_normalization_follows_the_loud_channel_and_dense_adam_does_not() -> None:
    grad, x = _loud_layer()
    kinds = input_channels.measure(
        {"model.layers.0.self_attn.q_proj": grad}, {"model.layers.0.self_attn.q_proj": x}, rank=16, top=1 / 64
    )
    row = kinds["q_proj"]
    assert row["layers"] == 1
    assert row["loud_share_of_input_energy"] > 0.9  # 30² against 63 channels of 1
    rules = row["rules"]
    # Dense Adam gives the loud column one column's share of the step: 1/64.
    assert abs(rules["dense AdamW"]["weight"] - 1 / 64) < 1e-12
    assert rules["dense AdamW"]["cos_adamw"] > 1 - 1e-12
    # Normalizing in a rotated basis maps back onto the loud column (each rotated coordinate is mostly that column).
    assert rules["rotated Adam, full rank"]["weight"] > 0.5
    # The same normalization on the sketch of G D⁻¹ no longer favours it.
    assert rules["input-scaled rule"]["weight"] < 0.1
    assert rules["input-scaled rule"]["output"] < rules["LoGRA default rule"]["output"]


def test_the_report_has_a_row_per_kind_and_rule() -> None:
    grad, x = _loud_layer()
    result = {
        "model": "synthetic",
        "prompts": 1,
        "rank": 16,
        "top": 1 / 64,
        "kinds": input_channels.measure(
            {"model.layers.0.mlp.down_proj": grad}, {"model.layers.0.mlp.down_proj": x}, rank=16, top=1 / 64
        ),
    }
    text = input_channels.report(result)
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == len(input_channels.RULES)
    assert rows[0].startswith("| down_proj (1) |")
