"""Batch shaping (logra_pl/train/shaping.py): DAPO's soft overlong punishment against its formula written out, the
dynamic-sampling selection against the rule stated in its docstring, the refill stream, and real runs: every trained
group mixed, the counts logged, the shaped reward kept out of the filter, and kill -9 + ``--ckpt_path last`` bit for
bit through the CLI."""

from __future__ import annotations

import signal
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from logra_pl.errors import ConfigError
from logra_pl.losses import GroupBaseline
from logra_pl.module import LoGRAPolicyModule
from logra_pl.rollout.base import Rollout
from logra_pl.sketch import LoGRAConfig
from logra_pl.train.settings import RolloutSettings
from logra_pl.train.shaping import Drawn, RefillStream, dynamic_batch, group_rows, mixed_groups, overlong_penalty
from tests.conftest import chain_sum_data, quick_trainer
from tests.helpers.verifiers import HalfUniform
from tests.runs.test_resume import _cli, _scalars


# ---------------------------------------------------------------------------------------------- overlong penalty
def _dapo_r_length(length: int, l_max: int, l_cache: int) -> float:
    """DAPO eq. 13, case by case."""
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


@pytest.mark.parametrize("buffer", [1, 4, 16])
def test_overlong_penalty_is_dapo_eq13(buffer: int) -> None:
    lengths = torch.arange(0, 21)
    got = overlong_penalty(lengths, max_new_tokens=16, buffer=buffer, factor=0.5)
    expected = [0.5 * _dapo_r_length(int(n), 16, buffer) for n in lengths]
    assert got.tolist() == pytest.approx(expected, abs=1e-12)
    assert overlong_penalty(lengths, 16, 0).abs().sum() == 0  # no buffer: off


def test_overlong_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"overlong_buffer=40 is longer than rollout\.max_new_tokens=32"):
        RolloutSettings(max_new_tokens=32, overlong_buffer=40)
    with pytest.raises(ConfigError, match="responses_per_prompt is 1"):
        RolloutSettings(dynamic_sampling=True)
    with pytest.raises(ConfigError, match="max_staleness"):
        RolloutSettings(responses_per_prompt=2, dynamic_sampling=True, max_staleness=1)
    with pytest.raises(ConfigError, match="max_sampling_rounds"):
        RolloutSettings(responses_per_prompt=2, dynamic_sampling=True, max_sampling_rounds=0)


# ------------------------------------------------------------------------------------------------- selection
def _drawn(tag: str, rewards: list[list[float]]) -> Drawn:
    """A round of ``len(rewards)`` prompts with the given rewards per response (responses name their group)."""
    items = [{"id": f"{tag}{p}"} for p in range(len(rewards))]
    rows = [(p, k) for p, rs in enumerate(rewards) for k in range(len(rs))]
    rollout = Rollout(
        prompt_ids=[[p] for p, _ in rows],
        response_ids=[[p, k] for p, k in rows],
        logprobs=[[-0.1, -0.2] for _ in rows],
        finish_reasons=["stop" for _ in rows],
        prompt_index=[p for p, _ in rows],
    )
    flat = torch.tensor([r for rs in rewards for r in rs], dtype=torch.float64)
    return Drawn(items, rollout, flat)


def test_mixed_groups_compare_raw_rewards() -> None:
    d = _drawn("a", [[1, 1, 1], [0, 0.5, 0], [0.2, 0.2, 0.2], [5.0]])
    assert group_rows(d.rollout) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert mixed_groups(d.rewards, group_rows(d.rollout)) == [False, True, False, False]


def test_dynamic_batch_keeps_the_first_mixed_groups_in_draw_order_and_stops_when_full() -> None:
    first = _drawn("a", [[1, 1], [0, 1], [0, 0], [1, 0]])  # mixed: a1, a3
    rounds = {1: _drawn("b", [[1, 0], [1, 1], [0, 1], [0, 0]]), 2: _drawn("c", [[0, 1]] * 4)}  # mixed: b0, b2
    asked = []

    def draw(i: int) -> Drawn:
        asked.append(i)
        return rounds[i]

    out = dynamic_batch(first, draw, target_groups=3, max_rounds=5)
    assert asked == [1]  # 2 mixed after round 0, 4 after round 1: enough
    assert [it["id"] for it in out.batch.items] == ["a1", "a3", "b0"]
    assert out.batch.rewards.tolist() == [0, 1, 1, 0, 1, 0]
    assert out.batch.rollout.prompt_index == [0, 0, 1, 1, 2, 2]
    assert out.batch.rollout.response_ids == [[1, 0], [1, 1], [3, 0], [3, 1], [0, 0], [0, 1]]
    m = out.metrics()
    assert (m["shaping/rounds"], m["shaping/groups_sampled"], m["shaping/groups_mixed"]) == (2, 8, 4)
    assert (m["shaping/groups_uniform"], m["shaping/filled_uniform"], m["shaping/uniform_rate"]) == (4, 0, 0.5)
    assert m["shaping/sampled_reward_mean"] == pytest.approx(8 / 16)


def test_dynamic_batch_short_after_the_last_round_is_completed_with_uniform_groups() -> None:
    first = _drawn("a", [[1, 1], [0, 1], [0, 0]])
    out = dynamic_batch(first, lambda i: _drawn(f"r{i}", [[1, 1], [0, 0], [1, 1]]), target_groups=3, max_rounds=2)
    assert [it["id"] for it in out.batch.items] == ["a1", "a0", "a2"]  # the mixed one, then uniform in draw order
    assert out.metrics()["shaping/filled_uniform"] == 2 and out.rounds == 2


def test_rounds_are_agreed_over_ranks() -> None:
    """A rank that is full keeps drawing while another rank is short (every rank draws the same rounds)."""
    first = _drawn("a", [[0, 1], [0, 1]])  # this rank: full at once
    draws = []

    def draw(i: int) -> Drawn:
        draws.append(i)
        return _drawn(f"r{i}", [[0, 1], [0, 1]])

    other_rank_short = iter([True, True, False])
    out = dynamic_batch(first, draw, 2, 9, any_short=lambda mine: mine or next(other_rank_short))
    assert draws == [1, 2] and [it["id"] for it in out.batch.items] == ["a0", "a1"]


def test_refill_stream_splits_global_batches_over_ranks_and_resumes() -> None:
    data = [{"id": i} for i in range(24)]
    one = RefillStream(data, 1, 0, 8, seed=7)
    ranks = [RefillStream(data, 2, r, 4, seed=7) for r in range(2)]
    for _ in range(5):  # crosses the epoch boundary (3 batches per epoch)
        whole = [it["id"] for it in one.next_items()]
        parts = [[it["id"] for it in r.next_items()] for r in ranks]
        assert sorted(whole) == sorted(parts[0] + parts[1]) and not set(parts[0]) & set(parts[1])
    again = RefillStream(data, 1, 0, 8, seed=7)
    again.load_state_dict(one.state_dict())
    assert [it["id"] for it in again.next_items()] == [it["id"] for it in one.next_items()]
    assert RefillStream(data, 1, 0, 8, seed=8).seed != one.seed


# ------------------------------------------------------------------------------------------------- real runs
class Trained(pl.Callback):
    """What every update trained on: its items, raw and shaped rewards, and its shaping counts."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        ctx = pl_module.step_context
        groups = group_rows(ctx.rollout)
        self.steps.append(
            {
                "groups": [[float(ctx.rewards[r]) for r in rows] for rows in groups],
                "shaped": ctx.shaped_rewards.clone(),
                "lengths": [len(r) for r in ctx.rollout.response_ids],
                "items": [ctx.items[ctx.rollout.prompt_index[rows[0]]] for rows in groups],
                "metrics": dict(ctx.metrics),
            }
        )


def test_every_trained_group_is_mixed_and_the_counts_are_logged(tmp_path: Path) -> None:
    record = Trained()
    rollout = RolloutSettings(
        responses_per_prompt=4, max_new_tokens=6, dynamic_sampling=True, max_sampling_rounds=4, overlong_buffer=3
    )
    module = LoGRAPolicyModule(
        logra=LoGRAConfig(rank=16, update_ratio=1e-2),
        rollout=rollout,
        baseline=GroupBaseline(),
        microbatch_size=16,
        verifier=HalfUniform(),
    )
    quick_trainer(tmp_path, 4, [record]).fit(module, datamodule=chain_sum_data(prompts_per_step=8))
    sampled = uniform = 0
    for step in record.steps:
        m = step["metrics"]
        assert len(step["groups"]) == 8 and m["shaping/filled_uniform"] == 0  # a full batch of mixed groups
        assert all(max(g) > min(g) for g in step["groups"]), step["groups"]
        assert not any(HalfUniform.uniform_prompt(it) for it in step["items"])
        assert m["shaping/rounds"] >= 2 and m["shaping/groups_sampled"] == 8 * m["shaping/rounds"]
        sampled, uniform = sampled + m["shaping/groups_sampled"], uniform + m["shaping/groups_uniform"]
        # the shaped reward (raw + DAPO's penalty) is what the advantages saw; the filter used the raw reward
        raw = torch.tensor([r for g in step["groups"] for r in g], dtype=torch.float64)
        penalty = torch.tensor([_dapo_r_length(n, 6, 3) for n in step["lengths"]], dtype=torch.float64)
        assert torch.allclose(step["shaped"], raw + penalty)
        assert m["shaping/overlong_penalty"] == pytest.approx(float(penalty.mean()))
    assert 0.35 < uniform / sampled < 0.75  # about half the groups were uniform (and dropped)


@pytest.mark.system
@pytest.mark.slow
def test_dynamic_sampling_kill9_then_resume_last_is_bitwise(tmp_path: Path) -> None:
    shaping = [
        "--model.rollout.responses_per_prompt=4",
        "--model.rollout.dynamic_sampling=true",
        "--model.rollout.max_sampling_rounds=3",
        "--model.baseline=group",
        "--model.verifier.class_path=tests.helpers.verifiers.HalfUniform",
        "--data.prompts_per_step=4",
        "--trainer.max_steps=6",
    ]
    straight = _cli(tmp_path / "straight", *shaping)
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = _cli(tmp_path / "killed", *shaping, kill_at=5)
    assert killed.returncode == -signal.SIGKILL
    run = tmp_path / "killed" / "tiny_cpu" / "version_0"
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 4 and saved["logra_pl"]["refill"]["position"] > 0
    resumed = _cli(tmp_path / "killed", *shaping, "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ref_run = tmp_path / "straight" / "tiny_cpu" / "version_0"
    mine = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    ref = torch.load(ref_run / "checkpoints" / "last.ckpt", weights_only=False)
    assert mine["global_step"] == ref["global_step"] == 6
    assert mine["logra_pl"]["refill"] == ref["logra_pl"]["refill"]
    for key, value in ref["state_dict"].items():
        assert torch.equal(mine["state_dict"][key], value), key
    for tag in ("train/reward_mean", "shaping/rounds", "shaping/groups_uniform", "shaping/groups_mixed"):
        assert _scalars(run, tag) == _scalars(ref_run, tag), tag
    assert sum(_scalars(ref_run, "shaping/groups_uniform").values()) > 0
