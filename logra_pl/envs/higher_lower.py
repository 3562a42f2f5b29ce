"""A feedback game: a numeric problem answered over turns, each wrong answer told "higher" or "lower".

The conversation starts as the item's (a reasoning-gym ``chain_sum`` problem, say) after a system message stating
the rules. After each reply the environment reads the reply's last integer and compares it with the item's answer:
equal ends the game with reward ``1``; otherwise the policy is told ``Higher.`` or ``Lower.`` as a user message and
answers again, for at most ``max_turns`` replies. A reply without a number is told so. Every wrong or missing answer
costs ``turn_penalty``: the rewards are per turn, summed over the trajectory (``1 − penalty · wrong replies`` for a
game won, ``− penalty · replies`` for one lost), so a game won sooner is worth more.

The environment's reward is the whole reward (``verify_final = False``): the final reply is not scored again. A reply
cut at ``max_new_tokens`` is judged like any other (``continue_truncated``): its last number is its guess.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from logra_pl.envs.base import Message, Turn

RULES = "Answer with a number. If it is wrong you are told Higher or Lower; answer again."
_INTEGER = re.compile(r"-?\d+")


def last_integer(text: str) -> int | None:
    """The last integer written in ``text`` (a leading minus sign included), or None."""
    found = _INTEGER.findall(text)
    return int(found[-1]) if found else None


class HigherLowerEnv:
    """A numeric problem answered over turns with higher/lower feedback (see the module docstring).

    Arguments:
        max_turns: most replies per game; a game not won by then ends truncated.
        max_tokens: most tokens of a game after its first prompt.
        turn_penalty: reward of each wrong (or numberless) reply, negated; ≥ 0.
        rules: the system message that starts each game; None: :data:`RULES`.
    """

    verify_final = False
    continue_truncated = True  # a reply cut at max_new_tokens is still a guess: its last number is judged

    def __init__(self, max_turns: int = 4, max_tokens: int = 64, turn_penalty: float = 0.1, rules: str | None = None):
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns must be an integer >= 1, got {max_turns!r}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        if not math.isfinite(turn_penalty) or turn_penalty < 0:
            raise ValueError(f"turn_penalty must be a finite number >= 0, got {turn_penalty!r}")
        self.max_turns, self.max_tokens, self.turn_penalty = max_turns, max_tokens, float(turn_penalty)
        self.rules = RULES if rules is None else rules

    def start(self, item: Mapping[str, Any]) -> list[Message]:
        """The rules as the system message, then the item's messages (its own system message dropped)."""
        answer = str(item.get("answer", ""))
        if last_integer(answer) is None or str(last_integer(answer)) != answer.strip():
            raise ValueError(
                f"HigherLowerEnv plays items whose answer is an integer, got {answer!r} (item {item!r:.200})"
            )
        messages = [dict(m) for m in item["messages"] if m["role"] != "system"]
        return [{"role": "system", "content": self.rules}, *messages]

    def step(self, item: Mapping[str, Any], messages: Sequence[Message]) -> Turn:
        """Won (reward 1), or told ``Higher.`` / ``Lower.`` / to reply with a number (reward ``−turn_penalty``)."""
        guess, answer = last_integer(messages[-1]["content"]), int(str(item["answer"]).strip())
        if guess == answer:
            return Turn(done=True, reward=1.0, info={"won": 1.0})
        if guess is None:
            hint, info = "Reply with a number.", {"no_number": 1.0}
        else:
            hint, info = ("Higher." if answer > guess else "Lower."), {"wrong": 1.0}
        return Turn(observations=[{"role": "user", "content": hint}], reward=-self.turn_penalty, info=info)
