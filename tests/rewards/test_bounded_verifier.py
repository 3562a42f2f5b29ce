"""BoundedVerifier: real reasoning-gym scorers in real worker processes, under a per-call time limit.

One pool (2 workers, 2 s limit) is shared by the module; each test starts from zeroed counters.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, Mapping

import pytest
import reasoning_gym

from logra_pl.rewards import BoundedVerifier, ReasoningGymVerifier

TIMEOUT_S = 2.0
# Answers on which countdown's sympy scorer runs for minutes inside C code (a big-int power, a huge float).
HANGING_ANSWERS = ["9**9**9", "1e999999"]


def _items(task: str, size: int, seed: int = 0) -> list[dict]:
    return list(reasoning_gym.create_dataset(task, size=size, seed=seed))


def _zero(verifier: BoundedVerifier) -> None:
    verifier.load_state_dict({"errors": 0, "timeouts": 0, "long_answers": 0})


@pytest.fixture(scope="module")
def shared() -> Iterator[BoundedVerifier]:
    with BoundedVerifier(ReasoningGymVerifier("auto"), timeout_s=TIMEOUT_S, workers=2) as verifier:
        yield verifier


@pytest.fixture
def bounded(shared: BoundedVerifier) -> BoundedVerifier:
    _zero(shared)
    return shared


@pytest.mark.parametrize("answer", HANGING_ANSWERS)
def test_hanging_scorer_times_out_and_pool_recovers(
    bounded: BoundedVerifier, answer: str, caplog: pytest.LogCaptureFixture
) -> None:
    hang, other = _items("countdown", 2)
    start = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="logra_pl.rewards.bounded"):
        rewards = bounded.score([f"<answer>{answer}</answer>"], [hang])
    elapsed = time.perf_counter() - start
    assert rewards == [0.0]
    assert bounded.counters() == {"errors": 0, "timeouts": 1, "long_answers": 0}
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 15
    assert any("'countdown'" in r.getMessage() and answer in r.getMessage() for r in caplog.records)
    # The hung worker was killed and replaced: the same verifier scores the next item correctly.
    assert bounded.score([other["answer"]], [other]) == [1.0]
    assert bounded.counters() == {"errors": 0, "timeouts": 1, "long_answers": 0}


def test_timeout_in_a_batch_costs_only_its_own_reward(bounded: BoundedVerifier) -> None:
    chain = _items("chain_sum", 6, seed=3)
    (countdown,) = _items("countdown", 1)
    responses = [it["answer"] for it in chain[:3]] + ["9**9**9"] + [it["answer"] for it in chain[3:]]
    assert bounded.score(responses, [*chain[:3], countdown, *chain[3:]]) == [1.0] * 3 + [0.0] + [1.0] * 3
    assert bounded.timeouts == 1


def test_batch_matches_in_process_verifier(bounded: BoundedVerifier) -> None:
    items = _items("chain_sum", 16, seed=1)
    responses = []
    for k, item in enumerate(items):
        answer = item["answer"] if k % 2 == 0 else str(int(item["answer"]) + 1)
        responses.append(f"so the sum is <answer>{answer}</answer>" if k % 3 == 0 else answer)
    expected = [ReasoningGymVerifier("auto")(r, i) for r, i in zip(responses, items, strict=True)]
    assert sorted(set(expected)) == [0.0, 1.0]  # both kinds present, so the comparison means something
    assert bounded.score(responses, items) == expected
    assert bounded.counters() == {"errors": 0, "timeouts": 0, "long_answers": 0}


MALFORMED: list[tuple[object, str]] = [
    ({"question": "2 + 2", "answer": "4"}, "no 'metadata'"),
    ({"answer": "4", "metadata": {"source_index": 0}}, "no 'source_dataset'"),
    ({"answer": "4", "metadata": {"source_dataset": "no_such_task"}}, "unknown reasoning-gym task 'no_such_task'"),
    (["not", "a", "mapping"], "not a mapping"),
]


def test_malformed_items_score_zero_and_count_in_process(caplog: pytest.LogCaptureFixture) -> None:
    verifier = ReasoningGymVerifier()
    with caplog.at_level(logging.WARNING, logger="logra_pl.rewards.reasoning_gym"):
        rewards = [verifier("4", item) for item, _ in MALFORMED]  # type: ignore[arg-type]
    assert rewards == [0.0] * len(MALFORMED)
    assert verifier.errors == len(MALFORMED)
    messages = "\n".join(r.getMessage() for r in caplog.records)
    for _, missing in MALFORMED:
        assert missing in messages


def test_malformed_items_score_zero_and_count_through_pool(bounded: BoundedVerifier) -> None:
    (good,) = _items("chain_sum", 1)
    items = [item for item, _ in MALFORMED] + [good]
    rewards = bounded.score(["4"] * len(MALFORMED) + [good["answer"]], items)  # type: ignore[arg-type]
    assert rewards == [0.0] * len(MALFORMED) + [1.0]
    # Counted inside the workers, added to the wrapped verifier in this process.
    assert bounded.verifier.errors == len(MALFORMED)
    assert bounded.counters() == {"errors": len(MALFORMED), "timeouts": 0, "long_answers": 0}


def test_answer_length_cap_at_the_boundary() -> None:
    item = next(it for it in _items("chain_sum", 20, seed=5) if len(it["answer"]) >= 2)
    gold = item["answer"]
    assert ReasoningGymVerifier("tags", max_answer_chars=len(gold))(f"<answer>{gold}</answer>", item) == 1.0
    capped = ReasoningGymVerifier("tags", max_answer_chars=len(gold) - 1)
    assert capped(f"<answer>{gold}</answer>", item) == 0.0
    assert (capped.long_answers, capped.errors) == (1, 0)
    with pytest.raises(ValueError, match="max_answer_chars"):
        ReasoningGymVerifier(max_answer_chars=0)


def test_long_answer_is_never_scored(bounded: BoundedVerifier) -> None:
    # If the scorer saw this answer it would hang (timeouts == 1); the cap rejects it before any scoring.
    (item,) = _items("countdown", 1)
    answer = " + ".join(["9**9**9"] * 200)
    assert len(answer) > bounded.verifier.max_answer_chars
    start = time.perf_counter()
    assert bounded.score([f"<answer>{answer}</answer>"], [item]) == [0.0]
    assert time.perf_counter() - start < TIMEOUT_S
    assert bounded.counters() == {"errors": 0, "timeouts": 0, "long_answers": 1}
    assert bounded.verifier.long_answers == 1


class RewardFromText:
    """A verifier without counters: the reward is the response read as a float; ``exit`` kills the worker."""

    def __call__(self, response: str, item: Mapping) -> float:
        if response == "exit":
            os._exit(3)
        return float(response)


def test_dying_worker_and_bad_rewards_count_as_errors() -> None:
    responses = ["0.25", "exit", "nan", "2.5", "-1", "oops", "0.75"]
    items = [{}] * len(responses)
    with BoundedVerifier(RewardFromText(), timeout_s=TIMEOUT_S, workers=1) as bounded:
        assert bounded.score(responses, items) == [0.25, 0.0, 0.0, 1.0, 0.0, 0.0, 0.75]
        # the worker that exited, the NaN reward and the raising call
        assert bounded.counters() == {"errors": 3, "timeouts": 0, "long_answers": 0}
    in_process = BoundedVerifier(RewardFromText(), timeout_s=None)
    assert in_process.score(["nan", "2.5", "oops"], [{}] * 3) == [0.0, 1.0, 0.0]
    assert in_process.errors == 2


def test_state_dict_round_trip() -> None:
    (item,) = _items("chain_sum", 1)
    source = BoundedVerifier(ReasoningGymVerifier(max_answer_chars=3), timeout_s=None)
    assert source.score(["4", "12345"], [{"metadata": {}}, item]) == [0.0, 0.0]
    source.timeouts = 5
    state = source.state_dict()
    assert state == {"errors": 1, "timeouts": 5, "long_answers": 1}
    target = BoundedVerifier(ReasoningGymVerifier(), timeout_s=None)
    target.load_state_dict(state)
    assert target.counters() == state
    assert (target.verifier.errors, target.verifier.long_answers) == (1, 1)  # the wrapped verifier holds them


def test_close_is_idempotent_and_the_pool_restarts() -> None:
    (item,) = _items("chain_sum", 1)
    bounded = BoundedVerifier(ReasoningGymVerifier(), timeout_s=TIMEOUT_S, workers=1)
    bounded.close()  # never started
    assert bounded.score([item["answer"]], [item]) == [1.0]
    bounded.close()
    bounded.close()
    assert bounded(item["answer"], item) == 1.0  # a fresh pool
    bounded.close()


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"timeout_s": 0}, ValueError),
        ({"timeout_s": -1.0}, ValueError),
        ({"timeout_s": float("inf")}, ValueError),
        ({"timeout_s": float("nan")}, ValueError),
        ({"timeout_s": "5"}, TypeError),
        ({"workers": 0}, ValueError),
        ({"workers": 1.5}, ValueError),
    ],
)
def test_invalid_arguments(kwargs: dict, error: type[Exception]) -> None:
    with pytest.raises(error):
        BoundedVerifier(ReasoningGymVerifier(), **kwargs)


def test_unpicklable_verifier_is_refused_unless_in_process() -> None:
    with pytest.raises(TypeError, match="cannot be pickled"):
        BoundedVerifier(lambda response, item: 1.0)
    assert BoundedVerifier(lambda response, item: 1.0, timeout_s=None).score(["x"], [{}]) == [1.0]


def test_forgotten_pool_does_not_block_interpreter_exit() -> None:
    # A pool that is never closed, with a worker stuck in C code, must not keep the interpreter alive.
    script = textwrap.dedent(
        """
        import threading, time
        import reasoning_gym
        from logra_pl.rewards import BoundedVerifier, ReasoningGymVerifier

        item = next(iter(reasoning_gym.create_dataset("countdown", size=1, seed=0)))
        verifier = BoundedVerifier(ReasoningGymVerifier(), timeout_s=600, workers=1)
        assert verifier.score([item["answer"]], [item]) == [1.0]
        threading.Thread(target=verifier.score, args=(["9**9**9"], [item]), daemon=True).start()
        time.sleep(1.0)
        print("exiting", flush=True)
        """
    )
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "exiting" in result.stdout
    assert time.perf_counter() - start < 60
