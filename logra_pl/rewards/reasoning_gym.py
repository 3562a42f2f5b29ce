"""Verifier for reasoning-gym tasks: extract the answer, score it with the task's own scorer."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

import reasoning_gym
from reasoning_gym.utils import extract_answer

log = logging.getLogger(__name__)

AnswerFormat = Literal["auto", "tags", "plain"]


class ReasoningGymVerifier:
    """Reward in [0, 1] for a response to a reasoning-gym item.

    Arguments:
        answer_format: ``"tags"`` reads the answer between ``<answer>…</answer>`` (unparseable → 0, SPEC §10);
            ``"plain"`` takes the whole response, stripped; ``"auto"`` uses the tags when present, else plain.

    A scorer that raises gives reward 0 and increments :attr:`errors` — a bad response never stops training.
    """

    def __init__(self, answer_format: AnswerFormat = "auto") -> None:
        if answer_format not in ("auto", "tags", "plain"):
            raise ValueError(f"unknown answer_format {answer_format!r}: use 'auto', 'tags' or 'plain'")
        self.answer_format = answer_format
        self.errors = 0
        self._scorers: dict[str, Any] = {}

    def extract(self, response: str) -> str | None:
        """The answer string the scorer sees, or None when the format requires tags and there are none."""
        tagged = extract_answer(response)
        if self.answer_format == "tags":
            return tagged
        if self.answer_format == "plain" or tagged is None:
            return response.strip()
        return tagged

    def scorer(self, task: str) -> Any:
        """The task's ``score_answer(answer, entry)`` function (cached)."""
        if task not in self._scorers:
            self._scorers[task] = reasoning_gym.get_score_answer_fn(task)
        return self._scorers[task]

    def __call__(self, response: str, item: Mapping[str, Any]) -> float:
        """Score ``response`` against ``item`` (a reasoning-gym entry with ``metadata.source_dataset``)."""
        task = item["metadata"]["source_dataset"]
        try:
            answer = self.extract(response)
            if answer is None:
                return 0.0
            reward = float(self.scorer(task)(answer, item))
        except Exception as err:  # a verifier bug must not crash a long run
            self.errors += 1
            log.warning("verifier for task %r raised %s: %s (reward 0)", task, type(err).__name__, err)
            return 0.0
        return min(max(reward, 0.0), 1.0)
