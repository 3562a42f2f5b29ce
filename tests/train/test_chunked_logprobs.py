"""Chunked log-probs (``train/chunked_logprobs.py``) against the full ``(B, R, V)`` path: values, entropy and
gradients for several chunk sizes, temperatures and padded (and multi-turn masked) rows; a formula check of the
custom backward on its own; and the sketches a LoGRA backward accumulates through it."""

from __future__ import annotations

import copy

import pytest
import torch

from logra_pl.sketch import LoGRAConfig, LoGRASketcher
from logra_pl.train.chunked_logprobs import ChunkedTokenLogprobs, chunked_response_scores, token_scores
from logra_pl.train.logprobs import pack_responses, response_logprobs, response_logprobs_and_entropy


def _batch(vocab: int, seed: int = 0, masked: bool = False):
    """Three rows of different prompt and response lengths (right padding), optionally with inserted tokens."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 9, 3)]
    responses = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (6, 2, 9)]
    masks = None
    if masked:  # row 2: an environment inserted tokens 3-5 into the response
        masks = [[1] * 6, [1] * 2, [1, 1, 1, 0, 0, 0, 1, 1, 1]]
    return pack_responses(prompts, responses, pad_token_id=0, masks=masks)


@pytest.mark.parametrize("chunk", [1, 4, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("masked", [False, True], ids=["one-turn", "multi-turn"])
def test_values_entropy_and_gradients_equal_the_full_path(
    qwen2_factory, chunk: int, temperature: float, masked: bool
) -> None:
    model = qwen2_factory(seed=0)
    packed = _batch(model.config.vocab_size, masked=masked)
    weights = torch.randn(packed.targets.shape, generator=torch.Generator().manual_seed(5))

    full = copy.deepcopy(model)
    want_logp, want_entropy = response_logprobs_and_entropy(full, packed, temperature)
    (want_logp * weights).sum().backward()
    logp, entropy = chunked_response_scores(model, packed, temperature, chunk)
    (logp * weights).sum().backward()

    torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-5, atol=1e-5)
    assert torch.all(logp[packed.response_mask == 0] == 0) and torch.all(entropy[packed.response_mask == 0] == 0)
    grads = {n: p.grad for n, p in full.named_parameters()}
    for name, p in model.named_parameters():
        assert (p.grad is None) == (grads[name] is None), name
        if p.grad is not None:
            scale = float(grads[name].abs().max())
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-5 * max(scale, 1e-3), msg=name)
    assert model.lm_head.forward.__func__ is type(model.lm_head).forward  # the projection's forward is restored


def test_the_backward_is_the_softmax_gradient_written_out() -> None:
    """For ``log p(y) = z_y − logsumexp(z)``, ``z = (hWᵀ + b)/T``: ``∂/∂z = onehot(y) − softmax(z)``, in float64
    here, against the custom backward for every chunk size."""
    gen = torch.Generator().manual_seed(0)
    n, h, v, temperature = 7, 5, 11, 0.8
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64)
    head = torch.nn.Linear(h, v, dtype=torch.float64)
    targets = torch.randint(0, v, (n,), generator=gen)
    upstream = torch.randn(n, generator=gen, dtype=torch.float64)
    z = (hidden @ head.weight.T + head.bias) / temperature
    p = torch.softmax(z, dim=-1)
    dz = (torch.nn.functional.one_hot(targets, v) - p) * upstream[:, None] / temperature
    want = {"hidden": dz @ head.weight, "weight": dz.T @ hidden, "bias": dz.sum(0)}
    want_logp = z.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(z, dim=-1)
    for chunk in (1, 3, 7, 50):
        x = hidden.clone().requires_grad_(True)
        head.zero_grad()
        logp, entropy = token_scores(x, head, targets, temperature, chunk)
        torch.testing.assert_close(logp.double(), want_logp, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(entropy.double(), -(p * torch.log(p)).sum(-1), rtol=1e-6, atol=1e-6)
        (logp.double() * upstream).sum().backward()
        got = {"hidden": x.grad, "weight": head.weight.grad, "bias": head.bias.grad}
        for key, value in want.items():
            torch.testing.assert_close(got[key].double(), value, rtol=1e-5, atol=1e-6, msg=f"{key}, chunk {chunk}")
    with pytest.raises(ValueError, match="chunk must be at least 1"):
        token_scores(hidden, head, targets, 1.0, 0)
    assert ChunkedTokenLogprobs is not None


def test_a_logra_backward_through_it_accumulates_the_same_sketches(qwen2_factory) -> None:
    """The sketches ``S = G Pᵀ`` a LoGRA backward accumulates through the chunked path equal the full path's."""
    sketches = {}
    for kind in ("full", "chunked"):
        model = qwen2_factory(seed=0)
        sketcher = LoGRASketcher(model, LoGRAConfig(rank=8, base_seed=3))
        for seed in (0, 1):
            packed = _batch(model.config.vocab_size, seed=seed)
            if kind == "full":
                logp = response_logprobs(model, packed, 0.9)
            else:
                logp = chunked_response_scores(model, packed, 0.9, chunk=5)[0]
            (-logp.sum()).backward()
        sketches[kind] = {name: m.sketch.clone() for name, m in sketcher.matrices.items()}
    assert sketches["full"].keys() == sketches["chunked"].keys() and sketches["full"]
    for name, want in sketches["full"].items():
        got = sketches["chunked"][name]
        assert float((got - want).norm() / want.norm()) < 1e-5, name


def test_models_whose_logits_are_not_the_projection_are_refused(qwen2_factory) -> None:
    model = qwen2_factory(seed=0)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match=r"final_logit_softcapping after it; set model\.logprob_chunk_tokens: null"):
        chunked_response_scores(model, _batch(model.config.vocab_size), 1.0, 4)


def test_a_run_with_chunked_logprobs_trains_as_the_full_path_does(tmp_path, rl_run) -> None:
    """``model.logprob_chunk_tokens``: two LoGRA updates on ``tiny`` with chunks of 3 tokens end at the weights of
    the same run on the full path, within float tolerance (the projections of a chunk and of the whole batch may
    round differently), with the same rewards."""
    from logra_pl.module import LoGRAPolicyModule, RolloutSettings

    ends = {}
    for chunk in (None, 3):
        torch.manual_seed(0)
        module = LoGRAPolicyModule(
            policy="tiny", rollout=RolloutSettings(max_new_tokens=6), microbatch_size=4, logprob_chunk_tokens=chunk
        )
        rl_run(module, tmp_path / str(chunk), 2)
        assert module.passes.chunk_tokens == chunk
        ends[chunk] = ({k: v.clone() for k, v in module.policy.state_dict().items()}, module.step_context.rewards)
    (full, full_rewards), (chunked, chunked_rewards) = ends[None], ends[3]
    assert torch.equal(full_rewards, chunked_rewards)
    start = LoGRAPolicyModule(policy="tiny")
    start.configure_model()
    initial = start.policy.state_dict()
    assert any(not torch.equal(full[k], initial[k]) for k in full)  # the updates moved the weights
    for key in full:
        torch.testing.assert_close(chunked[key], full[key], rtol=1e-4, atol=1e-6, msg=key)
    with pytest.raises(Exception, match="logprob_chunk_tokens must be"):
        LoGRAPolicyModule(policy="tiny", logprob_chunk_tokens=0)
