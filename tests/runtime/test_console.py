"""What a first run shows: progress in updates, an honest model summary, a summary that knows a short run, the
end-of-run pointers — and not Lightning's cloud tips."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary, RichProgressBar, TQDMProgressBar

from logra_pl.callbacks import RunSummary
from logra_pl.callbacks.progress import (
    LoGRAModelSummary,
    LoGRARichModelSummary,
    RichUpdateProgressBar,
    UpdateProgressBar,
)
from logra_pl.cli import LoGRACLI
from logra_pl.module import LoGRAPolicyModule, RolloutSettings
from logra_pl.sketch import LoGRAConfig

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml")


@pytest.mark.parametrize(
    ("bar", "summary", "want_bar", "want_summary"),
    [
        (TQDMProgressBar(), ModelSummary(), UpdateProgressBar, LoGRAModelSummary),
        (RichProgressBar(), RichModelSummary(), RichUpdateProgressBar, LoGRARichModelSummary),
    ],
)
def test_progress_in_updates_and_trained_parameters_in_the_summary(
    tmp_path: Path, rl_run, caplog: pytest.LogCaptureFixture, bar, summary, want_bar, want_summary
) -> None:
    module = LoGRAPolicyModule(
        policy="tiny", logra=LoGRAConfig(rank=16), rollout=RolloutSettings(max_new_tokens=4), microbatch_size=8
    )
    caplog.set_level(logging.INFO)
    # The Trainer's defaults would be these two; the module swaps them for its own kinds.
    trainer = rl_run(module, tmp_path, 2, [bar, summary], enable_progress_bar=True, enable_model_summary=True)
    assert type(trainer.progress_bar_callback) is want_bar
    assert sum(isinstance(c, want_summary) for c in trainer.callbacks) == 1
    if want_bar is UpdateProgressBar:
        assert trainer.progress_bar_callback.train_progress_bar.total == 2  # updates, not batches of an epoch
        assert trainer.progress_bar_callback.train_progress_bar.desc.startswith("update")
    else:
        task = trainer.progress_bar_callback.progress.tasks[trainer.progress_bar_callback.train_progress_bar_id]
        assert task.total == 2 and task.completed == 2 and "update" in task.description
    # 14 matrices of the tiny model are what LoGRA trains; the summary says so.
    trained = sum(m.module.weight.numel() for m in module.method.sketcher.matrices.values())
    assert module.method.trained_parameter_count(module.policy) == trained > 0
    assert "LoGRA trains 524.3 K parameters in 14 matrices" in caplog.text
    assert "rank-16 sketches" in caplog.text and "of fp32 dense gradients" in caplog.text
    assert "💡 Tip" not in caplog.text


def test_run_summary_says_a_short_run_is_too_short() -> None:
    summary = RunSummary(window=10)
    summary.rewards = [0.1] * 12
    text = summary.summary()
    assert "too short to compare the first and last 10: needs 20" in text
    assert "first 10 updates" not in text
    summary.rewards = [0.0] * 10 + [0.5] * 10
    assert "first 10 updates 0.000 -> last 10 updates 0.500 (+0.500)" in summary.summary()
    # Its record travels in checkpoints: a resumed run's summary covers the whole run.
    again = RunSummary(window=10)
    again.load_state_dict(summary.state_dict())
    assert again.rewards == summary.rewards and "over 2 sessions" in again.summary()


def test_end_of_fit_says_where_things_are(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="logra_pl")
    LoGRACLI(
        args=[
            "fit",
            f"--config={CONFIG}",
            "--trainer.max_steps=1",
            "--trainer.enable_progress_bar=false",
            "--trainer.val_check_interval=100",
            "--model.warm_start=null",
            "--data.train_size=64",
            "--data.eval_size=8",
            "--data.prompts_per_step=8",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
        ]
    )
    run = tmp_path / "tiny_cpu" / "version_0"
    assert f"tensorboard --logdir {run}" in caplog.text
    assert f"checkpoint:  {run / 'checkpoints' / 'last.ckpt'}" in caplog.text
    # Resuming names the run's own resolved config, which keeps the --trainer.logger override above.
    assert f"(resume: logra-pl fit --config {run / 'config.yaml'} --ckpt_path last)" in caplog.text
    assert f"logra-pl export --ckpt {run / 'checkpoints' / 'last.ckpt'} --out {run / 'hf'}" in caplog.text
    assert (run / "checkpoints" / "last.ckpt").is_file()  # at_end: a 1-update run is saved too
