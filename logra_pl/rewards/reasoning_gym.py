"""Verifier for reasoning-gym tasks: extract the answer, score it with the task's own scorer."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, Literal

import reasoning_gym
from reasoning_gym.utils import extract_answer

log = logging.getLogger(__name__)

AnswerFormat = Literal["auto", "tags", "plain"]


class MalformedItem(ValueError):
    """An item the verifier cannot score: not a mapping, no ``metadata.source_dataset``, or an unknown task."""


def task_of(item: Any) -> str:
    """The reasoning-gym task named by ``item["metadata"]["source_dataset"]``; :class:`MalformedItem` if absent."""
    if not isinstance(item, Mapping):
        raise MalformedItem(f"item is a {type(item).__name__}, not a mapping")
    metadata = item.get("metadata")
    if metadata is None:
        raise MalformedItem(f"item has no 'metadata' (keys: {sorted(map(str, item))})")
    if not isinstance(metadata, Mapping):
        raise MalformedItem(f"item 'metadata' is a {type(metadata).__name__}, not a mapping")
    task = metadata.get("source_dataset")
    if not isinstance(task, str):
        raise MalformedItem(f"item metadata has no 'source_dataset' string (keys: {sorted(map(str, metadata))})")
    return task


class ReasoningGymVerifier:
    """Reward in [0, 1] for a response to a reasoning-gym item.

    Arguments:
        answer_format: ``"tags"`` reads the answer between ``<answer>…</answer>`` (unparseable → 0, algorithm.md §10);
            ``"plain"`` takes the whole response, stripped; ``"auto"`` uses the tags when present, else plain.
        max_answer_chars: an extracted answer longer than this scores 0 without calling the scorer and increments
            :attr:`long_answers` (some scorers, e.g. sympy-based ones, take unbounded time on huge inputs).

    Nothing a response or an item contains stops training: a malformed item (not a mapping, no
    ``metadata.source_dataset``, unknown task), a scorer that raises, or a non-finite score gives reward 0 and
    increments :attr:`errors`, with a warning. A scorer that *hangs* cannot be stopped from inside the process:
    wrap the verifier in :class:`~logra_pl.rewards.BoundedVerifier` for a per-call time limit.
    """

    def __init__(self, answer_format: AnswerFormat = "auto", max_answer_chars: int = 1000) -> None:
        if answer_format not in ("auto", "tags", "plain"):
            raise ValueError(f"unknown answer_format {answer_format!r}: use 'auto', 'tags' or 'plain'")
        if isinstance(max_answer_chars, bool) or not isinstance(max_answer_chars, int) or max_answer_chars < 1:
            raise ValueError(f"max_answer_chars must be an integer >= 1, got {max_answer_chars!r}")
        self.answer_format = answer_format
        self.max_answer_chars = max_answer_chars
        self.errors = 0
        self.long_answers = 0
        self._scorers: dict[str, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        # The scorers are bound methods of dataset objects: rebuilt on demand, never pickled (worker processes).
        state = self.__dict__.copy()
        state["_scorers"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._scorers = {}

    def extract(self, response: str) -> str | None:
        """The answer string the scorer sees, or None when the format requires tags and there are none."""
        tagged = extract_answer(response)
        if self.answer_format == "tags":
            return tagged
        if self.answer_format == "plain" or tagged is None:
            return response.strip()
        return tagged

    def scorer(self, task: str) -> Any:
        """The task's ``score_answer(answer, entry)`` function (cached); :class:`MalformedItem` for unknown tasks."""
        if task not in self._scorers:
            try:
                self._scorers[task] = reasoning_gym.get_score_answer_fn(task)
            except ValueError as err:
                raise MalformedItem(f"unknown reasoning-gym task {task!r}") from err
        return self._scorers[task]

    def __call__(self, response: str, item: Mapping[str, Any]) -> float:
        """Score ``response`` against ``item`` (a reasoning-gym entry with ``metadata.source_dataset``)."""
        task = "?"
        try:
            task = task_of(item)
            score = self.scorer(task)
            answer = self.extract(response)
            if answer is None:
                return 0.0
            if len(answer) > self.max_answer_chars:
                self.long_answers += 1
                return 0.0
            reward = float(score(answer, item))
            if not math.isfinite(reward):
                raise ValueError(f"scorer returned {reward}")
        except MalformedItem as err:
            self.errors += 1
            log.warning("malformed verifier item: %s (reward 0)", err)
            return 0.0
        except Exception as err:  # a verifier bug must not crash a long run
            self.errors += 1
            log.warning("verifier for task %r raised %s: %s (reward 0)", task, type(err).__name__, err)
            return 0.0
        return min(max(reward, 0.0), 1.0)
