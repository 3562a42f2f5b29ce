"""The update methods without a Trainer: what each trains, one guarded step against an independent computation,
what engines receive, and how short names and checkpoints name them."""

from __future__ import annotations

import pytest
import torch
from helpers.optim import StepThrough

from logra_pl.errors import ConfigError, PolicyDivergedError
from logra_pl.methods import DenseAdamW, LoGRAMethod, LoRAMethod, checkpoint_kind, resolve_method
from logra_pl.methods.adamw import AdamWConfig
from logra_pl.methods.guard import DivergenceGuard, RejectionCount
from logra_pl.methods.lora import LoRAConfig
from logra_pl.models.load import load_policy
from logra_pl.sketch import LoGRAConfig

TARGETS = ["q_proj", "down_proj"]


def _backward(policy, seed=0):
    ids = torch.randint(3, 200, (2, 10), generator=torch.Generator().manual_seed(seed))
    policy(input_ids=ids, labels=ids).loss.backward()


def _build(method, policy, guard=None):
    built = method.configure_optimizers(policy, TARGETS, guard or DivergenceGuard())
    if isinstance(built, dict):
        return StepThrough(built["optimizer"]), built["lr_scheduler"]["scheduler"]
    return StepThrough(built), None


def test_dense_adamw_first_step_is_lr_times_sign_of_the_gradient(tiny_model_dir) -> None:
    policy, _ = load_policy(str(tiny_model_dir))
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    method = DenseAdamW(AdamWConfig(lr=1e-3, warmup_steps=0, eps=1e-12))
    opt, sched = _build(method, policy)
    trained = sorted(n for n, p in policy.named_parameters() if p.requires_grad)
    assert trained and all(n.endswith(("q_proj.weight", "down_proj.weight")) for n in trained)
    assert method.changed_numel(policy) == sum(p.numel() for p in policy.parameters() if p.requires_grad)
    _backward(policy)
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    result = method.step(opt, sched, lambda t: t)
    # Adam's first bias-corrected step is lr · m/√v = lr · sign(g) (eps negligible); nothing else moves.
    expected_sq = 0.0
    for n, p in policy.named_parameters():
        if n in grads:
            want = before[n] - 1e-3 * torch.sign(grads[n])
            assert torch.allclose(p.detach(), want, atol=1e-6, rtol=0), n
            expected_sq += float((p.detach().double() - before[n].double()).square().sum())
        else:
            assert torch.equal(p.detach(), before[n]), n
    assert result.rejected is None and result.payload is None
    assert abs(result.update_norm - expected_sq**0.5) < 1e-6 * max(1.0, expected_sq**0.5)
    assert set(method.trained_tensors(policy)) == set(grads)


def test_a_rejected_dense_step_leaves_weights_and_state_untouched(tiny_model_dir) -> None:
    policy, _ = load_policy(str(tiny_model_dir))
    method = DenseAdamW(AdamWConfig(lr=1.0, warmup_steps=0))
    opt, sched = _build(method, policy, DivergenceGuard(max_update_ratio=1e-6))
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    _backward(policy)
    result = method.step(opt, sched, lambda t: t)
    assert result.rejected is not None and "max_update_ratio" in result.rejected and result.update_norm == 0.0
    assert all(torch.equal(p.detach(), before[n]) for n, p in policy.named_parameters())
    assert not opt.optimizer.state  # AdamW never saw the gradients
    assert method.metrics()["guard/relative_update"] > 1e-6


def test_logra_step_merges_its_payload_and_refuses_other_targets(tiny_model_dir) -> None:
    policy, _ = load_policy(str(tiny_model_dir))
    method = LoGRAMethod(LoGRAConfig(rank=16, update_ratio=1e-2))
    opt, _ = _build(method, policy)
    assert method.sketcher is not None and method.ships_factors and method.makes_proposals
    assert sorted({n.split(".")[-1] for n in method.sketcher.matrices}) == sorted(TARGETS)
    before = {n: p.detach().clone() for n, p in method.trained_tensors(policy).items()}
    _backward(policy)
    result = method.step(opt, None, lambda t: t)
    assert result.rejected is None and result.payload is not None
    moved = [n for n, t in method.trained_tensors(policy).items() if not torch.equal(t, before[n])]
    assert sorted(moved) == sorted(before)
    # The reported norm is the norm of what changed in the weights (bf16 factors: up to rounding).
    delta = sum(
        float((t.double() - before[n].double()).square().sum()) for n, t in method.trained_tensors(policy).items()
    )
    assert abs(result.update_norm - delta**0.5) / delta**0.5 < 1e-3
    assert method.metrics()["logra/skipped_updates"] == 0.0
    with pytest.raises(ConfigError, match=r"model\.targets"):
        LoGRAMethod(LoGRAConfig(targets=("v_proj",))).with_targets(TARGETS)


def test_lora_engines_receive_merged_matrices_under_plain_names(tiny_model_dir) -> None:
    policy, _ = load_policy(str(tiny_model_dir))
    method = LoRAMethod(LoRAConfig(rank=4, alpha=8.0), AdamWConfig(lr=1e-2, warmup_steps=0))
    method.prepare_policy(policy, TARGETS)
    opt, sched = _build(method, policy)
    _backward(policy)
    assert method.step(opt, sched, lambda t: t).rejected is None
    merged = method.trained_tensors(policy)
    assert merged and all(".lora_" not in n and ".base_layer" not in n for n in merged)
    state = dict(method.full_state(policy))
    assert all(".lora_" not in n for n in state) and set(merged) <= set(state)
    # W + (alpha/r)·B A, computed here from the adapter tensors.
    layer = policy.model.layers[0].self_attn.q_proj
    want = layer.base_layer.weight + 2.0 * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    assert torch.allclose(merged["model.layers.0.self_attn.q_proj.weight"], want, atol=1e-6)
    assert "LoRA trains" in method.report(policy, TARGETS)


def test_short_names_dotted_paths_and_checkpoint_kinds() -> None:
    assert type(resolve_method("adamw")) is DenseAdamW
    assert type(resolve_method("lora")) is LoRAMethod and type(resolve_method(None)) is LoGRAMethod
    built = resolve_method({"class_path": "logra_pl.methods.LoGRAMethod", "init_args": {"logra": {"rank": 8}}})
    assert isinstance(built, LoGRAMethod) and built.config.rank == 8  # a mapping of the settings' fields
    assert built.to_config()["init_args"]["logra"] is built.config
    assert type(resolve_method("logra_pl.methods.DenseAdamW")) is DenseAdamW
    mine = DenseAdamW()
    assert resolve_method(mine) is mine
    with pytest.raises(ConfigError, match=r"unknown model\.method 'nope': use one of 'adamw', 'logra', 'lora'"):
        resolve_method("nope")
    with pytest.raises(ConfigError, match=r"logra: .*LoGRAConfig does not take 'rnak'"):
        resolve_method({"class_path": "logra_pl.methods.LoGRAMethod", "init_args": {"logra": {"rnak": 8}}})
    with pytest.raises(ConfigError, match=r"model\.method logra_pl\.methods\.AdamWConfig is not an update method"):
        resolve_method("logra_pl.methods.AdamWConfig")
    assert checkpoint_kind({"logra_pl": {"optimizer": "lora", "method": "logra_pl.methods.LoRAMethod"}}) == (
        "logra_pl.methods.LoRAMethod"
    )
    assert checkpoint_kind({"logra_pl": {"optimizer": "lora"}}) == "lora"
    assert checkpoint_kind({"optimizer_states": [{"logra": {}}]}) == "logra"  # before the kind was recorded
    assert checkpoint_kind({"optimizer_states": [{"param_groups": []}]}) == "adamw"
    assert checkpoint_kind({}) is None


def test_rejection_count_stops_the_run_at_the_limit_and_resets_on_success() -> None:
    count = RejectionCount(max_consecutive=3)
    count.record("too big", 1, "lr", "last.ckpt", say=False)
    count.record(None, 2, "lr", "last.ckpt", say=False)
    assert (count.total, count.in_a_row) == (1, 0)
    count.record("too big", 3, "lr", "last.ckpt", say=False)
    count.record("nan", 4, "lr", "last.ckpt", say=False)
    with pytest.raises(PolicyDivergedError, match=r"at update 5: 3 updates in a row.*Lower update_ratio.*last\.ckpt"):
        count.record("nan", 5, "update_ratio", "last.ckpt", say=False)
    restored = RejectionCount(3)
    restored.load_state_dict(count.state_dict())
    assert (restored.total, restored.in_a_row) == (4, 3)
