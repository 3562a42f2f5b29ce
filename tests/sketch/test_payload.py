"""The payload: what the trainer merges is what a receiver applies, bit for bit, on any row shard."""

from __future__ import annotations

import copy

import pytest
import torch

from logra_pl.sketch import (
    LoGRAConfig,
    LoGRASketcher,
    Payload,
    apply_payload,
    make_projection,
    merge_operand,
    merge_rows_,
)


def _trained_step(model, cfg: LoGRAConfig, steps: int = 2):
    """Run `steps` real updates; return (weights before the last, payload of the last, sketcher)."""
    sketcher = LoGRASketcher(model, cfg)
    gen = torch.Generator().manual_seed(0)
    before = payload = None
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (3, 10), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        before = copy.deepcopy(model.state_dict())
        proposal = sketcher.propose()
        proposal.alpha = 0.7  # a step controller's multiplier travels in the payload
        payload = sketcher.apply(proposal)
    return before, payload, sketcher


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian", "hadamard"])
def test_payload_on_fresh_copy_reproduces_trainer_bit_for_bit(qwen2_factory, distribution: str) -> None:
    model = qwen2_factory(seed=0)
    before, payload, _ = _trained_step(model, LoGRAConfig(rank=16, distribution=distribution, update_ratio=1e-3))
    assert payload.alpha == 0.7 and payload.update_index == 1

    # A receiver: the pre-update weights as a plain state dict, given only the serialised payload.
    received = Payload.from_bytes(payload.to_bytes())
    state = {k: v.clone() for k, v in before.items()}
    merged = apply_payload(received, state)
    assert len(merged) == 14
    changed = 0
    for key, value in model.state_dict().items():
        assert torch.equal(state[key], value), key
        changed += int(not torch.equal(before[key], value))
    assert changed == 14  # exactly the selected matrices moved

    # And as a module (named parameters, wrapper prefixes ignored).
    other = qwen2_factory(seed=0)
    other.load_state_dict(before)
    apply_payload(received, other)
    for key, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[key], value), key


def test_payload_is_compact_and_typed(qwen2_factory) -> None:
    model = qwen2_factory(seed=1)
    _, payload, sketcher = _trained_step(model, LoGRAConfig(rank=8), steps=1)
    dense = sum(m.d_out * m.d_in * 2 for m in sketcher.matrices.values())  # bf16 full tensors
    assert payload.nbytes == sum(m.d_out * 8 * 2 for m in sketcher.matrices.values())
    assert payload.nbytes * 8 < dense
    assert all(f.dtype == torch.bfloat16 for f in payload.factors.values())
    assert len(payload.to_bytes()) < payload.nbytes + 8192
    with pytest.raises(ValueError, match="not a"):
        Payload.from_bytes(b"garbage bytes that are not safetensors")


def test_payload_for_another_model_is_refused(qwen2_factory) -> None:
    model = qwen2_factory(seed=2)
    _, payload, _ = _trained_step(model, LoGRAConfig(rank=8), steps=1)
    stranger = qwen2_factory(seed=2, num_hidden_layers=1)
    with pytest.raises(KeyError, match="another model"):
        apply_payload(payload, stranger)


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian", "hadamard"])
@pytest.mark.parametrize("cut", [1, 333, 512])
def test_merge_on_two_row_shards_equals_whole(distribution: str, cut: int) -> None:
    d_out, d_in, rank = 700, 96, 32
    gen = torch.Generator().manual_seed(cut)
    weight = torch.randn(d_out, d_in, generator=gen)
    # Factor rows of very different magnitudes, as real RowAdam factors have.
    factor = (torch.randn(d_out, rank, generator=gen) * torch.logspace(-6, 0, d_out).unsqueeze(1)).bfloat16()
    operand, scale = merge_operand(seed=99, rank=rank, d_in=d_in, distribution=distribution)
    assert torch.equal((operand * scale).float(), make_projection(99, rank, d_in, distribution))

    whole = weight.clone()
    merge_rows_(whole, factor, operand, scale, chunk_rows=256)
    top, bottom = weight[:cut].clone(), weight[cut:].clone()
    merge_rows_(top, factor, operand, scale, row_offset=0, chunk_rows=100)
    merge_rows_(bottom, factor, operand, scale, row_offset=cut, chunk_rows=64)
    assert torch.equal(torch.cat([top, bottom]), whole)
    # And it is the spec's W − F P.
    torch.testing.assert_close(whole, weight - factor.float() @ (operand * scale).float(), rtol=0, atol=1e-6)


def test_merge_rejects_rows_outside_factor() -> None:
    operand, scale = merge_operand(1, 4, 8, "rademacher")
    with pytest.raises(ValueError, match="row offset"):
        merge_rows_(torch.zeros(5, 8), torch.zeros(6, 4), operand, scale, row_offset=3)


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian", "hadamard"])
@pytest.mark.parametrize("rank", [16, 12])  # power of two (scale folded into ±1) and not
def test_merge_with_cached_projection_equals_fresh_draw(distribution: str, rank: int) -> None:
    """Reusing an already drawn P gives the same (M, c), and so the same merged weights, bit for bit."""
    d_in, d_out = 96, 70
    fresh, fresh_scale = merge_operand(7, rank, d_in, distribution)
    cached, cached_scale = merge_operand(
        7, rank, d_in, distribution, projection=make_projection(7, rank, d_in, distribution)
    )
    assert torch.equal(cached, fresh) and cached_scale == fresh_scale and cached.dtype == torch.float64
    gen = torch.Generator().manual_seed(rank)
    weight = torch.randn(d_out, d_in, generator=gen)
    factor = (torch.randn(d_out, rank, generator=gen) * torch.logspace(-6, 0, d_out).unsqueeze(1)).bfloat16()
    a, b = weight.clone(), weight.clone()
    merge_rows_(a, factor, fresh, fresh_scale)
    merge_rows_(b, factor, cached, cached_scale)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="cached projection has shape"):
        merge_operand(7, rank, d_in, distribution, projection=torch.zeros(rank, d_in + 1))


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian", "hadamard"])
def test_trainer_merge_reuses_the_sketchers_projection(qwen2_factory, monkeypatch, distribution: str) -> None:
    """The sketcher's merge draws no P (it reuses the one it sketched with); a receiver draws each P once."""
    import logra_pl.sketch.payload as payload_module

    draws: list[int] = []
    original = payload_module.make_projections

    def counting(seeds, *args, **kwargs):  # a group of same-shaped matrices at a time
        draws.extend(seeds)
        return original(seeds, *args, **kwargs)

    monkeypatch.setattr(payload_module, "make_projections", counting)
    model = qwen2_factory(seed=3)
    before, payload, sketcher = _trained_step(model, LoGRAConfig(rank=16, distribution=distribution), steps=2)
    assert draws == []
    state = {k: v.clone() for k, v in before.items()}
    apply_payload(payload, state)
    assert sorted(draws) == sorted(payload.seed(n) for n in payload.factors)
    for key, value in model.state_dict().items():
        assert torch.equal(state[key], value), key
    # A cached P of another seed (a stale one) is ignored: the merge draws the payload's own P.
    draws.clear()
    stale = {n: (payload.seed(n) + 1, torch.zeros(16, m.d_in)) for n, m in sketcher.matrices.items()}
    state = {k: v.clone() for k, v in before.items()}
    apply_payload(payload, state, projections=stale)
    assert len(draws) == len(payload.factors)
    for key, value in model.state_dict().items():
        assert torch.equal(state[key], value), key
