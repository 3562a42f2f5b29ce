"""Dense AdamW with its moments in a rotated basis (``methods/rotated.py``, a diagnostic of the KL-matched grid): the
rotation against the Kronecker product written out, two steps against Adam written out in the rotated basis here
(float64, the dense ``Q`` built with ``torch.kron``), and a controller's α and veto on its steps."""

from __future__ import annotations

import pytest
import torch
from helpers.optim import (
    StepThrough,
    assert_alpha_scales_the_step,
    assert_moved_as_written,
    kl_controlled_run,
    lm_gradients,
)

from logra_pl.errors import ConfigError
from logra_pl.methods.adamw import AdamWConfig
from logra_pl.methods.guard import DivergenceGuard
from logra_pl.methods.rotated import RotatedAdamW, RotationConfig, kron_factors, rotate_rows
from logra_pl.models.load import load_policy

TARGETS = ["q_proj", "down_proj"]


@pytest.mark.parametrize("d", [12, 64, 7])
def test_the_rotation_is_the_kronecker_product_written_out(d: int) -> None:
    """``rotate_rows(x) = x Qᵀ`` and its inverse ``x Q`` with ``Q = Q_a ⊗ Q_b`` orthogonal (a prime ``d``: one
    ``d × d`` factor); the same seed gives the same ``Q``."""
    qa, qb = kron_factors(d, seed=3)
    q = torch.kron(qa, qb)
    assert q.shape == (d, d)
    torch.testing.assert_close(q @ q.T, torch.eye(d, dtype=torch.float64), atol=1e-12, rtol=0)
    x = torch.randn(5, d, dtype=torch.float64)
    torch.testing.assert_close(rotate_rows(x, qa, qb), x @ q.T)
    torch.testing.assert_close(rotate_rows(x, qa, qb, inverse=True), x @ q)
    assert all(torch.equal(a, b) for a, b in zip(kron_factors(d, seed=3), (qa, qb), strict=True))
    if d == 64:
        assert qa.shape == qb.shape == (8, 8)


def _method(rotate: str, **adamw) -> RotatedAdamW:
    config = AdamWConfig(lr=1e-3, warmup_steps=0, decay_steps=0, min_lr_ratio=1.0, **adamw)
    return RotatedAdamW(config, RotationConfig(rotate=rotate, seed=1))


@pytest.mark.parametrize("rotate", ["inputs", "outputs"])
def test_two_steps_are_adam_in_the_rotated_basis(tiny_model_dir, rotate: str) -> None:
    """``G' = G Qᵀ`` (inputs) or ``Q G`` (outputs), Adam's moments and bias corrections on ``G'``, ``Δ'`` rotated
    back, decoupled weight decay on ``W``: two steps, float64 here; only the targets move; the norm is the step's."""
    policy, _ = load_policy(str(tiny_model_dir))
    lr, wd, (b1, b2), eps = 1e-3, 0.01, (0.9, 0.95), 1e-8
    method = _method(rotate, weight_decay=wd)
    configured = method.configure_optimizers(policy, TARGETS, DivergenceGuard(max_update_ratio=1.0))
    opt, scheduler = StepThrough(configured["optimizer"]), configured["lr_scheduler"]["scheduler"]
    trained = sorted(n for n, p in policy.named_parameters() if p.requires_grad)
    assert trained and all(n.endswith(("q_proj.weight", "down_proj.weight")) for n in trained)
    before = {n: p.detach().double().clone() for n, p in policy.named_parameters()}
    want, m, v = dict(before), {}, {}
    for t, seed in enumerate((0, 1), start=1):
        grads = lm_gradients(policy, seed)
        step_sq = 0.0
        for n in trained:
            g = grads[n]
            d = g.shape[1] if rotate == "inputs" else g.shape[0]
            q = torch.kron(*kron_factors(d, 1 * 1_000_003 + d))
            g_rot = g @ q.T if rotate == "inputs" else q @ g
            m[n] = (1 - b1) * g_rot if t == 1 else b1 * m[n] + (1 - b1) * g_rot
            v[n] = (1 - b2) * g_rot**2 if t == 1 else b2 * v[n] + (1 - b2) * g_rot**2
            step_rot = -lr / (1 - b1**t) * m[n] / ((v[n] / (1 - b2**t)).sqrt() + eps)
            delta = (step_rot @ q if rotate == "inputs" else q.T @ step_rot) - lr * wd * want[n]
            want[n] = want[n] + delta
            step_sq += float(delta.square().sum())
        result = method.step(opt, scheduler, lambda x: x)
        assert result.rejected is None
        assert result.update_norm == pytest.approx(step_sq**0.5, rel=1e-4)
    assert_moved_as_written(policy, trained, before, want)
    assert method.applied_updates == 2


def test_alpha_scales_the_step_and_a_veto_changes_nothing(tiny_model_dir) -> None:
    """α makes the step α·ΔW with the moments α-free (the preview is the step); a veto leaves weights and moments."""
    policy, _ = load_policy(str(tiny_model_dir))
    method = _method("inputs")
    configured = method.configure_optimizers(policy, TARGETS, DivergenceGuard(max_update_ratio=1.0))
    inner, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    trained = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    lm_gradients(policy, 0)
    assert_alpha_scales_the_step(method, inner, scheduler, trained)
    moments = {p: inner.state[p]["exp_avg"].clone() for p in trained.values()}
    lm_gradients(policy, 1)
    w1 = {n: p.detach().clone() for n, p in trained.items()}

    def veto(optimizer) -> None:
        optimizer.proposal.skip("vetoed by the test")

    result = method.step(StepThrough(inner, veto), scheduler, lambda x: x)
    assert result.rejected == "vetoed by the test" and result.update_norm == 0.0
    assert all(torch.equal(p.detach(), w1[n]) for n, p in trained.items())
    assert all(torch.equal(inner.state[p]["exp_avg"], moments[p]) for p in trained.values())
    assert method.applied_updates == 1


def test_bad_settings_are_named() -> None:
    with pytest.raises(ConfigError, match=r"rotation\.rotate must be one of"):
        RotationConfig(rotate="columns")
    with pytest.raises(ConfigError, match=r"adamw\.train_all: false"):
        RotatedAdamW(AdamWConfig(train_all=True))


def test_a_run_under_kl_control_keeps_the_engine_equal(tmp_path, rl_run) -> None:
    """Two updates in a real Trainer with the KL-matched protocol's step control (the probe's JVP along the rotated
    step), the engine's weights equal to the policy's after them."""
    module = kl_controlled_run(_method("outputs"), TARGETS, tmp_path, rl_run)
    assert "moments rotated on the matrices' outputs" in module.method.report(module.policy, module.targets)
