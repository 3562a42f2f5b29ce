"""algorithm.md §6's prediction against the KL realized by the merge, and the two probe paths against each other."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from logra_pl.models import load_policy
from logra_pl.sketch import LoGRAConfig, LoGRASketcher
from logra_pl.sketch.probe import logit_tangent, predicted_kl_terms


def _proposal(model, seed: int):
    sketcher = LoGRASketcher(model, LoGRAConfig.paper(rank=16, update_ratio=1e-2, base_seed=seed))
    gen = torch.Generator().manual_seed(seed)
    for _ in range(2):
        ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
    ids = torch.randint(0, model.config.vocab_size, (3, 10), generator=gen)
    return sketcher, sketcher.propose(), ids


def _kl_full(before: torch.Tensor, after: torch.Tensor, temperature: float) -> float:
    """Mean KL(p ‖ q) per position, written out from the two full softmax distributions."""
    p = torch.softmax(before.double() / temperature, dim=-1)
    q = torch.softmax(after.double() / temperature, dim=-1)
    return float((p * (p.log() - q.log())).sum(-1).mean())


@pytest.fixture(scope="module")
def tiny64(tiny_model_dir):
    model, _ = load_policy(tiny_model_dir, dtype=torch.float64)
    return model


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_realized_kl_matches_prediction(tiny64, seed: int) -> None:
    """The offline tiny Qwen2 (float64), proposals scaled to a 1e-4 budget: realized within 3% of α²·pred."""
    temperature = 1.0  # the training sampling temperature (algorithm.md §10)
    model = copy.deepcopy(tiny64)
    sketcher, proposal, ids = _proposal(model, seed)
    modules = {n: m.module for n, m in sketcher.matrices.items()}
    logits, tangent = logit_tangent(model, modules, proposal, {"input_ids": ids}, mode="jvp")
    vocab = logits.shape[-1]
    pred = float(predicted_kl_terms(logits.reshape(-1, vocab), tangent.reshape(-1, vocab), temperature).mean())
    alpha = math.sqrt(1e-4 / pred)  # scale the step to a 1e-4 budget
    assert sketcher.apply(proposal, alpha=alpha) is not None  # merged as the trainer merges: bf16 factors
    with torch.no_grad():
        after = model(input_ids=ids).logits
    realized = _kl_full(logits.reshape(-1, vocab), after.reshape(-1, vocab), temperature)
    assert abs(realized - alpha**2 * pred) / realized < 0.03, (realized, alpha**2 * pred)


def test_jvp_and_finite_difference_agree(qwen2_factory) -> None:
    model = qwen2_factory(seed=4, dtype=torch.float64)
    sketcher, proposal, ids = _proposal(model, 4)
    modules = {n: m.module for n, m in sketcher.matrices.items()}
    z1, t1 = logit_tangent(model, modules, proposal, {"input_ids": ids}, mode="jvp")
    z2, t2 = logit_tangent(model, modules, proposal, {"input_ids": ids}, mode="fd", fd_step=1e-4)
    torch.testing.assert_close(z1, z2)
    assert float((t1 - t2).norm() / t1.norm()) < 1e-2
    v = z1.shape[-1]
    p1 = float(predicted_kl_terms(z1.reshape(-1, v), t1.reshape(-1, v)).mean())
    p2 = float(predicted_kl_terms(z2.reshape(-1, v), t2.reshape(-1, v)).mean())
    assert abs(p1 - p2) / p1 < 1e-2
    # The probe leaves the weights and the attention implementation as they were.
    assert model.config._attn_implementation == "sdpa"


def test_zero_proposal_has_zero_tangent(qwen2_factory) -> None:
    model = qwen2_factory(seed=5)
    sketcher = LoGRASketcher(model, LoGRAConfig.paper(rank=8))
    proposal = sketcher.propose()  # nothing accumulated: U = 0
    ids = torch.randint(0, model.config.vocab_size, (1, 6))
    _, tangent = logit_tangent(model, {n: m.module for n, m in sketcher.matrices.items()}, proposal, {"input_ids": ids})
    assert float(tangent.abs().max()) == 0.0


def test_jvp_probes_pass_checkpointed_layers_without_recomputation(qwen2_factory) -> None:
    """Under activation checkpointing both forward-mode probes (LoGRA's and a dense step's) call every layer plainly:
    torch 2.11's checkpoint has no ``jvp`` and raised ``NotImplementedError`` there (the first CUDA run), emulated
    here by a ``checkpoint_fn`` that refuses dual tensors. The tangents equal the unwrapped model's bit for bit."""
    from logra_pl.runtime.checkpointing import checkpointed_layers, enable_activation_checkpointing
    from logra_pl.sketch.probe import parameter_logit_tangent

    plain = qwen2_factory(seed=6, dtype=torch.float64)
    sketcher, proposal, ids = _proposal(plain, 6)
    wrapped = copy.deepcopy(plain)
    assert enable_activation_checkpointing(wrapped) == plain.config.num_hidden_layers
    calls = []

    def refuses_duals(fn, *args, **kwargs):
        calls.append(1)
        if any(torch.autograd.forward_ad.unpack_dual(a).tangent is not None for a in args if torch.is_tensor(a)):
            raise NotImplementedError("You must implement the jvp function for custom autograd.Function")
        return fn(*args, **kwargs)

    for layer in checkpointed_layers(wrapped):
        layer.checkpoint_fn = refuses_duals
    with torch.no_grad():
        assert torch.equal(wrapped(input_ids=ids).logits, plain(input_ids=ids).logits)
    assert len(calls) == plain.config.num_hidden_layers  # an ordinary forward does go through the wrappers

    def modules(model):  # the proposal's names, which drop the wrapper's prefix
        named = {n.replace("._checkpoint_wrapped_module", ""): m for n, m in model.named_modules()}
        return {n: named[n] for n in sketcher.matrices}

    got = [logit_tangent(m, modules(m), proposal, {"input_ids": ids}, mode="jvp") for m in (plain, wrapped)]
    for a, b in zip(got[0], got[1], strict=True):
        assert torch.equal(a, b)
    assert float(got[0][1].abs().max()) > 0
    name = "model.layers.0.mlp.down_proj.weight"
    dense = {name: 1e-3 * torch.randn_like(dict(plain.named_parameters())[name])}
    wrapped_names = {n.replace("._checkpoint_wrapped_module", ""): n for n, _ in wrapped.named_parameters()}
    got = [
        parameter_logit_tangent(plain, dense, {"input_ids": ids}),
        parameter_logit_tangent(wrapped, {wrapped_names[k]: v for k, v in dense.items()}, {"input_ids": ids}),
    ]
    for a, b in zip(got[0], got[1], strict=True):
        assert torch.equal(a, b)
    assert len(calls) == plain.config.num_hidden_layers  # neither probe went through a checkpoint
    assert all("forward" not in vars(layer) for layer in checkpointed_layers(wrapped))  # restored


def test_input_scaled_tangent_is_the_merged_change(qwen2_factory) -> None:
    """``input_scaling: rms``: the probe's tangent (jvp) is the logits' change per unit α of the merged step, which
    the merge forms as ``U P diag(s)`` (float32 factors: the step is exactly the proposal's)."""
    model = qwen2_factory(seed=5, dtype=torch.float64)
    cfg = LoGRAConfig(rank=8, refresh_every=0, input_scaling="rms", factor_dtype="float32", lr=1e-3)
    sketcher = LoGRASketcher(model, cfg)
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):  # the first update sets the scales; the second is probed
        ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        proposal = sketcher.propose()
        if sketcher.input_age == 0:
            sketcher.apply(proposal)
    assert any(not bool((m.input_scale == 1).all()) for m in sketcher.matrices.values())
    probe = torch.randint(0, model.config.vocab_size, (2, 10), generator=gen)
    modules = {n: m.module for n, m in sketcher.matrices.items()}
    logits, tangent = logit_tangent(model, modules, proposal, {"input_ids": probe}, mode="jvp")
    alpha = 1e-3
    assert sketcher.apply(proposal, alpha=alpha) is not None
    with torch.no_grad():
        after = model(input_ids=probe).logits
    moved = (after - logits) / alpha
    assert float((moved - tangent).norm() / tangent.norm()) < 1e-2
