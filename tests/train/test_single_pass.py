"""A single-pass update takes the pre-update log-probs and entropy from its training forward (``build_step`` with
``single_pass``; ``backward_over`` fills them in): the same gradients, log-probs and entropy as a separate no-grad
pass before the update, for every loss of the menu; a reader before the backward gets the separate pass's values."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from logra_pl.losses import CISPO, GSPO, PPOClip, ReinforceTIS
from logra_pl.rollout.base import Rollout
from logra_pl.train.backward import backward_over, update_totals
from logra_pl.train.logprobs import response_logprobs, response_logprobs_and_entropy
from logra_pl.train.step import assemble_step

LOSSES = [
    pytest.param(lambda: ReinforceTIS(aggregation="seq_mean_token_mean"), id="tis"),
    pytest.param(lambda: PPOClip(eps_high=0.28, aggregation="seq_mean_token_sum_norm", mask_truncated=True), id="dapo"),
    pytest.param(lambda: GSPO(eps_low=0.02, eps_high=0.03), id="gspo"),
    pytest.param(lambda: CISPO(aggregation="token_mean"), id="cispo"),
]
GROUPS = [[0, 1], [2, 3, 4], [5], [0]]  # three microbatches and a padding one (ranks' forward counts)


def _rollout(rows: int = 6) -> Rollout:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 90, (3,), generator=g).tolist()]
    lengths = torch.randint(1, 7, (rows,), generator=g).tolist()
    responses = [torch.randint(3, 90, (n,), generator=g).tolist() for n in lengths]
    return Rollout(
        prompt_ids=prompts * rows,
        response_ids=responses,
        logprobs=[[-2.0 - 0.1 * j for j in range(len(r))] for r in responses],
        finish_reasons=["length" if i == 3 else "stop" for i in range(rows)],
        prompt_index=[i // 2 for i in range(rows)],
    )


def _context(model, loss_fn, single_pass: bool, calls: list[int]):
    rollout = _rollout()
    advantages = torch.randn(len(rollout), generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    def scores(packed, temperature):  # the separate pre-update pass, as TrainerPasses.scores runs it
        calls.append(packed.input_ids.shape[0])
        with torch.no_grad():
            return response_logprobs_and_entropy(model, packed, temperature)

    ctx = assemble_step(
        0, [{}] * 3, rollout, torch.zeros(len(rollout)), advantages, 0, scores, 0.9, single_pass=single_pass
    )
    ctx.loss_mask = loss_fn.token_mask(ctx.packed.response_mask, rollout.truncated)
    return ctx


def _backward(model, ctx, loss_fn, score):
    model.zero_grad()
    totals = update_totals(ctx, list(range(6)), 8, lambda t: t)
    total = backward_over(
        score, ctx, GROUPS, loss_fn, totals, lambda loss: loss.backward(), torch.device("cpu"), False, 1
    )
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("make_loss", LOSSES)
def test_a_single_pass_update_equals_the_separate_pass(qwen2_factory, make_loss) -> None:
    loss_fn = make_loss()
    model = qwen2_factory(seed=0)
    calls: list[int] = []
    separate = _context(model, loss_fn, single_pass=False, calls=calls)
    assert calls == [6]  # the separate pass ran, over the whole batch
    single = _context(model, loss_fn, single_pass=True, calls=calls)
    assert calls == [6] and single.pending_scores is not None  # deferred: nothing ran
    want, want_grads = _backward(model, separate, loss_fn, partial(response_logprobs, model))
    got, got_grads = _backward(model, single, loss_fn, partial(response_logprobs_and_entropy, model))
    assert calls == [6] and single.pending_scores is None  # filled by the training forward, no second pass
    # The same microbatches at the same weights: the forward's log-probs and entropy are the separate pass's (which
    # ran over all six rows at once: equal to float32 rounding).
    mask = separate.packed.response_mask > 0
    torch.testing.assert_close(single.logp_trainer, separate.logp_trainer, rtol=0, atol=2e-6)
    torch.testing.assert_close(single.entropy, separate.entropy, rtol=0, atol=2e-6)
    assert bool((single.logp_trainer[mask] < 0).all()) and float(single.entropy[mask].min()) > 0
    assert float(single.logp_trainer[~mask].abs().max()) == 0.0  # padding stays zero
    assert got == pytest.approx(want, rel=1e-5, abs=1e-9)
    assert got_grads.keys() == want_grads.keys() and len(want_grads) > 0
    for name, g in want_grads.items():
        assert float(g.abs().max()) > 0, name
        if loss_fn.reference == "rollout":  # the same loss from the same forward: bit for bit
            assert torch.equal(got_grads[name], g), name
        else:  # π_old from the forward itself (ratio exactly 1) against the separate pass's rounding of it
            torch.testing.assert_close(got_grads[name], g, rtol=1e-4, atol=1e-4 * float(g.abs().max()))


def test_a_reader_before_the_backward_gets_the_separate_pass(qwen2_factory) -> None:
    """Whoever reads ``logp_trainer`` (or ``entropy``) before a single-pass update's forward makes the separate pass
    run then: the values a separate pass gives, and the update then proceeds as an ordinary one."""
    loss_fn = ReinforceTIS()
    model = qwen2_factory(seed=1)
    calls: list[int] = []
    separate = _context(model, loss_fn, single_pass=False, calls=calls)
    single = _context(model, loss_fn, single_pass=True, calls=calls)
    assert calls == [6]
    entropy = single.entropy  # the first read runs the deferred pass, once
    assert calls == [6, 6] and single.pending_scores is None
    assert torch.equal(entropy, separate.entropy) and torch.equal(single.logp_trainer, separate.logp_trainer)
    assert calls == [6, 6]
    _, want = _backward(model, separate, loss_fn, partial(response_logprobs, model))
    _, got = _backward(model, single, loss_fn, partial(response_logprobs, model))
    assert all(torch.equal(got[n], g) for n, g in want.items())
    with pytest.raises(AttributeError, match="no attribute 'missing'"):
        _ = single.missing
