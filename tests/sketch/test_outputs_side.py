"""``logra.sketch_side: outputs``: the sketch ``T = R G`` on the outputs' side, kept as ``Tᵀ = Gᵀ Rᵀ``.

Every check is against a computation written out here: the sketch from the dense gradient of a copy of the model
(plain autograd) times the projection drawn from its seed, the merged weights from the payload's factors in float64
(``W − (F R)ᵀ``), the first-order gain from that dense gradient, the probe's logit change from two forwards of a
model whose weights were moved by the written-out step, and a resumed sketcher against an uninterrupted one.
"""

from __future__ import annotations

import copy

import pytest
import torch

from logra_pl.sketch import LoGRAConfig, LoGRASketcher, apply_payload
from logra_pl.sketch.config import LoGRAConfigError
from logra_pl.sketch.merge import merge_stack_
from logra_pl.sketch.payload import Payload
from logra_pl.sketch.probe import logit_tangent, moved_logits
from logra_pl.sketch.projection import make_projection
from logra_pl.sketch.reference import PerMatrixSketcher
from tests.helpers.gradients import dense_target_gradients


def _ids(model, seed: int) -> torch.Tensor:
    return torch.randint(3, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(seed))


def _backward(model, seed: int) -> None:
    ids = _ids(model, seed)
    model(input_ids=ids, labels=ids).loss.backward()


def _dense_grads(model, seed: int) -> dict[str, torch.Tensor]:
    """The dense gradient ``G`` (float64, ``d_out × d_in``) of every target matrix of a copy of ``model``."""
    return dense_target_gradients(model, _ids(model, seed))


def _config(**overrides) -> LoGRAConfig:
    return LoGRAConfig(**{"rank": 8, "refresh_every": 0, "sketch_side": "outputs", **overrides})


def _projection(sketcher: LoGRASketcher, name: str) -> torch.Tensor:
    """``R`` (``r × d_out``) drawn from the matrix's seed, independently of the sketcher's own draw."""
    m = sketcher.matrices[name]
    return make_projection(sketcher.seed_for(name), m.rank, m.d_out, sketcher.config.distribution).double()


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian"])
def test_sketch_is_the_dense_gradient_projected_on_its_outputs(qwen2_factory, distribution) -> None:
    model = qwen2_factory(seed=0)
    sketcher = LoGRASketcher(model, _config(distribution=distribution))
    grads = _dense_grads(model, 1)
    _backward(model, 1)
    for name, m in sketcher.matrices.items():
        assert tuple(m.sketch.shape) == (m.d_in, 8)  # Tᵀ: one row per input channel
        want = grads[name].T @ _projection(sketcher, name).T  # Gᵀ Rᵀ
        torch.testing.assert_close(m.sketch.double(), want, rtol=1e-4, atol=1e-6)


def test_sketch_sums_over_microbatches(qwen2_factory) -> None:
    model = qwen2_factory(seed=0)
    sketcher = LoGRASketcher(model, _config())
    grads = [_dense_grads(model, s) for s in (1, 2)]
    _backward(model, 1)
    _backward(model, 2)
    for name, m in sketcher.matrices.items():
        want = (grads[0][name] + grads[1][name]).T @ _projection(sketcher, name).T
        torch.testing.assert_close(m.sketch.double(), want, rtol=1e-4, atol=1e-6)


def test_bf16_operands_follow_the_fp32_sketch(qwen2_factory) -> None:
    """The bf16 path (X and dY in bf16, R as its signs times one scale, Z as two bf16 terms) against the fp32 sketch
    of the same bf16-rounded inputs: within the bf16 split's error."""
    model = qwen2_factory(seed=0)
    fp32 = LoGRASketcher(model, _config())
    _backward(model, 1)
    want = {n: m.sketch.clone() for n, m in fp32.matrices.items()}
    fp32.detach()
    model2 = qwen2_factory(seed=0)
    mixed = LoGRASketcher(model2, _config(sketch_operands="bfloat16"))
    assert all(m.signs is not None for m in mixed.matrices.values())
    _backward(model2, 1)
    for name, m in mixed.matrices.items():
        scale = want[name].abs().max()
        assert float((m.sketch - want[name]).abs().max()) <= 2e-2 * float(scale), name


def test_merge_is_the_transposed_factor_step(qwen2_factory) -> None:
    model = qwen2_factory(seed=0)
    before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    sketcher = LoGRASketcher(model, _config())
    projections = {n: _projection(sketcher, n) for n in sketcher.matrices}
    _backward(model, 1)
    payload = sketcher.apply(sketcher.propose(), alpha=0.5)
    assert payload is not None and payload.sketch_side == "outputs"
    for name, m in sketcher.matrices.items():
        factor = payload.factors[name]
        assert tuple(factor.shape) == (m.d_in, 8)
        step = (factor.double() @ projections[name]).T  # (F R)ᵀ, d_out × d_in
        want = (before[f"{name}.weight"] - step).to(torch.float32)
        assert torch.equal(m.module.weight.detach(), want), name


def test_gain_is_the_dense_gradients_inner_product_with_the_step(qwen2_factory) -> None:
    model = qwen2_factory(seed=0)
    sketcher = LoGRASketcher(model, _config())
    projections = {n: _projection(sketcher, n) for n in sketcher.matrices}
    grads = _dense_grads(model, 1)
    _backward(model, 1)
    proposal = sketcher.propose()
    payload = sketcher.apply(proposal, alpha=1.0)
    # −⟨G, ΔW⟩ with ΔW = −(U R)ᵀ, U the proposal's fp32 factors at α = 1.
    want = sum(
        float((grads[n] * (proposal.matrices[n].factor.double() @ projections[n]).T).sum()) for n in sketcher.matrices
    )
    assert payload is not None
    assert sketcher.last_gain == pytest.approx(want, rel=1e-4)


def test_payload_round_trip_and_receivers_match_the_trainer(qwen2_factory) -> None:
    model = qwen2_factory(seed=0)
    receiver = copy.deepcopy(model)
    sketcher = LoGRASketcher(model, _config())
    for seed in (1, 2):
        _backward(model, seed)
        payload = sketcher.step(alpha=0.7)
        assert payload is not None
        data = payload.to_bytes()
        back = Payload.from_bytes(data)
        assert back.sketch_side == "outputs"
        apply_payload(back, receiver)
    for (name, a), b in zip(model.state_dict().items(), receiver.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_inputs_side_payload_header_is_unchanged() -> None:
    """An inputs-side payload writes no ``sketch_side``: its bytes are those of a payload from before the setting."""
    factors = {"layer": torch.ones(4, 2, dtype=torch.bfloat16)}
    plain = Payload(factors=factors, update_index=0, base_seed=0, rank=2, distribution="rademacher", refresh=False)
    assert "sketch_side" not in plain.header()
    outputs = Payload(
        factors=factors, update_index=0, base_seed=0, rank=2, distribution="rademacher", refresh=False,
        sketch_side="outputs",
    )  # fmt: skip
    assert outputs.header()["sketch_side"] == "outputs"
    with pytest.raises(ValueError, match="sketch_side"):
        Payload(factors=factors, update_index=0, base_seed=0, rank=2, distribution="rademacher", sketch_side="rows")


def test_a_row_shard_merges_as_its_part_of_the_whole(qwen2_factory) -> None:
    """The trainer's merge of a dim-0 shard (rows [o, o + n) of W, columns of Wᵀ) gives those rows of the whole
    matrix's merge, bit for bit."""
    model = qwen2_factory(seed=0)
    whole = copy.deepcopy(model)
    sketcher = LoGRASketcher(model, _config())
    _backward(model, 1)
    payload = sketcher.step(alpha=0.7)
    assert payload is not None
    apply_payload(payload, whole)
    # A second copy whose matrices each keep only their lower half of rows, merged with the factors at that offset.
    halves = copy.deepcopy(whole)
    start = {n: p.detach().clone() for n, p in qwen2_factory(seed=0).named_parameters()}
    for name in sketcher.matrices:
        w = start[f"{name}.weight"]
        offset = w.shape[0] // 2
        rows = w[offset:].clone()
        merge_stack_(
            [rows.mT],
            payload.factors[name].unsqueeze(0),
            sketcher.matrices[name].projection.unsqueeze(0),
            "rademacher",
            cols=(offset, w.shape[0]),
        )
        assert torch.equal(rows, dict(halves.named_parameters())[f"{name}.weight"][offset:]), name


def test_probe_tangent_is_the_written_out_steps_logit_change(qwen2_factory) -> None:
    model = qwen2_factory(seed=0).double()
    sketcher = LoGRASketcher(model, _config())
    projections = {n: _projection(sketcher, n) for n in sketcher.matrices}
    _backward(model, 1)
    proposal = sketcher.propose()
    modules = {n: m.module for n, m in sketcher.matrices.items()}
    inputs = {"input_ids": _ids(model, 3)}
    _, tangent = logit_tangent(model, modules, proposal, inputs)
    # Two forwards of copies whose weights were moved by ∓h (U R)ᵀ, written out here. (The tiny model's logits keep
    # float32 roundoff even in double: a central difference at h = 1e-2 is within 1e-5 of the tangent, at 1e-4 not.)
    h = 1e-2
    moved = []
    for sign in (1.0, -1.0):
        copy_ = copy.deepcopy(model)
        with torch.no_grad():
            for n in sketcher.matrices:
                w = dict(copy_.named_parameters())[f"{n}.weight"]
                w -= sign * h * (proposal.matrices[n].factor.double() @ projections[n]).T
        moved.append(copy_(**inputs, use_cache=False).logits)
    want = (moved[0] - moved[1]) / (2 * h)
    assert float(want.abs().max()) > 1e-2  # the step moves the logits
    torch.testing.assert_close(tangent, want, rtol=0, atol=5e-5)
    at = moved_logits(model, modules, proposal, inputs, alpha=h)
    assert torch.equal(at, moved[0])


def test_resume_continues_bit_for_bit(qwen2_factory) -> None:
    model = qwen2_factory(seed=0)
    sketcher = LoGRASketcher(model, _config())
    _backward(model, 1)
    assert sketcher.step() is not None
    state = copy.deepcopy(sketcher.state_dict())
    weights = copy.deepcopy(model.state_dict())
    _backward(model, 2)
    assert sketcher.step() is not None
    resumed_model = qwen2_factory(seed=0)
    resumed_model.load_state_dict(weights)
    resumed = LoGRASketcher(resumed_model, _config())
    resumed.load_state_dict(state)
    _backward(resumed_model, 2)
    assert resumed.step() is not None
    for (name, a), b in zip(model.state_dict().items(), resumed_model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    for name in sketcher.moments:
        assert torch.equal(sketcher.moments[name], resumed.moments[name])
        assert torch.equal(sketcher.second_moments[name], resumed.second_moments[name])
    # A checkpoint of one side does not resume on the other.
    other = LoGRASketcher(qwen2_factory(seed=0), _config(sketch_side="inputs"))
    with pytest.raises(LoGRAConfigError, match="sketch_side"):
        other.load_state_dict(state)


def test_rank_is_checked_against_d_out(qwen2_factory) -> None:
    """``R`` is ``r × d_out``: a rank above a matrix's ``d_out`` (k/v: 64 here) is refused on this side, and
    ``clip_rank`` clips to ``d_out``."""
    with pytest.raises(LoGRAConfigError, match="rank"):
        LoGRASketcher(qwen2_factory(seed=0), _config(rank=96))
    sketcher = LoGRASketcher(qwen2_factory(seed=0), _config(rank=96, clip_rank=True))
    ranks = {n: m.rank for n, m in sketcher.matrices.items()}
    assert ranks["model.layers.0.self_attn.k_proj"] == 64 and ranks["model.layers.0.mlp.down_proj"] == 96


def test_settings_that_act_on_the_inputs_mixing_are_refused() -> None:
    with pytest.raises(LoGRAConfigError, match="input_scaling"):
        _config(input_scaling="rms")
    with pytest.raises(LoGRAConfigError, match="input_precondition"):
        _config(update_rule="rowadam", input_precondition="gram")
    with pytest.raises(LoGRAConfigError, match="sketch_side"):
        _config(sketch_side="rows")
    with pytest.raises(LoGRAConfigError, match="inputs-side"):
        PerMatrixSketcher(torch.nn.Sequential(), _config())
    assert "sketch_side" not in LoGRAConfig().to_dict()  # inputs-side checkpoints keep their bytes
    assert _config().to_dict()["sketch_side"] == "outputs"
