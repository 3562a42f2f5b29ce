"""A response without a reward is never trained on: the failure policy's counting and stop, the advantages, the loss
and the metrics of an update with failed responses — each against a computation written here without them."""

from __future__ import annotations

import logging
import math
from functools import partial
from typing import Any

import pytest
import torch

from logra_pl.errors import ConfigError, VerifierFailedError
from logra_pl.losses import GroupBaseline, ReinforceTIS, RLOOBaseline, RunningBaseline
from logra_pl.rewards.failures import Failure, FailurePolicy, Scores, verifier_label
from logra_pl.rollout.base import Rollout
from logra_pl.train.backward import backward_over, update_totals
from logra_pl.train.logprobs import response_logprobs
from logra_pl.train.metrics import MacroMean
from logra_pl.train.sampler import score_tensors
from logra_pl.train.step import assemble_step, scored_advantages, step_metrics
from logra_pl.train.validation import ValidationMetrics

TRACE = 'Traceback (most recent call last):\n  File "mine.py", line 3, in __call__\nValueError: boom'


def _scores(kinds: list[str | None], rewards: list[float] | None = None) -> Scores:
    rewards = rewards or [1.0] * len(kinds)
    failures = [None if k is None else Failure(k, f"{k} happened", TRACE if k == "errors" else "", "t") for k in kinds]
    return Scores(
        [math.nan if k else r for k, r in zip(kinds, rewards, strict=True)],
        [k is None and r >= 1.0 for k, r in zip(kinds, rewards, strict=True)],
        failures,
    )


class Mine:
    def __repr__(self) -> str:
        return "Mine(limit=3)"


class Plain:
    pass


def test_cut_is_the_first_count_at_the_share() -> None:
    policy = FailurePolicy(max_failure_rate=0.5)
    assert [policy.cut(n) for n in (1, 2, 7, 8, 64)] == [1, 1, 4, 4, 32]
    assert FailurePolicy(max_failure_rate=0.3).cut(10) == 3  # 0.3·10 is 3.0000000000000004 in floats
    assert FailurePolicy(max_failure_rate=1.0).cut(5) == 5
    assert FailurePolicy(max_failure_rate=0.5).fails(4, 8) and not FailurePolicy(max_failure_rate=0.5).fails(3, 8)
    with pytest.raises(ConfigError, match=r"scoring\.max_failure_rate"):
        FailurePolicy(max_failure_rate=0.0)
    with pytest.raises(ConfigError, match=r"scoring\.max_failed_updates"):
        FailurePolicy(max_failed_updates=0)


def test_failing_updates_in_a_row_stop_the_run_with_the_first_traceback(caplog: pytest.LogCaptureFixture) -> None:
    policy = FailurePolicy(max_failure_rate=0.5, max_failed_updates=2)
    failing, fine = _scores(["errors", "nan", "timeouts", None]), _scores([None, "timeouts", None, None])
    caplog.set_level(logging.WARNING, logger="logra_pl.module")
    policy.record(1, failing, 3, 4, "pkg.Mine", "last.ckpt", say=True)
    policy.record(2, fine, 1, 4, "pkg.Mine", "last.ckpt", say=True)  # below the share: the streak ends
    assert (policy.total, policy.in_a_row) == (1, 0)
    policy.record(3, failing, 3, 4, "pkg.Mine", "last.ckpt", say=True)
    with pytest.raises(VerifierFailedError) as info:
        policy.record(4, _scores(["nan", "nan", None, None]), 2, 4, "pkg.Mine", "last.ckpt", say=True)
    text = str(info.value)
    assert text.startswith("the verifier pkg.Mine failed on at least 50% of the responses of 2 updates in a row")
    assert "update 4: 2 of 4 without a reward" in text and "last.ckpt holds the last good weights" in text
    assert "First failure (update 3): errors happened (task 't')\n" + TRACE in text  # the streak's first
    # One console line per update with failures, none for an update without.
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4
    assert lines[0] == (
        "update 1: 3 of 4 responses have no reward (errors 1, nan 1, timeouts 1), left out of the update; first: "
        "errors happened (task 't'); 1 failing update(s) in a row, the run stops at 2"
    )
    assert "update 2: 1 of 4" in lines[1] and "in a row" not in lines[1]
    policy.record(5, _scores([None, None]), 0, 2, "pkg.Mine", "last.ckpt", say=True)
    assert len(caplog.records) == 4


def test_policy_state_round_trip_and_validation() -> None:
    policy = FailurePolicy(max_failed_updates=3)
    policy.record(1, _scores(["errors", "errors"]), 2, 2, "v", "c", say=False)
    restored = FailurePolicy(max_failed_updates=3)
    restored.load_state_dict(policy.state_dict())
    assert restored.state_dict() == {"failed_updates": 1, "failed_in_a_row": 1}
    restored.check_validation(0, _scores([None, "nan"]), 0, 4, "v", "c", say=False)  # 0 of 4 over all ranks
    with pytest.raises(VerifierFailedError, match="responses of a validation batch"):
        restored.check_validation(0, _scores(["nan", "nan"]), 2, 4, "v", "c", say=False)


def test_verifier_label_names_the_class_and_its_repr() -> None:
    assert verifier_label(Mine()) == f"{__name__}.Mine = Mine(limit=3)"
    assert verifier_label(Plain()) == f"{__name__}.Plain"
    assert verifier_label(len) == "builtins.builtin_function_or_method = <built-in function len>"


def test_scores_summaries() -> None:
    scores = _scores(["unscored", None, "timeouts", "errors"])
    assert scores.counts() == {"errors": 1, "timeouts": 1, "unscored": 1}
    assert scores.failed == 3 and scores.scored == [False, True, False, False]
    assert scores.first() is scores.failures[2]  # an unscored response is not a failure of the verifier
    rewards, scored, correct = score_tensors(scores)
    assert rewards.dtype == torch.float64 and math.isnan(rewards[0]) and rewards[1] == 1.0
    assert scored.tolist() == [False, True, False, False] and correct.tolist() == [False, True, False, False]


# ---------------------------------------------------------------------------------------------------- advantages
def _sum(t: torch.Tensor) -> torch.Tensor:
    return t


def test_group_advantages_leave_failed_responses_out() -> None:
    rewards = torch.tensor([1.0, math.nan, 0.0, 1.0, 0.5, math.nan, 1.0, 0.0], dtype=torch.float64)
    scored = ~torch.isnan(rewards)
    correct = torch.nan_to_num(rewards) >= 1.0
    groups = [0, 0, 0, 1, 1, 1, 2, 2]
    baseline = GroupBaseline()
    adv = scored_advantages(baseline, rewards, scored, correct, groups, _sum)
    # By hand: outcomes 1 / −0.01 over the scored responses of each prompt only.
    outcome = {0: 1.0, 2: -0.01, 3: 1.0, 4: -0.01, 6: 1.0, 7: -0.01}
    expected = [0.0] * 8
    for g in (0, 1, 2):
        rows = [i for i in outcome if groups[i] == g]
        mean = sum(outcome[i] for i in rows) / len(rows)
        for i in rows:
            expected[i] = outcome[i] - mean
    assert adv.tolist() == pytest.approx(expected, rel=1e-7)  # outcomes pass through float32 (-0.01)
    assert adv[1] == 0.0 and adv[5] == 0.0
    # The running value moves by the scored responses' mean outcome only.
    assert baseline.value == pytest.approx(0.1 * sum(outcome.values()) / len(outcome))


def test_leave_one_out_with_a_lone_scored_response() -> None:
    rewards = torch.tensor([1.0, math.nan, 1.0, 0.0, 0.0], dtype=torch.float64)
    scored = ~torch.isnan(rewards)
    adv = scored_advantages(RLOOBaseline(), rewards, scored, torch.nan_to_num(rewards) >= 1, [0, 0, 1, 1, 1], _sum)
    # Prompt 0 has one scored response: nothing to compare it with (advantage 0, out of the baseline).
    o = [1.0, -0.01, -0.01]
    expected = [0.0, 0.0, o[0] - (o[1] + o[2]) / 2, o[1] - (o[0] + o[2]) / 2, o[2] - (o[0] + o[1]) / 2]
    assert adv.tolist() == pytest.approx(expected, rel=1e-7)


def test_no_scored_response_still_calls_the_baseline_once() -> None:
    calls: list[torch.Tensor] = []

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        calls.append(t.clone())
        return t

    baseline = RunningBaseline()
    baseline.value = 0.25
    rewards = torch.full((3,), math.nan, dtype=torch.float64)
    none = torch.zeros(3, dtype=torch.bool)
    assert scored_advantages(baseline, rewards, none, none, [0, 1, 2], all_reduce).tolist() == [0.0, 0.0, 0.0]
    assert len(calls) == 1 and calls[0].tolist() == [0.0, 0.0]  # the other ranks' collective is matched
    assert baseline.value == 0.25


def test_correctness_is_the_baselines_outcome_unless_a_threshold_is_set() -> None:
    rewards = torch.tensor([5.0, 0.5, 2.0], dtype=torch.float64)
    correct = torch.tensor([False, True, True])  # the verifier's own verdict, not reward >= 1
    fail = float(torch.tensor(-0.01, dtype=torch.float32))  # outcomes pass through float32, as they always did
    assert RunningBaseline().outcomes(rewards, correct).tolist() == [fail, 1.0, 1.0]
    assert RunningBaseline(success_threshold=1.0).outcomes(rewards, correct).tolist() == [1.0, fail, 1.0]
    assert RunningBaseline().outcomes(rewards).tolist() == [1.0, fail, 1.0]  # without a verdict: reward >= 1


# ------------------------------------------------------------------------------------------------------- the loss
def _rollout(rows: list[int]) -> Rollout:
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10], [11]]
    responses = [[12, 13, 14, 2], [15, 2], [16, 17, 18, 19, 20], [21, 22]]
    logprobs = [[-0.5 - 0.1 * k for k in range(len(r))] for r in responses]
    return Rollout(
        prompt_ids=[prompts[i] for i in rows],
        response_ids=[responses[i] for i in rows],
        logprobs=[logprobs[i] for i in rows],
        finish_reasons=["stop"] * len(rows),
        prompt_index=list(range(len(rows))),
    )


def test_a_failed_response_adds_nothing_to_the_update(qwen2_factory) -> None:
    """The update of a batch with failed responses equals the update of the same batch without them."""
    model = qwen2_factory(seed=3)
    advantages = torch.tensor([0.7, 0.0, -0.4, 1.2], dtype=torch.float64)  # row 1 failed: advantage 0

    def trainer_logprobs(packed, temperature):
        return torch.zeros_like(packed.response_mask, dtype=torch.float32)

    def run(rows: list[int], scored: torch.Tensor | None, loss: Any) -> tuple[float, dict[str, torch.Tensor], Any]:
        model.zero_grad()
        rewards = torch.tensor([1.0, math.nan, 0.0, 1.0], dtype=torch.float64)[rows]
        ctx = assemble_step(
            0, [{}] * len(rows), _rollout(rows), rewards, advantages[rows], 0, trainer_logprobs, 1.0, scored=scored
        )
        every = list(range(len(rows)))
        totals = update_totals(ctx, every, 8, lambda t: t)
        score = partial(response_logprobs, model)
        total = backward_over(score, ctx, [every], loss, totals, lambda t: t.backward(), "cpu")
        return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, totals

    # Under every aggregation (the token and sequence counts leave the failed response out too).
    for loss in [
        ReinforceTIS(aggregation=mode) for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
    ]:
        with_failed, grads, totals = run([0, 1, 2, 3], torch.tensor([True, False, True, True]), loss)
        without, expected, totals_without = run([0, 2, 3], None, loss)
        assert totals == totals_without and (totals.tokens, totals.sequences) == (4 + 5 + 2, 3)
        assert with_failed == pytest.approx(without, rel=1e-6)
        for name, grad in expected.items():
            assert torch.allclose(grads[name], grad, atol=1e-7, rtol=1e-5), name
    ctx = assemble_step(0, [{}] * 4, _rollout([0, 1, 2, 3]), torch.zeros(4), advantages, 0, trainer_logprobs, 1.0)
    assert ctx.loss_mask is ctx.packed.response_mask  # nothing failed: the mask is the response mask itself
    ctx = assemble_step(
        0, [{}] * 4, _rollout([0, 1, 2, 3]), torch.zeros(4), advantages, 0, trainer_logprobs, 1.0,
        scored=torch.tensor([True, False, True, True]),
    )  # fmt: skip
    assert ctx.loss_mask[1].sum() == 0 and torch.equal(ctx.loss_mask[0], ctx.packed.response_mask[0])


class _Scorer:
    def __init__(self) -> None:
        self.errors, self.timeouts, self.nan, self.long_answers = 1, 2, 3, 0
        self.last_components: dict[str, float] = {}


def test_step_metrics_average_the_scored_responses_only() -> None:
    rewards = torch.tensor([5.0, math.nan, -1.0, 2.0], dtype=torch.float64)
    ctx = assemble_step(0, [{}] * 4, _rollout([0, 1, 2, 3]), rewards, torch.tensor([0.5, 0.0, -1.5, 1.0]), 0,
                        lambda p, t: torch.zeros_like(p.response_mask, dtype=torch.float32), 1.0)  # fmt: skip
    ctx.scored = ~torch.isnan(rewards)
    metrics = step_metrics(ctx, [(0.0, 0.0, 0.0, 1.0)], 1.0, 1.0, RunningBaseline(), _Scorer())
    assert metrics["train/reward_mean"] == 2.0  # (5 − 1 + 2) / 3: real-valued, the failed one left out
    assert metrics["train/advantage_mean"] == pytest.approx(0.0)
    assert metrics["verifier/failure_rate"] == 0.25
    assert (metrics["verifier/errors"], metrics["verifier/timeouts"], metrics["verifier/nan"]) == (1.0, 2.0, 3.0)
    ctx.scored = torch.zeros(4, dtype=torch.bool)
    nothing = step_metrics(ctx, [(0.0, 0.0, 0.0, 1.0)], 1.0, 1.0, RunningBaseline(), _Scorer())
    assert math.isnan(nothing["train/reward_mean"]) and nothing["verifier/failure_rate"] == 1.0


# ----------------------------------------------------------------------------------------------------- validation
def test_validation_counts_correctness_and_leaves_failed_rewards_out() -> None:
    batch = [{"task": "a", "answer": "1"}, {"task": "b", "answer": "2"}]
    metrics = ValidationMetrics(ks=[1, 2], samples=2)
    metrics.start(batch, torch.device("cpu"))
    rewards = torch.tensor([7.0, math.nan, 0.5, 3.0], dtype=torch.float64)
    correct = torch.tensor([False, False, True, True])  # the verifier's verdicts (7.0 is not correct)
    scored = torch.tensor([True, False, True, True])
    metrics.update(batch, rewards, [], torch.device("cpu"), correct=correct, scored=scored)
    out = metrics.compute()
    assert float(out["val/pass@1"]) == 0.5
    assert float(out["val/pass@2"]) == pytest.approx((0.0 + 1.0) / 2)
    assert float(out["val/a/pass@1"]) == 0.0 and float(out["val/b/pass@1"]) == 1.0
    assert float(out["val/a/reward"]) == 7.0 and float(out["val/b/reward"]) == 1.75
    assert float(metrics.reward.compute()) == pytest.approx((7.0 + 0.5 + 3.0) / 3)


def test_macro_mean_mask_against_a_plain_loop() -> None:
    values = torch.tensor([[1.0, 2.0, math.nan], [4.0, math.nan, 6.0], [-3.0, 0.5, 1.5]], dtype=torch.float64)
    mask = ~torch.isnan(values)
    tasks = ["x", "y", "x"]
    metric = MacroMean(["x", "y"], "reward")
    metric.update(values, tasks, mask)
    sums: dict[str, list[float]] = {"x": [], "y": []}
    for row, task in zip(values.tolist(), tasks, strict=True):
        sums[task] += [v for v in row if not math.isnan(v)]
    means = {t: sum(v) / len(v) for t, v in sums.items()}
    out = metric.compute()
    assert float(out["x/reward"]) == pytest.approx(means["x"]) and float(out["y/reward"]) == pytest.approx(means["y"])
    assert float(out["macro_reward"]) == pytest.approx((means["x"] + means["y"]) / 2)


def test_dynamic_sampling_judges_a_group_on_its_scored_responses() -> None:
    from logra_pl.train.shaping import Drawn, concat, dynamic_batch, mixed_groups

    nan = math.nan
    rewards = torch.tensor([1.0, nan, 0.0, 1.0, nan, 1.0, nan, nan, 0.5], dtype=torch.float64)
    groups = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    # Prompt 0: 1 vs 0 among the scored (mixed); prompt 1: 1 and 1 (uniform); prompt 2: one scored (never mixed).
    assert mixed_groups(rewards, groups) == [True, False, False]
    rollout = _rollout([0, 1, 2, 3])
    correct = torch.tensor([True, False, False, True])
    first = Drawn([{"id": "a"}, {"id": "b"}], rollout, torch.tensor([1.0, nan, 0.0, 1.0]), correct)
    first.rollout.prompt_index = [0, 0, 1, 1]
    picked = dynamic_batch(first, lambda j: first, 1, 1).batch  # "a" has one scored response: not mixed
    assert picked.items == [{"id": "b"}] and picked.correct.tolist() == [False, True]  # the verdicts travel along
    assert concat([first, first]).correct.tolist() == correct.tolist() * 2
