"""Forming and merging the update (algorithm.md §4-5) against references written here from the spec's formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from logra_pl.sketch import LoGRAConfig, LoGRASketcher, rowadam_direction


def rowadam_reference(sketches: list[np.ndarray], beta2: float = 0.95, eps: float = 1e-8) -> list[np.ndarray]:
    """algorithm.md §4 row by row in float64 numpy: one direction per update, row statistic carried over."""
    d_out = sketches[0].shape[0]
    v = np.zeros(d_out)
    out = []
    for t, s in enumerate(sketches, start=1):
        for i in range(d_out):
            v[i] = beta2 * v[i] + (1 - beta2) * np.mean(s[i] ** 2)
        root = np.sqrt(v / (1 - beta2**t))
        den = root + max(eps * root.mean(), np.finfo(np.float32).tiny)
        scale = den.min() / den
        scale = scale / math.sqrt(np.mean(scale**2))
        d = s * scale[:, None]
        d = d * (np.linalg.norm(s) / np.linalg.norm(d))
        out.append(d)
    return out


def test_rowadam_matches_reference_over_five_updates() -> None:
    gen = torch.Generator().manual_seed(0)
    # Rows of very different magnitudes, so the per-row scaling and the bias correction both matter.
    row_scale = torch.logspace(-3, 1, 12, dtype=torch.float64).unsqueeze(1)
    sketches = [(torch.randn(12, 6, generator=gen, dtype=torch.float64) * row_scale).float() for _ in range(5)]
    expected = rowadam_reference([s.double().numpy() for s in sketches])
    v = torch.zeros(12, 1)
    for t, (s, ref) in enumerate(zip(sketches, expected, strict=True), start=1):
        d, v = rowadam_direction(s, v, t)
        np.testing.assert_allclose(d.double().numpy(), ref, rtol=2e-5, atol=1e-9)
        # The Frobenius restore: the direction keeps the layer's sketch norm.
        assert math.isclose(float(d.norm()), float(s.norm()), rel_tol=1e-5)
    # Bias correction matters: t=1 gives a per-row scale of exactly 1/|row rms| (up to the common factor).
    d1, _ = rowadam_direction(sketches[0], torch.zeros(12, 1), 1)
    rms = sketches[0].square().mean(dim=1, keepdim=True).sqrt()
    ratio = (d1 / sketches[0]) * rms
    assert float(ratio.std() / ratio.mean()) < 1e-4


def _fill(sketcher: LoGRASketcher, gen: torch.Generator) -> dict[str, torch.Tensor]:
    filled = {}
    for name, s in sketcher.sketches().items():
        s.copy_(torch.randn(s.shape, generator=gen) * (1 + torch.arange(s.shape[0]).unsqueeze(1)))
        filled[name] = s.clone()
    return filled


@pytest.mark.parametrize("rule", ["rowadam", "sgd"])
def test_merged_update_matches_reference(qwen2_factory, rule: str) -> None:
    """Five updates through the sketcher; each merged ΔW equals −bf16(c·D)·P computed densely here."""
    model = qwen2_factory(seed=1)
    cfg = LoGRAConfig.paper(rank=8, update_rule=rule, update_ratio=1e-3)
    sketcher = LoGRASketcher(model, cfg)
    gen = torch.Generator().manual_seed(1)
    history: dict[str, list[np.ndarray]] = {name: [] for name in sketcher.matrices}
    for _ in range(5):
        sketches = _fill(sketcher, gen)
        before = {n: m.module.weight.detach().clone() for n, m in sketcher.matrices.items()}
        projections = {n: m.projection.clone() for n, m in sketcher.matrices.items()}
        for n, s in sketches.items():
            history[n].append(s.double().numpy())
        directions = {
            n: torch.from_numpy(rowadam_reference(history[n])[-1] if rule == "rowadam" else history[n][-1])
            for n in sketcher.matrices
        }
        w_sq = sum(float(w.double().square().sum()) for w in before.values())
        lifted_sq = sum(float((directions[n] @ projections[n].double()).square().sum()) for n in directions)
        c = cfg.update_ratio * math.sqrt(w_sq / lifted_sq)

        proposal = sketcher.propose()
        assert proposal is not None and math.isclose(proposal.scale, c, rel_tol=1e-6)
        for n, m in proposal.matrices.items():
            torch.testing.assert_close(m.factor.double(), c * directions[n], rtol=5e-5, atol=1e-12)
        sketcher.apply(proposal)

        total_delta = 0.0
        for n, m in sketcher.matrices.items():
            factor = proposal.matrices[n].factor.to(torch.bfloat16).double()
            expected = before[n].double() - factor @ projections[n].double()
            torch.testing.assert_close(m.module.weight.double(), expected, rtol=0, atol=1e-6)
            total_delta += float((m.module.weight.double() - before[n].double()).square().sum())
        # The nominal step has the configured relative size over all selected matrices.
        assert math.isclose(math.sqrt(total_delta / w_sq), cfg.update_ratio, rel_tol=1e-2)
    assert sketcher.num_applied == 5 and sketcher.num_skipped == 0


def test_lr_mode_scales_by_learning_rate(qwen2_factory) -> None:
    model = qwen2_factory(seed=2)
    sketcher = LoGRASketcher(model, LoGRAConfig.paper(rank=4, update_rule="sgd", step_mode="lr", lr=0.5))
    sketches = _fill(sketcher, torch.Generator().manual_seed(2))
    proposal = sketcher.propose()
    for n, m in proposal.matrices.items():
        torch.testing.assert_close(m.factor, 0.5 * sketches[n])


def test_zero_sketch_gives_zero_step(qwen2_factory) -> None:
    model = qwen2_factory(seed=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sketcher = LoGRASketcher(model, LoGRAConfig.paper(rank=8))
    proposal = sketcher.propose()
    assert proposal is not None and proposal.scale == 0.0
    assert all(float(m.factor.abs().max()) == 0.0 for m in proposal.matrices.values())
    payload = sketcher.apply(proposal)
    assert payload is not None and sketcher.num_applied == 1
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_non_finite_sketch_skips_update(qwen2_factory, poison: float) -> None:
    model = qwen2_factory(seed=4)
    sketcher = LoGRASketcher(model, LoGRAConfig.paper(rank=8))
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    model(input_ids=ids, labels=ids).loss.backward()
    assert sketcher.step() is not None  # one good update, so the row statistics are non-zero
    model(input_ids=ids, labels=ids).loss.backward()
    sketcher.sketches()["model.layers.1.self_attn.v_proj"][3, 2] = poison
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    stats = {k: v.clone() for k, v in sketcher.row_stats.items()}

    assert sketcher.step() is None
    assert sketcher.num_skipped == 1 and sketcher.num_applied == 1
    assert "v_proj" in sketcher.last_skip_reason
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k  # bit-identical
    for k, v in sketcher.row_stats.items():
        assert torch.equal(v, stats[k]), k
    # The next update starts clean, on the next projection.
    assert sketcher.update_index == 2
    assert all(float(s.abs().sum()) == 0 for s in sketcher.sketches().values())
    model(input_ids=ids, labels=ids).loss.backward()
    assert sketcher.step() is not None and sketcher.num_applied == 2


def test_non_finite_alpha_skips_merge(qwen2_factory) -> None:
    model = qwen2_factory(seed=5)
    sketcher = LoGRASketcher(model, LoGRAConfig.paper(rank=8))
    _fill(sketcher, torch.Generator().manual_seed(5))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    proposal = sketcher.propose()
    assert sketcher.apply(proposal, alpha=float("nan")) is None
    assert sketcher.num_skipped == 1
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_matrix_ratio_scope_gives_every_matrix_the_same_relative_step(qwen2_factory) -> None:
    model = qwen2_factory(seed=6)
    sketcher = LoGRASketcher(model, LoGRAConfig.paper(rank=8, update_ratio=1e-3, ratio_scope="matrix"))
    _fill(sketcher, torch.Generator().manual_seed(6))
    before = {n: m.module.weight.detach().double().clone() for n, m in sketcher.matrices.items()}
    assert sketcher.step() is not None
    for n, m in sketcher.matrices.items():
        rel = float((m.module.weight.double() - before[n]).norm() / before[n].norm())
        assert math.isclose(rel, 1e-3, rel_tol=1e-2), n


@pytest.mark.parametrize("shape", [(128, 64), (512, 64), (640, 64), (2048, 64), (640, 640)])
def test_matrix_sum_gives_each_matrix_its_own_bits_in_any_stack_and_thread_count(shape: tuple[int, int]) -> None:
    """A float64 sum per matrix is the same alone, in stacks of 2-6 and on 1 or 2 threads (a plain stacked ``sum``
    was not: 640 × 64 in a stack of 6), and it is the exactly rounded sum up to float64 accumulation error."""
    from logra_pl.sketch.update import matrix_sum

    stack = torch.randn(6, *shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    try:
        alone = {t: [matrix_sum(m) for m in stack] for t in (1, 2) if not torch.set_num_threads(t)}
        for t in (1, 2):
            torch.set_num_threads(t)
            for k in (2, 3, 6):
                got = matrix_sum(stack[:k])
                assert all(torch.equal(got[i], alone[1][i]) for i in range(k)), (t, k)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(alone[1], alone[2], strict=True))
    for m, value in zip(stack, alone[1], strict=True):
        exact = math.fsum(m.flatten().tolist())
        assert abs(float(value) - exact) <= 1e-12 * float(m.abs().sum())
