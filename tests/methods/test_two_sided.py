"""Dense AdamW with its moments in an inputs' and an outputs' side sketch of each matrix (``methods/two_sided.py``, a
diagnostic of the KL-matched grid): three steps against both sketches' Adam written out in float64, one side alone,
α and a veto, bad settings, and a real Trainer run under the protocol's step control."""

from __future__ import annotations

import pytest
import torch
from helpers.optim import (
    StepThrough,
    assert_alpha_scales_the_step,
    assert_moved_as_written,
    assert_step_taken,
    kl_controlled_run,
    lm_gradients,
)

from logra_pl.errors import ConfigError
from logra_pl.methods.adamw import AdamWConfig
from logra_pl.methods.guard import DivergenceGuard
from logra_pl.methods.projected import random_basis
from logra_pl.methods.two_sided import TwoSidedAdamW, TwoSidedConfig, side_seed
from logra_pl.models.load import load_policy

TARGETS = ["q_proj", "down_proj"]


def _method(rank_inputs: int, rank_outputs: int, **adamw) -> TwoSidedAdamW:
    config = AdamWConfig(lr=1e-3, warmup_steps=0, decay_steps=0, min_lr_ratio=1.0, **adamw)
    return TwoSidedAdamW(config, TwoSidedConfig(rank_inputs=rank_inputs, rank_outputs=rank_outputs, seed=1))


def _adam(m, v, g, t, b1, b2, eps):
    m = (1 - b1) * g if m is None else b1 * m + (1 - b1) * g
    v = (1 - b2) * g**2 if v is None else b2 * v + (1 - b2) * g**2
    return m, v, (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)


@pytest.mark.parametrize("ranks", [(6, 5), (6, 0), (0, 5)])
def test_three_steps_are_adam_on_both_sketches(tiny_model_dir, ranks: tuple[int, int]) -> None:
    """``S = G Pᵀ``, ``T = R G``, Adam's moments and bias corrections on each, ``ΔW = −lr·(Û_S P + Rᵀ Û_T)`` and
    decoupled weight decay on ``W``, in float64 here with the bases drawn as the method's seeds say; a side of rank 0
    is absent from the step."""
    policy, _ = load_policy(str(tiny_model_dir))
    lr, wd, (b1, b2), eps = 1e-3, 0.01, (0.9, 0.95), 1e-8
    method = _method(*ranks, weight_decay=wd)
    configured = method.configure_optimizers(policy, TARGETS, DivergenceGuard(max_update_ratio=1.0))
    opt, scheduler = StepThrough(configured["optimizer"]), configured["lr_scheduler"]["scheduler"]
    names = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert names and all(n.endswith(("q_proj.weight", "down_proj.weight")) for n in names)
    before = {n: p.detach().double().clone() for n, p in policy.named_parameters()}
    want: dict[str, torch.Tensor] = dict(before)
    moments: dict[tuple[str, str], tuple] = {}
    for t, seed in enumerate((0, 1, 2), start=1):
        grads = lm_gradients(policy, seed)
        step_sq = 0.0
        for index, n in enumerate(names):
            g = grads[n]
            delta = -lr * wd * want[n]
            if ranks[0]:
                p_in = random_basis(g.shape[1], ranks[0], side_seed(1, index, "inputs"))
                m, v, u = _adam(*moments.get((n, "in"), (None, None)), g @ p_in.T, t, b1, b2, eps)
                moments[(n, "in")] = (m, v)
                delta = delta - lr * u @ p_in
            if ranks[1]:
                r_out = random_basis(g.shape[0], ranks[1], side_seed(1, index, "outputs"))
                m, v, u = _adam(*moments.get((n, "out"), (None, None)), r_out @ g, t, b1, b2, eps)
                moments[(n, "out")] = (m, v)
                delta = delta - lr * r_out.T @ u
            want[n] = want[n] + delta
            step_sq += float(delta.square().sum())
        assert_step_taken(method, opt, scheduler, step_sq)
    assert_moved_as_written(policy, names, before, want)
    assert method.applied_updates == 3


def test_alpha_scales_the_step_and_a_veto_keeps_weights_and_moments(tiny_model_dir) -> None:
    policy, _ = load_policy(str(tiny_model_dir))
    method = _method(6, 5)
    configured = method.configure_optimizers(policy, TARGETS, DivergenceGuard(max_update_ratio=1.0))
    inner, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    trained = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    lm_gradients(policy, 0)
    assert_alpha_scales_the_step(method, inner, scheduler, trained)
    keys = ("exp_avg_inputs", "exp_avg_sq_inputs", "exp_avg_outputs", "exp_avg_sq_outputs")
    state = {p: [inner.state[p][k].clone() for k in keys] for p in trained.values()}

    def veto(optimizer) -> None:
        optimizer.proposal.skip("vetoed by the test")

    lm_gradients(policy, 1)
    w1 = {n: p.detach().clone() for n, p in trained.items()}
    result = method.step(StepThrough(inner, veto), scheduler, lambda x: x)
    assert result.rejected == "vetoed by the test" and result.update_norm == 0.0
    assert all(torch.equal(p.detach(), w1[n]) for n, p in trained.items())
    for p in trained.values():
        assert all(torch.equal(inner.state[p][k], s) for k, s in zip(keys, state[p], strict=True))
    assert method.applied_updates == 1


def test_bad_settings_are_named() -> None:
    with pytest.raises(ConfigError, match=r"sketches\.rank_inputs must be 0"):
        TwoSidedConfig(rank_inputs=-1)
    with pytest.raises(ConfigError, match="both 0"):
        TwoSidedConfig(rank_inputs=0, rank_outputs=0)
    with pytest.raises(ConfigError, match=r"adamw\.train_all: false"):
        TwoSidedAdamW(AdamWConfig(train_all=True))


def test_a_run_under_kl_control_keeps_the_engine_equal(tmp_path, rl_run) -> None:
    """Two updates in a real Trainer with the KL-matched protocol's step control (the probe's JVP along the two-sided
    step), the engine's weights equal to the policy's after them."""
    module = kl_controlled_run(_method(6, 5), TARGETS, tmp_path, rl_run)
    assert "rank-6 inputs' and a rank-5 outputs' sketch" in module.method.report(module.policy, module.targets)
