"""Rollout throughput: the HF engine vs vLLM on the same prompts, batch and sampling, side by side.

    python benchmarks/rollout_speed.py [--policy tiny] [--prompts 64] [--max-new-tokens 8] [--repeats 5]

Prompts are reasoning-gym chain_sum chats (the demo's), sampled at T=1 with per-prompt seeds. The HF engine runs
first (vLLM's CPU worker re-binds the process's threads when it starts). Tokens/s counts generated tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    import reasoning_gym
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from logra_pl.models.load import resolve_source
    from logra_pl.rollout.base import SamplingConfig
    from logra_pl.rollout.hf import HFEngine
    from logra_pl.rollout.vllm import VLLMEngine, VLLMSettings

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="tiny", help="tiny | tiny:small | a save_pretrained folder")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    folder = resolve_source(args.policy).location
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    data = reasoning_gym.create_dataset("chain_sum", size=args.prompts, seed=0, min_terms=2, max_terms=3)
    chats = [[{"role": "user", "content": item["question"]}] for item in data]
    prompts = [
        tokenizer(
            tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False), add_special_tokens=False
        ).input_ids
        for c in chats
    ]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.max_new_tokens)
    seeds = list(range(len(prompts)))

    def measure(engine) -> tuple[float, float]:
        engine.generate(prompts, sampling, prompt_seeds=seeds)  # warm-up
        rates, secs = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            rollout = engine.generate(prompts, sampling, prompt_seeds=seeds)
            dt = time.perf_counter() - start
            rates.append(rollout.num_response_tokens / dt)
            secs.append(dt)
        return statistics.median(rates), statistics.median(secs)

    hf = measure(HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id))
    vllm = measure(VLLMEngine(folder, tokenizer.eos_token_id, VLLMSettings()))
    print(f"\n{args.prompts} prompts x 1 response, max_new_tokens={args.max_new_tokens}, T=1, median of {args.repeats}")
    print(f"{'engine':<8}{'tokens/s':>12}{'seconds/batch':>16}")
    print(f"{'hf':<8}{hf[0]:>12.0f}{hf[1]:>16.3f}")
    print(f"{'vllm':<8}{vllm[0]:>12.0f}{vllm[1]:>16.3f}")
    print(f"vllm/hf tokens/s: {vllm[0] / hf[0]:.2f}x")


if __name__ == "__main__":
    main()
