"""Sketch accumulation (algorithm.md §3) against dense weight gradients computed independently."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from logra_pl.sketch import DEFAULT_TARGETS, LoGRAConfig, LoGRASketcher


def _microbatches(vocab: int, n: int = 3, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (2, 7 + 3 * i), generator=gen) for i in range(n)]


def _dense_grads(model: nn.Module, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Reference: ordinary autograd on a copy whose target weights require grad."""
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.requires_grad_(False)
    targets = {n: m for n, m in ref.named_modules() if n.rsplit(".", 1)[-1] in DEFAULT_TARGETS}
    for m in targets.values():
        m.weight.requires_grad_(True)
    for ids in batches:
        ref(input_ids=ids, labels=ids).loss.backward()
    return {n: m.weight.grad.clone() for n, m in targets.items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "nonreentrant-checkpoint"])
def test_sketch_equals_dense_gradient_times_projection(qwen2_factory, checkpointing: bool) -> None:
    model = qwen2_factory(seed=0)
    batches = _microbatches(model.config.vocab_size)
    grads = _dense_grads(model, batches)

    if checkpointing:
        model.train()  # transformers only checkpoints in training mode; the tiny Qwen2 has no dropout
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    sketcher = LoGRASketcher(model, LoGRAConfig(rank=16, base_seed=3))
    calls = []
    model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda *_: calls.append(1))
    for ids in batches:
        model(input_ids=ids, labels=ids).loss.backward()
    # With checkpointing the layer's forward is replayed in backward: its first Linear ran twice per microbatch.
    assert len(calls) == len(batches) * (2 if checkpointing else 1)

    assert set(sketcher.matrices) == set(grads)
    assert len(grads) == 2 * 7
    for name, matrix in sketcher.matrices.items():
        expected = grads[name] @ matrix.projection.T
        assert _rel(matrix.sketch, expected) < 1e-5, name
    # Selected weights never hold a dense gradient.
    for matrix in sketcher.matrices.values():
        assert matrix.module.weight.grad is None
        assert not matrix.module.weight.requires_grad


def test_backward_reaches_sketches_with_everything_frozen(qwen2_factory) -> None:
    """All non-target parameters frozen (algorithm.md §1 default): sketches still fill, nothing else gets a grad."""
    model = qwen2_factory(seed=2)
    sketcher = LoGRASketcher(model, LoGRAConfig(rank=8))
    assert not any(p.requires_grad for p in model.parameters())
    ids = _microbatches(model.config.vocab_size, n=1)[0]
    loss = model(input_ids=ids, labels=ids).loss
    assert loss.requires_grad
    loss.backward()
    first = sketcher.matrices["model.layers.0.self_attn.q_proj"]
    assert first.sketch.abs().sum() > 0  # the lowest layer too
    assert all(p.grad is None for p in model.parameters())


def test_no_accumulation_without_grad(qwen2_factory) -> None:
    model = qwen2_factory(seed=4)
    sketcher = LoGRASketcher(model, LoGRAConfig(rank=8))
    ids = _microbatches(model.config.vocab_size, n=1)[0]
    with torch.no_grad():
        model(input_ids=ids)
    assert all(float(s.abs().sum()) == 0.0 for s in sketcher.sketches().values())


def test_hook_saves_only_tokens_by_rank() -> None:
    """The only activation kept for backward by a sketched layer is Z (tokens × r), never X (tokens × d_in)."""
    tokens, d_in, d_out, rank = 11, 40, 24, 4
    layer = nn.Sequential()
    layer.add_module("up_proj", nn.Linear(d_in, d_out))
    LoGRASketcher(layer, LoGRAConfig(targets=("up_proj",), rank=rank))
    x = torch.randn(tokens, d_in, requires_grad=True)
    saved: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    assert (tokens, rank) in saved
    assert all(s[0] != tokens or s == (tokens, rank) for s in saved), saved  # no tokens × d_in activation
    y.sum().backward()  # and the graph still runs
    assert x.grad is not None and x.grad.shape == (tokens, d_in)


def test_sketches_add_over_microbatches_and_reset(qwen2_factory) -> None:
    model = qwen2_factory(seed=5)
    sketcher = LoGRASketcher(model, LoGRAConfig(rank=8))
    a, b = _microbatches(model.config.vocab_size, n=2)
    model(input_ids=a, labels=a).loss.backward()
    one = {n: s.clone() for n, s in sketcher.sketches().items()}
    sketcher.zero_sketches()
    model(input_ids=b, labels=b).loss.backward()
    two = {n: s.clone() for n, s in sketcher.sketches().items()}
    sketcher.zero_sketches()
    model(input_ids=a, labels=a).loss.backward()
    model(input_ids=b, labels=b).loss.backward()
    for name, s in sketcher.sketches().items():
        torch.testing.assert_close(s, one[name] + two[name], rtol=1e-5, atol=1e-7)


def test_forward_mode_ad_passes_through() -> None:
    """A JVP through sketched layers (what the KL probe runs) equals the JVP of the plain layers."""
    import torch.autograd.forward_ad as fwad

    plain = nn.Sequential()
    plain.add_module("up_proj", nn.Linear(8, 6))
    plain.add_module("act", nn.Tanh())
    plain.add_module("down_proj", nn.Linear(6, 8))
    sketched = copy.deepcopy(plain)
    LoGRASketcher(sketched, LoGRAConfig(targets=("up_proj", "down_proj"), rank=4))
    x, tangent = torch.randn(3, 8), torch.randn(3, 8)
    with fwad.dual_level():
        out = sketched(fwad.make_dual(x, tangent))
        got = fwad.unpack_dual(out).tangent
    _, expected = torch.func.jvp(plain, (x,), (tangent,))
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("distribution", ["rademacher", "hadamard"])
def test_bf16_operands_stay_within_their_tolerance_of_the_fp64_sketch(qwen2_factory, distribution: str) -> None:
    """``logra.sketch_operands: bfloat16`` on a model whose layers run in bf16 (as under ``bf16-mixed``): the sketch
    of every matrix is within 2⁻¹⁵ (relative Frobenius) of ``Σ dYᵀ X Pᵀ`` computed in float64 from the layer inputs
    and output gradients captured in the test; the fp32 operands are within 1e-6 of it; both see the same bf16 X."""
    sketches, dense = {}, {}
    for operands in ("float32", "bfloat16"):
        model = qwen2_factory(seed=0).to(torch.bfloat16)
        config = LoGRAConfig(rank=16, distribution=distribution, sketch_operands=operands)
        sketcher = LoGRASketcher(model, config)
        captured: dict[str, list[torch.Tensor]] = {n: [] for n in sketcher.matrices}

        def capture(name: str, captured: dict[str, list[torch.Tensor]] = captured):
            def hook(module, args, output) -> None:
                x = args[0].detach().reshape(-1, module.in_features).to(torch.float64)

                def grad(g: torch.Tensor) -> None:
                    dy = g.detach().reshape(-1, module.out_features).to(torch.float64)
                    captured[name].append(dy.T @ x)

                output.register_hook(grad)

            return hook

        for name, matrix in sketcher.matrices.items():
            matrix.module.register_forward_hook(capture(name))  # after the sketch hook: its output's gradient is dY
        for ids in _microbatches(model.config.vocab_size):
            model(input_ids=ids, labels=ids).loss.backward()
        sketches[operands] = {n: m.sketch.clone() for n, m in sketcher.matrices.items()}
        projections = {n: m.projection.to(torch.float64) for n, m in sketcher.matrices.items()}
        dense[operands] = {n: sum(captured[n]) @ projections[n].T for n in sketcher.matrices}
        if operands == "bfloat16":
            assert all(m.signs is not None and m.signs.dtype == torch.bfloat16 for m in sketcher.matrices.values())
    for name, reference in dense["bfloat16"].items():
        assert _rel(sketches["bfloat16"][name].to(torch.float64), reference) < 2**-15, name
        assert _rel(sketches["float32"][name].to(torch.float64), dense["float32"][name]) < 1e-6, name


def test_bf16_operands_need_a_projection_of_signs() -> None:
    """A Gaussian ``P`` has no exact bf16 form: refused, naming the distributions that have one; the default is not
    written into checkpoints (old ones read the same)."""
    from logra_pl.sketch.config import LoGRAConfigError

    with pytest.raises(LoGRAConfigError, match="rademacher or hadamard"):
        LoGRAConfig(sketch_operands="bfloat16", distribution="gaussian")
    with pytest.raises(LoGRAConfigError, match="sketch_operands"):
        LoGRAConfig(sketch_operands="int8")
    assert "sketch_operands" not in LoGRAConfig().to_dict()
    assert LoGRAConfig(sketch_operands="bfloat16").to_dict()["sketch_operands"] == "bfloat16"


def test_a_checkpointed_layer_projects_once_per_microbatch(qwen2_factory) -> None:
    """Under ``enable_activation_checkpointing`` the first pass's saved tensors are dropped and recomputed in the
    backward: the hook projects in the replay only (one ``Z = X Pᵀ`` per matrix and microbatch, counted), and the
    sketches equal, bit for bit, those of the same microbatches without checkpointing."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from logra_pl.runtime.checkpointing import enable_activation_checkpointing
    from logra_pl.sketch import trace

    class CountProjections(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.products = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "logra.sketch.project" in trace.open_ranges() and func.overloadpacket.__name__ == "mm":
                self.products += 1
            return func(*args, **(kwargs or {}))

    sketches, counts = {}, {}
    for checkpointing in (False, True):
        model = qwen2_factory(seed=0)
        batches = _microbatches(model.config.vocab_size)
        if checkpointing:
            assert enable_activation_checkpointing(model) == model.config.num_hidden_layers
        sketcher = LoGRASketcher(model, LoGRAConfig(rank=4))
        count = CountProjections()
        with count, trace.listening():
            for ids in batches:
                model(input_ids=ids, labels=ids).loss.backward()
        sketches[checkpointing] = {n: m.sketch.clone() for n, m in sketcher.matrices.items()}
        counts[checkpointing] = count.products
    assert counts[True] == counts[False] == len(batches) * len(sketches[False])
    assert all(torch.equal(sketches[True][n], sketches[False][n]) for n in sketches[False])
