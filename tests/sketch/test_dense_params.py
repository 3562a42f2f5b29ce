"""``logra.dense_params`` (algorithm.md §1): parameters outside the sketched matrices trained by a small dense
Adam inside the same proposal — its step checked against torch's AdamW, its tangent against the realized change of
the logits, its values shipped in the payload, its state in checkpoints."""

from __future__ import annotations

import copy

import pytest
import torch

from logra_pl.sketch import LoGRAConfig, LoGRASketcher
from logra_pl.sketch.config import LoGRAConfigError
from logra_pl.sketch.payload import Payload, apply_payload
from logra_pl.sketch.probe import logit_tangent

NORMS = ("*norm.weight",)


def _backward(model, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=gen)
    model(input_ids=ids, labels=ids).loss.backward()
    return torch.randint(0, model.config.vocab_size, (3, 10), generator=gen)


def test_dense_step_is_torch_adamw(qwen2_factory) -> None:
    model = qwen2_factory(seed=1)
    cfg = LoGRAConfig(rank=8, dense_params=NORMS, dense_lr=1e-2, dense_betas=(0.8, 0.9), dense_eps=1e-6)
    sketcher = LoGRASketcher(model, cfg)
    names = sorted(sketcher.dense)
    assert names == sorted(n for n, _ in model.named_parameters() if n.endswith("norm.weight")) and len(names) == 5
    assert all(not m.module.weight.requires_grad for m in sketcher.matrices.values())
    # The reference: torch's AdamW (no weight decay) on copies of the parameters, fed the same gradients.
    refs = {n: torch.nn.Parameter(dict(model.named_parameters())[n].detach().clone()) for n in names}
    opt = torch.optim.AdamW(list(refs.values()), lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.0)
    for step in range(2):
        _backward(model, step)
        for n in names:
            refs[n].grad = dict(model.named_parameters())[n].grad.clone()
        opt.step()
        assert sketcher.apply(sketcher.propose()) is not None
        for n in names:
            torch.testing.assert_close(dict(model.named_parameters())[n], refs[n], rtol=1e-6, atol=1e-7)
        assert all(p.grad is None for p in sketcher.dense.values())  # reset for the next update


def test_dense_tangent_is_the_logit_change(qwen2_factory) -> None:
    """dz/dα from the probe equals (z(α) − z(0)) / α of the actual update, dense parameters included."""
    model = qwen2_factory(seed=2, dtype=torch.float64)
    sketcher = LoGRASketcher(model, LoGRAConfig(rank=16, update_ratio=1e-2, dense_params=NORMS, dense_lr=1e-2))
    ids = _backward(model, 0)
    proposal = sketcher.propose()
    modules = {n: m.module for n, m in sketcher.matrices.items()}
    inputs = {"input_ids": ids}
    _, t_jvp = logit_tangent(model, modules, proposal, inputs, mode="jvp", dense=sketcher.dense)
    _, t_fd = logit_tangent(model, modules, proposal, inputs, mode="fd", fd_step=1e-3, dense=sketcher.dense)
    _, t_matrices = logit_tangent(model, modules, proposal, inputs, mode="jvp")
    assert float((t_jvp - t_matrices).norm() / t_jvp.norm()) > 1e-3  # the dense part is there
    assert float((t_jvp - t_fd).norm() / t_jvp.norm()) < 1e-2  # as for the matrices alone (test_probe.py)
    # The realized change at a small α, merged by hand on a float64 copy. (Qwen2's RMSNorm computes in float32 even
    # in a float64 model, so smaller steps drown in its rounding: α = 1e-3 leaves ~0.1-0.5% of second-order terms.)
    alpha = 1e-3
    with torch.no_grad():
        base = model(input_ids=ids).logits
    moved = copy.deepcopy(model)
    params = dict(moved.named_parameters())
    with torch.no_grad():
        for name, m in proposal.matrices.items():
            params[f"{name}.weight"] -= alpha * (m.factor.double() @ m.projection.double())
        for name, step in proposal.dense.items():
            params[name] += alpha * step.delta.double()
        after = moved(input_ids=ids).logits
    realized = (after - base) / alpha
    assert float((realized - t_jvp).norm() / t_jvp.norm()) < 1e-2


def test_payload_ships_dense_values_and_receivers_match(qwen2_factory) -> None:
    model = qwen2_factory(seed=3)
    engine = copy.deepcopy(model)
    sketcher = LoGRASketcher(model, LoGRAConfig(rank=8, dense_params=NORMS, dense_lr=1e-2))
    _backward(model, 0)
    payload = sketcher.apply(sketcher.propose())
    assert payload is not None and sorted(payload.dense) == sorted(sketcher.dense)
    received = Payload.from_bytes(payload.to_bytes())
    assert sorted(received.dense) == sorted(payload.dense) and sorted(received.factors) == sorted(payload.factors)
    apply_payload(received, engine)
    trainer, copy_ = model.state_dict(), engine.state_dict()
    assert all(torch.equal(trainer[k], copy_[k]) for k in trainer)  # matrices and dense values, bit for bit
    assert not torch.equal(trainer["model.norm.weight"], torch.ones_like(trainer["model.norm.weight"]))


def test_dense_state_in_checkpoints(qwen2_factory) -> None:
    model = qwen2_factory(seed=4)
    cfg = LoGRAConfig(rank=8, dense_params=NORMS)
    sketcher = LoGRASketcher(model, cfg)
    _backward(model, 0)
    sketcher.apply(sketcher.propose())
    state = sketcher.state_dict()
    other = LoGRASketcher(qwen2_factory(seed=4), cfg)
    other.load_state_dict(state)
    for name, st in sketcher.dense_state.items():
        assert all(torch.equal(st[k], other.dense_state[name][k]) for k in st)
    with pytest.raises(LoGRAConfigError, match="dense_params"):
        LoGRASketcher(qwen2_factory(seed=4), LoGRAConfig(rank=8)).load_state_dict(state)
    with pytest.raises(LoGRAConfigError, match="matches no parameter"):
        LoGRASketcher(qwen2_factory(seed=4), LoGRAConfig(rank=8, dense_params=("*nope*",)))
