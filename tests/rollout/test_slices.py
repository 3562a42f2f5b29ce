"""Factor updates applied to fused, tensor-parallel engine slices equal the trainer's whole-matrix merge."""

from __future__ import annotations

import pytest
import torch

from logra_pl.rollout.slices import EngineSlice, apply_payload_to_slices, column_parallel_slices, row_parallel_slice
from logra_pl.sketch.payload import Payload, apply_payload
from logra_pl.sketch.projection import make_projection

D = 128  # hidden width
Q, KV, FF = 256, 64, 192  # rows of q (4 heads of 64), k/v (1 KV head: replicated when tp > 1), gate/up


def _matrices(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"a.q_proj": (Q, D), "a.k_proj": (KV, D), "a.v_proj": (KV, D), "a.o_proj": (D, Q)}
    shapes |= {"m.gate_proj": (FF, D), "m.up_proj": (FF, D), "m.down_proj": (D, FF)}
    return {name: torch.randn(*shape, generator=g) for name, shape in shapes.items()}


def _payload(weights: dict[str, torch.Tensor], distribution: str) -> Payload:
    g = torch.Generator().manual_seed(1)
    factors = {name: (torch.randn(w.shape[0], 16, generator=g) * 0.1).bfloat16() for name, w in weights.items()}
    return Payload(factors, update_index=4, base_seed=3, rank=16, distribution=distribution, refresh=True)


def _engine_layout(full: dict[str, torch.Tensor], tp_rank: int, tp: int) -> tuple[dict, dict]:
    """What a vLLM rank holds: fused qkv / gate_up row shards (KV replicated when tp > #kv heads), o/down columns."""
    kv_reps = tp  # one KV head of 64 rows: every rank holds all of k and v
    slices = column_parallel_slices(
        "a.qkv.weight", [("a.q_proj", Q, 1), ("a.k_proj", KV, kv_reps), ("a.v_proj", KV, kv_reps)], D, tp_rank, tp
    )
    slices |= column_parallel_slices("m.gate_up.weight", [("m.gate_proj", FF, 1), ("m.up_proj", FF, 1)], D, tp_rank, tp)
    slices["a.o_proj"] = row_parallel_slice("a.o.weight", D, Q, tp_rank, tp)
    slices["m.down_proj"] = row_parallel_slice("m.down.weight", D, FF, tp_rank, tp)
    params = {}
    for param in {s.param for s in slices.values()}:
        blocks = sorted((s.local_row, name, s) for name, s in slices.items() if s.param == param)
        parts = [full[name][s.rows[0] : s.rows[1], s.cols[0] : s.cols[1]] for _, name, s in blocks]
        params[param] = torch.cat(parts).clone()
    return slices, params


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("distribution", ["rademacher", "gaussian", "hadamard"])
def test_sliced_merge_equals_whole_matrix_merge(tp: int, distribution: str) -> None:
    full = _matrices()
    payload = _payload(full, distribution)
    # The independent reference: each whole matrix merged (W - F P), then cut the way the engine cuts it.
    reference = {k: v.clone() for k, v in full.items()}
    for name, factor in payload.factors.items():
        proj = make_projection(payload.seed(name), 16, full[name].shape[1], distribution).double()
        reference[name] = (full[name].double() - factor.double() @ proj).float()
    for rank in range(tp):
        slices, params = _engine_layout(full, rank, tp)
        _, expected = _engine_layout(reference, rank, tp)
        merged = apply_payload_to_slices(payload, slices, params)
        assert sorted(merged) == sorted(full)
        for key in params:
            assert torch.allclose(params[key], expected[key], rtol=0, atol=1e-6), (tp, rank, key)
    # Bit for bit: the same rows merged through the trainer's own function equal the sliced engine merge.
    trainer = {f"{k}.weight": v.clone() for k, v in full.items()}
    apply_payload(payload, trainer)
    _assert_slices_equal_trainer(full, {k[: -len(".weight")]: v for k, v in trainer.items()}, payload, tp)


def _assert_slices_equal_trainer(full: dict, trainer: dict, payload: Payload, tp: int) -> None:
    """Every engine rank's slices, merged from ``full``, hold the bits of the trainer's whole-matrix merge."""
    for rank in range(tp):
        slices, params = _engine_layout(full, rank, tp)
        _, exact = _engine_layout(trainer, rank, tp)
        apply_payload_to_slices(payload, slices, params)
        for key in params:
            assert torch.equal(params[key], exact[key]), (tp, rank, key)


def test_slice_geometry_and_errors() -> None:
    # 8 KV rows over 4 ranks with 2 replicas: ranks 0,1 hold KV shard 0; ranks 2,3 shard 1.
    parts = [("q", 16, 1), ("k", 8, 2), ("v", 8, 2)]
    got = [column_parallel_slices("qkv", parts, 32, r, 4) for r in range(4)]
    assert [g["k"].rows for g in got] == [(0, 4), (0, 4), (4, 8), (4, 8)]
    assert [g["q"].rows for g in got] == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert got[3]["v"] == EngineSlice("qkv", (4, 8), 8, (0, 32), 32, 8)
    assert row_parallel_slice("o", 10, 32, 1, 2) == EngineSlice("o", (0, 10), 0, (16, 32), 32, 10)
    with pytest.raises(ValueError, match="do not split"):
        column_parallel_slices("x", [("q", 10, 1)], 8, 0, 4)
    full = _matrices()
    payload = _payload(full, "rademacher")
    slices, params = _engine_layout(full, 0, 1)
    del slices["a.k_proj"]
    with pytest.raises(KeyError, match="have no slice in the engine"):
        apply_payload_to_slices(payload, slices, params)


@pytest.mark.parametrize("tp", [1, 2])
def test_input_scaled_payload_merges_alike_on_slices(tp: int) -> None:
    """``logra.input_scaling: rms``: every column of a matrix's delta carries its scale ``s_j``; the engine's slices
    (row-parallel ones cut the columns) get the whole-matrix merge's bits."""
    full = _matrices()
    payload = _payload(full, "rademacher")
    g = torch.Generator().manual_seed(2)
    payload.input_scales = {  # bf16-valued, as the sketcher rounds them
        name: torch.rand(w.shape[1], generator=g).add(0.2).bfloat16().float() for name, w in full.items()
    }
    reference = {}
    for name, factor in payload.factors.items():
        proj = make_projection(payload.seed(name), 16, full[name].shape[1], "rademacher").double()
        delta = (factor.double() @ proj) * payload.input_scales[name].double()
        reference[name] = (full[name].double() - delta).float()
    wire = Payload.from_bytes(payload.to_bytes())  # the scales travel as bf16, exactly
    assert all(torch.equal(wire.input_scales[n], s) for n, s in payload.input_scales.items())
    trainer = {f"{k}.weight": v.clone() for k, v in full.items()}
    apply_payload(wire, trainer)
    for name, want in reference.items():
        assert torch.allclose(trainer[f"{name}.weight"], want, rtol=0, atol=1e-6), name
    _assert_slices_equal_trainer(full, {k[: -len(".weight")]: v for k, v in trainer.items()}, wire, tp)
    del payload.input_scales["a.q_proj"]
    with pytest.raises(KeyError, match="input scales but none"):
        apply_payload(payload, {f"{k}.weight": v.clone() for k, v in full.items()})


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("distribution", ["rademacher", "hadamard"])
def test_outputs_side_payload_merges_alike_on_slices(tp: int, distribution: str) -> None:
    """``logra.sketch_side: outputs``: ``W ← W − (F R)ᵀ`` with ``F`` ``d_in × r`` and ``R`` drawn at ``d_out``. A fused
    column-parallel block (a row range of ``W``) needs those columns of ``R``; a row-parallel block (a column range)
    those rows of ``F``. Written out in float64, then the trainer's merge and every rank's slices bit for bit."""
    full = _matrices()
    g = torch.Generator().manual_seed(1)
    factors = {name: (torch.randn(w.shape[1], 16, generator=g) * 0.1).bfloat16() for name, w in full.items()}
    payload = Payload(
        factors, update_index=4, base_seed=3, rank=16, distribution=distribution, refresh=True, sketch_side="outputs"
    )
    wire = Payload.from_bytes(payload.to_bytes())
    assert wire.sketch_side == "outputs"
    trainer = {f"{k}.weight": v.clone() for k, v in full.items()}
    apply_payload(wire, trainer)
    for name, factor in factors.items():
        proj = make_projection(payload.seed(name), 16, full[name].shape[0], distribution).double()
        want = (full[name].double() - (factor.double() @ proj).T).float()
        assert torch.allclose(trainer[f"{name}.weight"], want, rtol=0, atol=1e-6), name
        assert not torch.equal(trainer[f"{name}.weight"], full[name])
    _assert_slices_equal_trainer(full, {k[: -len(".weight")]: v for k, v in trainer.items()}, wire, tp)
    slices, params = _engine_layout(full, 0, 1)
    slices["a.q_proj"] = EngineSlice(
        *[getattr(slices["a.q_proj"], f) for f in ("param", "rows", "local_row", "cols", "d_in")]
    )
    with pytest.raises(ValueError, match="d_out"):
        apply_payload_to_slices(wire, slices, params)
