"""Every method's first-order gain of an update (``method.last_gain = −⟨∇L, Δθ⟩``) against the dense gradient of the
same loss and the weights' actual change, both computed here: LoGRA's from its sketches (``α·⟨S, U⟩``), the dense
methods' from their gradients and steps, LoRA's in adapter space; a vetoed or rejected update gains 0."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.optim import StepThrough

from logra_pl.methods import DenseAdamW, LoGRAMethod, LoRAMethod
from logra_pl.methods.adamw import AdamWConfig
from logra_pl.methods.guard import DivergenceGuard
from logra_pl.methods.lora import LoRAConfig
from logra_pl.methods.sgd import DenseSGD, SGDConfig
from logra_pl.sketch import LoGRAConfig

TARGETS = ["q_proj", "v_proj", "down_proj"]
ALPHA = 0.37


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _loss(model, seed: int) -> torch.Tensor:
    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed))
    return model(input_ids=ids, labels=ids).loss


def _dense_gradients(model, seed: int) -> dict[str, torch.Tensor]:
    """The reference: plain autograd on a copy whose target weights require grad, float64 gradients by name."""
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.requires_grad_(False)
    weights = {n: m.weight for n, m in ref.named_modules() if n.rsplit(".", 1)[-1] in TARGETS}
    for w in weights.values():
        w.requires_grad_(True)
    _loss(ref, seed).backward()
    return {n: w.grad.double() for n, w in weights.items()}


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().double().clone() for n, p in model.named_parameters()}


def _build(kind: str, model):
    if kind.startswith("logra"):  # logra: float32 factors, the gain is exact; logra_bf16: the default bf16 factors
        dtype = "bfloat16" if kind == "logra_bf16" else "float32"
        cfg = LoGRAConfig(rank=8, base_seed=5, step_mode="adam", lr=1e-3, beta1=0.9, factor_dtype=dtype)
        method = LoGRAMethod(cfg)
        opt = method.configure_optimizers(model, TARGETS, DivergenceGuard())
        return method, opt, None
    if kind == "sgd":
        method = DenseSGD(SGDConfig(lr=0.5, momentum=0.9))
        return method, method.configure_optimizers(model, TARGETS, DivergenceGuard()), None
    adamw = AdamWConfig(lr=1e-3, warmup_steps=0, min_lr_ratio=1.0)
    method = DenseAdamW(adamw) if kind == "adamw" else LoRAMethod(LoRAConfig(rank=4, alpha=8.0), adamw)
    method.prepare_policy(model, TARGETS)
    built = method.configure_optimizers(model, TARGETS, DivergenceGuard())
    return method, built["optimizer"], built["lr_scheduler"]["scheduler"]


def _scale(optimizer) -> None:
    optimizer.proposal.alpha = ALPHA


@pytest.mark.parametrize("kind", ["logra", "logra_bf16", "adamw", "sgd"])
def test_gain_is_minus_the_dense_gradient_dot_the_weights_change(kind: str, qwen2_factory) -> None:
    """Two updates at α = 0.37 (the second with momentum/moments in play): each gain equals ``−⟨G, W_after −
    W_before⟩`` with ``G`` the dense gradient of the update's loss from plain autograd on a copy. LoGRA's gain comes
    from its sketches alone (``α·⟨S, U⟩``), so this checks ``⟨S, U⟩ = ⟨G, U P⟩`` through the merged weights (exactly
    with float32 factors; the default bf16 ones round the merged step by ~1e-4)."""
    model = qwen2_factory(seed=0)
    method, opt, sched = _build(kind, model)
    for seed in (1, 2):
        grads = _dense_gradients(model, seed)
        before = _weights(model)
        _loss(model, seed).backward()
        result = method.step(StepThrough(opt, _scale), sched, _same)
        assert result.rejected is None
        after = _weights(model)
        want = -sum(float((grads[n] * (after[f"{n}.weight"] - before[f"{n}.weight"])).sum()) for n in grads)
        assert want > 0  # LoGRA's α·⟨S, U⟩ leaves out the bf16 rounding of the merged factor: to ~1e-4
        assert method.last_gain == pytest.approx(want, rel=2e-4 if kind == "logra_bf16" else 1e-5)
        assert method.metrics()["train/update_gain"] == method.last_gain


def test_lora_gain_is_in_adapter_space(qwen2_factory) -> None:
    """LoRA's gain is ``−⟨g, Δθ⟩`` over its adapters (``A``, ``B``): the gradients of the adapters, taken here before
    the step, against the adapters' change."""
    model = qwen2_factory(seed=0)
    method, opt, sched = _build("lora", model)
    for seed in (1, 2):  # the first step moves B only (B = 0 at init gives A no gradient); the second both
        _loss(model, seed).backward()
        grads = {n: p.grad.double().clone() for n, p in model.named_parameters() if p.grad is not None}
        before = _weights(model)
        assert method.step(StepThrough(opt, _scale), sched, _same).rejected is None
        after = _weights(model)
        want = -sum(float((g * (after[n] - before[n])).sum()) for n, g in grads.items())
        assert want > 0 and method.last_gain == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("kind", ["logra", "adamw"])
def test_an_update_not_taken_gains_nothing(kind: str, qwen2_factory) -> None:
    model = qwen2_factory(seed=0)
    method, opt, sched = _build(kind, model)
    _loss(model, 1).backward()
    method.step(StepThrough(opt, _scale), sched, _same)
    assert method.last_gain > 0
    _loss(model, 2).backward()
    result = method.step(StepThrough(opt, lambda o: o.proposal.skip("vetoed by the test")), sched, _same)
    assert result.rejected == "vetoed by the test" and method.last_gain == 0.0


# ------------------------------------------------------------------------------- the next batch's gain
def _dense_reference(model, seed: int, names) -> dict[str, torch.Tensor]:
    """Float64 gradients, by parameter name, of the loss of ``seed`` at the weights as they are (plain autograd on a
    copy, every parameter of ``names`` requiring grad)."""
    ref = copy.deepcopy(model)
    for n, p in ref.named_parameters():
        p.requires_grad_(n in names)
    _loss(ref, seed).backward()
    return {n: p.grad.double() for n, p in ref.named_parameters() if n in names and p.grad is not None}


def _trained_names(kind: str, model) -> set[str]:
    if kind == "lora":
        return {n for n, p in model.named_parameters() if p.requires_grad}
    return {f"{n}.weight" for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in TARGETS}


@pytest.mark.parametrize("kind", ["logra", "logra_bf16", "adamw", "sgd", "lora"])
def test_next_batch_gain_is_the_last_step_against_the_next_dense_gradient(kind: str, qwen2_factory) -> None:
    """Three updates at α = 0.37 with the last step kept: the first has no earlier step (None); each later one
    measures ``−⟨G', W_t − W_{t−1}⟩``, ``G'`` the dense gradient of its own loss at the weights the earlier step
    produced (plain autograd on a copy), ``W_t − W_{t−1}`` that step's actual change (LoRA: its adapters'). LoGRA
    measures it as ``⟨S', F⟩`` from its next sketches alone, exactly: the merged factors, bf16 ones included. The
    measure does not change the training: the weights are those of the same updates without it, bit for bit."""
    model, twin = qwen2_factory(seed=0), qwen2_factory(seed=0)
    torch.manual_seed(0)  # LoRA's adapters are drawn: the same for both
    method, opt, sched = _build(kind, model)
    torch.manual_seed(0)
    plain, plain_opt, plain_sched = _build(kind, twin)
    assert method.next_batch_gain is None and method.keep_last_step()
    names = _trained_names(kind, model)
    before = None
    for seed in (1, 2, 3):
        grads = _dense_reference(model, seed, names)
        now = _weights(model)
        for m, net, o, s in ((method, model, opt, sched), (plain, twin, plain_opt, plain_sched)):
            _loss(net, seed).backward()
            assert m.step(StepThrough(o, _scale), s, _same).rejected is None
        if before is None:
            assert method.next_batch_gain is None
        else:
            want = -sum(float((grads[n] * (now[n] - before[n])).sum()) for n in grads)
            assert want != 0 and method.next_batch_gain == pytest.approx(want, rel=1e-5, abs=1e-12)
        assert plain.next_batch_gain is None
        before = now
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values(), strict=True))


@pytest.mark.parametrize("kind", ["logra", "adamw"])
def test_a_step_not_taken_leaves_the_last_one_kept(kind: str, qwen2_factory) -> None:
    """A vetoed update changes nothing, so the update after it measures the step before the veto, against its own
    gradient at the weights that step produced."""
    model = qwen2_factory(seed=0)
    method, opt, sched = _build(kind, model)
    method.keep_last_step()
    names = _trained_names(kind, model)
    before = _weights(model)
    _loss(model, 1).backward()
    method.step(StepThrough(opt, _scale), sched, _same)
    taken = _weights(model)
    _loss(model, 2).backward()
    assert method.step(StepThrough(opt, lambda o: o.proposal.skip("vetoed")), sched, _same).rejected == "vetoed"
    grads = _dense_reference(model, 3, names)
    _loss(model, 3).backward()
    method.step(StepThrough(opt, _scale), sched, _same)
    want = -sum(float((grads[n] * (taken[n] - before[n])).sum()) for n in grads)
    # The dense side reads the step back from float32 weights (each entry rounded at its weight's scale, not the
    # step's); on one CPU that alone put the two 1.3e-5 apart. A wrong step or gradient is off by far more than 1e-4.
    assert method.next_batch_gain == pytest.approx(want, rel=1e-4)


def test_logra_measures_only_on_a_persisting_basis(qwen2_factory) -> None:
    """With a new projection every 2 updates, the second update of a basis is measured and the first one on a new
    basis is not (its sketches are on another ``P``). A basis drawn anew every update, or rescaled every update
    (input_scaling), never persists: the method says it cannot keep a step."""
    model = qwen2_factory(seed=0)
    cfg = LoGRAConfig(rank=8, base_seed=5, step_mode="adam", lr=1e-3, beta1=0.9, refresh_every=2)
    method = LoGRAMethod(cfg)
    assert method.keep_last_step()
    opt = method.configure_optimizers(model, TARGETS, DivergenceGuard())
    measured = []
    for seed in (1, 2, 3, 4):
        _loss(model, seed).backward()
        method.step(StepThrough(opt, _scale), None, _same)
        measured.append(method.next_batch_gain is not None)
    assert measured == [False, True, False, True]
    for changes in ({"refresh_every": 1}, {"refresh_every": 0, "input_scaling": "rms"}):
        assert not LoGRAMethod(LoGRAConfig(rank=8, step_mode="adam", lr=1e-3, **changes)).keep_last_step()
