"""Bytes per policy sync: LoGRA factor payloads vs full bf16 weights, measured on the tiny model and computed
for Qwen2.5-7B (algorithm.md §9).

    python benchmarks/sync_bytes.py [--rank-tiny 64] [--rank-7b 256]

Tiny: a real payload (random factors of the right shapes) is serialized exactly as ``PolicySync`` sends it.
7B: the model is built on the meta device from its config (no weights), the target matrices are read from it,
and the payload size is Σ d_out·r·2 plus the safetensors header of a payload with the same names.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from logra_pl.models import build_tiny_model
from logra_pl.sketch import DEFAULT_TARGETS, select_targets
from logra_pl.sketch.payload import Payload

# Qwen2.5-7B(-Instruct) config.json, the fields that shape the weights.
QWEN25_7B = dict(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    max_position_embeddings=32768,
    tie_word_embeddings=False,
)


def sync_bytes(model: torch.nn.Module, rank: int, materialize: bool) -> dict[str, float]:
    """Factor payload bytes (serialized) vs the target matrices in bf16."""
    targets = select_targets(model, DEFAULT_TARGETS)
    shapes = {name: tuple(m.weight.shape) for name, m in targets.items()}
    factor_bytes = sum(d_out * rank * 2 for d_out, _ in shapes.values())
    full_bytes = sum(d_out * d_in * 2 for d_out, d_in in shapes.values())
    if materialize:
        factors = {n: torch.zeros(d_out, rank, dtype=torch.bfloat16) for n, (d_out, _) in shapes.items()}
        wire = len(Payload(factors, 1, 0, rank, "rademacher", True).to_bytes())
    else:  # header of a same-named payload with 1×1 factors, plus the factor data
        stub = {n: torch.zeros(1, 1, dtype=torch.bfloat16) for n in shapes}
        wire = len(Payload(stub, 1, 0, rank, "rademacher", True).to_bytes()) - 2 * len(shapes) + factor_bytes
    return {
        "matrices": len(shapes),
        "factor_bytes": factor_bytes,
        "payload_bytes": wire,
        "payload_over_factor": wire / factor_bytes,
        "full_bf16_bytes": full_bytes,
        "payload_over_full": wire / full_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank-tiny", type=int, default=64)
    parser.add_argument("--rank-7b", type=int, default=256)
    parser.add_argument("--json", help="also write the numbers here")
    args = parser.parse_args()
    tiny = AutoModelForCausalLM.from_pretrained(build_tiny_model("tiny"))
    with torch.device("meta"):
        big = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN25_7B))
    rows = {
        f"tiny (r={args.rank_tiny})": sync_bytes(tiny, args.rank_tiny, materialize=True),
        f"Qwen2.5-7B (r={args.rank_7b})": sync_bytes(big, args.rank_7b, materialize=False),
    }
    print(f"{'model':<22}{'matrices':>9}{'payload':>14}{'full bf16':>16}{'payload/factor':>16}{'payload/full':>14}")
    for name, r in rows.items():
        print(
            f"{name:<22}{r['matrices']:>9}{r['payload_bytes']:>14,}{r['full_bf16_bytes']:>16,}"
            f"{r['payload_over_factor']:>16.4f}{r['payload_over_full']:>14.4f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
