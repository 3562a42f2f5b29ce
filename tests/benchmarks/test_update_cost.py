"""benchmarks/update_cost.py: its cost count charges each call to the range it runs in, with the FLOPs a dense
computation in the test gives, and it counts a whole LoGRA and AdamW update of a small Qwen2 shape on ``meta``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

import update_cost

from logra_pl.sketch.trace import listening, traced


def test_a_matmul_is_charged_to_its_range_with_its_flops_bytes_and_dtype() -> None:
    a = torch.empty(64, 32, device="meta", dtype=torch.bfloat16)
    b = torch.empty(32, 16, device="meta", dtype=torch.bfloat16)
    mode = update_cost.CostCount()
    mode.phase = "phase"
    with mode, listening():
        with traced("logra.sketch.project"):
            a @ b
        (a.float() @ b.float()).sum().item()  # a host read of a device tensor: one synchronization
    part = mode.parts["logra.sketch.project"]
    assert part.calls == 1 and part.launches == 1 and part.syncs == 0
    assert part.flops == {"bf16": 2 * 64 * 32 * 16}
    assert part.bytes == 2 * (64 * 32 + 32 * 16 + 64 * 16)
    other = mode.parts["phase"]
    assert other.flops == {"fp32": 2 * 64 * 32 * 16} and other.syncs == 1


@pytest.mark.timeout(300)
def test_an_update_of_a_small_shape_is_counted_for_both_methods(monkeypatch) -> None:
    monkeypatch.setitem(update_cost.SHAPES, "small", (64, 128, 2, 4, 2, 256, True))
    logra, _ = update_cost.logra_costs("small", tokens=16, rank=8, checkpointing=True, probe_tokens=8)
    adamw, _ = update_cost.adamw_costs("small", tokens=16, checkpointing=True, probe_tokens=8)
    for part in ("logra.sketch.project", "logra.sketch.accumulate", "logra.propose", "logra.apply", "logra.kl_probe"):
        assert logra[part].launches > 0, part
    # 2 layers × 7 matrices, each projected once per microbatch under activation checkpointing (in the replay; the
    # first pass saves a placeholder): Z = X Pᵀ in fp32 at 2·tokens·d_in·r FLOPs each.
    d_in = {"q": 64, "k": 64, "v": 64, "o": 64, "gate": 64, "up": 64, "down": 128}
    assert logra["logra.sketch.project"].flops == {"fp32": 2 * 2 * 16 * sum(d_in.values()) * 8}
    assert "fp64" in logra["logra.apply"].flops  # the exact merge
    assert adamw["AdamW step"].flops == {} and adamw["AdamW step"].bytes > 0
    # AdamW computes the weight gradients LoGRA skips: more bf16 FLOPs in its layers.
    assert adamw["model (AdamW: weight gradients)"].flops["bf16"] > logra["model (LoGRA: frozen targets)"].flops["bf16"]


def test_bf16_operands_take_the_tensor_core_path_on_the_gpus_stand_in(monkeypatch) -> None:
    """``sketch_operands: bfloat16`` on ``meta`` (where ``torch.mm(..., out_dtype=float32)`` exists, as on CUDA):
    the projection's and the accumulation's FLOPs are bf16 products — the GPU branch of ``mixed_mm`` is the one
    that runs — with the accumulation's two terms doubling its FLOPs."""
    monkeypatch.setitem(update_cost.SHAPES, "small", (64, 128, 2, 4, 2, 256, True))
    fp32, _ = update_cost.logra_costs("small", tokens=16, rank=8, checkpointing=False, probe_tokens=8)
    bf16, _ = update_cost.logra_costs(
        "small", tokens=16, rank=8, checkpointing=False, probe_tokens=8, operands="bfloat16"
    )
    assert bf16["logra.sketch.project"].flops == {"bf16": fp32["logra.sketch.project"].flops["fp32"]}
    assert bf16["logra.sketch.accumulate"].flops == {"bf16": 2 * fp32["logra.sketch.accumulate"].flops["fp32"]}
