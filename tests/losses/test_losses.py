"""Losses and baselines against algorithm.md §8: by hand on small batches, and bit for bit against the arithmetic of
the function-and-registry layout they replace (written out here, so a change to the objects cannot pass unnoticed)."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

from logra_pl.errors import ConfigError
from logra_pl.losses import (
    AdvantageBaseline,
    Baseline,
    GroupBaseline,
    Loss,
    PPOClip,
    ReinforceTIS,
    RLOOBaseline,
    RunningBaseline,
    SpecLoss,
    build_baseline,
    build_loss,
    clip_fraction,
    length_weights,
    ppo_clip_loss,
    reinforce_tis_loss,
)
from logra_pl.train.settings import LossConfig

# ----------------------------------------------------------------------------------- the pinned arithmetic
# The loss, plan and baseline formulas of the previous layout (module.py / losses.py at 4964d0a), written out. The
# reference runs' digests depend on these exact floating-point operations, in this order.


def pinned_reinforce_tis(logp, logp_rollout, advantages, mask, num_tokens, weights, tis_cap):
    ratio = torch.exp(logp.detach() - logp_rollout).clamp(max=tis_cap)
    per_seq = advantages.to(logp.dtype) * (weights.to(logp.dtype) if weights is not None else 1.0)
    per_token = -per_seq.unsqueeze(1) * ratio * logp
    return (per_token * mask).sum() / num_tokens


def pinned_ppo(logp, logp_old, advantages, mask, num_tokens, weights, clip_eps):
    ratio = torch.exp(logp - logp_old)
    adv = (advantages.to(logp.dtype) * (weights.to(logp.dtype) if weights is not None else 1.0)).unsqueeze(1)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv)
    return -(surrogate * mask).sum() / num_tokens


def pinned_clip_counts(logp, logp_old, mask, clip_eps):
    ratio = torch.exp(logp.detach() - logp_old)
    outside = ((ratio < 1 - clip_eps) | (ratio > 1 + clip_eps)) & mask.bool()
    return float(outside.sum()), float(mask.sum())


def pinned_length_weights(lengths, reference):
    if reference is None:
        return torch.ones_like(lengths, dtype=torch.float32)
    return reference / lengths.clamp(min=1).to(torch.float32)


def pinned_plan(rows: int, seed: int, epochs: int, minibatches: int, trainer_reference: bool) -> list[list[int]]:
    """``LoGRAPolicyModule.training_step``'s plan at 4964d0a, with ``seed = _sampling_seed("ppo")``."""
    rows_list = list(range(rows))
    if not trainer_reference:
        return [rows_list]
    gen = torch.Generator().manual_seed(seed)
    plan = []
    for _ in range(epochs):
        perm = torch.randperm(len(rows_list), generator=gen).tolist()
        size = math.ceil(len(rows_list) / minibatches)
        plan += [perm[i : i + size] for i in range(0, len(perm), size)]
    return plan


def _batch(seed: int, dtype: torch.dtype, rows: int = 6, width: int = 9):
    """Random log-probs (some ratios far outside any clip), advantages of both signs, ragged masks, lengths."""
    g = torch.Generator().manual_seed(seed)
    logp = (-3 * torch.rand(rows, width, generator=g)).to(dtype)
    ref = logp.detach() + (2 * torch.rand(rows, width, generator=g) - 1).to(dtype)  # ratios in [e^-1, e]
    adv = torch.randn(rows, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, width + 1, (rows,), generator=g)
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).to(dtype)
    return logp, ref, adv, mask, lengths


def _loss_and_grad(fn, logp, *args):
    leaf = logp.clone().requires_grad_(True)
    loss = fn(leaf, *args)
    loss.backward()
    return loss.detach(), leaf.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("length_reference", [None, 1024.0])
@pytest.mark.parametrize("tis_cap", [2.0, 1.3])
def test_reinforce_tis_object_is_the_pinned_arithmetic_bit_for_bit(dtype, length_reference, tis_cap) -> None:
    loss_fn = ReinforceTIS(tis_cap=tis_cap, length_reference=length_reference)
    assert loss_fn.reference == "rollout"
    for seed in range(4):
        logp, ref, adv, mask, lengths = _batch(seed, dtype)
        weights = loss_fn.weights(lengths)
        assert torch.equal(weights, pinned_length_weights(lengths, length_reference))
        num_tokens = max(int(mask.sum()) + 3, 1)  # the update's count: more than this microbatch holds
        got = _loss_and_grad(loss_fn, logp, ref, adv, mask, num_tokens, weights)
        want = _loss_and_grad(pinned_reinforce_tis, logp, ref, adv, mask, num_tokens, weights, tis_cap)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert loss_fn.stats(logp, ref, mask) == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("length_reference", [None, 1024.0])
@pytest.mark.parametrize("clip_eps", [0.2, 0.05])
def test_ppo_object_is_the_pinned_arithmetic_bit_for_bit(dtype, length_reference, clip_eps) -> None:
    loss_fn = PPOClip(clip_eps=clip_eps, length_reference=length_reference)
    assert loss_fn.reference == "trainer"
    for seed in range(4):
        logp, ref, adv, mask, lengths = _batch(seed, dtype)
        weights = loss_fn.weights(lengths)
        assert torch.equal(weights, pinned_length_weights(lengths, length_reference))
        num_tokens = max(int(mask.sum()), 1)
        got = _loss_and_grad(loss_fn, logp, ref, adv, mask, num_tokens, weights)
        want = _loss_and_grad(pinned_ppo, logp, ref, adv, mask, num_tokens, weights, clip_eps)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        stats = loss_fn.stats(logp, ref, mask)
        assert stats == {"clip_fraction": pinned_clip_counts(logp, ref, mask, clip_eps)}
        assert 0 < stats["clip_fraction"][0] <= stats["clip_fraction"][1]  # the batch does clip tokens


@pytest.mark.parametrize("rows", [1, 7, 8, 64, 129])
@pytest.mark.parametrize(("epochs", "minibatches"), [(2, 2), (1, 1), (3, 4), (2, 5)])
def test_plans_are_the_pinned_plans(rows: int, epochs: int, minibatches: int) -> None:
    for seed in (0, 12345, 2**40 + 7):  # _sampling_seed gives 48-bit seeds
        ppo = PPOClip(epochs=epochs, minibatches=minibatches).plan(rows, seed)
        assert ppo == pinned_plan(rows, seed, epochs, minibatches, trainer_reference=True)
        assert ReinforceTIS().plan(rows, seed) == pinned_plan(rows, seed, epochs, minibatches, trainer_reference=False)
    # Each epoch covers every row once, in parts of ceil(rows / minibatches).
    plan, size = PPOClip(epochs=epochs, minibatches=minibatches).plan(rows, 3), math.ceil(rows / minibatches)
    parts = len(range(0, rows, size))
    assert len(plan) == epochs * parts
    for e in range(epochs):
        epoch = plan[e * parts : (e + 1) * parts]
        assert sorted(r for part in epoch for r in part) == list(range(rows))
        assert all(len(part) == size for part in epoch[:-1])


# -------------------------------------------------------------------------------------------- by hand
def test_reinforce_tis_matches_hand_computation() -> None:
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -3.0, 0.0]], requires_grad=True)
    logp_rollout = torch.tensor([[-1.5, -1.0, -0.5], [-0.2, -3.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([0.5, -1.0])
    loss = ReinforceTIS()(logp, logp_rollout, adv, mask, num_tokens=5)
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
    big = ReinforceTIS()(torch.tensor([[-1.0]]), torch.tensor([[-5.0]]), torch.tensor([1.0]), torch.ones(1, 1), 1)
    assert math.isclose(float(big), 2.0)  # ratio e^4 capped at 2: −1·2·(−1)


def test_length_weights() -> None:
    w = length_weights(torch.tensor([4, 1024, 0]), 1024.0)
    assert torch.allclose(w, torch.tensor([256.0, 1.0, 1024.0]))
    assert torch.equal(length_weights(torch.tensor([3, 5]), None), torch.ones(2))
    assert torch.equal(PPOClip(length_reference=1024.0).weights(torch.tensor([4, 1024, 0])), w)


def test_ppo_clip() -> None:
    logp_old = torch.zeros(1, 4)
    # ratios 1.5 (above 1+ε), 0.5 (below 1−ε), 1.1 (inside), 1.5 with negative advantage
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 1.0]])).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    pos = PPOClip()(logp, logp_old, torch.tensor([1.0]), mask, num_tokens=3)
    # A>0: min(r·A, clip(r)·A) = min(1.5, 1.2)=1.2 ; min(0.5, 0.8)=0.5 ; 1.1
    assert math.isclose(float(pos.detach()), -(1.2 + 0.5 + 1.1) / 3, rel_tol=1e-6)
    pos.backward()
    # Clipped tokens get no gradient; unclipped ones get −A·r/num_tokens.
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -0.5 / 3, -1.1 / 3, 0.0]]), atol=1e-6)
    neg = ppo_clip_loss(logp.detach(), logp_old, torch.tensor([-1.0]), mask, num_tokens=3)
    # A<0: min(−r, −clip(r)) = −1.5 ; min(−0.5, −0.8) = −0.8 ; −1.1
    assert math.isclose(float(neg), (1.5 + 0.8 + 1.1) / 3, rel_tol=1e-6)
    assert math.isclose(clip_fraction(logp.detach(), logp_old, mask), 2 / 3)
    assert PPOClip().stats(logp.detach(), logp_old, mask) == {"clip_fraction": (2.0, 3.0)}


# ---------------------------------------------------------------------------------------------- baselines
def test_running_baseline_uses_previous_batches_only() -> None:
    b = RunningBaseline()
    assert not b.needs_groups
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
    assert restored.value == b.value and b.state_dict() == {"value": b.value}
    with pytest.raises(ValueError, match=r"unknown baseline\.mode 'median'"):
        RunningBaseline(mode="median")
    with pytest.raises(ConfigError, match=r"baseline\.momentum must lie in \[0, 1\), got 1"):
        RunningBaseline(momentum=1)


def test_group_and_leave_one_out_baselines() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    groups = [0, 0, 0, 1, 1, 1]
    outcome = torch.where(rewards >= 1, 1.0, -0.01).to(torch.float64)
    grp = GroupBaseline()
    assert grp.needs_groups and RLOOBaseline.needs_groups
    adv = grp.advantages(rewards, groups=groups)
    # Written out: prompt 0 has outcomes (1, -0.01, -0.01), mean 0.98/3; prompt 1 all 1.
    expected = outcome - torch.tensor([0.98 / 3] * 3 + [1.0] * 3, dtype=torch.float64)
    assert torch.allclose(adv, expected, atol=1e-12)
    rloo = RLOOBaseline().advantages(rewards, groups=groups)
    others = torch.tensor([-0.02 / 2, 0.99 / 2, 0.99 / 2, 1.0, 1.0, 1.0], dtype=torch.float64)
    assert torch.allclose(rloo, outcome - others, atol=1e-12)
    assert grp.value == pytest.approx(0.1 * float(outcome.mean()))  # b is tracked for logging either way
    with pytest.raises(ValueError, match="at least 2 responses per prompt"):
        RLOOBaseline().advantages(rewards[:4], groups=[0, 0, 0, 1])


@pytest.mark.parametrize("kind", ["running", "group", "rloo"])
def test_baselines_are_the_pinned_arithmetic_bit_for_bit(kind: str) -> None:
    """Advantages and every ``b`` over several batches equal the formulas of the ``Baseline(kind=...)`` layout."""
    g = torch.Generator().manual_seed(1)
    new = build_baseline(kind)
    with pytest.warns(DeprecationWarning, match="Baseline\\(kind=...\\) is deprecated"):
        old = Baseline(kind=kind)
    b, reduced = 0.0, []

    def all_reduce_sum(stats: torch.Tensor) -> torch.Tensor:  # a second rank contributing fixed numbers
        reduced.append(stats.clone())
        return stats + torch.tensor([1.5, 4.0], dtype=torch.float64)

    for _ in range(5):
        rewards = torch.rand(8, generator=g, dtype=torch.float64).round()
        groups = [0, 0, 1, 1, 2, 2, 3, 3]
        outcome = torch.where(rewards >= 1.0, 1.0, -0.01).to(torch.float64)
        if kind == "running":
            want = outcome - b
        else:
            g_ = torch.tensor(groups)
            sums = torch.zeros(4, dtype=torch.float64).index_add_(0, g_, outcome)
            counts = torch.zeros(4, dtype=torch.float64).index_add_(0, g_, torch.ones_like(outcome))
            ref = sums[g_] / counts[g_] if kind == "group" else (sums[g_] - outcome) / (counts[g_] - 1)
            want = outcome - ref
        stats = torch.tensor([float(outcome.sum()), float(outcome.numel())], dtype=torch.float64) + torch.tensor(
            [1.5, 4.0], dtype=torch.float64
        )
        b = 0.9 * b + (1.0 - 0.9) * float(stats[0] / stats[1])
        got = new.advantages(rewards, all_reduce_sum, groups=groups)
        assert torch.equal(got, want) and new.value == b
        assert torch.equal(old.advantages(rewards, all_reduce_sum, groups=groups), want) and old.value == b


# -------------------------------------------------------------------------------------- building them
def test_build_loss_accepts_every_form() -> None:
    assert isinstance(build_loss(None), ReinforceTIS)
    for text in ("ppo", "PPOClip", "logra_pl.losses.PPOClip", " ppo "):
        assert build_loss(text).to_config() == PPOClip().to_config()
    assert build_loss("reinforce_tis").to_config() == ReinforceTIS().to_config()
    mapping = {"class_path": "logra_pl.losses.PPOClip", "init_args": {"clip_eps": 0.1, "epochs": 3}}
    built = build_loss(mapping)
    assert isinstance(built, PPOClip) and (built.clip_eps, built.epochs, built.minibatches) == (0.1, 3, 2)
    assert build_loss("{class_path: PPOClip, init_args: {clip_eps: 0.1, epochs: 3}}").to_config() == built.to_config()
    same = PPOClip(minibatches=4)
    assert build_loss(same) is same
    # The settings every loss shares (issue 25) follow its own, at their defaults; repr leaves those out.
    shared = {"aggregation": "token_mean", "aggregation_length": None, "mask_truncated": False, "kl_coef": 0.0}
    shared |= {"kl_estimator": "k3", "reference_device": "cpu", "reference_dtype": None}
    assert built.to_config() == {
        "class_path": "logra_pl.losses.PPOClip",
        "init_args": {"clip_eps": 0.1, "epochs": 3, "minibatches": 2, "length_reference": None}
        | {"eps_low": None, "eps_high": None}
        | shared,
    }
    assert repr(built) == "PPOClip(clip_eps=0.1, epochs=3, minibatches=2, length_reference=None)"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("nope", r"unknown model\.loss 'nope': use one of 'reinforce_tis', 'ppo'"),
        ({"class_path": "PPOClip", "init_args": {"nope": 1}}, r"PPOClip does not take 'nope'; its arguments are clip"),
        ("{class_path: PPOClip, init_args: {nope: 1}}", r"PPOClip does not take 'nope'"),
        ({"clip_eps": 0.3}, r"gives arguments but no class_path\. A short name takes none: .*--model\.loss CLASS "),
        ({"kind": "ppo", "clip_eps": 0.3}, r"gives arguments but no class_path"),  # old sections: read at parse time
        ("logra_pl.losses.NoSuch", r"model\.loss 'logra_pl\.losses\.NoSuch': cannot import it"),
        ("logra_pl.losses.length_weights", r"length_weights is not a loss: it lacks plan, stats, weights"),
        (PPOClip, r"is a class, not an instance"),
    ],
)
def test_build_loss_refusals_say_what_to_write(value, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_loss(value)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ReinforceTIS(tis_cap=0), r"loss\.tis_cap must lie in \(0, inf\), got 0"),
        (lambda: ReinforceTIS(length_reference=-1.0), r"loss\.length_reference must lie in \(0, inf\)"),
        (lambda: PPOClip(clip_eps=1.0), r"loss\.clip_eps must lie in \(0, 1\), got 1"),
        (lambda: PPOClip(epochs=0), r"loss\.epochs must be an integer >= 1, got 0"),
        (lambda: PPOClip(minibatches=1.5), r"loss\.minibatches must be an integer, got 1\.5"),
        (lambda: RLOOBaseline(failure_value=float("nan")), r"baseline\.failure_value must be a finite number"),
    ],
)
def test_arguments_are_checked_at_construction(build, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build()


def test_build_baseline_accepts_every_form() -> None:
    assert isinstance(build_baseline(None), RunningBaseline)
    assert type(build_baseline("rloo")) is RLOOBaseline and type(build_baseline("GroupBaseline")) is GroupBaseline
    built = build_baseline({"class_path": "logra_pl.losses.RunningBaseline", "init_args": {"mode": "reward"}})
    assert built.mode == "reward" and built.value == 0.0
    with pytest.warns(DeprecationWarning):
        legacy = Baseline(kind="group", momentum=0.5, value=0.25)
    converted = build_baseline(legacy)
    assert type(converted) is GroupBaseline and converted.momentum == 0.5 and converted.value == 0.25
    assert legacy.to_config() == converted.to_config()  # `value` is state, not a setting
    with pytest.raises(ConfigError, match=r"gives arguments but no class_path"):
        build_baseline({"momentum": 0.5})  # no kind: arguments after a short name, most likely
    with pytest.raises(ConfigError, match=r"unknown model\.baseline 'median'"):
        build_baseline("median")
    with pytest.raises(ConfigError, match=r"is not a baseline: it lacks advantages"):
        build_baseline("logra_pl.losses.length_weights")


def test_the_old_sections_are_read_with_their_class_path_form() -> None:
    """``{kind: ..., <arguments>}``: old configs, and the hyper-parameters of old CLI checkpoints, translated where they
    are read (the CLI's YAML loader, resume comparisons, ``load_from_checkpoint``: ``logra_pl/_graveyard``)."""
    from logra_pl._graveyard.losses import translate_section

    message = r"model\.loss \{kind: ppo, \.\.\.\} is the deprecated form .* read as loss: \{class_path: .*PPOClip, "
    with pytest.warns(FutureWarning, match=message):
        section = translate_section(
            {"kind": "ppo", "clip_eps": 0.3, "ppo_epochs": 3, "tis_cap": 2.0, "params": {}}, "loss", "model.loss"
        )
    assert build_loss(section).to_config() == PPOClip(clip_eps=0.3, epochs=3).to_config()
    with pytest.warns(FutureWarning, match=r"read as baseline: \{class_path: logra_pl\.losses\.RLOOBaseline, "):
        section = translate_section({"kind": "rloo", "momentum": 0.5, "value": 0.25}, "baseline", "model.baseline")
    rloo = build_baseline(section)
    assert type(rloo) is RLOOBaseline and rloo.momentum == 0.5 and rloo.value == 0.0  # the value is state: restored
    with pytest.raises(ConfigError, match=r"unexpected keyword argument 'nope'"):
        translate_section({"kind": "ppo", "nope": 1}, "loss", "model.loss")
    with pytest.raises(ConfigError, match=r"loss\.clip_eps must lie in \(0, 1\), got 0"), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        translate_section({"kind": "ppo", "clip_eps": 0}, "loss", "model.loss")


def test_loss_config_is_a_deprecated_adapter_to_the_objects() -> None:
    """``LossConfig`` (old checkpoints pickle it) builds the object of its kind, with the same plan and arithmetic."""
    with pytest.warns(DeprecationWarning, match="LossConfig is deprecated"):
        ppo = LossConfig(kind="ppo", clip_eps=0.1, ppo_epochs=3, ppo_minibatches=4, length_reference=512.0)
    built = build_loss(ppo)
    assert built.to_config() == PPOClip(clip_eps=0.1, epochs=3, minibatches=4, length_reference=512.0).to_config()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        tis = build_loss(LossConfig(tis_cap=1.5))
    assert tis.to_config() == ReinforceTIS(tis_cap=1.5).to_config()
    assert build_loss(ppo).plan(10, 99) == pinned_plan(10, 99, 3, 4, trainer_reference=True)
    assert built.reference == "trainer"


# ------------------------------------------------------------------------------------------- in the module
def _tiny(**overrides):
    from logra_pl.module import LoGRAPolicyModule, RolloutSettings
    from logra_pl.sketch import LoGRAConfig

    settings = dict(
        policy="tiny",
        logra=LoGRAConfig(rank=16, update_ratio=1e-2),
        rollout=RolloutSettings(max_new_tokens=4),
        microbatch_size=4,
    )
    return LoGRAPolicyModule(**(settings | overrides))


def test_group_baselines_need_several_responses_per_prompt() -> None:
    from logra_pl.module import RolloutSettings

    with pytest.raises(ConfigError, match=r"baseline RLOOBaseline compares a prompt's responses with each other"):
        _tiny(baseline="rloo")
    assert isinstance(_tiny(baseline="group", rollout=RolloutSettings(responses_per_prompt=2)).baseline, GroupBaseline)


class HalfAndHalf(Loss):
    """A loss of its own: plain REINFORCE (``−A·w·log π``), two updates per rollout (each half of the rows), and the
    mean log-prob as a statistic."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale
        self.calls: list[int] = []

    def plan(self, rows: int, generator_seed: int) -> list[list[int]]:
        return [list(range(0, rows, 2)), list(range(1, rows, 2))]

    def __call__(self, logp, ref_logp, advantages, mask, num_tokens, weights=None):
        self.calls.append(logp.shape[0])
        return -(self.scale * (advantages * weights).to(logp.dtype).unsqueeze(1) * logp * mask).sum() / num_tokens

    def stats(self, logp, ref_logp, mask):
        return {"mean_logp": (float((logp * mask).sum()), float(mask.sum()))}


def test_a_loss_of_your_own_brings_its_plan_and_stats(tmp_path, rl_run) -> None:
    loss = HalfAndHalf(scale=0.5)
    module = _tiny(loss=loss)
    assert module.loss_config is loss
    rl_run(module, tmp_path, 4)  # 2 rollouts of 8 prompts, 2 updates each
    assert module.global_step == 4 and module.method.sketcher.num_applied == 4
    assert loss.calls == [4] * 4  # 4 rows per update (one microbatch of 4)
    total, tokens = module.step_context.loss_stats["mean_logp"]
    assert tokens > 0 and module.step_context.metrics["train/mean_logp"] == total / tokens < 0


def test_the_deprecated_registry_still_trains(tmp_path, rl_run) -> None:
    from logra_pl.losses import LOSSES, LossSpec, register_loss

    calls = []

    def plain_reinforce(logp, logp_rollout, advantages, mask, num_tokens, weights, scale):
        calls.append(scale)
        return -(scale * advantages.unsqueeze(1) * logp * mask).sum() / num_tokens

    with pytest.warns(DeprecationWarning, match="register_loss/LossSpec are deprecated"):
        register_loss("plain_reinforce", LossSpec(plain_reinforce, "rollout", ("scale",)))
    try:
        with pytest.warns(DeprecationWarning):
            config = LossConfig(kind="plain_reinforce", params={"scale": 0.5})
        module = _tiny(loss=config)
        assert isinstance(module.loss_config, SpecLoss)
        rl_run(module, tmp_path, 2)
        assert calls == [0.5] * 4  # 2 updates × 2 microbatches, with the configured hyper-parameter
        assert module.method.sketcher.num_applied == 2
        # The YAML form of a registered loss while it is being ported: SpecLoss names it, with its parameters.
        spec_loss = {"class_path": "logra_pl.losses.SpecLoss", "init_args": {"spec": "plain_reinforce"}}
        spec_loss["init_args"]["params"] = {"scale": 1.0}
        assert build_loss(spec_loss).reference == "rollout" and build_loss(spec_loss).hyper_parameters() == {"scale": 1}
        with pytest.raises(ConfigError, match="needs the hyper-parameter 'scale'"):
            build_loss("plain_reinforce")  # a registered name is a short name, with no parameters
        with pytest.raises(ValueError, match="needs the hyper-parameter 'scale'"):
            LossConfig(kind="plain_reinforce")
    finally:
        LOSSES.pop("plain_reinforce")
        Loss.registry.names.pop("plain_reinforce")
    with pytest.raises(ValueError, match=r"unknown loss\.kind 'nope'"):
        LossConfig(kind="nope")


def test_ppo_logs_its_clip_fraction(tmp_path, rl_run) -> None:
    from logra_pl.sketch import LoGRAConfig

    module = _tiny(logra=LoGRAConfig(rank=16, update_ratio=5e-2), loss=PPOClip(clip_eps=0.01))
    rl_run(module, tmp_path, 4)
    ctx = module.step_context
    fraction = ctx.metrics["train/clip_fraction"]
    clipped, tokens = ctx.loss_stats["clip_fraction"]
    assert 0.0 < fraction < 1.0 and fraction == clipped / tokens  # later minibatches move past a tiny ε


def test_checkpoints_of_the_old_layout_load_and_resume(tmp_path, rl_run) -> None:
    """A checkpoint written before losses were objects: its hyper-parameters pickle ``LossConfig`` and
    ``Baseline`` and its settings hold the old ``{kind: ...}`` sections. It loads, restores ``b``, resumes under the
    equivalent new settings, and is refused (naming the class) under another loss."""
    from logra_pl.errors import ResumeMismatchError
    from logra_pl.module import LoGRAPolicyModule
    from logra_pl.runs import resume

    instantiator = "lightning.pytorch.cli.instantiate_module"  # how the CLI has Lightning rebuild its modules

    first = _tiny()
    rl_run(first, tmp_path, 2)
    ckpt = tmp_path / "new.ckpt"
    first.trainer.save_checkpoint(ckpt)
    raw = torch.load(ckpt, weights_only=False)
    b = raw["logra_pl"]["baseline"]["value"]
    assert b != 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        raw["hyper_parameters"]["loss"] = LossConfig()
        raw["hyper_parameters"]["baseline"] = Baseline(value=b)
    settings = raw["logra_pl"]["settings"]
    settings["loss"] = {"kind": "reinforce_tis", "tis_cap": 2.0, "clip_eps": 0.2, "ppo_epochs": 2}
    settings["loss"] |= {"ppo_minibatches": 2, "length_reference": None, "params": {}}
    settings["baseline"] = {"kind": "running", "momentum": 0.9, "mode": "outcome", "success_threshold": 1.0}
    settings["baseline"] |= {"success_value": 1.0, "failure_value": -0.01, "value": b}
    old = tmp_path / "old.ckpt"
    torch.save(raw, old)

    loaded = LoGRAPolicyModule.load_from_checkpoint(old, weights_only=False)
    assert isinstance(loaded.loss_config, ReinforceTIS) and type(loaded.baseline) is RunningBaseline
    assert loaded.baseline.value == b
    # The CLI's checkpoints hold the config's sections as plain data, which load_from_checkpoint parses again with
    # the current type hints: the old sections are read (with a FutureWarning naming their class_path form).
    cli_style = dict(raw, hyper_parameters=resume.plain(raw["hyper_parameters"]) | {"_instantiator": instantiator})
    cli_style["hyper_parameters"] |= {"loss": settings["loss"], "baseline": settings["baseline"]}
    torch.save(cli_style, tmp_path / "old_cli.ckpt")
    with pytest.warns(FutureWarning, match=r"model\.baseline \{kind: running, \.\.\.\} is the deprecated form"):
        loaded = LoGRAPolicyModule.load_from_checkpoint(tmp_path / "old_cli.ckpt", weights_only=False)
    assert isinstance(loaded.loss_config, ReinforceTIS) and loaded.baseline.value == b

    resumed = _tiny(loss="reinforce_tis", baseline=RunningBaseline())
    rl_run(resumed, tmp_path, 3, ckpt_path=old)
    assert resumed.global_step == 3
    with pytest.raises(ResumeMismatchError, match=r"model\.loss\.class_path: checkpoint 'logra_pl\.losses\.ReinforceT"):
        rl_run(_tiny(loss="ppo"), tmp_path, 3, ckpt_path=old)


def test_a_new_baseline_subclass_needs_only_compare_to() -> None:
    class Median(AdvantageBaseline):
        def compare_to(self, outcome, groups):
            return outcome.median()

    adv = build_baseline(Median()).advantages(torch.tensor([1.0, 0.0, 1.0]))
    assert torch.allclose(adv, torch.tensor([0.0, -1.01, 0.0], dtype=torch.float64))


def test_the_cli_reads_old_sections_that_name_their_kind_and_refuses_the_others(tmp_path, monkeypatch, capsys) -> None:
    import yaml

    from logra_pl.cli import LoGRACLI

    monkeypatch.setattr("sys.argv", ["logra-pl"])
    base = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"
    config = yaml.safe_load(base.read_text())
    config["model"]["loss"] = {"kind": "ppo", "clip_eps": 0.3}  # the old section form, as configs wrote it
    config["model"]["baseline"] = {"kind": "rloo", "momentum": 0.5}
    config["model"]["rollout"]["responses_per_prompt"] = 2
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(config))
    with pytest.warns(FutureWarning, match="is the deprecated form"):
        cli = LoGRACLI(args=["--config", str(old)], run=False)
    assert repr(cli.model.loss_config) == "PPOClip(clip_eps=0.3, epochs=2, minibatches=2, length_reference=None)"
    assert type(cli.model.baseline) is RLOOBaseline and cli.model.baseline.momentum == 0.5
    # Without a kind, the section is refused (not the abstract base class built, not the old default assumed): so
    # are arguments given after a short name, which would otherwise be dropped. Both are parse errors: a short message.
    config["model"]["baseline"] = {"momentum": 0.9, "mode": "outcome", "failure_value": -0.01}
    old.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit):
        LoGRACLI(args=["--config", str(old)], run=False)
    assert "model.baseline gives arguments but no class_path" in capsys.readouterr().err
    flags = ["--model.baseline=rloo", "--model.baseline.momentum=0.5", "--model.rollout.responses_per_prompt=2"]
    with pytest.raises(SystemExit):
        LoGRACLI(args=["--config", str(base), *flags], run=False)
    assert "a short name (rloo) takes no arguments: name the class instead" in capsys.readouterr().err
    flags[0] = "--model.baseline=RLOOBaseline"  # the class's own name takes them
    assert LoGRACLI(args=["--config", str(base), *flags], run=False).model.baseline.momentum == 0.5
    with pytest.raises(TypeError, match="abstract"):
        Loss()
    with pytest.raises(TypeError, match="abstract"):
        AdvantageBaseline()
