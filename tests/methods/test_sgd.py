"""Dense SGD (``methods/sgd.py``), the built-in method added as one file: its steps against the formula written out
here, a step controller's α and veto on them, the guard, its memory (planned and measured), its short name, and a
run that keeps the engine equal. Its probe and predicted KL are in ``test_dense_proposal.py``; step control in a
Trainer, and its resume, in ``callbacks/test_kl_control_dense.py``."""

from __future__ import annotations

import pytest
import torch
from helpers.optim import StepThrough

from logra_pl.methods import resolve_method
from logra_pl.methods.guard import DivergenceGuard
from logra_pl.methods.memory_plan import plan
from logra_pl.methods.sgd import DenseSGD, SGDConfig
from logra_pl.models.load import load_policy
from logra_pl.sketch import select_targets

TARGETS = ["q_proj", "down_proj"]


def _grads(policy, seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 200, (2, 10), generator=torch.Generator().manual_seed(seed))
    policy(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.detach().double().clone() for n, p in policy.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_two_steps_are_the_formula_written_out(tiny_model_dir, momentum: float) -> None:
    """``B ← μB + (G + wd·W)`` (``B = G + wd·W`` first), ``W ← W − lr·B``, in float64 here; only the targets move."""
    policy, _ = load_policy(str(tiny_model_dir))
    before = {n: p.detach().double().clone() for n, p in policy.named_parameters()}
    lr, wd = 0.05, 0.01
    method = DenseSGD(SGDConfig(lr=lr, momentum=momentum, weight_decay=wd))
    opt = StepThrough(method.configure_optimizers(policy, TARGETS, DivergenceGuard(max_update_ratio=1.0)))
    trained = sorted(n for n, p in policy.named_parameters() if p.requires_grad)
    assert trained and all(n.endswith(("q_proj.weight", "down_proj.weight")) for n in trained)
    want, buffers, norms = dict(before), {}, []
    for seed in (0, 1):
        grads = _grads(policy, seed)
        assert set(grads) == set(trained)
        step_sq = 0.0
        for n in trained:
            d = grads[n] + wd * want[n]
            buffers[n] = d if n not in buffers or not momentum else momentum * buffers[n] + d
            delta = -lr * buffers[n]
            want[n] = want[n] + delta
            step_sq += float(delta.square().sum())
        result = method.step(opt, None, lambda t: t)
        assert result.rejected is None and result.payload is None
        norms.append((result.update_norm, step_sq**0.5))
    for n, p in policy.named_parameters():
        torch.testing.assert_close(p.detach().double(), want[n], rtol=1e-5, atol=1e-7, msg=n)
        if n not in trained:
            assert torch.equal(p.detach().double(), before[n]), n
    assert all(abs(got - expected) <= 1e-5 * expected for got, expected in norms)
    state = sum(len(s) for s in opt.optimizer.state.values())
    assert (state > 0) == (momentum > 0)  # stateless without momentum
    assert set(method.trained_tensors(policy)) == set(trained)


def test_alpha_scales_the_step_the_momentum_is_kept_and_a_veto_changes_nothing(tiny_model_dir) -> None:
    """A controller's α makes the step ``W ← W − α·lr·B`` while the buffer ``B ← μB + G + wd·W`` is α-free (float64
    here); a veto leaves weights, buffers and the applied-step count as they were; the guard judges the α-scaled
    step and refuses it before it is taken."""
    policy, _ = load_policy(str(tiny_model_dir))
    lr, mu, wd, alpha = 0.1, 0.9, 0.01, 0.3
    method = DenseSGD(SGDConfig(lr=lr, momentum=mu, weight_decay=wd))
    opt = method.configure_optimizers(policy, TARGETS, DivergenceGuard(max_update_ratio=0.05))
    trained = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    w0 = {n: p.detach().double().clone() for n, p in trained.items()}
    g1 = _grads(policy, 0)
    assert method.step(StepThrough(opt), None, lambda t: t).rejected is None and method.applied_updates == 1
    w1 = {n: p.detach().double().clone() for n, p in trained.items()}
    g2 = _grads(policy, 1)
    seen = {}

    def scale(optimizer) -> None:
        seen["proposal"] = optimizer.proposal
        optimizer.proposal.alpha = alpha

    result = method.step(StepThrough(opt, scale), None, lambda t: t)
    assert result.rejected is None and method.applied(seen["proposal"]) and method.applied_updates == 2
    step_sq = 0.0
    for n, p in trained.items():
        b2 = mu * (g1[n] + wd * w0[n]) + g2[n] + wd * w1[n]
        torch.testing.assert_close(opt.state[p]["momentum_buffer"].double(), b2, rtol=1e-5, atol=1e-9, msg=n)
        torch.testing.assert_close(p.detach().double(), w1[n] - alpha * lr * b2, rtol=1e-5, atol=1e-8, msg=n)
        step_sq += float((alpha * lr * b2).square().sum())
    assert result.update_norm == pytest.approx(step_sq**0.5, rel=1e-4)

    _grads(policy, 2)
    w2 = {n: p.detach().clone() for n, p in policy.named_parameters()}
    buffers = {p: opt.state[p]["momentum_buffer"].clone() for p in trained.values()}

    def veto(optimizer) -> None:
        seen["vetoed"] = optimizer.proposal
        optimizer.proposal.skip("vetoed by the test")

    result = method.step(StepThrough(opt, veto), None, lambda t: t)
    assert result.rejected == "vetoed by the test" and result.update_norm == 0.0
    assert all(torch.equal(p.detach(), w2[n]) for n, p in policy.named_parameters())
    assert all(torch.equal(opt.state[p]["momentum_buffer"], b) for p, b in buffers.items())
    assert method.applied_updates == 2 and not method.applied(seen["vetoed"])

    _grads(policy, 3)

    def enlarge(optimizer) -> None:
        optimizer.proposal.alpha = 1e3

    result = method.step(StepThrough(opt, enlarge), None, lambda t: t)
    assert result.rejected is not None and "exceeds the guard's max_update_ratio 0.05" in result.rejected
    assert all(torch.equal(p.detach(), w2[n]) for n, p in policy.named_parameters())
    assert all(torch.equal(opt.state[p]["momentum_buffer"], b) for p, b in buffers.items())
    assert method.applied_updates == 2
    # The count travels with the optimizer's state: a new optimizer loaded from it continues at 2.
    again = DenseSGD(SGDConfig(lr=lr, momentum=mu, weight_decay=wd))
    again.configure_optimizers(policy, TARGETS, DivergenceGuard()).load_state_dict(opt.state_dict())
    assert again.applied_updates == 2


def test_the_guard_refuses_a_large_step_before_it_is_taken(tiny_model_dir) -> None:
    policy, _ = load_policy(str(tiny_model_dir))
    method = DenseSGD(SGDConfig(lr=100.0))
    opt = StepThrough(method.configure_optimizers(policy, TARGETS, DivergenceGuard(max_update_ratio=0.01)))
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    _grads(policy, 0)
    result = method.step(opt, None, lambda t: t)
    assert result.rejected is not None and "exceeds the guard's max_update_ratio 0.01" in result.rejected
    assert method.metrics()["guard/relative_update"] > 0.01 and result.update_norm == 0.0
    assert all(torch.equal(p.detach(), before[n]) for n, p in policy.named_parameters())
    assert all(p.grad is None for p in policy.parameters())


def test_its_memory_is_planned_and_measured_alike(tiny_model_dir) -> None:
    """The planner's gradients are the target matrices in float32 (no state without momentum, as much again with
    it); a live step's measured gradients and momentum are the same bytes."""
    policy, _ = load_policy(str(tiny_model_dir))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    matrices = select_targets(policy, targets)
    dense = sum(m.weight.numel() * 4 for m in matrices.values())
    planned = plan(str(tiny_model_dir), optimizers=["sgd", "adamw"])
    assert planned["sgd"].report.gradients == dense and planned["sgd"].report.optimizer_state == 0
    assert planned["sgd"].report.total < planned["adamw"].report.total
    method = DenseSGD(SGDConfig(momentum=0.9))
    opt = StepThrough(method.configure_optimizers(policy, targets, DivergenceGuard()))
    _grads(policy, 0)
    assert method.memory(policy).gradients == dense
    method.step(opt, None, lambda t: t)
    assert method.memory(policy).optimizer_state == dense  # one momentum buffer per trained matrix


def test_the_short_name_and_a_run_that_keeps_the_engine_equal(tmp_path, rl_run) -> None:
    from logra_pl.module import LoGRAPolicyModule, RolloutSettings

    assert type(resolve_method("sgd")) is DenseSGD
    module = LoGRAPolicyModule(
        policy="tiny",
        method=DenseSGD(SGDConfig(lr=0.05)),
        targets=TARGETS,
        rollout=RolloutSettings(max_new_tokens=4),
        microbatch_size=4,
    )
    rl_run(module, tmp_path, 2)
    assert module.global_step == 2 and module.method.last_relative_update > 0
    engine = module.engine.model.state_dict()
    assert all(torch.equal(t, engine[k]) for k, t in module.policy.state_dict().items())
    assert "dense SGD (lr 0.05)" in module.method.report(module.policy, module.targets)
