"""The feedback game (logra_pl.envs.HigherLowerEnv): its replies and per-turn rewards, and two updates through the
CLI with configs/overlays/higher_lower.yaml, whose rewards are the game's alone."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from logra_pl.cli import LoGRACLI
from logra_pl.envs import HigherLowerEnv, last_integer
from tests.helpers.cli import quick_fit_args

ROOT = Path(__file__).resolve().parents[2]
ITEM = {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "4 - 1 - 7 ="}], "answer": "-4"}


@pytest.mark.parametrize(
    ("text", "value"), [("-4", -4), ("I think 3, no, 12", 12), ("x = - 5", 5), ("none", None), ("10-3", -3)]
)
def test_last_integer(text: str, value: int | None) -> None:
    assert last_integer(text) == value


def test_a_game_is_told_higher_or_lower_until_it_is_won() -> None:
    env = HigherLowerEnv(max_turns=4, turn_penalty=0.25)
    first = env.start(ITEM)
    assert first == [{"role": "system", "content": env.rules}, {"role": "user", "content": "4 - 1 - 7 ="}]
    rewards = []
    conversation = list(first)
    for reply, hint in (("-7", "Higher."), ("0", "Lower."), ("hmm", "Reply with a number."), ("-4", None)):
        conversation.append({"role": "assistant", "content": reply})
        turn = env.step(ITEM, conversation)
        rewards.append(turn.reward)
        if hint is None:
            assert turn.done and turn.info == {"won": 1.0}
        else:
            assert not turn.done and turn.observations == [{"role": "user", "content": hint}]
            conversation += turn.observations
    assert rewards == [-0.25, -0.25, -0.25, 1.0] and sum(rewards) == 0.25  # a later win is worth less


def test_bad_settings_and_non_integer_answers_are_refused() -> None:
    with pytest.raises(ValueError, match="turn_penalty"):
        HigherLowerEnv(turn_penalty=-1.0)
    with pytest.raises(ValueError, match="max_turns"):
        HigherLowerEnv(max_turns=0)
    with pytest.raises(ValueError, match=r"answer is an integer, got '1\.5'"):
        HigherLowerEnv().start({**ITEM, "answer": "1.5"})


def test_two_updates_through_the_cli_score_the_game_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The overlay's game on the untrained tiny model: every reward is a sum of turn rewards (1 for a win, −0.1 per
    wrong reply), never the verifier's, and the turn counts and feedback inserted are logged and masked."""
    monkeypatch.setattr(sys, "argv", ["logra-pl"])
    args = quick_fit_args(2, tmp_path / "runs", max_new_tokens=4)
    overlay = str(ROOT / "configs" / "overlays" / "higher_lower.yaml")
    cli = LoGRACLI(args=[*args[:2], f"--config={overlay}", *args[2:]])
    module = cli.model
    assert isinstance(module.env, HigherLowerEnv) and module.scorer.correct_threshold == 0.5
    assert cli.trainer.global_step == 2
    ctx = module.step_context
    rewards = ctx.rewards.flatten().tolist()
    allowed = {round(1.0 - 0.1 * k, 6) for k in range(4)} | {round(-0.1 * k, 6) for k in range(1, 5)}
    assert {round(r, 6) for r in rewards} <= allowed, rewards
    assert ctx.metrics["env/turns"] > 1.0 and ctx.metrics["env/reward"] == pytest.approx(sum(rewards) / len(rewards))
    masks = ctx.rollout.response_masks
    assert masks is not None and any(0 in m for m in masks)
    assert torch.isfinite(ctx.rewards).all()
