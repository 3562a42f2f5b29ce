"""Memory accounting by kind: the sketch is d_out·r, the dense gradient it replaces d_out·d_in."""

from __future__ import annotations

import torch
from torch import nn

from logra_pl.sketch import LoGRAConfig, LoGRASketcher, memory_report
from logra_pl.sketch.memory import MiB


def _one_matrix() -> nn.Module:
    root = nn.Module()
    root.q_proj = nn.Linear(4096, 4096, bias=False)
    return root


def test_4096_square_at_rank_64() -> None:
    model = _one_matrix()
    sketcher = LoGRASketcher(model, LoGRAConfig(targets=("q_proj",), rank=64))
    x = torch.randn(4, 4096)
    model.q_proj(x).sum().backward()
    report = memory_report(model, sketcher=sketcher)
    assert report.sketches == 1 * MiB  # 4096 × 64 fp32
    assert report.dense_gradient_equivalent == 64 * MiB
    assert report.gradients == 0
    assert report.weights == 64 * MiB
    assert report.projections == 1 * MiB  # 64 × 4096 fp32
    assert report.row_statistics == 4096 * 4

    # The dense alternative, measured the same way: a real fp32 gradient and Adam's two moments.
    dense = _one_matrix()
    opt = torch.optim.Adam(dense.parameters())
    dense.q_proj(x).sum().backward()
    opt.step()
    dense_report = memory_report(dense, optimizer=opt)
    assert dense_report.gradients == 64 * MiB
    assert dense_report.optimizer_state >= 128 * MiB
    assert report.total < dense_report.total / 3


def test_shared_storage_counted_once(qwen2_factory) -> None:
    model = qwen2_factory(seed=0, tie_word_embeddings=True)
    report = memory_report(model)
    unique = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    buffers = sum(b.untyped_storage().nbytes() for b in model.buffers())
    assert report.weights == sum(unique.values()) + buffers
    assert "sketches" in report.format() and report.as_mib()["total"] == report.total / MiB
