"""Verifiers for tests that run the CLI in a child process (importable there: ``tests`` is on its PYTHONPATH)."""

from __future__ import annotations

import hashlib
from typing import Any


def _bit(text: str) -> int:
    return hashlib.blake2b(text.encode(), digest_size=1).digest()[0] & 1


class HalfUniform:
    """About half the prompts score every response alike (all 1 or all 0, by the question), the others score each
    response by a bit of its text: with a few responses per prompt those groups are mostly mixed.

    A task for dynamic sampling (rollout.dynamic_sampling): which groups are uniform is known from the item alone
    for the first half (``uniform_prompt``), and from the responses for the rest.
    """

    @staticmethod
    def uniform_prompt(item: dict[str, Any]) -> bool:
        """Whether ``item``'s responses all score alike whatever they say."""
        return _bit(item["messages"][-1]["content"] + "/u") == 0

    def __call__(self, response: str, item: dict[str, Any]) -> float:
        question = item["messages"][-1]["content"]
        if self.uniform_prompt(item):
            return float(_bit(question + "/v"))
        return float(_bit(response))
