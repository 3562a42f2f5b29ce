"""Validation by the paper's protocol: k responses per problem, pass@1 over all of them, unbiased pass@j, per-task
pass@1 and its macro mean, and a text panel of samples."""

from __future__ import annotations

import glob
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from logra_pl.data import ReasoningGymDataModule
from logra_pl.errors import ConfigError
from logra_pl.module import LoGRAPolicyModule, RolloutSettings
from logra_pl.train.metrics import pass_at_k


def test_pass_at_k_and_per_task_pass_at_1(tmp_path: Path) -> None:
    tasks = {
        "chain_sum": {"config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}},
        "basic_arithmetic": {"config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}},
    }
    data = ReasoningGymDataModule(tasks, train_size=32, eval_size=12, prompts_per_step=8, eval_batch_size=6)
    module = LoGRAPolicyModule(
        policy="tiny",
        rollout=RolloutSettings(max_new_tokens=4, val_responses=4, val_temperature=1.0, val_top_p=1.0),
        answer_format="plain",
    )
    scored: list[list[float]] = []

    class Spy(pl.Callback):
        """Record what validation scored (the module's sampler, built at setup), to recompute the metrics here."""

        def on_validation_start(self, trainer: pl.Trainer, pl_module: LoGRAPolicyModule) -> None:
            original = pl_module.sampler.score

            def spy(rollout, items):
                scores = original(rollout, items)
                scored.append(list(scores.rewards))
                return scores

            pl_module.sampler.score = spy

    logger = TensorBoardLogger(tmp_path, name="eval")
    trainer = pl.Trainer(
        accelerator="cpu", logger=logger, enable_progress_bar=False, enable_model_summary=False, callbacks=[Spy()]
    )
    metrics = trainer.validate(module, datamodule=data)[0]
    flat = [r for batch in scored for r in batch]
    assert len(flat) == 12 * 4
    rows = [[r >= 1.0 for r in flat[i : i + 4]] for i in range(0, len(flat), 4)]
    assert metrics["val/pass@1"] == pytest.approx(sum(map(sum, rows)) / len(flat))
    assert metrics["val/pass@4"] == pytest.approx(sum(pass_at_k(4, sum(r), 4) for r in rows) / len(rows))
    by_task = {}
    for item, row in zip(data.eval_items, rows, strict=True):
        by_task.setdefault(item["metadata"]["source_dataset"], []).extend(row)
    for task, values in by_task.items():
        assert metrics[f"val/{task}/pass@1"] == pytest.approx(sum(values) / len(values))
    macro = sum(sum(v) / len(v) for v in by_task.values()) / len(by_task)
    assert metrics["val/macro_pass@1"] == pytest.approx(macro)
    # The paper's RG-Hard score: the macro mean of per-task mean rewards (partial credit counts).
    rewards_by_task: dict[str, list[float]] = {}
    for item, start in zip(data.eval_items, range(0, len(flat), 4), strict=True):
        rewards_by_task.setdefault(item["metadata"]["source_dataset"], []).extend(flat[start : start + 4])
    for task, values in rewards_by_task.items():
        assert metrics[f"val/{task}/reward"] == pytest.approx(sum(values) / len(values))
    macro_reward = sum(sum(v) / len(v) for v in rewards_by_task.values()) / len(rewards_by_task)
    assert metrics["val/macro_reward"] == pytest.approx(macro_reward)
    acc = EventAccumulator(glob.glob(str(tmp_path / "eval" / "*"))[0])
    acc.Reload()
    assert "val/samples/text_summary" in acc.Tags()["tensors"]


def test_pass_at_j_above_the_samples_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"val_responses=2 is smaller than the requested pass@4"):
        RolloutSettings(val_responses=2, val_pass_at=[1, 4])
    assert RolloutSettings(val_responses=4).pass_at() == [1, 4]
    assert RolloutSettings(val_responses=8, val_pass_at=[2, 8]).pass_at() == [1, 2, 8]


def test_math500_eval_config_on_a_local_file(tmp_path: Path) -> None:
    """`logra-pl validate --config configs/eval/math500.yaml` with the policy and data overridden for a CPU."""
    import json

    from logra_pl.cli import LoGRACLI
    from logra_pl.data import Math500DataModule
    from logra_pl.rewards import MathVerifier

    rows = [
        {"problem": f"What is ${a} + {b}$?", "answer": str(a + b), "solution": "", "subject": "Algebra", "level": 1,
         "unique_id": f"test/algebra/{a}{b}.json"}
        for a, b in [(1, 2), (3, 4), (2, 2), (5, 1), (6, 3), (7, 2)]
    ]  # fmt: skip
    local = tmp_path / "math500.jsonl"
    local.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = Path(__file__).resolve().parents[2] / "configs" / "eval" / "math500.yaml"
    cli = LoGRACLI(
        args=[
            "validate",
            f"--config={config}",
            f"--data.init_args.path={local}",
            "--data.init_args.eval_batch_size=3",
            "--model.policy=tiny",
            "--model.dtype=float32",
            "--model.rollout.max_new_tokens=4",
            "--trainer.accelerator=cpu",
            "--trainer.enable_progress_bar=false",
            f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}",
        ]
    )
    assert isinstance(cli.datamodule, Math500DataModule) and isinstance(cli.model.verifier, MathVerifier)
    assert cli.model.rollout_settings.val_responses == 4 and cli.model.rollout_settings.val_top_p == 0.7
    metrics = cli.trainer.callback_metrics
    assert 0.0 <= float(metrics["val/pass@1"]) <= float(metrics["val/pass@4"]) <= 1.0
    assert len(cli.datamodule.eval_items) == 6
