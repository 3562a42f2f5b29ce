"""HFExport under real Lightning runs: periodic and final exports hold the policy of their update, exactly."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from logra_pl.callbacks import HFExport
from logra_pl.losses import PPOClip
from logra_pl.module import LoGRAPolicyModule, RolloutSettings
from logra_pl.runs.export import PROVENANCE_FILE, export_checkpoint, policy_folder_complete
from logra_pl.sketch import LoGRAConfig

SMALL = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}
DP_RUN = Path(__file__).parents[1] / "strategy" / "dp_run.py"


class Snapshots(pl.Callback):
    """The policy's tensors after every update (global step), cloned."""

    def __init__(self) -> None:
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.states[trainer.global_step] = {k: v.clone() for k, v in pl_module.policy.state_dict().items()}


class FailAt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"failure injected at update {self.step}")


def _module(**kwargs) -> LoGRAPolicyModule:
    return LoGRAPolicyModule(
        policy="tiny",
        logra=LoGRAConfig(rank=16, update_ratio=1e-2),
        rollout=RolloutSettings(max_new_tokens=6),
        microbatch_size=4,
        **kwargs,
    )


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    """An export's tensors as plain transformers loads them (tied lm_head included)."""
    assert policy_folder_complete(folder)
    return AutoModelForCausalLM.from_pretrained(folder).state_dict()


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_periodic_and_final_exports_hold_their_updates(
    rl_run, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    export, snaps, module = HFExport(every_n_updates=2, dirpath=str(tmp_path / "hf")), Snapshots(), _module()
    with caplog.at_level(logging.INFO):
        rl_run(module, tmp_path, 4, [snaps, export])
    root = tmp_path / "hf"
    assert _listing(root) == ["final", "update-000002", "update-000004"]  # and no temporary folder
    for name, step in [("update-000002", 2), ("update-000004", 4), ("final", 4)]:
        weights = _weights(root / name)
        assert weights.keys() == snaps.states[step].keys()
        for key, value in snaps.states[step].items():
            assert torch.equal(weights[key], value), (name, key)
        record = json.loads((root / name / PROVENANCE_FILE).read_text())
        assert record["global_step"] == step and record["written_by"] == "HFExport" and record["dtype"] == "float32"
    moved = [k for k, v in snaps.states[2].items() if not torch.equal(v, snaps.states[4][k])]
    assert moved and all(k.endswith("proj.weight") for k in moved)  # the two periodic exports differ
    assert export.exported == [root / "update-000002", root / "update-000004", root / "final"]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("HFExport:")]
    assert lines == [f"HFExport: update {s} -> {root / n}" for s, n in [(2, "update-000002"), (4, "update-000004")]] + [
        f"HFExport: update 4 -> {root / 'final'}"
    ]


def test_keep_newest_default_dir_and_dtype(rl_run, tmp_path: Path) -> None:
    module = _module()
    rl_run(module, tmp_path, 4, [HFExport(every_n_updates=1, keep=1, dtype="bfloat16")])
    root = tmp_path / "hf"  # <default_root_dir>/hf: with logger=False, trainer.log_dir is default_root_dir
    assert _listing(root) == ["final", "update-000004"]
    assert json.loads((root / "final" / "config.json").read_text())["dtype"] == "bfloat16"
    tensors = load_file(root / "update-000004" / "model.safetensors")
    policy = module.policy.state_dict()
    assert tensors and all(
        v.dtype == torch.bfloat16 and torch.equal(v, policy[k].bfloat16()) for k, v in tensors.items()
    )


def test_no_final_export_when_the_fit_fails(rl_run, tmp_path: Path) -> None:
    export = HFExport(every_n_updates=1, dirpath=str(tmp_path / "hf"))
    with pytest.raises(RuntimeError, match="failure injected at update 2"):
        rl_run(_module(), tmp_path, 4, [FailAt(2), export])
    assert _listing(tmp_path / "hf") == ["update-000001"]


def test_ppo_updates_cross_the_period_and_resume_continues_the_count(rl_run, tmp_path: Path) -> None:
    # PPO: 2 epochs × 2 minibatches = 4 updates per training step, so global_step goes 4, 8: every 2 updates means
    # "whenever a multiple of 2 was crossed".
    ppo = _module(loss=PPOClip(epochs=2, minibatches=2))
    rl_run(ppo, tmp_path / "ppo", 8, [HFExport(every_n_updates=2, at_end=False, dirpath=str(tmp_path / "ppo_hf"))])
    assert _listing(tmp_path / "ppo_hf") == ["update-000004", "update-000008"]

    # Resume at update 3 with every 2 updates: the next export is update 4, not an immediate one for period 1.
    first = rl_run(_module(), tmp_path / "a", 3, [])
    ckpt = tmp_path / "three.ckpt"
    first.save_checkpoint(ckpt)
    export = HFExport(every_n_updates=2, at_end=False, dirpath=str(tmp_path / "resumed_hf"))
    rl_run(_module(), tmp_path / "b", 6, [export], ckpt_path=str(ckpt))
    assert _listing(tmp_path / "resumed_hf") == ["update-000004", "update-000006"]


def test_bad_settings(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="every_n_updates must be >= 0"):
        HFExport(every_n_updates=-1)
    with pytest.raises(ValueError, match="keep must be >= 1"):
        HFExport(keep=0)
    with pytest.raises(ValueError, match="unknown floating dtype 'int8'"):
        HFExport(dtype="int8")
    trainer = pl.Trainer(max_steps=1, logger=False, enable_checkpointing=False, callbacks=[HFExport()])
    with pytest.raises(TypeError, match="HFExport works with a policy module"):
        trainer.fit(BoringModel())


@pytest.mark.system
@pytest.mark.cores(2)
@pytest.mark.slow
def test_two_fsdp_ranks_gather_and_rank0_writes(tmp_path: Path, tiny_model_dir: Path) -> None:
    """2 gloo ranks (LoGRAStrategy, FSDP2): exports equal the gathered policy and the distributed checkpoint."""
    out, ckpts, hf = tmp_path / "run.pt", tmp_path / "ckpt", tmp_path / "hf"
    args = [sys.executable, str(DP_RUN), "2", "4", str(out), "--ckpt-dir", str(ckpts), "--distributed-ckpt"]
    proc = subprocess.run(
        [*args, "--hf-export", str(hf)],
        cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _listing(hf) == ["final", "update-000003"]
    gathered = torch.load(out)["policy"]  # rank 0's full state dict after update 4, gathered by the run itself
    final = _weights(hf / "final")
    assert all(torch.equal(final[k], v) for k, v in gathered.items())
    # Update 3, two ways: gathered from FSDP shards by the callback, and read from the sharded (DCP) checkpoint.
    from_dcp = _weights(export_checkpoint(ckpts / "step=3.ckpt", tmp_path / "from_dcp"))
    at3 = _weights(hf / "update-000003")
    assert at3.keys() == from_dcp.keys() == final.keys()
    assert all(torch.equal(at3[k], from_dcp[k]) for k in at3)
    assert any(not torch.equal(at3[k], final[k]) for k in at3)


def test_default_dir_is_the_runs_own_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TensorBoard/CSV: ``<log_dir>/hf``. MLflow, W&B: ``Trainer.log_dir`` is their save_dir, shared by every run, so
    the exports go beside the run's checkpoints instead (two runs never overwrite each other's ``final``)."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    run = tmp_path / "mlruns" / "1" / "abc"
    trainer = pl.Trainer(
        logger=MLFlowLogger(tracking_uri=f"file:{tmp_path / 'mlruns'}"),
        callbacks=[ModelCheckpoint(dirpath=run / "checkpoints")],
        enable_progress_bar=False,
    )
    assert HFExport().export_dir(trainer) == run / "hf"
    trainer = pl.Trainer(
        logger=CSVLogger(tmp_path, name="csv"),
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "elsewhere")],
        enable_progress_bar=False,
    )
    assert HFExport().export_dir(trainer) == Path(trainer.log_dir) / "hf"
