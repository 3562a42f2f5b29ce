"""``logra.projection_storage: packed``: projections kept as their draws and built where read.

The packed stack is checked against :func:`make_projection` of each seed (itself checked against the distributions'
definitions in ``test_projection.py``), and a packed sketcher against a dense one run beside it on a copy of the
model: the same weights, moments, factors, probe tangents and next-batch gains bit for bit, over updates that cross
a refresh (the moments carried), on both sides, with fp32 and bf16 sketch operands, and across a resume from the
other storage. Its bytes are counted by the planner and by the measured report alike.
"""

from __future__ import annotations

import copy

import pytest
import torch

from logra_pl.methods.base import PlanShapes
from logra_pl.methods.logra import LoGRAMethod
from logra_pl.sketch import LoGRAConfig, LoGRASketcher, select_targets
from logra_pl.sketch.config import LoGRAConfigError
from logra_pl.sketch.memory import memory_report
from logra_pl.sketch.probe import logit_tangent
from logra_pl.sketch.projection import PackedProjections, make_projection, packed_bytes
from logra_pl.sketch.reference import PerMatrixSketcher


def _ids(model, seed: int) -> torch.Tensor:
    return torch.randint(3, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(seed))


def _backward(model, seed: int) -> None:
    ids = _ids(model, seed)
    model(input_ids=ids, labels=ids).loss.backward()


def _config(**overrides) -> LoGRAConfig:
    return LoGRAConfig(**{"rank": 8, "refresh_every": 2, "beta1": 0.9, "update_rule": "adam", **overrides})


@pytest.mark.parametrize("distribution", ["rademacher", "hadamard"])
@pytest.mark.parametrize(("rank", "d_in"), [(8, 64), (5, 24), (3, 7)])
def test_the_packed_stack_builds_each_seeds_projection(distribution: str, rank: int, d_in: int) -> None:
    seeds = [11, 12, 13]
    packed = PackedProjections.draw(seeds, rank, d_in, distribution)
    want = torch.stack([make_projection(s, rank, d_in, distribution) for s in seeds])
    assert torch.equal(packed.expand(), want)
    assert all(torch.equal(packed[i], want[i]) for i in range(3))
    assert torch.equal(packed.expand([2, 0]), want[[2, 0]])
    assert packed.nbytes == 3 * packed_bytes(rank, d_in, distribution)
    if distribution == "rademacher":  # one bit per entry, in whole int64 words
        assert packed.nbytes == 3 * 8 * -(-rank * d_in // 64)
    other = PackedProjections.draw([21], rank, d_in, distribution)
    replaced = packed.replace_rows([1], other)
    assert torch.equal(replaced[1], make_projection(21, rank, d_in, distribution))
    assert torch.equal(replaced[0], want[0]) and torch.equal(packed[1], want[1])  # a new stack; the old one kept
    with pytest.raises(LoGRAConfigError, match="no packed form"):
        PackedProjections(packed.draws, rank, d_in, "gaussian")


def _pair(qwen2_factory, **overrides) -> tuple[tuple, tuple]:
    """(model, sketcher) twice from the same weights: dense projections, then packed ones."""
    out = []
    for storage in ("dense", "packed"):
        model = qwen2_factory(seed=0)
        sketcher = LoGRASketcher(model, _config(projection_storage=storage, **overrides))
        sketcher.keep_step = True
        out.append((model, sketcher))
    return out[0], out[1]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"sketch_side": "outputs"},
        {"distribution": "hadamard"},
        {"sketch_operands": "bfloat16"},
        {"sketch_operands": "bfloat16", "sketch_side": "outputs", "distribution": "hadamard"},
        {"input_scaling": "rms", "refresh_every": 0, "sketch_operands": "bfloat16"},
    ],
    ids=["rademacher", "outputs", "hadamard", "bf16", "bf16-outputs-hadamard", "input-scaled-bf16"],
)
def test_a_packed_sketcher_runs_as_the_dense_one_bit_for_bit(qwen2_factory, overrides) -> None:
    """Four updates (a refresh at update 2 carries the moments across bases): after each, the same payload factors,
    weights, moments, first-order gain and next-batch gain; the probe's tangent is the same too. The packed one
    holds no fp32 projection: its groups keep draws, and its matrices build ``P`` where read."""
    (dense_model, dense), (packed_model, packed) = _pair(qwen2_factory, **overrides)
    measured = []
    assert all(g.projection is None and g.packed is not None for g in packed.groups)
    assert all(g.packed is None for g in dense.groups)
    for update, seed in enumerate((1, 2, 3, 4)):
        for model in (dense_model, packed_model):
            _backward(model, seed)
        for name in dense.matrices:
            assert torch.equal(dense.matrices[name].sketch, packed.matrices[name].sketch), (update, name)
        proposals = [s.propose() for s in (dense, packed)]
        if update == 1:
            inputs = {"input_ids": _ids(dense_model, 9)}
            tangents = [
                logit_tangent(m, {n: x.module for n, x in s.matrices.items()}, p, inputs)[1]
                for m, s, p in zip((dense_model, packed_model), (dense, packed), proposals, strict=True)
            ]
            assert torch.equal(tangents[0], tangents[1])
        payloads = [s.apply(p) for s, p in zip((dense, packed), proposals, strict=True)]
        assert all(p is not None for p in payloads)
        for name in dense.matrices:
            assert torch.equal(payloads[0].factors[name], payloads[1].factors[name]), (update, name)
        for (name, a), b in zip(dense_model.state_dict().items(), packed_model.state_dict().values(), strict=True):
            assert torch.equal(a, b), (update, name)
        for name in dense.moments:
            assert torch.equal(dense.moments[name], packed.moments[name]), (update, name)
            assert torch.equal(dense.second_moments[name], packed.second_moments[name]), (update, name)
        assert dense.last_gain == packed.last_gain
        assert dense.next_gain == packed.next_gain
        measured.append(dense.next_gain)
    if "input_scaling" not in overrides:  # new input scales every update: never the basis the step merged on
        assert any(g is not None for g in measured)  # the kept step's gain where that basis still holds


def test_a_run_resumes_under_the_other_storage(qwen2_factory) -> None:
    (model, sketcher), _ = _pair(qwen2_factory)
    _backward(model, 1)
    assert sketcher.step() is not None
    state, weights = copy.deepcopy(sketcher.state_dict()), copy.deepcopy(model.state_dict())
    for seed in (2, 3):  # crosses the refresh at update 2
        _backward(model, seed)
        assert sketcher.step() is not None
    resumed_model = qwen2_factory(seed=0)
    resumed_model.load_state_dict(weights)
    resumed = LoGRASketcher(resumed_model, _config(projection_storage="packed"))
    resumed.load_state_dict(state)
    for seed in (2, 3):
        _backward(resumed_model, seed)
        assert resumed.step() is not None
    for (name, a), b in zip(model.state_dict().items(), resumed_model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("side", ["inputs", "outputs"])
@pytest.mark.parametrize("operands", ["float32", "bfloat16"])
def test_the_plan_counts_the_draws_the_sketcher_holds(qwen2_factory, side: str, operands: str) -> None:
    """The planner's projection bytes equal the measured report's, packed (the draws) and dense (fp32 P and, with
    bf16 operands, their bf16 signs); packed Rademacher holds 1/32 of dense fp32."""
    measured, planned = {}, {}
    for storage in ("dense", "packed"):
        config = _config(projection_storage=storage, sketch_side=side, sketch_operands=operands)
        model = qwen2_factory(seed=0)
        sketcher = LoGRASketcher(model, config)
        measured[storage] = memory_report(model, sketcher=sketcher).projections
        shapes = PlanShapes(select_targets(model, config.targets), list(model.parameters()), 0, 1, torch.float32)
        planned[storage] = LoGRAMethod(config).plan_memory(shapes).projections
        _backward(model, 1)
        assert sketcher.step() is not None
        assert memory_report(model, sketcher=sketcher).projections == measured[storage]  # nothing built is kept
    assert planned == measured
    fp32 = measured["dense"] * (4 / 6 if operands == "bfloat16" else 1)
    assert measured["packed"] <= fp32 / 32 + 8 * len(LoGRASketcher(qwen2_factory(seed=0), _config()).matrices)


def test_settings_without_a_packed_form_are_refused(qwen2_factory) -> None:
    with pytest.raises(LoGRAConfigError, match="Gaussian P"):
        LoGRAConfig(distribution="gaussian", projection_storage="packed")
    with pytest.raises(LoGRAConfigError, match="projection_storage"):
        LoGRAConfig(projection_storage="bits")
    with pytest.raises(LoGRAConfigError, match="PerMatrixSketcher draws each P"):
        PerMatrixSketcher(qwen2_factory(seed=0), _config(projection_storage="packed"))
    assert "projection_storage" not in LoGRAConfig().to_dict()  # the default writes what it wrote before
    assert LoGRAConfig(projection_storage="packed").to_dict()["projection_storage"] == "packed"
