"""The LoRA baseline (``model.optimizer: lora``): adapters on the target matrices, frozen base weights, and an
engine that holds the merged matrices — on real Trainer runs and through the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from logra_pl.methods.adamw import AdamWConfig
from logra_pl.methods.lora import LoRAConfig, MergedState, lora_layers, merged_tensors
from logra_pl.models.load import load_policy
from logra_pl.module import LoGRAPolicyModule, RolloutSettings
from logra_pl.sketch import memory_report

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lora_run(rl_run, tmp_path_factory: pytest.TempPathFactory) -> LoGRAPolicyModule:
    pl.seed_everything(0)
    module = LoGRAPolicyModule(
        policy="tiny",
        optimizer="lora",
        lora=LoRAConfig(rank=8, alpha=16.0),
        adamw=AdamWConfig(lr=1e-3, warmup_steps=0),
        rollout=RolloutSettings(max_new_tokens=6),
        microbatch_size=8,
    )
    rl_run(module, tmp_path_factory.mktemp("lora"), 3)
    return module


def test_adapters_train_and_base_weights_stay(lora_run: LoGRAPolicyModule) -> None:
    base, _ = load_policy("tiny")
    initial = base.state_dict()
    layers = lora_layers(lora_run.policy)
    assert len(layers) == 14
    for name, layer in layers.items():
        assert torch.equal(layer.base_layer.weight, initial[f"{name}.weight"]), name  # frozen
        assert layer.lora_A["default"].weight.shape == (8, layer.base_layer.in_features)
        assert float(layer.lora_B["default"].weight.abs().max()) > 0, name  # B left its zero init: trained
    trained = [n for n, p in lora_run.policy.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in n for n in trained)
    # By hand: W + (alpha / r) B A, against the module's merge.
    name, layer = next(iter(layers.items()))
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    expected = initial[f"{name}.weight"] + (16.0 / 8) * (b @ a)
    assert torch.allclose(merged_tensors(lora_run.policy)[f"{name}.weight"], expected, atol=1e-6)


def test_engine_holds_the_merged_weights(lora_run: LoGRAPolicyModule) -> None:
    engine = lora_run.engine.model.state_dict()
    merged = MergedState(lora_run.policy)
    assert sorted(merged) == sorted(engine)  # plain names only: no base_layer / lora_ keys reach an engine
    for key in merged:
        assert torch.equal(engine[key], merged[key]), key


def test_memory_report_counts_adapters_as_their_own_kinds(lora_run: LoGRAPolicyModule) -> None:
    report = memory_report(lora_run.policy, optimizer=lora_run.optimizers().optimizer)
    layers = lora_layers(lora_run.policy).values()
    adapters = sum(8 * (m.base_layer.in_features + m.base_layer.out_features) * 4 for m in layers)
    assert report.adapters == adapters
    assert report.adapter_optimizer_state >= 2 * adapters and report.optimizer_state == 0
    assert "LoRA trains" in lora_run.method.report(lora_run.policy, lora_run.targets)


def test_three_lora_updates_through_the_cli(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "logra_pl.cli",
        "fit",
        f"--config={ROOT / 'configs' / 'tiny_cpu.yaml'}",
        "--model.optimizer=lora",
        "--model.lora.rank=8",
        "--model.lora.alpha=16",
        "--model.adamw.lr=0.001",
        "--model.adamw.warmup_steps=0",
        "--trainer.max_steps=3",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false",
        "--model.warm_start.steps=20",
        "--data.train_size=128",
        "--data.eval_size=16",
        "--data.prompts_per_step=16",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "updates: 3" in out and "LoRA trains" in out
    # The run's HF folder and `logra-pl export` of its checkpoint are plain models with the merged matrices.
    from transformers import AutoModelForCausalLM

    run = tmp_path / "tiny_cpu" / "version_0"
    final = AutoModelForCausalLM.from_pretrained(run / "hf" / "final").state_dict()
    assert not any("lora" in k or "base_layer" in k for k in final)
    export = subprocess.run(
        [
            sys.executable,
            "-m",
            "logra_pl.cli",
            "export",
            "--ckpt",
            str(run / "checkpoints" / "last.ckpt"),
            "--out",
            str(tmp_path / "exported"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert export.returncode == 0, export.stderr[-3000:]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").state_dict()
    assert sorted(exported) == sorted(final)
    assert all(torch.equal(exported[k], final[k]) for k in final)
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    key = "model.layers.0.self_attn.q_proj"
    base = ckpt[f"policy.{key}.base_layer.weight"]
    assert not torch.equal(final[f"{key}.weight"], base)  # the adapters moved the merged matrix
