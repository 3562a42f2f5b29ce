"""``update_rule: adam``: Adam on the sketch's ``d_out × r`` coordinates, checked against Adam written out here on the
dense gradient's sketch (plain autograd on a copy, times the fixed ``P``): on a fixed basis the merged weights are
``W − Σ lr·m̂/(√V̂ + ε) P``, the step LoRA's AdamW takes on ``B`` with ``A = P`` frozen. At a basis change the moments
are carried (``V`` by the squared carry) or reset; the state resumes exactly."""

from __future__ import annotations

import copy

import pytest
import torch

from logra_pl.sketch import LoGRAConfig, LoGRASketcher
from logra_pl.sketch.config import LoGRAConfigError
from logra_pl.sketch.update import TINY, entry_adam_direction, transfer_moment
from tests.helpers.gradients import dense_target_gradients

BETA1, BETA2, EPS, LR = 0.9, 0.95, 1e-8, 1e-3


def _ids(model, seed: int) -> torch.Tensor:
    return torch.randint(3, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(seed))


def _dense_gradients(model, seed: int) -> dict[str, torch.Tensor]:
    return dense_target_gradients(model, _ids(model, seed))


def test_the_rule_is_adam_per_entry() -> None:
    gen = torch.Generator().manual_seed(0)
    s, v, m = (torch.randn(3, 5, 4, generator=gen) for _ in range(3))
    v = v.abs()
    d, v_new = entry_adam_direction(s, v, age=3, beta2=BETA2, eps=EPS, numerator=m)
    want_v = BETA2 * v.double() + (1 - BETA2) * s.double().square()
    root = (want_v / (1 - BETA2**3)).sqrt()
    den = root + (EPS * root.mean(dim=(1, 2), keepdim=True)).clamp(min=TINY)
    assert torch.allclose(v_new.double(), want_v, rtol=1e-6)
    assert torch.allclose(d.double(), m.double() / den, rtol=1e-5)
    assert torch.equal(entry_adam_direction(s[1], v[1], 3, BETA2, EPS, m[1])[0], d[1])  # a stack row = one matrix


def test_fixed_basis_adam_is_loras_step_on_b_with_a_frozen(qwen2_factory) -> None:
    """Three updates at lr 1e-3 on a fixed basis, float32 factors: each matrix moves by ``−lr·m̂_t/(√V̂_t + ε·mean)·P``
    with ``m``, ``V`` Adam's moments of ``S_t = G_t Pᵀ``, all written out here from dense gradients."""
    model = qwen2_factory(seed=0)
    cfg = LoGRAConfig(
        rank=8, refresh_every=0, update_rule="adam", beta1=BETA1, beta2=BETA2, step_mode="adam", lr=LR,
        moment_dtype="float32", factor_dtype="float32", base_seed=4,
    )  # fmt: skip
    sketcher = LoGRASketcher(model, cfg)
    projections = {n: m.projection.double().clone() for n, m in sketcher.matrices.items()}
    start = {n: m.module.weight.detach().double().clone() for n, m in sketcher.matrices.items()}
    m = {n: 0.0 for n in projections}
    v = {n: 0.0 for n in projections}
    moved = {n: torch.zeros_like(w) for n, w in start.items()}
    for t in (1, 2, 3):
        grads = _dense_gradients(model, t)
        ids = _ids(model, t)
        model(input_ids=ids, labels=ids).loss.backward()
        assert sketcher.apply(sketcher.propose()) is not None
        for n, p in projections.items():
            s = grads[n] @ p.T
            m[n] = BETA1 * m[n] + (1 - BETA1) * s
            v[n] = BETA2 * v[n] + (1 - BETA2) * s.square()
            root = (v[n] / (1 - BETA2**t)).sqrt()
            den = root + EPS * root.mean()
            moved[n] -= LR * (m[n] / (1 - BETA1**t)) / den @ p
    for n, mat in sketcher.matrices.items():
        got = mat.module.weight.detach().double() - start[n]
        assert float((got - moved[n]).norm() / moved[n].norm()) < 1e-4, n
        assert torch.equal(mat.projection.double(), projections[n])  # the basis never changed
    assert sketcher.second_age == sketcher.moment_age == 3


@pytest.mark.parametrize("transfer", ["project", "reset"])
def test_a_basis_change_carries_or_resets_both_moments(qwen2_factory, transfer: str) -> None:
    model = qwen2_factory(seed=0)
    cfg = LoGRAConfig(rank=8, refresh_every=2, update_rule="adam", beta1=BETA1, momentum_transfer=transfer)
    sketcher = LoGRASketcher(model, cfg)
    for t in (1, 2):
        ids = _ids(model, t)
        old = {n: m.projection.clone() for n, m in sketcher.matrices.items()}
        model(input_ids=ids, labels=ids).loss.backward()
        assert sketcher.apply(sketcher.propose()) is not None
    # Update 2 merged in the basis of updates 0-1; the basis changed for update 2 (index 2) and both moments followed.
    for n, mat in sketcher.matrices.items():
        assert not torch.equal(old[n], mat.projection)
        if transfer == "project":
            assert sketcher.second_age == sketcher.moment_age == 2
            assert bool((sketcher.second_moments[n] >= 0).all()) and bool(sketcher.second_moments[n].any())
        else:
            assert sketcher.second_age == sketcher.moment_age == 0
            assert not bool(sketcher.second_moments[n].any()) and not bool(sketcher.moments[n].any())


def test_the_second_moment_follows_the_variance_of_the_carried_first_moment() -> None:
    """``V ← V (C ∘ C)``: for independent entries, the variance of ``m C``'s entries; the same basis is the identity."""
    gen = torch.Generator().manual_seed(1)
    old, new = torch.randn(4, 12, generator=gen), torch.randn(4, 12, generator=gen)
    v = torch.rand(3, 4, generator=gen, dtype=torch.float64)
    carry = torch.linalg.solve(old.double() @ old.double().T, old.double() @ new.double().T)
    assert torch.allclose(transfer_moment(v, old, new, squared=True), v @ carry.square())
    assert torch.allclose(transfer_moment(v, old, old, squared=True), v)
    samples = torch.randn(200_000, 3, 4, generator=gen, dtype=torch.float64) * v.sqrt()
    empirical = (samples @ carry).square().mean(dim=0)
    assert torch.allclose(empirical, v @ carry.square(), rtol=0.05)


def test_the_state_resumes_exactly(qwen2_factory) -> None:
    cfg = LoGRAConfig(rank=8, refresh_every=0, update_rule="adam", beta1=BETA1, moment_dtype="bfloat16")
    a, b = qwen2_factory(seed=0), qwen2_factory(seed=0)
    straight = LoGRASketcher(a, cfg)
    for t in (1, 2, 3, 4):
        ids = _ids(a, t)
        a(input_ids=ids, labels=ids).loss.backward()
        straight.apply(straight.propose())
        if t == 2:
            saved, weights = copy.deepcopy(straight.state_dict()), copy.deepcopy(a.state_dict())
    b.load_state_dict(weights)
    resumed = LoGRASketcher(b, cfg)
    resumed.load_state_dict(saved)
    for t in (3, 4):
        ids = _ids(b, t)
        b(input_ids=ids, labels=ids).loss.backward()
        resumed.apply(resumed.propose())
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    for n in straight.second_moments:
        assert torch.equal(straight.second_moments[n], resumed.second_moments[n])
    with pytest.raises(LoGRAConfigError, match="update_rule"):
        rowadam = LoGRAConfig.paper(rank=8, refresh_every=0, beta1=BETA1)
        LoGRASketcher(qwen2_factory(seed=0), rowadam).load_state_dict(saved)
