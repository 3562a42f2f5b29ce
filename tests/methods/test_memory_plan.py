"""The memory planner predicts the state bytes a real model, sketcher and optimizer hold (no weights needed)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from logra_pl.cli import main as cli_main
from logra_pl.methods.memory_plan import plan
from logra_pl.models.tiny import PRESETS
from logra_pl.sketch import DEFAULT_TARGETS, LoGRAConfig, LoGRASketcher, memory_report, select_targets

# Qwen2.5-7B-Instruct's config.json (the fields that shape the weights), as published.
QWEN25_7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
}


def _measured(preset: str, rank: int) -> tuple[int, int, object]:
    """Real models: LoGRA state after attaching the sketcher; AdamW state after one real step."""
    spec = PRESETS[preset]
    config = spec.qwen2_config(spec.vocab_size, 0, 1)
    model = AutoModelForCausalLM.from_config(config)
    logra = memory_report(model, sketcher=LoGRASketcher(model, LoGRAConfig(rank=rank))).total
    dense = AutoModelForCausalLM.from_config(config)
    for p in dense.parameters():
        p.requires_grad_(False)
    params = [m.weight.requires_grad_(True) for m in select_targets(dense, DEFAULT_TARGETS).values()]
    opt = torch.optim.AdamW(params)
    dense(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    return logra, memory_report(dense, optimizer=opt).total, config


@pytest.mark.parametrize(("preset", "rank"), [("tiny", 64), ("medium", 64), ("medium", 16)])
def test_plan_matches_measured_state(preset: str, rank: int) -> None:
    logra, adamw, config = _measured(preset, rank)
    rows = plan(config, ranks=1, rank_r=rank)
    assert abs(rows["logra"].report.total - logra) <= 0.05 * logra
    assert abs(rows["adamw"].report.total - adamw) <= 0.05 * adamw


def test_plan_shards_over_ranks_and_prints_the_7b_shape(tmp_path, capsys) -> None:
    one, four = plan(QWEN25_7B, ranks=1, rank_r=256), plan(QWEN25_7B, ranks=4, rank_r=256)
    # Independent count of the 7B's 196 target matrices: rows per layer and the d_in of each.
    h, ff, kv, layers = 3584, 18944, 4 * 128, 28
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (ff, h), (ff, h), (h, ff)] * layers
    assert four["logra"].report.sketches == sum(d_out * 256 * 4 for d_out, _ in shapes)
    assert four["logra"].report.projections == sum(256 * d_in * 4 for _, d_in in shapes)
    assert four["adamw"].report.gradients == sum(-(-d_out // 4) * d_in * 4 for d_out, d_in in shapes)
    # Weights and dense state shard 4 ways; sketches, projections and row statistics do not.
    assert four["adamw"].report.optimizer_state < 0.26 * one["adamw"].report.optimizer_state
    assert four["logra"].report.sketches == one["logra"].report.sketches
    assert four["logra"].report.total < 0.5 * four["adamw"].report.total
    path = tmp_path / "qwen2.5-7b.json"
    path.write_text(json.dumps(QWEN25_7B))
    cli_main(["plan", "--model", str(path), "--ranks", "4", "--rank", "256", "--json", str(tmp_path / "p.json")])
    out = capsys.readouterr().out
    assert "4 rank(s), r=256" in out and "optimizer_state" in out and "logra / adamw total" in out
    saved = json.loads((tmp_path / "p.json").read_text())
    assert saved["logra"]["total"] == four["logra"].report.total


def test_plan_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="model_type"):
        plan({"hidden_size": 8})
    with pytest.raises(ValueError, match=r"logra\.rank=512 exceeds d_in"):
        plan(PRESETS["tiny"].qwen2_config(512, 0, 1), rank_r=512)
    with pytest.raises(ValueError, match="unknown method 'nope': plan a registered one"):
        plan(QWEN25_7B, optimizers=["nope"])
    with pytest.raises(ValueError, match=r"unknown plan options \['sgd_momentun'\]"):
        plan(QWEN25_7B, optimizers=["sgd"], sgd_momentun=True)
    with pytest.raises(ValueError, match="unknown logra_rule 'papr'"):
        plan(QWEN25_7B, optimizers=["logra"], logra_rule="papr")
    with pytest.raises(ValueError, match=r"no model config for 'nobody/no-such-model'.*local Hugging Face cache"):
        plan("nobody/no-such-model")  # offline in tests: not in the cache


def test_config_of_a_gguf_policy() -> None:
    """``smollm2`` (a GGUF file) gives its config without loading weights: the planner and the rank check use it."""
    from logra_pl.models.load import load_config

    config = load_config("smollm2")
    assert config.hidden_size == 576 and config.num_hidden_layers == 30


def test_the_vocabulary_sized_activations_of_a_microbatch_are_printed_beside_the_state(tmp_path, capsys) -> None:
    """Qwen2.5-7B's 152,064-token vocabulary, a 4,096-token microbatch of which 3,072 are response tokens, bf16
    weights: the full path holds the bf16 logits of every position and the fp32 log-softmax of the response ones; the
    chunked path three fp32 chunk × V tensors and one float per scored token (counted here by hand)."""
    from logra_pl.methods.memory_plan import logit_activations

    vocab = QWEN25_7B["vocab_size"]
    acts = logit_activations(QWEN25_7B, 4096, 3072, 512, "bfloat16")
    assert acts["vocab"] == vocab
    assert acts["full"] == 4096 * vocab * 2 + 3072 * vocab * 4
    assert acts["chunked"] == 3 * 512 * vocab * 4 + 3072 * 4
    assert acts["chunked"] < 0.5 * acts["full"]
    assert "chunked" not in logit_activations(QWEN25_7B, 4096)
    path = tmp_path / "qwen2.5-7b.json"
    path.write_text(json.dumps(QWEN25_7B))
    args = ["plan", "--model", str(path), "--weight-dtype", "bfloat16", "--microbatch-tokens", "4096"]
    cli_main([*args, "--response-tokens", "3072", "--logprob-chunk", "512", "--json", str(tmp_path / "p.json")])
    out = capsys.readouterr().out
    assert (
        f"4096 tokens (3072 scored), vocabulary {vocab:,}: logits and log-softmax {acts['full'] / 2**30:.3f} GiB" in out
    )
    assert f"with logprob_chunk_tokens 512: {acts['chunked'] / 2**30:.3f} GiB" in out
    assert json.loads((tmp_path / "p.json").read_text())["activations"] == acts


@pytest.mark.parametrize("operands", ["float32", "bfloat16"])
def test_bf16_sketch_operands_are_planned_as_the_sketcher_holds_them(operands: str) -> None:
    """``logra.sketch_operands: bfloat16`` keeps P's bf16 signs beside P: the planner's projection bytes equal the
    measured ones, 1.5× the fp32 operands' (the weights' share, r·d_in·2 bytes per matrix, written out here)."""
    spec = PRESETS["medium"]
    config = spec.qwen2_config(spec.vocab_size, 0, 1)
    model = AutoModelForCausalLM.from_config(config)
    sketcher = LoGRASketcher(model, LoGRAConfig(rank=16, sketch_operands=operands))
    measured = memory_report(model, sketcher=sketcher).projections
    planned = plan(config, rank_r=16, optimizers=["logra"], sketch_operands=operands)["logra"].report.projections
    fp32 = sum(16 * m.in_features * 4 for m in select_targets(model, DEFAULT_TARGETS).values())
    assert measured == planned == (fp32 if operands == "float32" else fp32 * 3 // 2)


@pytest.mark.parametrize("side", ["inputs", "outputs"])
def test_sketch_side_is_planned_as_the_sketcher_holds_it(side: str) -> None:
    """``logra.sketch_side: outputs``: a ``d_in × r`` sketch and moments and an ``r × d_out`` projection per matrix.
    The planner's bytes equal the measured ones, kind by kind, and the written-out sums over the matrices."""
    spec = PRESETS["medium"]
    config = spec.qwen2_config(spec.vocab_size, 0, 1)
    model = AutoModelForCausalLM.from_config(config)
    measured = memory_report(model, sketcher=LoGRASketcher(model, LoGRAConfig(rank=16, sketch_side=side)))
    planned = plan(config, rank_r=16, optimizers=["logra"], sketch_side=side)["logra"].report
    linears = select_targets(model, DEFAULT_TARGETS).values()
    rows = sum(m.out_features if side == "inputs" else m.in_features for m in linears)
    width = sum(m.in_features if side == "inputs" else m.out_features for m in linears)
    assert measured.sketches == planned.sketches == rows * 16 * 4
    assert measured.projections == planned.projections == width * 16 * 4
    assert measured.sketch_moments == planned.sketch_moments == 2 * rows * 16 * 2  # two bf16 moments
    assert measured.row_statistics == planned.row_statistics == rows * 4
