"""``logra.moment_reference_kl``: the first moment's horizon as a distance in policy space (algorithm.md §4).

Each update decays ``m`` by ``β1^√(κ/κ_ref)``, ``κ`` the KL the last merged update was priced at, and ``m̂`` is the
weighted mean of the sketches. Checked against that weighted mean written out here from dense gradients (plain
autograd on a copy, times the fixed ``P``), for SGD and Adam in sketch space; a resume continues bit for bit."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from logra_pl.sketch import LoGRAConfig, LoGRASketcher
from logra_pl.sketch.config import LoGRAConfigError
from logra_pl.sketch.update import horizon_decay
from tests.helpers.gradients import dense_target_gradients

BETA1, BETA2, EPS, LR, REF = 0.95, 0.95, 1e-8, 1e-3, 1e-3
# The KL each update is priced at: the reference, four times it (decay β1²), then one that did not move the policy.
PRICES = (REF, 4 * REF, 0.0, 2.5 * REF)


def _ids(model, seed: int) -> torch.Tensor:
    return torch.randint(3, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(seed))


def _config(**overrides) -> LoGRAConfig:
    base = dict(
        rank=8, refresh_every=0, beta1=BETA1, beta2=BETA2, step_mode="lr", lr=LR, moment_dtype="float32",
        factor_dtype="float32", base_seed=3, moment_reference_kl=REF,
    )  # fmt: skip
    return LoGRAConfig(**{**base, **overrides})


def _update(sketcher: LoGRASketcher, model, t: int, price: float) -> None:
    ids = _ids(model, t)
    model(input_ids=ids, labels=ids).loss.backward()
    proposal = sketcher.propose()
    assert proposal is not None
    proposal.priced_kl = price  # what PredictedKLControl sets
    assert sketcher.apply(proposal) is not None


def test_the_decay_is_beta1_per_reference_kl_of_distance() -> None:
    assert horizon_decay(BETA1, REF, REF) == pytest.approx(BETA1)
    assert horizon_decay(BETA1, 4 * REF, REF) == pytest.approx(BETA1**2)
    assert horizon_decay(BETA1, REF / 4, REF) == pytest.approx(math.sqrt(BETA1))
    assert horizon_decay(BETA1, 0.0, REF) == 1.0  # the policy did not move: nothing went stale
    assert horizon_decay(BETA1, None, REF) == horizon_decay(BETA1, math.nan, REF) == BETA1


@pytest.mark.parametrize("rule", ["sgd", "adam"])
def test_the_step_is_the_kl_weighted_mean_of_the_sketches(qwen2_factory, rule: str) -> None:
    """Four updates priced at κ_ref, 4κ_ref, 0, 2.5κ_ref: sketch ``j``'s weight in update ``t``'s ``m̂`` is
    ``(1−β1)·Π β_i`` over the updates after it, normalized; SGD steps ``−lr·m̂ P``, Adam ``−lr·m̂/(√V̂ + ε) P``."""
    model = qwen2_factory(seed=0)
    lr = LR if rule == "adam" else 1.0  # SGD's step at lr 1e-3 would sit below the float32 weights' spacing
    sketcher = LoGRASketcher(model, _config(update_rule=rule, lr=lr))
    projections = {n: m.projection.double().clone() for n, m in sketcher.matrices.items()}
    start = {n: m.module.weight.detach().double().clone() for n, m in sketcher.matrices.items()}
    moved = {n: torch.zeros_like(w) for n, w in start.items()}
    sketches: dict[str, list[torch.Tensor]] = {n: [] for n in projections}
    v = dict.fromkeys(projections, 0.0)
    decays: list[float] = []  # β_t of each update: from the previous update's price (β1 before any)
    for t, price in enumerate(PRICES, start=1):
        grads = dense_target_gradients(model, _ids(model, t))
        _update(sketcher, model, t, price)
        decays.append(BETA1 if t == 1 else BETA1 ** math.sqrt(PRICES[t - 2] / REF))
        weights = [(1 - BETA1) * math.prod(decays[j + 1 :]) for j in range(t)]
        for n, p in projections.items():
            s = grads[n] @ p.T
            sketches[n].append(s)
            mean = sum(w * x for w, x in zip(weights, sketches[n], strict=True)) / sum(weights)
            if rule == "sgd":
                moved[n] -= lr * mean @ p
            else:
                v[n] = BETA2 * v[n] + (1 - BETA2) * s.square()
                root = (v[n] / (1 - BETA2**t)).sqrt()
                moved[n] -= lr * (mean / (root + EPS * root.mean())) @ p
    for n, mat in sketcher.matrices.items():
        got = mat.module.weight.detach().double() - start[n]
        assert float((got - moved[n]).norm() / moved[n].norm()) < 1e-4, n
    assert sketcher.moved_kl == PRICES[-1]
    assert sketcher.moment_mass == pytest.approx(sum(weights))


def test_priced_at_the_reference_every_update_it_is_the_constant_beta1_rule(qwen2_factory) -> None:
    """κ = κ_ref every update: the weights follow the rule without a horizon (``1 − β1^a``) to float32 rounding."""
    a, b = qwen2_factory(seed=0), qwen2_factory(seed=0)
    horizon, plain = LoGRASketcher(a, _config(update_rule="adam")), LoGRASketcher(b, _config(update_rule="adam"))
    plain.config.moment_reference_kl = None
    for t in (1, 2, 3):
        _update(horizon, a, t, REF)
        _update(plain, b, t, REF)
    assert horizon.moment_mass == pytest.approx(1 - BETA1**3)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_resume_continues_bit_for_bit(qwen2_factory) -> None:
    """Saved after two updates, loaded into a fresh sketcher: the next two updates decay the moment as the straight
    run's do (its mass and the last price travel in the state), on the outputs' side with packed projections."""
    cfg = _config(update_rule="adam", sketch_side="outputs", projection_storage="packed", moment_dtype="bfloat16")
    a, b = qwen2_factory(seed=0), qwen2_factory(seed=0)
    straight = LoGRASketcher(a, cfg)
    for t, price in enumerate(PRICES, start=1):
        _update(straight, a, t, price)
        if t == 2:
            saved, weights = copy.deepcopy(straight.state_dict()), copy.deepcopy(a.state_dict())
    b.load_state_dict(weights)
    resumed = LoGRASketcher(b, cfg)
    resumed.load_state_dict(saved)
    assert resumed.moved_kl == PRICES[1] and resumed.moment_mass == saved["moment_mass"]
    for t in (3, 4):
        _update(resumed, b, t, PRICES[t - 1])
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert all(torch.equal(straight.moments[n], resumed.moments[n]) for n in straight.moments)
    # A checkpoint from before the horizon (no mass, no price) resumes with the constant-β1 mass it implied.
    old = {k: v for k, v in saved.items() if k not in ("moment_mass", "moved_kl")}
    again = LoGRASketcher(qwen2_factory(seed=0), cfg)
    again.load_state_dict(old)
    assert again.moment_mass == pytest.approx(1 - BETA1**2) and again.moved_kl is None


def test_an_unpriced_update_stops_with_the_fix(qwen2_factory) -> None:
    model = qwen2_factory(seed=0)
    sketcher = LoGRASketcher(model, _config())
    ids = _ids(model, 1)
    model(input_ids=ids, labels=ids).loss.backward()
    weights = copy.deepcopy(model.state_dict())
    with pytest.raises(LoGRAConfigError, match="PredictedKLControl"):
        sketcher.apply(sketcher.propose())
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())  # nothing merged


def test_bad_settings_are_refused() -> None:
    with pytest.raises(LoGRAConfigError, match="beta1"):
        _config(beta1=0.0)
    for bad in (0.0, -1e-3, math.nan):
        with pytest.raises(LoGRAConfigError, match="moment_reference_kl"):
            _config(moment_reference_kl=bad)
    assert _config().to_dict()["moment_reference_kl"] == REF
    assert LoGRAConfig.from_dict(_config().to_dict()).moment_reference_kl == REF
