"""Checkpoints written by an earlier layout of the package, and what resuming each of them must give.

The package was regrouped into wings (``train/``, ``losses/``, ``methods/``, ``runs/``, ``runtime/``...), so module
paths that old checkpoints name moved. ``tests/behaviour/legacy/`` holds two checkpoints written by the code before
that move (2 updates of ``tiny`` each) and a record of resuming each to update 4 on that same code:

- ``cli``: ``logra-pl fit --config configs/tiny_cpu.yaml`` (LightningCLI: plain-data hyper-parameters), resumed with
  ``--ckpt_path``;
- ``notebook``: a module built in Python (its hyper-parameters pickle the settings objects by their module paths:
  ``logra_pl.settings.RolloutSettings``, ``logra_pl.warm_start.WarmStart``, ``logra_pl.guard.DivergenceGuard``, ...),
  rebuilt with ``LoGRAPolicyModule.load_from_checkpoint`` and resumed with ``Trainer.fit(ckpt_path=...)``.

``python -m tests.behaviour.legacy write`` wrote them (run once, on the code before the move: never again, since the
point is that the files come from the old layout). ``python -m tests.behaviour.legacy notebook-resume CKPT OUT`` is the
resumed notebook run (a child process with one thread, as every reference run). ``tests/test_legacy_checkpoints.py``
resumes both and compares with the records: bit for bit on the CPU kind they were written on, structure elsewhere.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from tests.behaviour.scenarios import ROOT, capture, checkpoint_image, comparable, digest, fingerprint

LEGACY = Path(__file__).resolve().parent / "legacy"

# The CLI run: the demo config, 2 updates (a checkpoint at update 2), then resumed to update 4.
CLI_COMMON = [
    "--config=configs/tiny_cpu.yaml",
    "--config=configs/overlays/rowadam_demo.yaml",  # the rule tiny_cpu.yaml held when the checkpoint was written
    "--trainer.val_check_interval=2",
    "--trainer.enable_progress_bar=false",
    "--model.warm_start.steps=20",
    "--data.train_size=64",
    "--data.eval_size=16",
    "--data.eval_batch_size=16",
    "--data.prompts_per_step=8",
    "--model.microbatch_size=8",
    "--checkpoint.every_n_updates=2",
]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def run_cli(save_dir: Path, steps: int, ckpt: Path | None = None) -> Path:
    """``logra-pl fit`` of the CLI scenario for ``steps`` updates (resumed from ``ckpt``); the run's folder."""
    args = [sys.executable, "-m", "logra_pl.cli", "fit", *CLI_COMMON, f"--trainer.max_steps={steps}"]
    args += [f"--trainer.logger.init_args.save_dir={save_dir}"]
    if ckpt is not None:
        args += [f"--ckpt_path={ckpt}"]
    done = subprocess.run(args, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"logra-pl fit exited {done.returncode}\n{done.stderr[-4000:]}")
    return save_dir / "tiny_cpu" / "version_0"


# ------------------------------------------------------------------------------------------ notebook scenario
def _notebook_module() -> Any:
    """The module as a notebook builds it: settings objects (pickled into the checkpoint's hyper-parameters)."""
    from logra_pl.losses import ReinforceTIS, RunningBaseline
    from logra_pl.methods.adamw import AdamWConfig
    from logra_pl.methods.guard import DivergenceGuard
    from logra_pl.module import LoGRAPolicyModule, RolloutSettings, ScoringSettings
    from logra_pl.sketch import LoGRAConfig
    from logra_pl.train.warm_start import WarmStart

    return LoGRAPolicyModule(
        policy="tiny",
        warm_start=WarmStart(task="chain_sum", task_config=dict(SMALL), steps=20),
        logra=LoGRAConfig(rank=16, update_ratio=1e-2, ratio_scope="matrix"),
        adamw=AdamWConfig(lr=1e-4),
        loss=ReinforceTIS(tis_cap=2.0),
        baseline=RunningBaseline(momentum=0.8),
        rollout=RolloutSettings(max_new_tokens=8),
        scoring=ScoringSettings(timeout_s=None),
        guard=DivergenceGuard(),
        microbatch_size=8,
    )


SMALL = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}


def _notebook_trainer(root: Path, steps: int) -> Any:
    import lightning.pytorch as pl

    from logra_pl.callbacks import UpdateCheckpoint

    checkpoint = UpdateCheckpoint(dirpath=root / "checkpoints", every_n_updates=2)
    return pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=root,
        callbacks=[checkpoint],
    )


def _notebook_data() -> Any:
    from logra_pl.data import ReasoningGymDataModule

    return ReasoningGymDataModule(
        {"chain_sum": {"config": dict(SMALL)}}, train_size=64, eval_size=16, prompts_per_step=8, eval_batch_size=16
    )


def notebook_write(root: Path) -> Path:
    """2 updates of the notebook scenario; its last checkpoint."""
    import lightning.pytorch as pl

    pl.seed_everything(0)
    trainer = _notebook_trainer(root, 2)
    trainer.fit(_notebook_module(), datamodule=_notebook_data())
    return root / "checkpoints" / "last.ckpt"


def notebook_resume(ckpt: Path, out: Path) -> None:
    """Rebuild the module from ``ckpt`` (its pickled settings), resume to update 4, write what it computed."""
    import lightning.pytorch as pl

    from logra_pl.module import LoGRAPolicyModule

    pl.seed_everything(0)
    module = LoGRAPolicyModule.load_from_checkpoint(ckpt, weights_only=False)
    trainer = _notebook_trainer(out.parent / "run", 4)
    trainer.fit(module, datamodule=_notebook_data(), ckpt_path=ckpt, weights_only=False)
    last = out.parent / "run" / "checkpoints" / "last.ckpt"
    state = torch.load(last, map_location="cpu", weights_only=False)
    record = {
        "global_step": int(trainer.global_step),
        "weights": {name: digest(t) for name, t in sorted(state["state_dict"].items())},
        "checkpoint": comparable(checkpoint_image(last)),
        "reward": [float(module.step_context.metrics["train/reward_mean"])],
    }
    out.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def run_notebook_resume(ckpt: Path, workdir: Path) -> dict[str, Any]:
    """:func:`notebook_resume` in a child process with one thread; its record."""
    out = workdir / "notebook.json"
    args = [sys.executable, "-m", "tests.behaviour.legacy", "notebook-resume", str(ckpt), str(out)]
    done = subprocess.run(args, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"notebook resume exited {done.returncode}\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


# ------------------------------------------------------------------------------------------------- writing
def write() -> None:
    """Write both checkpoints and the records of resuming them (the code before the move; run once)."""
    LEGACY.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("LOGRA_PL_CACHE", str(Path.home() / ".cache" / "logra-pl"))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        first = run_cli(tmp / "cli", 2)
        shutil.copy(first / "checkpoints" / "last.ckpt", LEGACY / "cli_update2.ckpt")
        resumed = run_cli(tmp / "cli_resumed", 4, ckpt=LEGACY / "cli_update2.ckpt")
        record = {"fingerprint": fingerprint(), **capture(resumed)}
        (LEGACY / "cli_update4.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")

        args = [sys.executable, "-m", "tests.behaviour.legacy", "notebook-write", str(tmp / "nb")]
        done = subprocess.run(args, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-4000:])
        shutil.copy(tmp / "nb" / "checkpoints" / "last.ckpt", LEGACY / "notebook_update2.ckpt")
        record = {"fingerprint": fingerprint(), **run_notebook_resume(LEGACY / "notebook_update2.ckpt", tmp)}
        (LEGACY / "notebook_update4.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    for path in sorted(LEGACY.iterdir()):
        print(f"{path.name}: {path.stat().st_size} bytes")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    command = sys.argv[1]
    if command == "write":
        write()
    elif command == "notebook-write":
        notebook_write(Path(sys.argv[2]))
    elif command == "notebook-resume":
        notebook_resume(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        raise SystemExit(f"unknown command {command!r}: write | notebook-write | notebook-resume")
