"""``input_precondition: gram``: the direction's numerator right-multiplied by the inverse damped Gram of the update's
projected layer inputs, checked against ``(G Pᵀ)(P A Pᵀ + λ·I)⁻¹`` written out here from the dense gradient
(plain autograd on a copy) and the layer inputs and output gradients captured by hooks on that copy."""

from __future__ import annotations

import copy

import pytest
import torch

from logra_pl.sketch import LoGRAConfig, LoGRASketcher
from logra_pl.sketch.config import LoGRAConfigError

LR, DAMPING = 10.0, 0.1  # lr 10: steps far above the fp32 rounding of W, so W_after − W_before is the step


def _ids(model, seed: int) -> torch.Tensor:
    return torch.randint(3, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(seed))


def _reference(model, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per target matrix: the dense gradient ``G`` and, over the tokens whose output gradient is non-zero, the layer
    inputs' second moment ``A = Σ x xᵀ`` and their count, from a copy with hooks."""
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.requires_grad_(False)
    linears = {n: m for n, m in ref.named_modules() if isinstance(m, torch.nn.Linear) and "proj" in n}
    inputs: dict[str, torch.Tensor] = {}
    outputs: dict[str, torch.Tensor] = {}
    for name, m in linears.items():
        m.weight.requires_grad_(True)
        m.register_forward_hook(lambda mod, args, out, name=name: inputs.__setitem__(name, args[0].detach()))
        m.register_full_backward_hook(lambda mod, gin, gout, name=name: outputs.__setitem__(name, gout[0].detach()))
    ids = _ids(ref, seed)
    ref(input_ids=ids, labels=ids).loss.backward()
    out = {}
    for name, m in linears.items():
        x = inputs[name].reshape(-1, m.in_features).double()
        live = outputs[name].reshape(-1, m.out_features).ne(0).any(dim=1)
        out[name] = (m.weight.grad.double(), x[live].T @ x[live], float(live.sum()))
    return out


@pytest.mark.parametrize("distribution", ["rademacher", "hadamard"])
def test_the_step_is_the_sketch_times_the_inverse_damped_input_gram(qwen2_factory, distribution: str) -> None:
    model = qwen2_factory(seed=0)
    ref = _reference(model, 1)
    cfg = LoGRAConfig.paper(
        rank=16, distribution=distribution, update_rule="sgd", input_precondition="gram", gram_damping=DAMPING,
        step_mode="lr", lr=LR, factor_dtype="float32",
    )  # fmt: skip
    sketcher = LoGRASketcher(model, cfg)
    before = {n: m.module.weight.detach().double().clone() for n, m in sketcher.matrices.items()}
    projections = {n: m.projection.double().clone() for n, m in sketcher.matrices.items()}
    ids = _ids(model, 1)
    model(input_ids=ids, labels=ids).loss.backward()
    assert sketcher.apply(sketcher.propose()) is not None
    for name, m in sketcher.matrices.items():
        g, a, n = ref[name]
        p = projections[name]
        second = p @ a @ p.T / n
        damped = second + DAMPING * second.trace() / p.shape[0] * torch.eye(p.shape[0], dtype=torch.float64)
        want = -LR * (g @ p.T) @ torch.linalg.inv(damped) @ p
        moved = m.module.weight.detach().double() - before[name]
        assert float((moved - want).norm() / want.norm()) < 1e-4, name
        # The preconditioner changed the step: it is not the plain sketched SGD step.
        plain = -LR * (g @ p.T) @ p
        assert float((want / want.norm() - plain / plain.norm()).norm()) > 0.1, name


def test_grams_are_per_update_buffers_counted_as_sketches(qwen2_factory) -> None:
    model = qwen2_factory(seed=0)
    ref = _reference(model, 2)
    sketcher = LoGRASketcher(model, LoGRAConfig.paper(rank=8, input_precondition="gram"))
    ids = _ids(model, 2)
    model(input_ids=ids, labels=ids).loss.backward()
    stacks = sketcher.sketch_stacks()
    assert len(stacks) == 3 * len(sketcher.groups)  # each group's sketches, then its Grams and token counts
    name, m = next(iter(sketcher.matrices.items()))
    # The tokens whose output gradient is non-zero, counted by the hooks of the reference: at most every token but
    # each row's last (a query at position 0 attends to itself alone, so its gradient can be exactly zero or not by
    # a rounding, which differs between CPUs).
    assert float(m.gram_tokens) == ref[name][2] and 2 * 10 - 4 <= ref[name][2] <= 2 * 10 - 2
    sketcher.apply(sketcher.propose())
    assert not bool(m.gram.any()) and float(m.gram_tokens) == 0.0  # zeroed for the next update
    from logra_pl.sketch import memory_report

    plain_sketcher = LoGRASketcher(qwen2_factory(seed=0), LoGRAConfig.paper(rank=8))
    plain = memory_report(qwen2_factory(seed=0), sketcher=plain_sketcher)
    report = memory_report(model, sketcher=sketcher)
    assert report.sketches - plain.sketches == len(sketcher.matrices) * (8 * 8 * 4 + 4)


def test_gram_with_per_entry_adam_is_refused() -> None:
    with pytest.raises(LoGRAConfigError, match="input_precondition"):
        LoGRAConfig.paper(update_rule="adam", input_precondition="gram")
