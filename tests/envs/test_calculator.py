"""The calculator example environment, and multi-turn training through ``logra-pl fit`` (the real CLI, engine,
verifier and Trainer)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from logra_pl.cli import LoGRACLI
from logra_pl.envs import CalculatorEnv, calculate
from tests.helpers.cli import quick_fit_args

OVERLAY = Path(__file__).resolve().parents[2] / "configs" / "overlays" / "calculator.yaml"


@pytest.mark.parametrize(
    ("expression", "value"),
    [("2 + 3", "5"), ("3 * (4 + 5)", "27"), ("7 / 2", "3.5"), ("8 / 2", "4"), ("-2 ** 3", "-8")],
)
def test_calculate(expression: str, value: str) -> None:
    assert calculate(expression) == value


@pytest.mark.parametrize("expression", ["__import__('os')", "x + 1", "", "[1, 2]", "True + 1"])
def test_calculate_refuses_anything_but_arithmetic(expression: str) -> None:
    with pytest.raises(ValueError):
        calculate(expression)


def test_a_reply_with_calls_gets_their_results_and_one_without_is_the_answer() -> None:
    env = CalculatorEnv(timeout_s=2.0)
    try:
        item = {"messages": [{"role": "user", "content": "What is 2 + 5?"}], "answer": "7"}
        first = env.start(item)
        assert first[0]["role"] == "system" and "<tool_call>" in first[0]["content"] and first[1] == item["messages"][0]
        call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2 + 5"}}\n</tool_call>'
        turn = env.step(item, [*first, {"role": "assistant", "content": f"Let me compute. {call}"}])
        assert not turn.done and turn.observations == [{"role": "tool", "content": "7"}]
        assert turn.info == {"tool_calls": 1.0, "tool_errors": 0.0}
        bad = (
            '<tool_call>{"name": "calculate", "arguments": {"expression": "x"}}</tool_call><tool_call>{oops</tool_call>'
        )
        turn = env.step(item, [*first, {"role": "assistant", "content": bad}])
        assert [o["content"].startswith("error") for o in turn.observations] == [True, True]
        assert turn.info == {"tool_calls": 2.0, "tool_errors": 2.0}
        assert env.step(item, [*first, {"role": "assistant", "content": "7"}]).done
        assert env.state_dict()["calls"] == 2 and env.state_dict()["parse_errors"] == 1
    finally:
        env.close()


def test_two_multi_turn_updates_through_the_cli_train_on_the_policys_tokens_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every conversation goes on for three replies: the environment (tests.helpers.envs.Feedback) answers each of
    the first two with a hint, also when the reply was cut at the token limit, as an untrained policy's are."""
    monkeypatch.setattr(sys, "argv", ["logra-pl"])
    args = quick_fit_args(2, tmp_path / "runs")
    cli = LoGRACLI(
        args=[
            *args,
            "--model.env.class_path=tests.helpers.envs.Feedback",
            "--model.env.init_args.max_turns=3",
            "--model.env.init_args.end_after=3",
            "--model.env.init_args.max_tokens=64",
        ]
    )
    module = cli.model
    assert cli.trainer.global_step == 2 and module.method.applied_updates == 2
    ctx = module.step_context
    masks = ctx.rollout.response_masks
    assert masks is not None and any(0 in m for m in masks)  # conversations went on: hints were inserted
    packed = ctx.packed
    inserted = packed.attention_mask.new_zeros(packed.response_mask.shape, dtype=torch.bool)
    for row, mask in enumerate(masks):
        inserted[row, : len(mask)] = torch.tensor(mask) == 0
    assert float(ctx.loss_mask[inserted].abs().sum()) == 0.0  # never trained on what the environment inserted
    assert float(packed.response_mask[inserted].sum()) == 0.0
    assert ctx.metrics["env/turns"] > 1.0 and "env/hints" in ctx.metrics
    assert module.env.hints > 0
    assert torch.isfinite(ctx.rewards).all()
