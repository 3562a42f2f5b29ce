"""``logra-pl fit`` end to end through LightningCLI on the tiny config, and its bad-input errors."""

from __future__ import annotations

import glob
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from logra_pl.cli import LoGRACLI

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml")
FAST = [
    "--trainer.max_steps=3",
    "--trainer.val_check_interval=3",
    "--trainer.enable_progress_bar=false",
    "--model.warm_start.steps=20",
    "--data.train_size=256",
    "--data.eval_size=32",
    "--data.prompts_per_step=16",
    "--model.microbatch_size=8",
]
SCALARS = [
    "train/reward_mean",
    "train/baseline",
    "train/advantage_mean",
    "train/advantage_std",
    "train/response_length",
    "train/truncation_rate",
    "train/loss",
    "train/update_norm",
    "time/rollout_s",
    "time/train_s",
    "time/update_s",
    "time/tokens_per_s",
    "verifier/errors",
    "val/reward_mean",
    "val/pass@1",
]
# tiny_cpu.yaml also carries PredictedKLControl (calibrating) and RolloutMismatch.
KL_SCALARS = [
    "kl/predicted",
    "kl/alpha",
    "kl/budget",
    "kl/effective_budget",
    "kl/realized",
    "kl/predicted_scaled",
    "mismatch/observed",
    "mismatch/ema",
]


def _scalars(save_dir: Path) -> dict[str, list[tuple[int, float]]]:
    files = glob.glob(str(save_dir / "**" / "events.out.tfevents.*"), recursive=True)
    assert files, f"no TensorBoard event file under {save_dir}"
    acc = EventAccumulator(sorted(files)[-1])
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.parametrize("optimizer", ["logra", "adamw"])
def test_three_updates_end_to_end(tmp_path: Path, optimizer: str) -> None:
    config = CONFIG if optimizer == "logra" else CONFIG.replace("tiny_cpu.yaml", "tiny_cpu_adamw.yaml")
    cli = LoGRACLI(args=["fit", f"--config={config}", *FAST, f"--trainer.logger.init_args.save_dir={tmp_path}"])
    module = cli.model
    assert cli.trainer.global_step == 3
    scalars = _scalars(tmp_path)
    wanted = SCALARS + (KL_SCALARS if optimizer == "logra" else [])
    missing = [s for s in wanted if s not in scalars]
    assert not missing, f"missing scalars {missing}; logged {sorted(scalars)}"
    assert [step for step, _ in scalars["train/reward_mean"]] == [0, 1, 2]
    assert all(v > 0 for _, v in scalars["train/update_norm"])
    assert 0.0 <= scalars["val/pass@1"][-1][1] <= 1.0
    # The engine holds exactly the trainer's weights after the last update.
    for (name, a), b in zip(module.policy.state_dict().items(), module.engine.model.state_dict().values(), strict=True):
        assert a.equal(b), name
    # The resolved config is saved with the run.
    assert glob.glob(str(tmp_path / "**" / "config.yaml"), recursive=True)
    if optimizer == "logra":
        assert module.sketcher.num_applied == 3
        assert [step for step, _ in scalars["kl/alpha"]] == [0, 1, 2]
        for (_, pred), (_, alpha), (_, scaled) in zip(
            scalars["kl/predicted"], scalars["kl/alpha"], scalars["kl/predicted_scaled"], strict=True
        ):
            assert scaled == pytest.approx(alpha**2 * pred, rel=1e-4)


def test_config_typo_is_lightningclis_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        LoGRACLI(args=["fit", f"--config={CONFIG}", "--model.logra.rnak=4", "--trainer.max_steps=1"])
    assert "rnak" in capsys.readouterr().err


def test_tokenizer_without_chat_template(tmp_path: Path, tiny_model_dir: Path) -> None:
    import shutil

    from logra_pl.module import LoGRAPolicyModule

    plain = tmp_path / "no-template"
    shutil.copytree(tiny_model_dir, plain)
    (plain / "chat_template.jinja").unlink()
    module = LoGRAPolicyModule(policy=str(plain))
    with pytest.raises(ValueError, match="has no chat template"):
        module.configure_model()
