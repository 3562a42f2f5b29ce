"""Math answers compared symbolically with Hugging Face's `math-verify <https://pypi.org/project/math-verify/>`_.

``1/2``, ``0.5``, ``\\frac{1}{2}`` and ``\\boxed{\\frac12}`` are one answer; so are ``[1, 2)`` and ``[1,2)``, and
``(x+1)^2`` and ``x^2+2x+1``. math-verify parses LaTeX (through ``latex2sympy2_extended`` and its ANTLR grammar) and
plain expressions into sympy objects and compares them by value, as sets or intervals, or symbolically.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Mapping
from typing import Any

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from logra_pl.errors import ConfigError
from logra_pl.rewards.base import _gold_answer, _item_label, extract_final_answer

log = logging.getLogger(__name__)

# LaTeX first (a \boxed{} before any other match), then plain expressions such as `1/2` or `x^2+1`: math-verify's
# own extraction, which also finds the last expression or "the final answer is …" in free text.
_EXTRACTION = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())


class MathVerifier:
    """Reward 1 when the response's final answer equals ``item["answer"]`` mathematically, else 0.

    Arguments:
        max_answer_chars: an answer longer than this (after extraction, see below) scores 0 without being parsed and
            increments :attr:`long_answers`.
        parsing_timeout: seconds math-verify may spend parsing one expression and comparing one pair, enforced with
            ``SIGALRM``; ``None`` disables it. A signal can only be set from a process's main thread, so in any other
            thread the call runs without it; and a signal cannot interrupt C code (a huge integer power): wrap the
            verifier in :class:`~logra_pl.rewards.BoundedVerifier` (which calls it in its workers' main threads) for a
            limit that always holds. In the main thread this replaces any ``SIGALRM`` timer the process had set.

    The answer read from a response is :func:`~logra_pl.rewards.base.extract_final_answer` (``<answer>`` tags, else
    the last ``\\boxed{}``), else the last line ``Answer: …`` (the format DAPO-Math's prompts ask for; ``$`` signs
    around it dropped), which math-verify parses as one LaTeX/plain expression; a response with none of these is given
    to math-verify whole (stripped), which takes its last expression or the one after "the final answer is" — and
    then the whole response counts against ``max_answer_chars``. The gold ``item["answer"]`` is parsed the same way.

    What math-verify considers equal (version 0.9): numbers by value (``0.5`` = ``1/2``; ``10\\%`` = ``0.1``), sets
    and intervals exactly (``[1, 2)`` ≠ ``[1, 2]``), expressions symbolically; ``\\text{…}`` units are dropped, not
    converted (``5 \\text{ cm}`` = ``5`` = ``5 \\text{ m}``, ``500 \\text{ cm}`` ≠ ``5 \\text{ m}``).

    A response with no parseable answer scores 0. An item without a usable ``answer`` (not a mapping, no
    ``answer``, not a string or number), a gold answer math-verify cannot parse, and any exception score 0,
    increment :attr:`errors` and log a warning; nothing raises.
    """

    def __init__(self, max_answer_chars: int = 1000, parsing_timeout: int | None = 5) -> None:
        if isinstance(max_answer_chars, bool) or not isinstance(max_answer_chars, int) or max_answer_chars < 1:
            raise ConfigError(f"max_answer_chars must be an integer >= 1, got {max_answer_chars!r}")
        if parsing_timeout is not None and (
            isinstance(parsing_timeout, bool) or not isinstance(parsing_timeout, int) or parsing_timeout < 1
        ):
            raise ConfigError(
                f"parsing_timeout must be a whole number of seconds >= 1 (signal.alarm) or None, "
                f"got {parsing_timeout!r}"
            )
        self.max_answer_chars = max_answer_chars
        self.parsing_timeout = parsing_timeout
        self.errors = 0
        self.long_answers = 0

    def extract(self, response: str) -> str:
        """The text math-verify reads: the tagged or boxed answer, else the whole response (stripped)."""
        answer = extract_final_answer(response) or answer_line(response)
        return response.strip() if answer is None else answer

    def _timeout(self) -> int | None:
        # math-verify's timeout is signal.alarm, which raises ValueError outside the main thread: disable it there.
        return self.parsing_timeout if threading.current_thread() is threading.main_thread() else None

    def _parse(self, text: str, tagged: bool, timeout: int | None) -> list[Any]:
        # An extracted answer is one expression: `$…$` makes math-verify read it whole as LaTeX (`[1, 2)` is an
        # interval, not the number 2); a free-text response is left for math-verify's own extraction.
        return parse(f"${text}$" if tagged else text, extraction_config=_EXTRACTION, parsing_timeout=timeout)

    def __call__(self, response: str, item: Mapping[str, Any]) -> float:
        """1.0 when the final answer of ``response`` equals ``item["answer"]`` under math-verify, else 0.0."""
        try:
            gold_text = _gold_answer(item)
        except ValueError as err:
            self.errors += 1
            log.warning("malformed verifier item: %s (reward 0)", err)
            return 0.0
        try:
            boxed = extract_final_answer(response) or answer_line(response)
            answer = response.strip() if boxed is None else boxed
            if len(answer) > self.max_answer_chars:
                self.long_answers += 1
                return 0.0
            if not answer:
                return 0.0
            timeout = self._timeout()
            gold = self._parse(gold_text, True, timeout)
            if not gold:
                raise ValueError(f"math-verify cannot parse the gold answer {gold_text[:80]!r}")
            target = self._parse(answer, boxed is not None, timeout)
            if not target:
                return 0.0
            return 1.0 if verify(gold, target, timeout_seconds=timeout) else 0.0
        except Exception as err:  # a verifier bug must not crash a long run
            self.errors += 1
            log.warning("math verifier on %s raised %s: %s (reward 0)", _item_label(item), type(err).__name__, err)
            return 0.0

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(max_answer_chars={self.max_answer_chars}, parsing_timeout={self.parsing_timeout})"
        )


_ANSWER_LINE = re.compile(r"^[ \t]*\**answer\**[ \t]*:[ \t]*(.+?)[ \t]*$", re.IGNORECASE | re.MULTILINE)


def answer_line(response: str) -> str | None:
    """The last ``Answer: …`` line's answer (DAPO-Math's requested format), without ``$…$``; None if there is none."""
    found = _ANSWER_LINE.findall(response)
    if not found:
        return None
    text = found[-1].strip()
    if len(text) >= 2 and text.startswith("$") and text.endswith("$"):
        text = text.strip("$").strip()
    return text or None
