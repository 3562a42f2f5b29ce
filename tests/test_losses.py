"""Losses and baseline against algorithm.md §8, on a batch small enough to compute by hand."""

from __future__ import annotations

import math

import pytest
import torch

from logra_pl.losses import RunningBaseline, clip_fraction, length_weights, ppo_clip_loss, reinforce_tis_loss


def test_running_baseline_uses_previous_batches_only() -> None:
    b = RunningBaseline()
    adv = b.advantages(torch.tensor([1.0, 0.0, 0.5, 1.0]))
    # outcomes: 1, -0.01, -0.01 (0.5 < 1), 1; b was 0
    assert torch.allclose(adv, torch.tensor([1.0, -0.01, -0.01, 1.0], dtype=torch.float64))
    mean1 = (1 - 0.01 - 0.01 + 1) / 4
    assert math.isclose(b.value, 0.1 * mean1)
    adv2 = b.advantages(torch.tensor([0.0, 1.0]))
    assert torch.allclose(adv2, torch.tensor([-0.01 - 0.1 * mean1, 1.0 - 0.1 * mean1], dtype=torch.float64))
    assert math.isclose(b.value, 0.9 * 0.1 * mean1 + 0.1 * (1 - 0.01) / 2)
    plain = RunningBaseline(mode="reward")
    assert torch.allclose(plain.advantages(torch.tensor([0.5, 0.25])), torch.tensor([0.5, 0.25], dtype=torch.float64))
    restored = RunningBaseline()
    restored.load_state_dict(b.state_dict())
    assert restored.value == b.value
    with pytest.raises(ValueError, match=r"unknown baseline\.mode 'median'"):
        RunningBaseline(mode="median")


def test_reinforce_tis_matches_hand_computation() -> None:
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -3.0, 0.0]], requires_grad=True)
    logp_rollout = torch.tensor([[-1.5, -1.0, -0.5], [-0.2, -3.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([0.5, -1.0])
    loss = reinforce_tis_loss(logp, logp_rollout, adv, mask, num_tokens=5)
    # ratios: e^0.5=1.6487, e^-1=0.3679, 1 | 1, e^0.5=1.6487 ; capped at 2 (none here)
    r = [math.exp(0.5), math.exp(-1.0), 1.0, 1.0, math.exp(0.5)]
    terms = [-0.5 * r[0] * -1.0, -0.5 * r[1] * -2.0, -0.5 * r[2] * -0.5, 1.0 * r[3] * -0.2, 1.0 * r[4] * -3.0]
    assert math.isclose(float(loss.detach()), sum(terms) / 5, rel_tol=1e-6)
    loss.backward()
    # The ratio is detached: d loss / d logp = -A·ratio/num_tokens on valid tokens, 0 on padding.
    expected = torch.tensor([[-0.5 * r[0], -0.5 * r[1], -0.5 * r[2]], [1.0 * r[3], 1.0 * r[4], 0.0]]) / 5
    assert torch.allclose(logp.grad, expected, atol=1e-6)

    capped = reinforce_tis_loss(torch.tensor([[0.0]]), torch.tensor([[-5.0]]), torch.tensor([1.0]), torch.ones(1, 1), 1)
    assert math.isclose(float(capped), 0.0)  # log π = 0
    big = reinforce_tis_loss(torch.tensor([[-1.0]]), torch.tensor([[-5.0]]), torch.tensor([1.0]), torch.ones(1, 1), 1)
    assert math.isclose(float(big), 2.0)  # ratio e^4 capped at 2: −1·2·(−1)


def test_length_weights() -> None:
    w = length_weights(torch.tensor([4, 1024, 0]), 1024.0)
    assert torch.allclose(w, torch.tensor([256.0, 1.0, 1024.0]))
    assert torch.equal(length_weights(torch.tensor([3, 5]), None), torch.ones(2))


def test_ppo_clip() -> None:
    logp_old = torch.zeros(1, 4)
    # ratios 1.5 (above 1+ε), 0.5 (below 1−ε), 1.1 (inside), 1.5 with negative advantage
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 1.0]])).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    pos = ppo_clip_loss(logp, logp_old, torch.tensor([1.0]), mask, num_tokens=3)
    # A>0: min(r·A, clip(r)·A) = min(1.5, 1.2)=1.2 ; min(0.5, 0.8)=0.5 ; 1.1
    assert math.isclose(float(pos.detach()), -(1.2 + 0.5 + 1.1) / 3, rel_tol=1e-6)
    pos.backward()
    # Clipped tokens get no gradient; unclipped ones get −A·r/num_tokens.
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -0.5 / 3, -1.1 / 3, 0.0]]), atol=1e-6)
    neg = ppo_clip_loss(logp.detach(), logp_old, torch.tensor([-1.0]), mask, num_tokens=3)
    # A<0: min(−r, −clip(r)) = −1.5 ; min(−0.5, −0.8) = −0.8 ; −1.1
    assert math.isclose(float(neg), (1.5 + 0.8 + 1.1) / 3, rel_tol=1e-6)
    assert math.isclose(clip_fraction(logp.detach(), logp_old, mask), 2 / 3)


def test_group_and_leave_one_out_baselines() -> None:
    from logra_pl.losses import Baseline

    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    groups = [0, 0, 0, 1, 1, 1]
    outcome = torch.where(rewards >= 1, 1.0, -0.01).to(torch.float64)
    grp = Baseline(kind="group")
    adv = grp.advantages(rewards, groups=groups)
    # Written out: prompt 0 has outcomes (1, -0.01, -0.01), mean 0.96/3; prompt 1 all 1.
    expected = outcome - torch.tensor([0.98 / 3] * 3 + [1.0] * 3, dtype=torch.float64)
    assert torch.allclose(adv, expected, atol=1e-12)
    rloo = Baseline(kind="rloo").advantages(rewards, groups=groups)
    others = torch.tensor([-0.02 / 2, 0.99 / 2, 0.99 / 2, 1.0, 1.0, 1.0], dtype=torch.float64)
    assert torch.allclose(rloo, outcome - others, atol=1e-12)
    assert grp.value == pytest.approx(0.1 * float(outcome.mean()))  # b is tracked for logging either way
    with pytest.raises(ValueError, match="at least 2 responses per prompt"):
        Baseline(kind="rloo").advantages(rewards[:4], groups=[0, 0, 0, 1])


def test_a_new_loss_is_one_function_and_one_entry(tmp_path, rl_run) -> None:
    from logra_pl.losses import LOSSES, LossSpec, register_loss
    from logra_pl.module import LoGRAPolicyModule, LossConfig, RolloutSettings
    from logra_pl.sketch import LoGRAConfig

    calls = []

    def plain_reinforce(logp, logp_rollout, advantages, mask, num_tokens, weights, scale):
        calls.append(scale)
        return -(scale * advantages.unsqueeze(1) * logp * mask).sum() / num_tokens

    register_loss("plain_reinforce", LossSpec(plain_reinforce, "rollout", ("scale",)))
    try:
        module = LoGRAPolicyModule(
            policy="tiny",
            logra=LoGRAConfig(rank=16, update_ratio=1e-2),
            loss=LossConfig(kind="plain_reinforce", params={"scale": 0.5}),
            rollout=RolloutSettings(max_new_tokens=4),
            microbatch_size=4,
        )
        rl_run(module, tmp_path, 2)
        assert calls == [0.5] * 4  # 2 updates × 2 microbatches, with the configured hyper-parameter
        assert module.sketcher.num_applied == 2
        with pytest.raises(ValueError, match="needs the hyper-parameter 'scale'"):
            LossConfig(kind="plain_reinforce")
    finally:
        LOSSES.pop("plain_reinforce")
    with pytest.raises(ValueError, match=r"unknown loss\.kind 'nope'"):
        LossConfig(kind="nope")


def test_ppo_logs_its_clip_fraction(tmp_path, rl_run) -> None:
    from logra_pl.module import LoGRAPolicyModule, LossConfig, RolloutSettings
    from logra_pl.sketch import LoGRAConfig

    module = LoGRAPolicyModule(
        policy="tiny",
        logra=LoGRAConfig(rank=16, update_ratio=5e-2),
        loss=LossConfig(kind="ppo", clip_eps=0.01),
        rollout=RolloutSettings(max_new_tokens=4),
        microbatch_size=4,
    )
    rl_run(module, tmp_path, 4)
    ctx = module.step_context
    fraction = ctx.metrics["train/clip_fraction"]
    clipped, tokens = ctx.loss_stats["clip_fraction"]
    assert 0.0 < fraction < 1.0 and fraction == clipped / tokens  # later minibatches move past a tiny ε
