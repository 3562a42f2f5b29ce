"""The arguments of a short ``logra-pl fit`` on the tiny demo config, shared by tests that only change the reward."""

from __future__ import annotations

from pathlib import Path

DEMO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"


def quick_fit_args(steps: int, save_dir: Path, max_new_tokens: int = 6) -> list[str]:
    """``fit`` on ``configs/tiny_cpu.yaml`` for ``steps`` updates of 8 prompts, no warm start, no validation before
    update 100, TensorBoard under ``save_dir``; append the verifier's own arguments."""
    return [
        "fit",
        f"--config={DEMO_CONFIG}",
        f"--trainer.max_steps={steps}",
        "--trainer.enable_progress_bar=false",
        "--trainer.val_check_interval=100",
        "--model.warm_start=null",
        "--data.train_size=64",
        "--data.eval_size=8",
        "--data.prompts_per_step=8",
        f"--model.rollout.max_new_tokens={max_new_tokens}",
        f"--trainer.logger.init_args.save_dir={save_dir}",
    ]
