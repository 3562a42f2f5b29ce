"""The reasoning-gym verifier: answer extraction by format, and errors that cost a reward, never a run."""

from __future__ import annotations

import reasoning_gym

from logra_pl.rewards import ReasoningGymVerifier


def _item(task: str = "chain_sum", seed: int = 0) -> dict:
    return next(iter(reasoning_gym.create_dataset(task, size=1, seed=seed)))


def test_answer_formats() -> None:
    item = _item()
    gold = item["answer"]
    auto, tags, plain = ReasoningGymVerifier("auto"), ReasoningGymVerifier("tags"), ReasoningGymVerifier("plain")
    assert auto(f" {gold}\n", item) == 1.0
    assert auto(f"thinking... <answer>{gold}</answer>", item) == 1.0
    assert tags(f"<answer>{gold}</answer>", item) == 1.0
    assert tags(gold, item) == 0.0  # unparseable under the tag protocol scores 0
    assert plain(f"<answer>{gold}</answer>", item) < 1.0  # plain reads the tags as part of the answer
    assert auto("41234", item) == 0.0


def test_scorer_exception_gives_zero_and_counts() -> None:
    # An entry without its gold answer makes the real chain_sum scorer raise KeyError.
    broken = {k: v for k, v in _item().items() if k != "answer"}
    verifier = ReasoningGymVerifier()
    assert verifier("3", broken) == 0.0
    assert verifier("4", broken) == 0.0
    assert verifier.errors == 2
