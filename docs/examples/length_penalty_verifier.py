"""A verifier: 1 for a correct final answer, minus a penalty per character of the response."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from logra_pl.rewards import ExactMatch


class CorrectWithLengthPenalty:
    """``reward = correct · (1 − min(per_char · len(response), max_penalty))``, in [0, 1].

    Arguments:
        per_char: penalty per character of the stripped response.
        max_penalty: cap on the penalty (a correct answer earns at least ``1 − max_penalty``).
    """

    def __init__(self, per_char: float = 0.01, max_penalty: float = 0.5) -> None:
        if not 0.0 <= max_penalty <= 1.0:
            raise ValueError(f"max_penalty must lie in [0, 1], got {max_penalty}")
        self.per_char = per_char
        self.max_penalty = max_penalty
        self.match = ExactMatch()  # final answer (<answer> tags, \boxed{}, else the response) vs item["answer"]
        self.errors = 0  # optional counter: logged as verifier/errors

    def penalty(self, response: str) -> float:
        return min(self.per_char * len(response.strip()), self.max_penalty)

    def __call__(self, response: str, item: Mapping[str, Any]) -> float:
        if "answer" not in item:
            self.errors += 1
            return 0.0
        return self.match(response, item) * (1.0 - self.penalty(response))

    def components(self, response: str, item: Mapping[str, Any]) -> dict[str, float]:
        """Optional: named parts of the reward, logged as reward/correct and reward/length_penalty."""
        return {"correct": self.match(response, item), "length_penalty": self.penalty(response)}
