"""``input_scaling: rms``: the sketch and the step in per-channel scaled inputs, ``Q = P·diag(s)``.

Every check is against a computation written out here: the statistics from the layer inputs captured by hooks on a
copy, the scales from their formula in float64, the sketch from the dense gradient of that copy (plain autograd), the
merged weights from the payload's factors in float64, and a resumed run against an uninterrupted one.
"""

from __future__ import annotations

import copy

import pytest
import torch

from logra_pl.sketch import LoGRAConfig, LoGRASketcher, apply_payload, memory_report
from logra_pl.sketch.config import LoGRAConfigError
from logra_pl.sketch.input_scale import INPUT_SCALE_FLOOR, input_scales
from logra_pl.sketch.payload import Payload
from logra_pl.sketch.reference import PerMatrixSketcher

BETA = 0.9


def _ids(model, seed: int) -> torch.Tensor:
    return torch.randint(3, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(seed))


def _backward(model, seed: int) -> None:
    ids = _ids(model, seed)
    model(input_ids=ids, labels=ids).loss.backward()


def _dense(model, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per target matrix of a copy of ``model``: the dense gradient ``G`` and the per-channel sums ``Σ_t x_tj²`` of
    its layer inputs over every token, from plain autograd and a forward hook."""
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.requires_grad_(False)
    linears = {n: m for n, m in ref.named_modules() if isinstance(m, torch.nn.Linear) and "proj" in n}
    sums: dict[str, torch.Tensor] = {}
    for name, m in linears.items():
        m.weight.requires_grad_(True)
        m.register_forward_hook(
            lambda mod, args, out, name=name: sums.__setitem__(name, args[0].detach().double().square().sum((0, 1)))
        )
    _backward(ref, seed)
    return {n: (m.weight.grad.double(), sums[n]) for n, m in linears.items()}


def _scales(mean_sq: torch.Tensor, age: int) -> torch.Tensor:
    """``s`` written out: bias-corrected rms, floored, to the power −½, mean square 1, rounded to bf16."""
    rms = (mean_sq / (1 - BETA**age)).sqrt()
    s = 1 / (rms + INPUT_SCALE_FLOOR * rms.mean()).sqrt()
    return (s / s.square().mean().sqrt()).to(torch.bfloat16).double()


def _config(**overrides) -> LoGRAConfig:
    base = dict(rank=8, refresh_every=0, input_scaling="rms", input_scale_beta=BETA)
    return LoGRAConfig(**{**base, **overrides})


def test_statistics_and_scales_follow_the_inputs(qwen2_factory) -> None:
    model = qwen2_factory(seed=0)
    sketcher = LoGRASketcher(model, _config())
    ref = _dense(model, 1)
    with torch.enable_grad():  # a forward with no backward (as the KL probe's) adds nothing
        model(input_ids=_ids(model, 5))
    assert all(not bool(m.input_sq.any()) for m in sketcher.matrices.values())
    _backward(model, 1)
    for name, m in sketcher.matrices.items():
        assert float(m.input_tokens) == 20.0
        torch.testing.assert_close(m.input_sq.double(), ref[name][1], rtol=1e-5, atol=1e-6)
        assert bool((m.input_scale == 1).all())  # no statistics before the first update: unscaled
    assert sketcher.apply(sketcher.propose()) is not None
    assert sketcher.input_age == 1
    for name, m in sketcher.matrices.items():
        want = _scales((1 - BETA) * ref[name][1] / 20, 1)
        assert torch.equal(m.input_scale.double(), want), name
        assert not bool(m.input_sq.any()) and float(m.input_tokens) == 0.0  # zeroed for the next update
    # The loud channels get the small scales: s falls as the channel's rms rises.
    name, m = next(iter(sketcher.matrices.items()))
    order = ref[name][1].argsort()
    assert float(m.input_scale[order[0]]) > float(m.input_scale[order[-1]])


def test_input_scales_formula_floors_dead_channels() -> None:
    ema = torch.tensor([[4.0, 1.0, 0.0, 1.0]])
    s = input_scales(ema, age=1, beta=0.0).double()
    rms = ema.double().sqrt()
    want = 1 / (rms + INPUT_SCALE_FLOOR * rms.mean()).sqrt()
    want = (want / want.square().mean().sqrt()).to(torch.bfloat16).double()
    assert torch.equal(s, want)
    # a dead channel: at most √((1 + ε)/ε) ≈ 10× the scale of a channel at the mean rms (bf16-rounded)
    assert float(s[0, 2] / s[0, 1]) == pytest.approx(((1 + INPUT_SCALE_FLOOR) / INPUT_SCALE_FLOOR) ** 0.5, rel=0.01)
    with pytest.raises(ValueError, match="at least one EMA step"):
        input_scales(ema, age=0, beta=0.9)


@pytest.mark.parametrize("distribution", ["rademacher", "hadamard"])
def test_scaled_sketch_and_sgd_step_match_the_dense_gradient(qwen2_factory, distribution: str) -> None:
    model = qwen2_factory(seed=0)
    lr = 10.0  # steps far above the fp32 rounding of W
    cfg = _config(
        distribution=distribution, update_rule="sgd", beta1=0.0, step_mode="lr", lr=lr, factor_dtype="float32"
    )
    sketcher = LoGRASketcher(model, cfg)
    _backward(model, 1)
    assert sketcher.apply(sketcher.propose()) is not None  # the first update sets the scales
    ref = _dense(model, 2)
    before = {n: m.module.weight.detach().double().clone() for n, m in sketcher.matrices.items()}
    q = {n: m.projection.double() * m.input_scale.double() for n, m in sketcher.matrices.items()}
    p = {n: m.projection.double() for n, m in sketcher.matrices.items()}
    _backward(model, 2)
    for name, m in sketcher.matrices.items():
        torch.testing.assert_close(m.sketch.double(), ref[name][0] @ q[name].T, rtol=1e-4, atol=1e-7)
    assert sketcher.apply(sketcher.propose()) is not None
    for name, m in sketcher.matrices.items():
        g = ref[name][0]
        want = -lr * (g @ q[name].T) @ q[name]
        moved = m.module.weight.detach().double() - before[name]
        assert float((moved - want).norm() / want.norm()) < 1e-4, name
        plain = -lr * (g @ p[name].T) @ p[name]  # the scaling changed the step
        assert float((want / want.norm() - plain / plain.norm()).norm()) > 0.05, name


def test_merge_is_exact_and_the_engine_gets_the_same_bits(qwen2_factory) -> None:
    model = qwen2_factory(seed=0)
    receiver = copy.deepcopy(model)
    sketcher = LoGRASketcher(model, _config())
    for seed in (1, 2):
        before = {n: m.module.weight.detach().clone() for n, m in sketcher.matrices.items()}
        scales = {n: m.input_scale.clone() for n, m in sketcher.matrices.items()}
        _backward(model, seed)
        payload = sketcher.apply(sketcher.propose())
        assert payload is not None and set(payload.input_scales) == set(sketcher.matrices)
        for name, m in sketcher.matrices.items():
            assert torch.equal(payload.input_scales[name], scales[name])
            # W − F P diag(s), formed here in float64 from the shipped factor and rounded once to W's dtype.
            f = payload.factors[name].double()
            delta = (f @ m.projection.double()) * scales[name].double()
            want = (before[name].double() - delta).to(before[name].dtype)
            assert torch.equal(m.module.weight.detach(), want), name
        wire = Payload.from_bytes(payload.to_bytes())
        assert all(torch.equal(wire.input_scales[n], payload.input_scales[n]) for n in payload.input_scales)
        apply_payload(wire, receiver)
    got, want = dict(receiver.named_parameters()), dict(model.named_parameters())
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert any(not bool((m.input_scale == 1).all()) for m in sketcher.matrices.values())


def test_first_scales_restart_the_moments(qwen2_factory) -> None:
    model = qwen2_factory(seed=0)
    sketcher = LoGRASketcher(model, _config())
    _backward(model, 1)
    sketcher.apply(sketcher.propose())
    assert sketcher.moment_age == 0 and sketcher.second_age == 0
    assert all(not bool(m.any()) for m in sketcher.moments.values())
    _backward(model, 2)
    sketcher.apply(sketcher.propose())
    assert sketcher.moment_age == 1 and any(bool(m.any()) for m in sketcher.moments.values())


def test_resume_is_bit_for_bit(qwen2_factory) -> None:
    model = qwen2_factory(seed=0)
    sketcher = LoGRASketcher(model, _config())
    for seed in (1, 2):
        _backward(model, seed)
        sketcher.apply(sketcher.propose())
    state = copy.deepcopy(sketcher.state_dict())
    resumed_model = copy.deepcopy(model)
    resumed = LoGRASketcher(resumed_model, _config())
    resumed.load_state_dict(state)
    for m, r in zip(sketcher.matrices.values(), resumed.matrices.values(), strict=True):
        assert torch.equal(m.input_scale, r.input_scale)
    for run, net in ((sketcher, model), (resumed, resumed_model)):
        _backward(net, 3)
        run.apply(run.propose())
    got, want = dict(resumed_model.named_parameters()), dict(model.named_parameters())
    assert all(torch.equal(got[k], want[k]) for k in want)
    # A checkpoint of an unscaled run does not resume a scaled one.
    plain = LoGRASketcher(qwen2_factory(seed=0), LoGRAConfig(rank=8, refresh_every=0))
    with pytest.raises(LoGRAConfigError, match="input_scaling"):
        LoGRASketcher(qwen2_factory(seed=0), _config()).load_state_dict(plain.state_dict())


def test_bf16_operands_sketch_the_same_scaled_inputs(qwen2_factory) -> None:
    model = qwen2_factory(seed=0)
    runs = {}
    for operands in ("float32", "bfloat16"):
        net = copy.deepcopy(model)
        sketcher = LoGRASketcher(net, _config(sketch_operands=operands))
        _backward(net, 1)
        sketcher.apply(sketcher.propose())
        _backward(net, 2)
        runs[operands] = {n: m.sketch.clone() for n, m in sketcher.matrices.items()}
        if operands == "bfloat16":  # the signs carry s, exactly
            m = next(iter(sketcher.matrices.values()))
            torch.testing.assert_close(m.signs.float(), m.projection.sign() * m.input_scale, rtol=0, atol=0)
    for name, s32 in runs["float32"].items():
        s16 = runs["bfloat16"][name]
        assert float((s16 - s32).norm() / s32.norm()) < 1e-2, name


def test_state_is_counted_and_planned(qwen2_factory) -> None:
    from logra_pl.methods.logra import LoGRAMethod
    from logra_pl.methods.memory_plan import PlanShapes

    model = qwen2_factory(seed=0)
    cfg = _config()
    sketcher = LoGRASketcher(model, cfg)
    plain = LoGRASketcher(qwen2_factory(seed=0), LoGRAConfig(rank=8, refresh_every=0))
    scaled_report, plain_report = memory_report(model, sketcher=sketcher), memory_report(model, sketcher=plain)
    d_in = sum(m.d_in for m in sketcher.matrices.values())
    assert scaled_report.sketches - plain_report.sketches == 4 * d_in + 4 * len(sketcher.matrices)
    assert scaled_report.row_statistics - plain_report.row_statistics == 8 * d_in
    shapes = PlanShapes({n: m.module for n, m in sketcher.matrices.items()}, list(model.parameters()), 0)
    planned = LoGRAMethod(cfg).plan_memory(shapes)
    assert planned.sketches == scaled_report.sketches
    assert planned.row_statistics == scaled_report.row_statistics


def test_config_is_validated() -> None:
    with pytest.raises(LoGRAConfigError, match="refresh_every: 0"):
        LoGRAConfig(input_scaling="rms", refresh_every=1)
    with pytest.raises(LoGRAConfigError, match="unknown input_scaling"):
        LoGRAConfig(input_scaling="l2", refresh_every=0)
    with pytest.raises(LoGRAConfigError, match="pick one"):
        LoGRAConfig(input_scaling="rms", refresh_every=0, input_precondition="gram", update_rule="rowadam")
    with pytest.raises(LoGRAConfigError, match="input_scale_beta"):
        LoGRAConfig(input_scaling="rms", refresh_every=0, input_scale_beta=1.0)
    assert "input_scaling" not in LoGRAConfig().to_dict()  # unscaled configs write what they wrote before
    assert LoGRAConfig.from_dict(_config().to_dict()) == _config()
    with pytest.raises(LoGRAConfigError, match="reference of the unscaled"):
        PerMatrixSketcher(torch.nn.Sequential(), _config())


def test_non_finite_statistics_leave_the_ema_alone(qwen2_factory) -> None:
    model = qwen2_factory(seed=0)
    sketcher = LoGRASketcher(model, _config())
    _backward(model, 1)
    names = list(sketcher.matrices)
    sketcher.matrices[names[0]].input_sq[3] = float("inf")  # one matrix's statistics overflowed
    assert sketcher.apply(sketcher.propose()) is not None  # its sketch is finite: the update merges
    bad, good = sketcher.matrices[names[0]], sketcher.matrices[names[1]]
    assert bool((bad.input_scale == 1).all())  # no statistics: unscaled, not NaN
    assert not bool((good.input_scale == 1).all()) and bool(torch.isfinite(good.input_scale).all())


def test_a_payload_scales_every_matrix_or_none() -> None:
    from logra_pl.sketch.payload import MatrixProposal, Proposal

    scales = torch.ones(1, 4)
    matrices = {
        "a": MatrixProposal(torch.zeros(3, 2), seed=1, projection=torch.zeros(2, 4), input_scales=scales),
        "b": MatrixProposal(torch.zeros(3, 2), seed=2, projection=torch.zeros(2, 4)),
    }
    proposal = Proposal(matrices, update_index=0, base_seed=0, rank=2, distribution="rademacher", refresh=False)
    with pytest.raises(ValueError, match="all or none"):
        proposal.to_payload()
    del matrices["b"]
    assert set(proposal.to_payload().input_scales) == {"a"}
