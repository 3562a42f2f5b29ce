"""The reward contract: check_verifier, answer extraction, ExactMatch, WeightedRewards (in process and in workers)."""

from __future__ import annotations

import logging
import math
import pickle
import time
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from jsonargparse import ArgumentParser

from logra_pl.errors import ConfigError
from logra_pl.rewards import (
    BoundedVerifier,
    ExactMatch,
    MathVerifier,
    Verifier,
    WeightedRewards,
    check_verifier,
    verifier_name,
)
from logra_pl.rewards.base import build_verifier, extract_final_answer


def _item(answer: object = "4", **extra: object) -> dict:
    return {"messages": [{"role": "user", "content": "2+2?"}], "answer": answer, "task": "t", "id": "0", **extra}


# -- user classes, as a user would write them (nothing subclassed) ---------------------------------------------------


class ContainsGold:
    """1 when the gold answer appears anywhere in the response."""

    def __call__(self, response: str, item: Mapping[str, Any]) -> float:
        return float(item["answer"] in response)


class ShortResponse:
    """1 for responses of at most 10 characters; counts its own long answers; ``boom`` raises."""

    name = "brevity"

    def __init__(self) -> None:
        self.long_answers = 0

    def __call__(self, response: str, item: Mapping[str, Any]) -> float:
        if response == "boom":
            raise RuntimeError("boom")
        if len(response) > 10:
            self.long_answers += 1
            return 0.0
        return 1.0


class OneArgument:
    def __call__(self, response: str) -> float:
        return 1.0


class NotCallable:
    pass


def plain_function(response: str, item: Mapping[str, Any]) -> float:
    return 1.0


class ReadsNumber:
    """The response read as a number is both the reward and its one component."""

    def __call__(self, response: str, item: Mapping[str, Any]) -> float:
        return float(response)

    def components(self, response: str, item: Mapping[str, Any]) -> dict[str, float]:
        return {"value": float(response)}


# -- check_verifier / verifier_name ---------------------------------------------------------------------------------


@pytest.mark.parametrize("verifier", [ContainsGold(), ShortResponse(), ExactMatch(), MathVerifier(), plain_function])
def test_check_verifier_accepts_plain_callables(verifier: object) -> None:
    check_verifier(verifier)
    assert isinstance(verifier, Verifier)  # the protocol is runtime-checkable


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        (NotCallable(), r"test_base\.NotCallable is not callable: expected a class with __call__\(response, item\)"),
        (OneArgument(), r"test_base\.OneArgument cannot be called as verifier\(response, item\).*too many"),
        (ContainsGold, r"test_base\.ContainsGold is a class, not an instance"),
        (lambda response, item, extra: 1.0, r"<lambda> cannot be called as verifier\(response, item\).*extra"),
        (42, r"builtins\.int is not callable: expected a class with __call__\(response, item\) -> float"),
    ],
)
def test_check_verifier_refuses_with_the_class_and_the_contract(obj: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_verifier(obj)


def test_verifier_name() -> None:
    assert verifier_name(ExactMatch()) == "exact_match"
    assert verifier_name(MathVerifier()) == "math_verifier"
    assert verifier_name(ShortResponse()) == "brevity"  # a `name` attribute wins
    assert verifier_name(plain_function) == "plain_function"
    assert verifier_name(BoundedVerifier(ContainsGold(), timeout_s=None)) == "bounded_verifier"


# -- extract_final_answer -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("think <answer> 42 </answer>", "42"),
        ("<answer>1</answer> then <answer>2</answer>", "2"),  # the last pair
        (r"<answer>7</answer> \boxed{8}", "7"),  # tags win over a box
        (r"a \boxed{1} b \boxed{\frac{1}{2}} c", r"\frac{1}{2}"),  # the last box, braces balanced
        (r"\boxed{\boxed{3}}", r"\boxed{3}"),  # a nested box belongs to the outer one
        (r"\boxed {x \} y}", r"x \} y"),  # escaped braces do not count
        (r"\boxed{1} and a truncated \boxed{2", None),  # the last box never closes: no answer
        ("no answer here", None),
    ],
)
def test_extract_final_answer(response: str, answer: str | None) -> None:
    assert extract_final_answer(response) == answer


# -- ExactMatch -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "gold", "reward"),
    [
        ("<answer>Paris</answer>", "paris", 1.0),
        ("  The   Eiffel\nTower. ", "the eiffel tower", 1.0),  # whitespace, case, trailing period
        (r"so \boxed{3.0}", "3", 1.0),  # numbers by value
        ("<answer>1e3</answer>", "1000", 1.0),
        ("-0", "0", 1.0),
        ("3.5", "3.50", 1.0),
        ("0.1", "0.10000000000000001", 0.0),  # exact decimals, no float rounding
        ("3", "3 apples", 0.0),
        ("Lyon", "Paris", 0.0),
        ("The answer is 4", "4", 0.0),  # no tags or box: the whole response is the answer
    ],
)
def test_exact_match(response: str, gold: str, reward: float) -> None:
    verifier = ExactMatch()
    assert verifier(response, _item(gold)) == reward
    assert (verifier.errors, verifier.long_answers) == (0, 0)


def test_exact_match_without_normalization() -> None:
    verifier = ExactMatch(normalize=False)
    assert verifier("<answer> Paris </answer>", _item("Paris ")) == 1.0  # stripped only
    assert verifier("<answer>paris</answer>", _item("Paris")) == 0.0
    assert verifier("3.0", _item("3")) == 0.0


def test_exact_match_huge_exponent_is_cheap() -> None:
    start = time.perf_counter()
    assert ExactMatch()("1e999999999", _item("1")) == 0.0
    assert ExactMatch()("1e999999999", _item("10e999999998")) == 1.0
    assert time.perf_counter() - start < 0.5


def test_exact_match_counts_long_answers_and_malformed_items(caplog: pytest.LogCaptureFixture) -> None:
    verifier = ExactMatch(max_answer_chars=5)
    assert verifier("<answer>12345</answer>", _item("12345")) == 1.0
    assert verifier("<answer>123456</answer>", _item("123456")) == 0.0
    with caplog.at_level(logging.WARNING, logger="logra_pl.rewards.base"):
        assert verifier("4", {"messages": [], "task": "t"}) == 0.0
        assert verifier("4", _item(None)) == 0.0
    assert verifier("4", _item(4)) == 1.0  # a number is read as its string
    assert (verifier.errors, verifier.long_answers) == (2, 1)
    assert "no 'answer'" in caplog.text
    with pytest.raises(ConfigError, match="max_answer_chars"):
        ExactMatch(max_answer_chars=0)


# -- WeightedRewards ------------------------------------------------------------------------------------------------


def test_weighted_sum_and_components() -> None:
    combined = WeightedRewards({"exact": ExactMatch(), "short": ShortResponse()}, weights={"exact": 0.7, "short": 0.3})
    item = _item("4")
    assert combined("4", item) == pytest.approx(1.0)
    assert combined.components("4", item) == {"exact": 1.0, "short": 1.0}
    assert combined("5", item) == pytest.approx(0.3)
    assert combined.components("5", item) == {"exact": 0.0, "short": 1.0}
    long = "so the answer is <answer>4</answer>"
    assert combined(long, item) == pytest.approx(0.7)
    assert combined.components(long, item) == {"exact": 1.0, "short": 0.0}
    assert combined.long_answers == 1  # the part's counter, counted once (components reuse the call)


def test_default_weights_are_the_mean() -> None:
    combined = WeightedRewards({"a": ExactMatch(), "b": ContainsGold(), "c": ShortResponse()})
    assert combined.weights == pytest.approx({"a": 1 / 3, "b": 1 / 3, "c": 1 / 3})
    assert combined("the answer: 4", _item("4")) == pytest.approx(1 / 3)  # only "contains" holds
    assert combined("4", _item("4")) == 1.0


def test_a_failing_part_fails_the_whole_call() -> None:
    combined = WeightedRewards({"short": ShortResponse(), "contains": ContainsGold()}, {"short": 0.5, "contains": 0.5})
    with pytest.raises(RuntimeError, match="boom") as info:
        combined("boom", _item("boom"))
    assert info.value.__notes__ == ["in WeightedRewards part 'short'"]  # the runner's message names the part
    with pytest.raises(KeyError) as info:
        combined("4", {"messages": []})  # ContainsGold on an item without an answer
    assert info.value.__notes__ == ["in WeightedRewards part 'contains'"]
    # A part's non-finite value makes the sum non-finite: the runner counts it (verifier/nan) and never trains on it.
    nan_part = WeightedRewards({"n": ReadsNumber(), "c": ContainsGold()})
    assert math.isnan(nan_part("nan", _item("x")))
    scores = BoundedVerifier(nan_part, timeout_s=None).run(["nan", "1"], [_item("1"), _item("1")])
    assert [f.kind if f else None for f in scores.failures] == ["nan", None]
    assert scores.rewards[1] == 1.0


def test_rewards_are_not_clamped_and_weights_may_be_negative() -> None:
    combined = WeightedRewards({"value": ReadsNumber(), "exact": ExactMatch()}, {"value": 2.0, "exact": -0.5})
    assert combined("3", _item("3")) == 2.0 * 3 - 0.5 * 1  # no [0, 1] anywhere
    assert combined.components("3", _item("3")) == {"value": 3.0, "exact": 1.0}
    assert combined("-7.5", _item("3")) == -15.0


def test_correct_part_gives_the_correctness() -> None:
    class Judged:
        """A part with its own verdict: correct when the reward is positive."""

        def __call__(self, response: str, item: Mapping[str, Any]) -> float:
            return float(response)

        def correct(self, response: str, item: Mapping[str, Any], reward: float) -> bool:
            return reward > 0

    by_sum = WeightedRewards({"value": ReadsNumber(), "exact": ExactMatch()}, {"value": 0.5, "exact": 0.5})
    assert by_sum.correct("3", _item("3"), by_sum("3", _item("3"))) is None  # the runner's threshold then applies
    by_exact = WeightedRewards({"value": ReadsNumber(), "exact": ExactMatch()}, correct_part="exact")
    assert by_exact.correct("3", _item("3"), by_exact("3", _item("3"))) is True  # exact gave full credit
    assert by_exact.correct("0.5", _item("3"), by_exact("0.5", _item("3"))) is False
    by_own = WeightedRewards({"judged": Judged(), "exact": ExactMatch()}, correct_part="judged")
    assert by_own.correct("0.25", _item("3"), by_own("0.25", _item("3"))) is True  # its own correct(): 0.25 > 0
    with pytest.raises(ConfigError, match="correct_part 'nope' is not one of the parts"):
        WeightedRewards({"exact": ExactMatch()}, correct_part="nope")
    # Through the runner: the threshold for by_sum, the part for by_exact.
    runner = BoundedVerifier(by_sum, timeout_s=None, correct_threshold=1.5)
    assert runner.run(["3", "1"], [_item("3"), _item("3")]).correct == [True, False]  # 2.0 >= 1.5, 0.5 < 1.5
    runner = BoundedVerifier(by_exact, timeout_s=None, correct_threshold=100.0)
    assert runner.run(["3", "1"], [_item("3"), _item("3")]).correct == [True, False]  # exact's verdict


def test_counters_are_the_sums_of_the_parts() -> None:
    exact, short = ExactMatch(max_answer_chars=3), ShortResponse()
    combined = WeightedRewards({"exact": exact, "short": short})
    combined("<answer>12345678901</answer>", _item("1"))  # too long for both
    combined("4", {"messages": []})  # malformed for ExactMatch
    assert (exact.errors, exact.long_answers, short.long_answers) == (1, 1, 1)
    assert (combined.errors, combined.long_answers) == (1, 2)
    combined.errors = 0  # the runner's reset (load_state_dict) leaves the parts' counts alone
    combined.long_answers = 5
    assert (combined.errors, combined.long_answers, exact.errors) == (0, 5, 1)
    combined("4", {"messages": []})
    assert combined.errors == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"verifiers": {}}, "non-empty mapping"),
        ({"verifiers": {"a": ExactMatch()}, "weights": {"a": math.nan}}, "finite number"),
        ({"verifiers": {"a": ExactMatch()}, "weights": {"a": "1"}}, "finite number"),
        ({"verifiers": {"a": ExactMatch()}, "weights": {"b": 1.0}}, r"missing \['a'\], unknown \['b'\]"),
        ({"verifiers": {"a": OneArgument()}}, r"part 'a'.*OneArgument cannot be called"),
        ({"verifiers": {"a": {"class_path": "logra_pl.rewards.NoSuchVerifier"}}}, "cannot import"),
    ],
)
def test_weighted_rewards_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        WeightedRewards(**kwargs)


def test_weights_need_not_sum_to_one() -> None:
    assert WeightedRewards({"a": ExactMatch(), "b": ContainsGold()}, {"a": 0.25, "b": 0.25})("4", _item("4")) == 0.5
    assert WeightedRewards({"a": ExactMatch(), "b": ContainsGold()}, {"a": 1.0, "b": 2.0})("4", _item("4")) == 3.0


def test_parts_given_as_class_path_dicts() -> None:
    combined = WeightedRewards(
        {
            "math": {"class_path": "logra_pl.rewards.MathVerifier", "init_args": {"max_answer_chars": 50}},
            "exact": {"class_path": "logra_pl.rewards.ExactMatch"},
        },
        weights={"math": 0.75, "exact": 0.25},
    )
    assert isinstance(combined.verifiers["math"], MathVerifier)
    assert combined.verifiers["math"].max_answer_chars == 50
    assert combined(r"\boxed{0.5}", _item(r"\frac{1}{2}")) == 0.75
    assert isinstance(build_verifier({"class_path": "logra_pl.rewards.ExactMatch"}), ExactMatch)


def test_built_from_yaml_by_jsonargparse() -> None:
    # The way LightningCLI reads `--model.verifier` typed as the Verifier protocol.
    parser = ArgumentParser()
    parser.add_argument("--verifier", type=Verifier)
    config = parser.parse_string(
        """
        verifier:
          class_path: logra_pl.rewards.WeightedRewards
          init_args:
            verifiers:
              math: {class_path: logra_pl.rewards.MathVerifier, init_args: {max_answer_chars: 50}}
              exact: {class_path: logra_pl.rewards.ExactMatch}
            weights: {math: 0.75, exact: 0.25}
        """
    )
    verifier = parser.instantiate(config).verifier
    assert isinstance(verifier, WeightedRewards)
    assert verifier.verifiers["math"].max_answer_chars == 50
    assert verifier(r"\boxed{0.5}", _item(r"\frac{1}{2}")) == 0.75


def test_weighted_rewards_pickle_without_the_cached_item() -> None:
    combined = WeightedRewards({"exact": ExactMatch(), "short": ShortResponse()})
    combined("4", _item("4"))
    copy = pickle.loads(pickle.dumps(combined))
    assert copy._last is None
    assert copy("4", _item("4")) == 1.0


# -- through BoundedVerifier ----------------------------------------------------------------------------------------

RESPONSES = ["4", r"\boxed{4.0}", "<answer>5</answer>", "so the answer is <answer>4</answer>", "4", "x" * 30]
WEIGHTS = {"math": 0.5, "exact": 0.3, "short": 0.2}


def _combined() -> WeightedRewards:
    return WeightedRewards({"math": MathVerifier(), "exact": ExactMatch(), "short": ShortResponse()}, WEIGHTS)


@pytest.fixture(scope="module")
def pooled() -> Iterator[BoundedVerifier]:
    with BoundedVerifier(_combined(), timeout_s=10.0, workers=2) as bounded:
        yield bounded


def _items() -> list[dict]:
    return [_item("4") for _ in RESPONSES[:-2]] + [{"messages": []}, _item("4")]  # one malformed


def _expected() -> tuple[list[float], dict[str, float], WeightedRewards]:
    """Rewards, component means and counters computed in this process, call by call as the runner does."""
    here = _combined()
    rewards, parts = [], []
    for response, item in zip(RESPONSES, _items(), strict=True):
        rewards.append(here(response, item))
        parts.append(here.components(response, item))
    means = {name: sum(p[name] for p in parts) / len(parts) for name in WEIGHTS}
    return rewards, means, here


def test_last_components_are_batch_means_in_workers(pooled: BoundedVerifier) -> None:
    rewards, means, here = _expected()
    assert rewards == pytest.approx([1.0, 0.8, 0.0, 0.8, 0.2, 0.0])
    got = pooled.score(RESPONSES, _items())
    assert got == pytest.approx(rewards)
    assert pooled.last_components == pytest.approx(means)
    assert pooled.last_components == pytest.approx({"math": 3 / 6, "exact": 3 / 6, "short": 2 / 6})
    # The weighted means add up to the mean reward.
    assert sum(WEIGHTS[n] * v for n, v in pooled.last_components.items()) == pytest.approx(sum(got) / len(got))
    # Counters from the workers: the malformed item (ExactMatch and MathVerifier), the long answers.
    assert pooled.counters() == {"errors": here.errors, "timeouts": 0, "long_answers": here.long_answers, "nan": 0}
    assert (here.errors, here.long_answers) == (2, 4)
    # The next batch replaces them.
    assert pooled.score(["4"], [_item("4")]) == [1.0]
    assert pooled.last_components == {"math": 1.0, "exact": 1.0, "short": 1.0}


def test_last_components_in_process_and_for_failed_calls() -> None:
    rewards, means, _ = _expected()
    in_process = BoundedVerifier(_combined(), timeout_s=None)
    assert in_process.score(RESPONSES, _items()) == pytest.approx(rewards)
    assert in_process.last_components == pytest.approx(means)
    assert in_process.score([], []) == [] and in_process.last_components == {}
    # A failed call (here a non-finite reward) has no reward and is left out of every component's mean.
    numbers = BoundedVerifier(ReadsNumber(), timeout_s=None)
    got = numbers.score(["1", "nan", "0.5"], [{}] * 3)
    assert got[0] == 1.0 and math.isnan(got[1]) and got[2] == 0.5
    assert numbers.last_components == {"value": 0.75}
    assert (numbers.errors, numbers.nan) == (0, 1)
    # A verifier without components leaves them empty.
    plain = BoundedVerifier(ContainsGold(), timeout_s=None)
    assert plain.score(["4"], [_item("4")]) == [1.0] and plain.last_components == {}
