"""A multi-turn environment for tests (importable by ``class_path``: ``tests.helpers.envs.Feedback``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from logra_pl.envs import Message, Turn


class Feedback:
    """After reply ``t`` the environment answers ``"hint t: <the item's answer>"`` as a tool message; it ends the
    conversation after ``end_after`` replies (reward 1) or when ``max_turns`` is reached; each hint earns
    ``hint_reward``. The final reply is scored by the run's verifier (``verify_final``). A reply cut by the token
    limit is answered too (``continue_truncated``): an untrained policy seldom ends its replies."""

    continue_truncated = True

    def __init__(
        self, max_turns: int = 3, end_after: int = 3, hint_reward: float = 0.25, max_tokens: int = 1024
    ) -> None:
        self.max_turns, self.end_after, self.hint_reward, self.max_tokens = (
            max_turns,
            end_after,
            hint_reward,
            max_tokens,
        )
        self.hints = 0

    def start(self, item: Mapping[str, Any]) -> list[Message]:
        return [dict(m) for m in item["messages"]]

    def step(self, item: Mapping[str, Any], messages: Sequence[Message]) -> Turn:
        replies = sum(m["role"] == "assistant" for m in messages)
        if replies >= self.end_after:
            return Turn(done=True, reward=1.0, info={"replies": float(replies)})
        self.hints += 1
        hint = {"role": "tool", "content": f"hint {replies}: {item['answer']}"}
        return Turn(observations=[hint], reward=self.hint_reward, info={"hints": 1.0})

    def state_dict(self) -> dict[str, int]:
        return {"hints": self.hints}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.hints = int(state["hints"])


class Failing(Feedback):
    """Feedback whose ``step`` raises on its first call: a broken environment (``tests.helpers.envs.Failing``)."""

    def step(self, item: Mapping[str, Any], messages: Sequence[Message]) -> Turn:
        raise RuntimeError("the game server refused the move")
