"""The dense step proposal without a Trainer (DenseAdamW, LoRA, DenseSGD): α scales AdamW's step, a veto changes
nothing, the guard judges the α-scaled step, and the probe's tangent is the logits' JVP along ΔW — checked against
AdamW's (or SGD's) step and a central difference computed here — which predicts the KL of small steps to second
order. SGD's own step, α and veto are in ``test_sgd.py``."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.optim import StepThrough

from logra_pl.methods import DenseAdamW, LoRAMethod
from logra_pl.methods.adamw import AdamWConfig
from logra_pl.methods.guard import DivergenceGuard
from logra_pl.methods.lora import LoRAConfig
from logra_pl.methods.sgd import DenseSGD, SGDConfig
from logra_pl.models.load import load_policy
from logra_pl.sketch.probe import predicted_kl_terms, realized_kl_terms

TARGETS = ["q_proj", "down_proj"]
BETAS, EPS = (0.9, 0.95), 1e-8
LR = 1e-3
# SGD's lr and momentum: the tiny model's gradients are ~1e-3 per entry, so its steps are about AdamW's size.
SGD_LR, MOMENTUM = 1.0, 0.9
# Central-difference steps (units of ΔW) that balance truncation and fp32 rounding (Qwen2's norms compute in fp32):
# LoRA's step moves the logits less, and almost linearly, so it takes a larger one.
FD_STEP = {"adamw": 0.05, "lora": 0.5, "sgd": 0.05}


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _setup(kind: str, tiny_model_dir, weight_decay: float = 0.0, guard: DivergenceGuard | None = None):
    """The tiny policy, the method, its optimizer and schedule (constant lr: ``min_lr_ratio = 1``)."""
    policy, _ = load_policy(str(tiny_model_dir))
    cfg = AdamWConfig(lr=LR, betas=BETAS, eps=EPS, weight_decay=weight_decay, warmup_steps=0, min_lr_ratio=1.0)
    if kind == "sgd":
        method = DenseSGD(SGDConfig(lr=SGD_LR, momentum=MOMENTUM, weight_decay=weight_decay))
        return policy, method, method.configure_optimizers(policy, TARGETS, guard or DivergenceGuard()), None
    method = DenseAdamW(cfg) if kind == "adamw" else LoRAMethod(LoRAConfig(rank=4, alpha=8.0), cfg)
    method.prepare_policy(policy, TARGETS)
    built = method.configure_optimizers(policy, TARGETS, guard or DivergenceGuard())
    return policy, method, built["optimizer"], built["lr_scheduler"]["scheduler"]


def _inputs(seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _backward(policy, seed: int) -> dict[str, torch.Tensor]:
    """Gradients of a language-model loss on random tokens; returns them by parameter name."""
    ids = _inputs(seed)["input_ids"]
    policy(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.detach().clone() for n, p in policy.named_parameters() if p.grad is not None}


def _trained(policy) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in policy.named_parameters() if p.requires_grad}


def _weights(policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.named_parameters()}


def _second_adamw_step(w, g1, g2, lr: float, wd: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AdamW's second step from scratch, in float64: ``(ΔW, m2, v2)`` for weights ``w`` after a first step on ``g1``."""
    b1, b2 = BETAS
    w, g1, g2 = w.double(), g1.double(), g2.double()
    m2 = b1 * (1 - b1) * g1 + (1 - b1) * g2
    v2 = b2 * (1 - b2) * g1.square() + (1 - b2) * g2.square()
    delta = -lr * wd * w - lr / (1 - b1**2) * m2 / (v2.sqrt() / math.sqrt(1 - b2**2) + EPS)
    return delta, m2, v2


def _second_step_deltas(kind: str, tiny_model_dir, weight_decay: float = 0.0):
    """One plain step (so LoRA's B is non-zero and A gets a gradient), then the gradients of a second: the policy,
    method, optimizer, schedule and the second step's ΔW of every trained parameter, computed here."""
    policy, method, opt, sched = _setup(kind, tiny_model_dir, weight_decay)
    w0 = _weights(policy)
    g1 = _backward(policy, 0)
    assert method.step(StepThrough(opt), sched, _same).rejected is None
    w1 = _weights(policy)
    g2 = _backward(policy, 1)
    if kind == "sgd":  # B1 = g1 + wd·W0, B2 = μ·B1 + g2 + wd·W1, ΔW = −lr·B2
        trained = _trained(policy)
        first = {n: g1[n].double() + weight_decay * w0[n].double() for n in trained}
        deltas = {n: -SGD_LR * (MOMENTUM * first[n] + g2[n].double() + weight_decay * w1[n].double()) for n in trained}
        return policy, method, opt, sched, deltas
    deltas = {n: _second_adamw_step(w1[n], g1[n], g2[n], LR, weight_decay)[0] for n in _trained(policy)}
    return policy, method, opt, sched, deltas


@torch.no_grad()
def _logits_moved(policy, deltas: dict[str, torch.Tensor], scale: float, inputs) -> torch.Tensor:
    """Logits with every trained parameter moved by ``scale·ΔW``, then restored exactly (float64 logits)."""
    params = _trained(policy)
    saved = {n: params[n].detach().clone() for n in deltas}
    for n, d in deltas.items():
        params[n].add_((scale * d).to(params[n].dtype))
    out = policy(**inputs, use_cache=False).logits.double()
    for n, value in saved.items():
        params[n].copy_(value)
    return out


@pytest.mark.parametrize("kind", ["adamw", "lora"])
def test_alpha_scales_the_dense_step_and_a_veto_changes_nothing(kind: str, tiny_model_dir) -> None:
    """At α the weights become ``W + α·ΔW`` (weight decay scaled too), the moments update as usual; a vetoed step
    leaves weights and AdamW state untouched and is not counted; the guard judges the α-scaled step."""
    wd, alpha = 0.1, 0.37
    policy, method, opt, sched = _setup(kind, tiny_model_dir, weight_decay=wd)
    g1 = _backward(policy, 0)
    method.step(StepThrough(opt), sched, _same)
    w1 = _weights(policy)
    g2 = _backward(policy, 1)
    seen = {}

    def control(optimizer) -> None:
        seen["proposal"] = optimizer.proposal
        optimizer.proposal.alpha = alpha

    result = method.step(StepThrough(opt, control), sched, _same)
    assert result.rejected is None and method.applied(seen["proposal"]) and method.applied_updates == 2
    moved_sq = 0.0
    for name, p in _trained(policy).items():
        delta, m2, v2 = _second_adamw_step(w1[name], g1[name], g2[name], LR, wd)
        want = w1[name].double() + alpha * delta
        assert torch.allclose(p.detach().double(), want, rtol=0, atol=1e-4 * LR), name
        nominal = w1[name].double() + delta  # α really changed the step: far from the nominal one
        assert float((p.detach().double() - nominal).abs().max()) > 0.5 * float(delta.abs().max()) * (1 - alpha)
        state = opt.state[p]
        assert int(state["step"]) == 2
        for key, want_moment in (("exp_avg", m2), ("exp_avg_sq", v2)):  # fp32 moments: up to rounding
            scale = float(want_moment.abs().max())
            assert torch.allclose(state[key].double(), want_moment, rtol=0, atol=1e-6 * scale), (name, key)
        moved_sq += float((p.detach().double() - w1[name].double()).square().sum())
    assert result.update_norm == pytest.approx(math.sqrt(moved_sq), rel=1e-4)  # the α-scaled step's norm

    # A veto: nothing changes, nothing is counted.
    _backward(policy, 2)
    w2 = _weights(policy)
    state2 = {p: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}

    def veto(optimizer) -> None:
        seen["vetoed"] = optimizer.proposal
        optimizer.proposal.skip("vetoed by the test")

    result = method.step(StepThrough(opt, veto), sched, _same)
    assert result.rejected == "vetoed by the test" and result.update_norm == 0.0
    assert all(torch.equal(p.detach(), w2[n]) for n, p in policy.named_parameters())
    assert all(torch.equal(opt.state[p][k], v) for p, s in state2.items() for k, v in s.items())
    assert method.applied_updates == 2 and not method.applied(seen["vetoed"]) and not method.applied(seen["proposal"])

    # The guard judges the step at α: the nominal step passes, α = 10⁴ times it is refused before it is taken.
    _backward(policy, 3)

    def enlarge(optimizer) -> None:
        optimizer.proposal.alpha = 1e4

    result = method.step(StepThrough(opt, enlarge), sched, _same)
    assert result.rejected is not None and "max_update_ratio" in result.rejected
    assert method.metrics()["guard/relative_update"] > 1.0
    assert all(torch.equal(p.detach(), w2[n]) for n, p in policy.named_parameters())
    assert method.applied_updates == 2


@pytest.mark.parametrize("kind", ["adamw", "lora", "sgd"])
def test_dense_probe_is_the_jvp_along_the_previewed_step(kind: str, tiny_model_dir) -> None:
    """The proposal's ΔW is AdamW's (SGD's) step; the method's ``jvp`` tangent equals a central difference of the logits
    along that ΔW computed here, its ``fd`` mode computes that same difference, and the weights are untouched."""
    policy, method, opt, sched, deltas = _second_step_deltas(kind, tiny_model_dir)
    inputs, h = _inputs(7), FD_STEP[kind]
    checked = {}

    def probe(optimizer) -> None:
        proposal = optimizer.proposal
        names = {id(p): n for n, p in policy.named_parameters()}
        previewed = {names[id(p)]: d for p, d in proposal.deltas().items()}
        assert sorted(previewed) == sorted(deltas)
        for n, d in deltas.items():
            assert torch.allclose(previewed[n].double(), d, rtol=1e-5, atol=1e-6 * LR), n
        before = _weights(policy)
        z, tangent = method.logit_tangent(policy, proposal, inputs, "jvp")
        assert all(torch.equal(p.detach(), before[n]) for n, p in policy.named_parameters())
        fd = (_logits_moved(policy, deltas, h, inputs) - _logits_moved(policy, deltas, -h, inputs)) / (2 * h)
        assert float(fd.norm()) > 0
        assert float((tangent.double() - fd).norm() / fd.norm()) < 1e-3
        assert torch.allclose(z.double(), _logits_moved(policy, deltas, 0.0, inputs), atol=1e-4)
        z_fd, t_fd = method.logit_tangent(policy, proposal, inputs, "fd", h)
        assert float((t_fd.double() - fd).norm() / fd.norm()) < 1e-3
        assert torch.allclose(z_fd, z, atol=1e-4)
        assert all(torch.equal(p.detach(), before[n]) for n, p in policy.named_parameters())  # fd restored exactly
        checked["done"] = True
        proposal.skip("probe only")

    method.step(StepThrough(opt, probe), sched, _same)
    assert checked.get("done")


@pytest.mark.parametrize("kind", ["adamw", "lora", "sgd"])
def test_dense_predicted_kl_matches_realized_to_second_order(kind: str, tiny_model_dir) -> None:
    """``KL(α) = α²·pred + O(α³)``: as the step shrinks 10×, ``|realized − α²·pred| / realized`` shrinks at least
    5× and ends below 1%. The realized KL is measured here, on weights moved by ``α·ΔW`` (AdamW's or SGD's step)."""
    policy, method, opt, sched, deltas = _second_step_deltas(kind, tiny_model_dir)
    inputs = _inputs(7)
    errors = {}

    def probe(optimizer) -> None:
        z, tangent = method.logit_tangent(policy, optimizer.proposal, inputs, "jvp")
        vocab = z.shape[-1]
        pred = float(predicted_kl_terms(z.reshape(-1, vocab), tangent.reshape(-1, vocab)).mean())
        for alpha in (1.0, 0.1):
            after = _logits_moved(policy, deltas, alpha, inputs)
            realized = float(realized_kl_terms(z.reshape(-1, vocab), after.reshape(-1, vocab)).mean())
            assert realized > 0
            errors[alpha] = abs(realized - alpha**2 * pred) / realized
        optimizer.proposal.skip("probe only")

    method.step(StepThrough(opt, probe), sched, _same)
    assert errors[0.1] < 0.2 * errors[1.0] and errors[0.1] < 1e-2, errors
