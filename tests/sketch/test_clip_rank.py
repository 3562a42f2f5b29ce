"""``logra.clip_rank``: a matrix with fewer inputs than ``rank`` gets rank ``d_in``; with a Hadamard projection at
``rank ≥ d_in`` every sketch is full-rank and orthogonal, so LoGRA's step is the dense step of its rule, checked here
against rules written out on the dense gradient (computed by plain autograd), and a receiver merges the same bits."""

from __future__ import annotations

import copy

import pytest
import torch

from logra_pl.errors import ConfigError
from logra_pl.methods.base import PlanShapes
from logra_pl.methods.logra import LoGRAMethod
from logra_pl.sketch import DEFAULT_TARGETS, LoGRAConfig, LoGRASketcher, Payload, apply_payload, select_targets
from logra_pl.sketch.config import LoGRAConfigError, matrix_rank
from tests.helpers.gradients import dense_target_gradients


def _ids(model, seed: int) -> torch.Tensor:
    return torch.randint(3, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(seed))


def _dense_gradients(model, seed: int) -> dict[str, torch.Tensor]:
    return dense_target_gradients(model, _ids(model, seed))


def test_matrix_rank() -> None:
    assert matrix_rank(64, 128, False) == 64 and matrix_rank(256, 128, True) == 128 and matrix_rank(16, 128, True) == 16


def test_rank_above_d_in_needs_clip_rank(qwen2_factory) -> None:
    model = qwen2_factory(seed=0)  # d_in 128 (attention, gate/up) and 192 (down)
    with pytest.raises(LoGRAConfigError, match="clip_rank"):
        LoGRASketcher(model, LoGRAConfig(rank=192))
    sketcher = LoGRASketcher(qwen2_factory(seed=0), LoGRAConfig(rank=192, clip_rank=True))
    ranks = {n: m.sketch.shape[1] for n, m in sketcher.matrices.items()}
    assert {r for n, r in ranks.items() if "down_proj" in n} == {192}
    assert {r for n, r in ranks.items() if "down_proj" not in n} == {128}


@pytest.mark.parametrize("rule", ["sgd", "rowadam"])
def test_full_rank_orthogonal_sketch_is_the_dense_rule(qwen2_factory, rule: str) -> None:
    """At full rank with orthogonal rows, ``S P = G Pᵀ P = G``: sketched SGD moves ``W`` by ``−lr·G`` and RowAdam by
    its row-normalized ``G`` (the row statistic of ``S`` is that of ``G``: an orthogonal ``P`` keeps row norms)."""
    model = qwen2_factory(seed=0)
    grads = _dense_gradients(model, 1)
    cfg = LoGRAConfig(
        rank=4096,
        clip_rank=True,
        distribution="hadamard",
        update_rule=rule,
        step_mode="lr",
        lr=10.0,
        factor_dtype="float32",
    )  # fmt: skip  (lr 10: steps far above the fp32 rounding of W, so W_after − W_before is the step)
    sketcher = LoGRASketcher(model, cfg)
    before = {n: m.module.weight.detach().double().clone() for n, m in sketcher.matrices.items()}
    ids = _ids(model, 1)
    model(input_ids=ids, labels=ids).loss.backward()
    assert sketcher.apply(sketcher.propose()) is not None
    for name, m in sketcher.matrices.items():
        g = grads[name]
        if rule == "sgd":
            want = -10.0 * g
        else:  # RowAdam at t = 1: v = (1 − β2)·mean_j g², den = sqrt(v/(1 − β2)) + ε·mean, s = min/den normalised
            root = g.square().mean(dim=1, keepdim=True).sqrt()
            den = root + torch.clamp(1e-8 * root.mean(), min=torch.finfo(torch.float32).tiny)
            s = den.min() / den
            s = s / s.square().mean().sqrt()
            d = s * g
            want = -10.0 * d * g.norm() / d.norm()
        moved = m.module.weight.detach().double() - before[name]
        assert float((moved - want).norm() / want.norm()) < 1e-5, name


def test_a_receiver_merges_the_clipped_ranks_bit_for_bit(qwen2_factory) -> None:
    model = qwen2_factory(seed=0)
    receiver = copy.deepcopy(model)
    sketcher = LoGRASketcher(model, LoGRAConfig(rank=160, clip_rank=True, distribution="hadamard", update_ratio=1e-2))
    ids = _ids(model, 2)
    model(input_ids=ids, labels=ids).loss.backward()
    payload = sketcher.apply(sketcher.propose())
    shipped = Payload.from_bytes(payload.to_bytes())
    assert shipped.clip_rank and shipped.matrix_rank(128) == 128 and shipped.matrix_rank(192) == 160
    apply_payload(shipped, receiver)
    for (name, p), q in zip(model.named_parameters(), receiver.parameters(), strict=True):
        assert torch.equal(p, q), name
    # A payload without the setting writes no key for it: its bytes read as before.
    assert "clip_rank" not in Payload(factors={}, update_index=0, base_seed=0, rank=4, distribution="hadamard").header()


def test_the_planner_counts_the_clipped_ranks(qwen2_factory) -> None:
    """``plan_memory`` counts each matrix at its own rank: at full rank a sketch entry per weight entry."""
    with torch.device("meta"):
        model = qwen2_factory(seed=0)
    matrices = select_targets(model, DEFAULT_TARGETS)
    shapes = PlanShapes(matrices, list(model.parameters()), 0)
    report = LoGRAMethod(LoGRAConfig(rank=1024, clip_rank=True)).plan_memory(shapes)
    assert report.sketches == report.dense_gradient_equivalent
    assert report.projections == sum(m.in_features**2 * 4 for m in matrices.values())
    LoGRAMethod(LoGRAConfig(rank=1024, clip_rank=True)).check_fits("tiny", ["q_proj", "down_proj"])  # no rank error
    with pytest.raises(ConfigError, match="clip_rank"):
        LoGRAMethod(LoGRAConfig(rank=1024)).check_fits("tiny", ["q_proj"])
