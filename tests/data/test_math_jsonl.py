"""Any dataset, any reward: a jsonl of math word problems the test writes, trained through the CLI with the math
verifier, validated with pass@1 and pass@4."""

from __future__ import annotations

import json
from pathlib import Path

from logra_pl.cli import LoGRACLI
from logra_pl.data import HFPromptDataModule
from logra_pl.rewards import MathVerifier

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml")


def test_jsonl_math_problems_train_with_math_verify_and_report_pass_at_4(tmp_path: Path) -> None:
    problems = tmp_path / "word_problems.jsonl"
    with problems.open("w") as f:
        for i in range(48):
            a, b = i % 7 + 1, i % 5 + 2
            f.write(json.dumps({"question": f"Ann has {a} apples and buys {b} more. How many now?", "sum": a + b}))
            f.write("\n")
    cli = LoGRACLI(
        args=[
            "fit",
            f"--config={CONFIG}",
            "--data.class_path=logra_pl.data.HFPromptDataModule",
            f"--data.init_args.path={problems}",
            "--data.init_args.prompt_column=question",
            "--data.init_args.answer_column=sum",
            "--data.init_args.eval_size=8",
            "--data.init_args.prompts_per_step=8",
            "--data.init_args.eval_batch_size=8",
            "--model.verifier.class_path=logra_pl.rewards.MathVerifier",
            "--model.warm_start=null",
            "--model.rollout.max_new_tokens=4",
            "--model.rollout.val_responses=4",
            "--model.rollout.val_temperature=1.0",
            "--trainer.max_steps=3",
            "--trainer.val_check_interval=3",
            "--trainer.enable_progress_bar=false",
            f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}",
        ]
    )
    assert isinstance(cli.datamodule, HFPromptDataModule) and isinstance(cli.model.verifier, MathVerifier)
    assert cli.trainer.global_step == 3
    metrics = cli.trainer.callback_metrics
    assert 0.0 <= float(metrics["val/pass@1"]) <= float(metrics["val/pass@4"]) <= 1.0
    # The rewards of the last update are math-verify's verdicts on the decoded responses against the jsonl's answers.
    ctx = cli.model.step_context
    texts = cli.model.tokenizer.batch_decode(ctx.rollout.response_ids, skip_special_tokens=True)
    verifier = MathVerifier()
    expected = [verifier(t, ctx.items[i]) for t, i in zip(texts, ctx.rollout.prompt_index, strict=True)]
    assert ctx.rewards.tolist() == expected
    assert {it["task"] for it in ctx.items} == {"word_problems"}
