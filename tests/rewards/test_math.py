"""MathVerifier on the real math-verify: equivalent forms, wrong and garbage answers, caps, errors, worker processes."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest

from logra_pl.errors import ConfigError
from logra_pl.rewards import BoundedVerifier, MathVerifier


def _item(answer: object, **extra: object) -> dict:
    return {"messages": [{"role": "user", "content": "?"}], "answer": answer, "task": "math", "id": "m-0", **extra}


# (response, gold): each pair is the same answer in math-verify's eyes.
EQUIVALENT = [
    (r"\boxed{\frac{1}{2}}", "0.5"),
    (r"\boxed{0.5}", r"\frac{1}{2}"),
    ("<answer>1/2</answer>", r"\frac{1}{2}"),
    (r"so we get \boxed{\frac12}", "1/2"),
    (r"\boxed{3}", "3"),
    ("<answer>3.0</answer>", "3"),
    ("<answer>[1, 2)</answer>", "[1,2)"),
    (r"\boxed{x \in [1, 2)}", "[1, 2)"),
    (r"\boxed{x^2+2x+1}", "(x+1)^2"),
    (r"\boxed{\sqrt{2}}", "2^{1/2}"),
    (r"\boxed{10\%}", "0.1"),
    (r"<answer>\boxed{7}</answer>", "7"),  # a box inside the tags
    ("Adding them gives 12, so the final answer is 42", "42"),  # no tags or box: math-verify's own extraction
    (r"\boxed{5 \text{ cm}}", "5"),  # units in \text{} are dropped ...
    (r"\boxed{5 \text{ m}}", r"5 \text{ cm}"),  # ... not converted
    ("Step 1 gives 10 and 32.\nAnswer: $\\frac{1}{2}$", "0.5"),  # DAPO-Math's requested last line
    ("**Answer:** 42", "42"),
]

WRONG = [
    (r"\boxed{\frac{1}{3}}", "0.5"),
    (r"\boxed{[1, 2]}", "[1, 2)"),  # closed vs half-open interval
    (r"\boxed{(1, 2)}", "[1, 2)"),
    (r"\boxed{1 \le x < 2}", "[1, 2)"),  # an inequality is not the interval (math-verify: only when pred is a set)
    (r"\boxed{500 \text{ cm}}", r"5 \text{ m}"),  # units dropped, not converted: 500 != 5
    (r"\boxed{4}", "3"),
    (r"\boxed{x^2+1}", "(x+1)^2"),
    (r"\boxed{3} and later \boxed{4}", "3"),  # the last box is the answer
    ("Answer: 3\nhmm, no.\nAnswer: 4", "3"),  # the last Answer: line is the answer
]


@pytest.mark.parametrize(("response", "gold"), EQUIVALENT)
def test_equivalent_forms_score_one(response: str, gold: str) -> None:
    verifier = MathVerifier()
    assert verifier(response, _item(gold)) == 1.0
    assert (verifier.errors, verifier.long_answers) == (0, 0)


@pytest.mark.parametrize(("response", "gold"), WRONG)
def test_wrong_answers_score_zero(response: str, gold: str) -> None:
    verifier = MathVerifier()
    assert verifier(response, _item(gold)) == 0.0
    assert (verifier.errors, verifier.long_answers) == (0, 0)


@pytest.mark.parametrize(
    "response",
    [
        "",
        "   ",
        "hello world",
        "}{",
        r"\boxed{",
        r"\boxed{4",
        "<answer></answer>",
        r"\frac{1}{",
        "<answer>9**9**9</answer>",
    ],
)
def test_garbage_scores_zero_without_error(response: str) -> None:
    verifier = MathVerifier()
    assert verifier(response, _item("4")) == 0.0
    assert (verifier.errors, verifier.long_answers) == (0, 0)


def test_answer_length_cap_at_the_boundary() -> None:
    answer = "1+" * 20 + "1"  # 41 characters, equal to 21
    assert MathVerifier(max_answer_chars=len(answer))(rf"\boxed{{{answer}}}", _item("21")) == 1.0
    capped = MathVerifier(max_answer_chars=len(answer) - 1)
    assert capped(rf"\boxed{{{answer}}}", _item("21")) == 0.0
    assert (capped.long_answers, capped.errors) == (1, 0)


def test_very_long_output_is_never_parsed() -> None:
    verifier = MathVerifier()
    # Without tags or a box the whole response is the answer: over the cap, scored 0 unparsed (it would be slow).
    response = " + ".join(["x^{x^{x}}"] * 2000) + " = 4"
    start = time.perf_counter()
    assert verifier(response, _item("4")) == 0.0
    assert verifier(f"<answer>{'9' * 5000}</answer>", _item("4")) == 0.0
    assert time.perf_counter() - start < 0.1
    assert (verifier.long_answers, verifier.errors) == (2, 0)
    # A long response with a short boxed answer is scored: the cap applies after extraction.
    assert verifier("reasoning " * 500 + r"\boxed{4}", _item("4")) == 1.0
    assert verifier.long_answers == 2


def test_malformed_items_are_errors(caplog: pytest.LogCaptureFixture) -> None:
    verifier = MathVerifier()
    malformed = [
        ({"messages": [], "task": "math"}, "no 'answer'"),
        (_item(["4"]), "'answer' is a list"),
        (["not", "a", "mapping"], "not a mapping"),
        (_item(""), "cannot parse the gold answer"),
    ]
    with caplog.at_level(logging.WARNING, logger="logra_pl.rewards.math"):
        rewards = [verifier(r"\boxed{4}", item) for item, _ in malformed]  # type: ignore[arg-type]
    assert rewards == [0.0] * len(malformed)
    assert (verifier.errors, verifier.long_answers) == (len(malformed), 0)
    messages = "\n".join(r.getMessage() for r in caplog.records)
    for _, why in malformed:
        assert why in messages
    assert verifier(r"\boxed{4}", _item(4)) == 1.0  # a numeric gold answer is read as its string


def test_runs_in_a_non_main_thread() -> None:
    # math-verify's own timeout is signal-based and raises in other threads; the verifier disables it there.
    verifier = MathVerifier(parsing_timeout=5)
    pairs = EQUIVALENT[:4] + WRONG[:4]
    results: list[float] = []
    thread = threading.Thread(target=lambda: results.extend(verifier(r, _item(g)) for r, g in pairs))
    thread.start()
    thread.join(timeout=60)
    assert results == [1.0] * 4 + [0.0] * 4
    assert verifier.errors == 0


@pytest.mark.parametrize(
    "kwargs",
    [{"max_answer_chars": 0}, {"max_answer_chars": 1.5}, {"parsing_timeout": 0}, {"parsing_timeout": 2.5}],
)
def test_invalid_settings(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        MathVerifier(**kwargs)


@pytest.fixture(scope="module")
def bounded() -> Iterator[BoundedVerifier]:
    with BoundedVerifier(MathVerifier(max_answer_chars=200), timeout_s=10.0, workers=2) as verifier:
        yield verifier


def test_worker_processes_match_in_process(bounded: BoundedVerifier) -> None:
    pairs = EQUIVALENT + WRONG + [("x" * 300, "4"), (r"\boxed{4}", None)]
    responses = [r for r, _ in pairs]
    items = [_item(g) if g is not None else {"messages": [], "task": "math"} for _, g in pairs]
    here = MathVerifier(max_answer_chars=200)
    expected = [here(r, i) for r, i in zip(responses, items, strict=True)]
    assert expected == [1.0] * len(EQUIVALENT) + [0.0] * (len(WRONG) + 2)
    assert bounded.score(responses, items) == expected
    # Counted inside the workers, added to the wrapped verifier here.
    assert bounded.counters() == {"errors": 1, "timeouts": 0, "long_answers": 1, "nan": 0}
    assert (bounded.verifier.errors, bounded.verifier.long_answers) == (here.errors, here.long_answers) == (1, 1)
    assert bounded.last_components == {}  # MathVerifier reports no components
