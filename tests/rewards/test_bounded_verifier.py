"""BoundedVerifier: real reasoning-gym scorers in real worker processes, under a per-call time limit.

One pool (2 workers, 2 s limit) is shared by the module; each test starts from zeroed counters.
"""

from __future__ import annotations

import logging
import math
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import reasoning_gym

from logra_pl.errors import ConfigError
from logra_pl.rewards import BoundedVerifier, ReasoningGymVerifier

TIMEOUT_S = 2.0
# Answers on which countdown's sympy scorer runs for minutes inside C code (a big-int power, a huge float).
HANGING_ANSWERS = ["9**9**9", "1e999999"]


def _items(task: str, size: int, seed: int = 0) -> list[dict]:
    return list(reasoning_gym.create_dataset(task, size=size, seed=seed))


def _zero(verifier: BoundedVerifier) -> None:
    verifier.load_state_dict({"errors": 0, "timeouts": 0, "long_answers": 0, "nan": 0})


def _counts(errors: int = 0, timeouts: int = 0, long_answers: int = 0, nan: int = 0) -> dict[str, int]:
    return {"errors": errors, "timeouts": timeouts, "long_answers": long_answers, "nan": nan}


@pytest.fixture(scope="module")
def shared() -> Iterator[BoundedVerifier]:
    with BoundedVerifier(ReasoningGymVerifier("auto"), timeout_s=TIMEOUT_S, workers=2) as verifier:
        yield verifier


@pytest.fixture
def bounded(shared: BoundedVerifier) -> BoundedVerifier:
    _zero(shared)
    return shared


@pytest.mark.parametrize("answer", HANGING_ANSWERS)
def test_hanging_scorer_times_out_and_pool_recovers(bounded: BoundedVerifier, answer: str) -> None:
    hang, other = _items("countdown", 2)
    start, wall_start = time.perf_counter(), time.time()
    scores = bounded.run([f"<answer>{answer}</answer>"], [hang])
    elapsed, wall_elapsed = time.perf_counter() - start, time.time() - wall_start
    assert math.isnan(scores.rewards[0]) and scores.correct == [False] and scores.scored == [False]
    (failure,) = scores.failures
    assert failure is not None and (failure.kind, failure.task) == ("timeouts", "countdown")
    assert f"{TIMEOUT_S:g} s" in failure.message
    assert bounded.counters() == _counts(timeouts=1)
    # pebble times a call on the wall clock (time.time()): a step of that clock (NTP on a busy VM; CI saw a call
    # stopped after 0.41 s) ends a call early or late, so the lower bound is the wall clock's, the upper one either's.
    assert max(elapsed, wall_elapsed) >= TIMEOUT_S
    assert elapsed < TIMEOUT_S + 15
    # The hung worker was killed and replaced: the same verifier scores the next item correctly.
    assert bounded.score([other["answer"]], [other]) == [1.0]
    assert bounded.counters() == _counts(timeouts=1)


def test_timeout_in_a_batch_costs_only_its_own_reward(bounded: BoundedVerifier) -> None:
    chain = _items("chain_sum", 6, seed=3)
    (countdown,) = _items("countdown", 1)
    responses = [it["answer"] for it in chain[:3]] + ["9**9**9"] + [it["answer"] for it in chain[3:]]
    scores = bounded.run(responses, [*chain[:3], countdown, *chain[3:]])
    assert scores.scored == [True] * 3 + [False] + [True] * 3
    assert [r for r, ok in zip(scores.rewards, scores.scored, strict=True) if ok] == [1.0] * 6
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
    assert bounded.counters() == _counts()


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
    assert bounded.counters() == _counts(errors=len(MALFORMED))


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
    assert bounded.counters() == _counts(long_answers=1)
    assert bounded.verifier.long_answers == 1


class RewardFromText:
    """A verifier without counters: the reward is the response read as a float; ``exit`` kills the worker."""

    def __call__(self, response: str, item: Mapping) -> float:
        if response == "exit":
            os._exit(3)
        return float(response)


class Sleeps:
    """A verifier whose every call hangs (a scorer stuck in C code, a dead service)."""

    def __call__(self, response: str, item: Mapping) -> float:
        time.sleep(3600)
        return 1.0


class PositiveIsCorrect:
    """The response read as a float; its own verdict: correct when positive, no verdict (None) on 0.5."""

    def __call__(self, response: str, item: Mapping) -> float:
        return float(response)

    def correct(self, response: str, item: Mapping, reward: float) -> bool | None:
        return None if reward == 0.5 else reward > 0


def _kinds(scores) -> list[str | None]:
    return [f.kind if f is not None else None for f in scores.failures]


@pytest.mark.parametrize("timeout_s", [TIMEOUT_S, None], ids=["workers", "in-process"])
def test_failures_by_kind_and_real_valued_rewards(timeout_s: float | None) -> None:
    responses = ["0.25", "exit", "nan", "2.5", "-1", "oops", "0.75", "inf"]
    if timeout_s is None:
        responses.remove("exit")  # os._exit would end this process
    items = [{}] * len(responses)
    with BoundedVerifier(RewardFromText(), timeout_s=timeout_s, workers=1) as bounded:
        scores = bounded.run(responses, items)
    expected = {"0.25": 0.25, "2.5": 2.5, "-1": -1.0, "0.75": 0.75}  # no clamp to [0, 1]
    kinds = {"exit": "errors", "nan": "nan", "oops": "errors", "inf": "nan"}
    assert _kinds(scores) == [kinds.get(r) for r in responses]
    for response, reward in zip(responses, scores.rewards, strict=True):
        assert reward == expected[response] if response in expected else math.isnan(reward)
    assert scores.correct == [r == "2.5" for r in responses]  # threshold 1.0: only 2.5 reaches it
    assert bounded.counters() == _counts(errors=2 if timeout_s else 1, nan=2)
    raised = scores.failures[responses.index("oops")]
    assert raised.message == "ValueError: could not convert string to float: 'oops'"
    # The traceback shows the verifier's own frame, not the runner's.
    assert "in __call__" in raised.traceback and "return float(response)" in raised.traceback
    assert "bounded.py" not in raised.traceback
    assert scores.first() is scores.failures[1]


def test_correctness_from_the_threshold_or_the_verifier() -> None:
    responses = ["2.5", "1.0", "0.5", "0.25", "-3"]
    plain = BoundedVerifier(RewardFromText(), timeout_s=None, correct_threshold=1.0)
    assert plain.run(responses, [{}] * 5).correct == [True, True, False, False, False]
    higher = BoundedVerifier(RewardFromText(), timeout_s=None, correct_threshold=2.0)
    assert higher.run(responses, [{}] * 5).correct == [True, False, False, False, False]
    # Its own verdict (> 0), asked in the worker; on 0.5 it has none, so the threshold decides (0.5 < 0.4 is False).
    with BoundedVerifier(PositiveIsCorrect(), timeout_s=TIMEOUT_S, workers=1, correct_threshold=0.4) as own:
        assert own.run(responses, [{}] * 5).correct == [True, True, True, True, False]
    with BoundedVerifier(PositiveIsCorrect(), timeout_s=TIMEOUT_S, workers=1, correct_threshold=0.6) as own:
        assert own.run(responses, [{}] * 5).correct == [True, True, False, True, False]


def test_a_batch_certain_to_fail_stops_scoring() -> None:
    with BoundedVerifier(Sleeps(), timeout_s=1.0, workers=1) as bounded:
        scores = bounded.run(["x"] * 5, [{}] * 5, stop_at=2)
    # Two calls timed out; the other three were cancelled, never scored.
    assert sorted(_kinds(scores), key=str) == ["timeouts", "timeouts", "unscored", "unscored", "unscored"]
    assert scores.counts() == {"timeouts": 2, "unscored": 3} and scores.failed == 5
    assert bounded.counters() == _counts(timeouts=2)
    in_process = BoundedVerifier(RewardFromText(), timeout_s=None)
    scores = in_process.run(["oops", "nan", "1", "2"], [{}] * 4, stop_at=2)
    assert _kinds(scores) == ["errors", "nan", "unscored", "unscored"]


class Batched:
    """A batch verifier: the response read as a float, per batch, in this process; ``slow`` times out, ``oops``
    fails its own response; the batch ``["crash"]`` raises; a batch of ``["short"]`` returns no values."""

    def __init__(self) -> None:
        self.batches: list[int] = []
        self.errors = 0

    def __call__(self, response: str, item: Mapping) -> float:
        return self.score_batch([response], [item])[0]

    def score_batch(self, responses: list[str], items: list[Mapping]) -> list:
        self.batches.append(len(responses))
        if responses == ["crash"]:
            raise RuntimeError("the model is gone")
        if responses == ["short"]:
            return []
        self.errors += responses.count("counted")
        out: list = []
        for r in responses:
            if r == "slow":
                out.append(TimeoutError("no answer in 1 s"))
            elif r == "oops":
                out.append(ValueError("cannot read oops"))
            else:
                out.append(0.0 if r == "counted" else float(r))
        return out

    def components(self, response: str, item: Mapping) -> dict[str, float]:
        return {"double": 0.0 if response == "counted" else 2 * float(response)}


def test_a_batch_verifier_is_called_once_per_batch_in_process() -> None:
    verifier = Batched()
    bounded = BoundedVerifier(verifier, timeout_s=TIMEOUT_S, workers=2)  # no pickling, no pool: it batches here
    scores = bounded.run(["1.5", "slow", "oops", "nan", "-4", "counted"], [{}] * 6)
    assert verifier.batches == [6]
    assert _kinds(scores) == [None, "timeouts", "errors", "nan", None, None]
    assert scores.rewards[0] == 1.5 and scores.rewards[4] == -4.0 and scores.correct[0] is True
    assert scores.failures[2].message == "ValueError: cannot read oops"
    assert bounded.counters() == _counts(errors=2, timeouts=1, nan=1)  # its own "counted" + the failed element
    assert scores.components == {"double": (3.0 - 8.0 + 0.0) / 3}  # over the scored responses
    crashed = bounded.run(["crash"], [{}])
    assert _kinds(crashed) == ["errors"] and "the model is gone" in crashed.failures[0].message
    assert "score_batch" in crashed.failures[0].traceback
    short = bounded.run(["short"], [{}])
    assert "score_batch returned 0 values for 1 responses" in short.failures[0].message
    assert not bounded._pool.started


class CannotWork:
    """A verifier that cannot work at all: a ConfigError stops the run, it is not one response's failure."""

    def __call__(self, response: str, item: Mapping) -> float:
        raise ConfigError("reward model folder 'missing' does not exist")


@pytest.mark.parametrize("timeout_s", [TIMEOUT_S, None], ids=["workers", "in-process"])
def test_a_config_error_propagates(timeout_s: float | None) -> None:
    bounded = BoundedVerifier(CannotWork(), timeout_s=timeout_s, workers=1)
    with bounded, pytest.raises(ConfigError, match="folder 'missing' does not exist"):
        bounded.run(["x"], [{}])


def test_state_dict_round_trip() -> None:
    (item,) = _items("chain_sum", 1)
    source = BoundedVerifier(ReasoningGymVerifier(max_answer_chars=3), timeout_s=None)
    assert source.score(["4", "12345"], [{"metadata": {}}, item]) == [0.0, 0.0]
    source.timeouts, source.nan = 5, 2
    state = source.state_dict()
    assert state == {"errors": 1, "timeouts": 5, "long_answers": 1, "nan": 2}
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


def test_the_batch_verifier_of_the_guide_runs() -> None:
    """docs/extending.md's batch example, executed as written: one score_batch call, its own correctness."""
    guide = (Path(__file__).resolve().parents[2] / "docs" / "extending.md").read_text()
    code = next(block for block in re.findall(r"```python\n(.*?)```", guide, re.DOTALL) if "class LengthScore" in block)
    namespace: dict = {}
    exec(code, namespace)
    verifier = namespace["LengthScore"]()
    items = [{"answer": "4"}, {"answer": "4"}, {"answer": "9"}]
    scores = BoundedVerifier(verifier, timeout_s=TIMEOUT_S).run(["so 4", "", "nine"], items)
    assert scores.rewards[0] == 4.0 and scores.rewards[2] == 4.0
    assert [f.kind if f else None for f in scores.failures] == [None, "errors", None]
    assert scores.correct == [True, False, False]  # its own verdict, not reward >= 1
