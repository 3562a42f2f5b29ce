"""Dense AdamW with its step in a rank-``r`` subspace of each matrix's outputs (``methods/projected.py``, a diagnostic
of the KL-matched grid): the gradient basis against an eigendecomposition of ``G Gᵀ`` written here, three steps
across a refresh against Adam written out in float64 with the moments carried, a controller's α and veto, and a real
Trainer run whose engine stays equal to the policy."""

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
from logra_pl.methods.projected import ProjectedAdamW, ProjectionConfig, gradient_basis, random_basis
from logra_pl.models.load import load_policy

TARGETS = ["q_proj", "down_proj"]
RANK = 8


def _top_output_directions(g: torch.Tensor, rank: int) -> torch.Tensor:
    """The top-``rank`` eigenvectors of ``G Gᵀ`` as rows (its eigenvalues are ``G``'s squared singular values)."""
    values, vectors = torch.linalg.eigh(g @ g.T)
    return vectors[:, values.argsort(descending=True)[:rank]].T


def test_the_bases_are_orthonormal_and_the_gradient_one_spans_its_top_directions() -> None:
    g = torch.randn(40, 30, dtype=torch.float64)
    for q in (random_basis(40, 6, seed=2), gradient_basis(g, 6)):
        assert q.shape == (6, 40)
        torch.testing.assert_close(q @ q.T, torch.eye(6, dtype=torch.float64), atol=1e-12, rtol=0)
    q, want = gradient_basis(g, 6), _top_output_directions(g, 6)
    torch.testing.assert_close(q.T @ q, want.T @ want, atol=1e-10, rtol=0)  # the same subspace (its projector)
    assert torch.equal(random_basis(40, 6, seed=2), random_basis(40, 6, seed=2))
    assert not torch.allclose(random_basis(40, 6, seed=2), random_basis(40, 6, seed=3))
    torch.testing.assert_close(gradient_basis(-g, 6), gradient_basis(g, 6), atol=1e-10, rtol=0)  # signs fixed


def _method(basis: str, refresh_every: int, **adamw) -> ProjectedAdamW:
    config = AdamWConfig(lr=1e-3, warmup_steps=0, decay_steps=0, min_lr_ratio=1.0, **adamw)
    return ProjectedAdamW(config, ProjectionConfig(rank=RANK, basis=basis, refresh_every=refresh_every, seed=1))


@pytest.mark.parametrize("basis", ["random", "gradient"])
def test_three_steps_across_a_refresh_are_adam_in_the_subspace(tiny_model_dir, basis: str) -> None:
    """``G' = Q G``, Adam's moments and bias corrections on ``G'``, ``ΔW = Qᵀ Δ'``, decoupled weight decay on ``W``;
    at update 3 a new basis (refresh every 2) with ``m ← C m``, ``v ← (C∘C) v``, ``C = Q_new Q_oldᵀ``: float64 here,
    the gradient basis from an eigendecomposition (Adam's step does not depend on the signs of ``Q``'s rows)."""
    policy, _ = load_policy(str(tiny_model_dir))
    lr, wd, (b1, b2), eps = 1e-3, 0.01, (0.9, 0.95), 1e-8
    method = _method(basis, refresh_every=2, weight_decay=wd)
    configured = method.configure_optimizers(policy, TARGETS, DivergenceGuard(max_update_ratio=1.0))
    opt, scheduler = StepThrough(configured["optimizer"]), configured["lr_scheduler"]["scheduler"]
    names = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert names and all(n.endswith(("q_proj.weight", "down_proj.weight")) for n in names)
    before = {n: p.detach().double().clone() for n, p in policy.named_parameters()}
    want, m, v, q = dict(before), {}, {}, {}
    for t, seed in enumerate((0, 1, 2), start=1):
        grads = lm_gradients(policy, seed)
        step_sq = 0.0
        for index, n in enumerate(names):
            g = grads[n]
            if t in (1, 3):  # drawn at update 1, refreshed at update 3
                new = (
                    random_basis(g.shape[0], RANK, 1 * 1_000_003 + index * 1_009 + (t - 1) // 2)
                    if basis == "random"
                    else _top_output_directions(g, RANK)
                )
                if t == 3:
                    carry = new @ q[n].T
                    m[n], v[n] = carry @ m[n], carry.square() @ v[n]
                q[n] = new
            g_proj = q[n] @ g
            m[n] = (1 - b1) * g_proj if t == 1 else b1 * m[n] + (1 - b1) * g_proj
            v[n] = (1 - b2) * g_proj**2 if t == 1 else b2 * v[n] + (1 - b2) * g_proj**2
            step_proj = -lr / (1 - b1**t) * m[n] / ((v[n] / (1 - b2**t)).sqrt() + eps)
            delta = q[n].T @ step_proj - lr * wd * want[n]
            want[n] = want[n] + delta
            step_sq += float(delta.square().sum())
        assert_step_taken(method, opt, scheduler, step_sq)
    assert_moved_as_written(policy, names, before, want)
    assert method.applied_updates == 3


def test_alpha_scales_the_step_and_a_vetoed_gradient_basis_is_not_kept(tiny_model_dir) -> None:
    """α makes the step α·ΔW (the preview is the step). A veto leaves weights and moments, and the next update
    draws its basis from its own gradient, not from the vetoed one's."""
    policy, _ = load_policy(str(tiny_model_dir))
    method = _method("gradient", refresh_every=1)
    configured = method.configure_optimizers(policy, TARGETS, DivergenceGuard(max_update_ratio=1.0))
    inner, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    trained = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    lm_gradients(policy, 0)
    assert_alpha_scales_the_step(method, inner, scheduler, trained)
    state = {p: (inner.state[p]["exp_avg"].clone(), inner.state[p]["basis"].clone()) for p in trained.values()}

    def veto(optimizer) -> None:
        list(optimizer.step_deltas())  # a preview draws this gradient's basis
        optimizer.proposal.skip("vetoed by the test")

    lm_gradients(policy, 1)
    w1 = {n: p.detach().clone() for n, p in trained.items()}
    result = method.step(StepThrough(inner, veto), scheduler, lambda x: x)
    assert result.rejected == "vetoed by the test" and result.update_norm == 0.0
    assert all(torch.equal(p.detach(), w1[n]) for n, p in trained.items())
    assert all(torch.equal(inner.state[p]["exp_avg"], state[p][0]) for p in trained.values())
    assert all(torch.equal(inner.state[p]["basis"], state[p][1]) for p in trained.values())
    grads = lm_gradients(policy, 2)
    assert method.step(StepThrough(inner), scheduler, lambda x: x).rejected is None
    for n, p in trained.items():
        want = _top_output_directions(grads[n], RANK)
        basis = inner.state[p]["basis"]
        torch.testing.assert_close(basis.T @ basis, want.T @ want, atol=1e-6, rtol=0, msg=n)
    assert method.applied_updates == 2


def test_bad_settings_are_named() -> None:
    with pytest.raises(ConfigError, match=r"projection\.basis must be one of"):
        ProjectionConfig(basis="top")
    with pytest.raises(ConfigError, match=r"projection\.rank must be a positive integer"):
        ProjectionConfig(rank=0)
    with pytest.raises(ConfigError, match=r"projection\.refresh_every must be 0"):
        ProjectionConfig(refresh_every=-1)
    with pytest.raises(ConfigError, match=r"adamw\.train_all: false"):
        ProjectedAdamW(AdamWConfig(train_all=True))


def test_a_run_under_kl_control_keeps_the_engine_equal(tmp_path, rl_run) -> None:
    """Two updates in a real Trainer with the KL-matched protocol's step control (the probe's JVP along the projected
    step, a gradient basis drawn each update), the engine's weights equal to the policy's after them."""
    module = kl_controlled_run(_method("gradient", refresh_every=1), TARGETS, tmp_path, rl_run)
    assert "rank-8 gradient subspace of the matrices' outputs" in module.method.report(module.policy, module.targets)
