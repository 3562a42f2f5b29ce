"""The loss menu of issue 25 against independent computations: plain Python loops over tokens and sequences give each
loss, its gradient, every aggregation mode, the KL penalty and the entropy; the normalisers add up over microbatches
and ranks; the reference policy is kept, planned and restored as documented; each loss runs 20 updates via the CLI."""

from __future__ import annotations

import glob
import math
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from logra_pl.errors import ConfigError, ResumeMismatchError
from logra_pl.losses import (
    CISPO,
    GSPO,
    PPOClip,
    ReinforceTIS,
    UpdateTotals,
    build_loss,
    kl_estimate,
)
from logra_pl.rollout.base import Rollout
from logra_pl.train.backward import backward_over, update_totals
from logra_pl.train.logprobs import pack_responses, response_logprobs, response_logprobs_and_entropy, token_entropy
from logra_pl.train.step import assemble_step

ROOT = Path(__file__).resolve().parents[2]
MODES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


# ------------------------------------------------------------------------------------ independent loops
def _batch(seed: int, rows: int = 6, width: int = 7):
    """float64 log-probs with ratios inside and far outside any clip, advantages of both signs, ragged masks
    (one empty row), per-response weights."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 3
    logp_old = logp + torch.randn(rows, width, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(rows, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    lengths[2] = 0
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float64)
    weights = 0.5 + torch.rand(rows, generator=g, dtype=torch.float64)
    return logp, logp_old, adv, mask, weights


def _rows(mask: torch.Tensor) -> list[list[int]]:
    """Each row's valid token positions."""
    return [[t for t in range(mask.shape[1]) if mask[i, t] > 0] for i in range(mask.shape[0])]


def _coefficients(mask: torch.Tensor, mode: str, constant: int) -> list[float]:
    """``c_i`` of ``loss = Σ_i c_i Σ_t term_it`` in each mode, counted by hand."""
    rows = _rows(mask)
    tokens = sum(len(r) for r in rows)
    sequences = sum(1 for r in rows if r)
    if mode == "token_mean":
        return [1.0 / tokens for _ in rows]
    if mode == "seq_mean_token_mean":
        return [1.0 / (sequences * len(r)) if r else 0.0 for r in rows]
    return [1.0 / (sequences * constant) for _ in rows]


def _ppo_loop(logp, old, adv, mask, w, low, high):
    """Per-token ``(term, d term / d logp)`` of PPO's clipped surrogate (min picks the smaller; both equal inside)."""
    out = {}
    for i, row in enumerate(_rows(mask)):
        for t in row:
            r = math.exp(float(logp[i, t]) - float(old[i, t]))
            a = float(adv[i]) * float(w[i])
            clipped = min(max(r, 1 - low), 1 + high)
            unclipped_active = r * a <= clipped * a or 1 - low <= r <= 1 + high
            out[i, t] = (-min(r * a, clipped * a), -a * r if unclipped_active else 0.0)
    return out


def _gspo_loop(logp, old, adv, mask, w, low, high):
    """Per-sequence ``(term, d term / d logp_it)``: ``s_i = exp(mean_t(log π − log π_old))``, the term counted on each
    of the row's tokens; ``d s_i / d logp_it = s_i / L_i``."""
    out = {}
    for i, row in enumerate(_rows(mask)):
        if not row:
            continue
        s = math.exp(sum(float(logp[i, t]) - float(old[i, t]) for t in row) / len(row))
        a = float(adv[i]) * float(w[i])
        clipped = min(max(s, 1 - low), 1 + high)
        active = s * a <= clipped * a or 1 - low <= s <= 1 + high
        out[i] = (-min(s * a, clipped * a), (-a * s / len(row)) if active else 0.0, len(row))
    return out


def _cispo_loop(logp, old, adv, mask, w, low, high):
    """Per-token ``(term, d term / d logp)``: the clipped ratio is a constant (stop-gradient)."""
    out = {}
    for i, row in enumerate(_rows(mask)):
        for t in row:
            r = math.exp(float(logp[i, t]) - float(old[i, t]))
            weight = min(r, 1 + high) if low is None else min(max(r, 1 - low), 1 + high)
            a = float(adv[i]) * float(w[i])
            out[i, t] = (-weight * a * float(logp[i, t]), -weight * a)
    return out


def _aggregated(loss_fn, logp, old, adv, mask, w, constant=5):
    """The loss object's value and gradient for one update (one microbatch), through the module's seam:
    ``weights × row_scale`` and the whole update's token count."""
    lengths = mask.sum(dim=1)
    totals = UpdateTotals(int(lengths.sum()), int((lengths > 0).sum()), constant)
    weights = w.clone()
    scale = loss_fn.row_scale(lengths, totals)
    if scale is not None:
        weights = weights * scale
    x = logp.clone().requires_grad_(True)
    value = loss_fn(x, old, adv, mask, totals.tokens, weights)
    (grad,) = torch.autograd.grad(value, x)
    return float(value.detach()), grad


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("low", "high"), [(0.2, 0.2), (0.2, 0.28), (0.1, 0.5)])
def test_ppo_clip_higher_is_the_loop(mode: str, low: float, high: float) -> None:
    logp, old, adv, mask, w = _batch(1)
    loss_fn = PPOClip(eps_low=low, eps_high=high, aggregation=mode)
    value, grad = _aggregated(loss_fn, logp, old, adv, mask, w)
    c = _coefficients(mask, mode, 5)
    terms = _ppo_loop(logp, old, adv, mask, w, low, high)
    assert value == pytest.approx(sum(c[i] * term for (i, _), (term, _) in terms.items()), rel=1e-12)
    expected = torch.zeros_like(grad)
    for (i, t), (_, d) in terms.items():
        expected[i, t] = c[i] * d
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)


def test_clip_higher_keeps_the_gradient_of_rising_tokens_that_the_symmetric_clip_stops() -> None:
    """A token with A > 0 whose ratio rose to 1.25: symmetric ε = 0.2 clips it (no gradient), [0.8, 1.28] does not."""
    logp, old = torch.tensor([[math.log(1.25)]], dtype=torch.float64), torch.zeros(1, 1, dtype=torch.float64)
    adv, mask = torch.ones(1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64)
    _, symmetric = _aggregated(PPOClip(clip_eps=0.2), logp, old, adv, mask, torch.ones(1, dtype=torch.float64))
    _, higher = _aggregated(PPOClip(eps_high=0.28), logp, old, adv, mask, torch.ones(1, dtype=torch.float64))
    assert float(symmetric) == 0.0 and float(higher) == pytest.approx(-1.25)
    assert PPOClip(eps_high=0.28).stats(logp, old, mask)["clip_fraction"] == (0.0, 1.0)
    assert PPOClip(clip_eps=0.2).stats(logp, old, mask)["clip_fraction"] == (1.0, 1.0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("low", "high"), [(3e-4, 4e-4), (0.05, 0.08)])
def test_gspo_is_the_sequence_loop(mode: str, low: float, high: float) -> None:
    logp, old, adv, mask, w = _batch(2)
    # Sequence ratios near 1, moved past the clip toward the advantage's sign on even rows (clipped: no gradient)
    # and against it on odd rows (the unclipped term is the smaller: gradient kept).
    direction = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(len(adv))], dtype=torch.float64)
    old = logp + (old - logp) * 0.001 - (direction * torch.sign(adv) * 0.01).unsqueeze(1)
    loss_fn = GSPO(eps_low=low, eps_high=high, aggregation=mode)
    value, grad = _aggregated(loss_fn, logp, old, adv, mask, w)
    c = _coefficients(mask, mode, 5)
    seqs = _gspo_loop(logp, old, adv, mask, w, low, high)
    assert value == pytest.approx(sum(c[i] * n * term for i, (term, _, n) in seqs.items()), rel=1e-12)
    expected = torch.zeros_like(grad)
    for i, (_, d, n) in seqs.items():
        for t in _rows(mask)[i]:
            expected[i, t] = c[i] * n * d  # the term sits on n tokens; each carries s_i's gradient
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)
    clipped = sum(1 for (_, d, _) in seqs.values() if d == 0.0)
    assert loss_fn.stats(logp, old, mask)["clip_fraction"][1] == len(seqs)
    if low == 3e-4:  # the test sees both kinds of sequence
        assert 0 < clipped < len(seqs)


def test_gspo_default_aggregation_is_the_papers_sequence_mean() -> None:
    """With seq_mean_token_mean: ``−(1/G) Σ_i min(s_i·A_i, clip(s_i)·A_i)`` exactly, whatever the lengths."""
    logp, old, adv, mask, w = _batch(3)
    value, _ = _aggregated(GSPO(eps_low=0.1, eps_high=0.1), logp, old, adv, mask, torch.ones_like(w))
    seqs = _gspo_loop(logp, old, adv, mask, torch.ones_like(w), 0.1, 0.1)
    assert value == pytest.approx(sum(term for term, _, _ in seqs.values()) / len(seqs), rel=1e-12)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("low", "high"), [(None, 0.28), (0.2, 0.28), (None, 4.0)])
def test_cispo_is_the_loop_with_a_stopped_gradient(mode: str, low: float | None, high: float) -> None:
    logp, old, adv, mask, w = _batch(4)
    loss_fn = CISPO(eps_low=low, eps_high=high, aggregation=mode)
    value, grad = _aggregated(loss_fn, logp, old, adv, mask, w)
    c = _coefficients(mask, mode, 5)
    terms = _cispo_loop(logp, old, adv, mask, w, low, high)
    assert value == pytest.approx(sum(c[i] * term for (i, _), (term, _) in terms.items()), rel=1e-12)
    expected = torch.zeros_like(grad)
    for (i, t), (_, d) in terms.items():
        expected[i, t] = c[i] * d
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)
    # Without the stop-gradient the ratio's own derivative would add −r·A·log π at every unclipped token.
    x = logp.clone().requires_grad_(True)
    ratio = torch.exp(x - old)
    leaky = (-(ratio.clamp(max=1 + high) * adv.unsqueeze(1) * x) * mask).sum()
    (leaky_grad,) = torch.autograd.grad(leaky, x)
    assert not torch.allclose(leaky_grad, -(ratio.detach().clamp(max=1 + high) * adv.unsqueeze(1)) * mask)


@pytest.mark.parametrize("mode", MODES)
def test_reinforce_tis_aggregates_like_the_loop(mode: str) -> None:
    logp, rollout, adv, mask, w = _batch(5)
    value, grad = _aggregated(ReinforceTIS(tis_cap=1.5, aggregation=mode), logp, rollout, adv, mask, w, constant=9)
    c = _coefficients(mask, mode, 9)
    total = 0.0
    expected = torch.zeros_like(grad)
    for i, row in enumerate(_rows(mask)):
        for t in row:
            rho = min(math.exp(float(logp[i, t]) - float(rollout[i, t])), 1.5)
            a = float(adv[i]) * float(w[i])
            total += c[i] * -a * rho * float(logp[i, t])
            expected[i, t] = c[i] * -a * rho
    assert value == pytest.approx(total, rel=1e-12)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_and_their_gradients(estimator: str) -> None:
    logp, ref, _, mask, w = _batch(6)
    loss_fn = ReinforceTIS(kl_coef=0.3, kl_estimator=estimator, aggregation="seq_mean_token_mean")
    lengths = mask.sum(dim=1)
    totals = UpdateTotals(int(lengths.sum()), int((lengths > 0).sum()), 7)
    weights = w * loss_fn.row_scale(lengths, totals)
    x = logp.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(loss_fn.penalty(x, ref, mask, totals.tokens, weights), x)
    c = _coefficients(mask, "seq_mean_token_mean", 7)
    value, expected = 0.0, torch.zeros_like(grad)
    for i, row in enumerate(_rows(mask)):
        for t in row:
            d = float(ref[i, t]) - float(logp[i, t])  # log π_ref − log π
            k, dk = {"k1": (-d, 1.0), "k2": (0.5 * d * d, -d), "k3": (math.exp(d) - d - 1, 1 - math.exp(d))}[estimator]
            value += 0.3 * c[i] * float(w[i]) * k
            expected[i, t] = 0.3 * c[i] * float(w[i]) * dk
    assert float(loss_fn.penalty(logp, ref, mask, totals.tokens, weights)) == pytest.approx(value, rel=1e-12)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)
    assert float(kl_estimate(logp, logp, estimator).abs().max()) == 0.0  # no divergence from itself
    if estimator == "k3":
        assert float(kl_estimate(logp, ref, "k3").min()) >= 0.0


def test_mask_truncated_leaves_responses_out_of_the_loss_and_its_normalisers() -> None:
    logp, rollout, adv, mask, w = _batch(7)
    truncated = [False, True, False, False, True, False]
    loss_fn = ReinforceTIS(mask_truncated=True, aggregation="seq_mean_token_mean")
    kept = loss_fn.token_mask(mask, truncated)
    assert kept[1].sum() == 0 and kept[4].sum() == 0 and torch.equal(kept[0], mask[0])
    assert torch.equal(ReinforceTIS().token_mask(mask, truncated), mask)  # off by default
    value, _ = _aggregated(loss_fn, logp, rollout, adv, kept, w)
    rows = [r for i, r in enumerate(_rows(mask)) if not truncated[i] and r]
    by_hand = 0.0
    for i, row in enumerate(_rows(mask)):
        if truncated[i] or not row:
            continue
        for t in row:
            rho = min(math.exp(float(logp[i, t]) - float(rollout[i, t])), 2.0)
            by_hand += -float(adv[i]) * float(w[i]) * rho * float(logp[i, t]) / (len(rows) * len(row))
    assert value == pytest.approx(by_hand, rel=1e-12)


# -------------------------------------------------------------------- the whole seam: microbatches and ranks
def _rollout(seed: int, rows: int = 6, truncated: tuple[int, ...] = ()) -> Rollout:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 90, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g).tolist()]
    responses = [
        torch.randint(3, 90, (int(n),), generator=g).tolist() for n in torch.randint(1, 7, (rows,), generator=g)
    ]
    return Rollout(
        prompt_ids=prompts * rows,
        response_ids=responses,
        logprobs=[[-1.0 - 0.1 * j for j in range(len(r))] for r in responses],
        finish_reasons=["length" if i in truncated else "stop" for i in range(rows)],
        prompt_index=[i // 2 for i in range(rows)],
    )


def _context(model, reference, rollout: Rollout, loss_fn, seed: int):
    """A step context as the module builds it: pre-update log-probs and entropy, reference log-probs, loss mask."""
    g = torch.Generator().manual_seed(seed)
    advantages = torch.randn(len(rollout), generator=g, dtype=torch.float64)

    def scores(packed, temperature):
        with torch.no_grad():
            return response_logprobs_and_entropy(model, packed, temperature)

    def ref(packed, temperature):
        with torch.no_grad():
            return response_logprobs(reference, packed, temperature)

    ctx = assemble_step(0, [{}] * 3, rollout, torch.zeros(len(rollout)), advantages, 0, scores, 0.9, ref)
    ctx.loss_mask = loss_fn.token_mask(ctx.packed.response_mask, rollout.truncated)
    return ctx


def _sub_rollout(rollout: Rollout, rows: list[int]) -> Rollout:
    pick = lambda xs: [xs[i] for i in rows]  # noqa: E731
    return Rollout(
        pick(rollout.prompt_ids),
        pick(rollout.response_ids),
        pick(rollout.logprobs),
        pick(rollout.finish_reasons),
        pick(rollout.prompt_index),
    )


def _grads(model, ctx, groups, loss_fn, totals):
    model.zero_grad()
    score = partial(response_logprobs, model)
    total = backward_over(score, ctx, groups, loss_fn, totals, lambda loss: loss.backward(), torch.device("cpu"))
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


LOSSES = [
    pytest.param(lambda: ReinforceTIS(aggregation="seq_mean_token_mean", kl_coef=0.2), id="tis-seqmean-kl"),
    pytest.param(lambda: PPOClip(eps_high=0.28, aggregation="seq_mean_token_sum_norm", mask_truncated=True), id="dapo"),
    pytest.param(lambda: GSPO(eps_low=0.02, eps_high=0.03, kl_coef=0.1, kl_estimator="k2"), id="gspo-kl"),
    pytest.param(lambda: CISPO(aggregation="token_mean", mask_truncated=True), id="cispo"),
]


@pytest.mark.parametrize("make_loss", LOSSES)
def test_microbatches_and_ranks_add_up_to_the_update(qwen2_factory, make_loss) -> None:
    """One update through the module's seam (update_totals + backward_over) on a real model: one microbatch, three
    microbatches, and two "ranks" whose counts are summed as the all-reduce sums them, give the same loss and the
    same gradient (the loop tests above pin what that loss is)."""
    loss_fn = make_loss()
    model, reference = qwen2_factory(seed=0), qwen2_factory(seed=1)
    rollout = _rollout(0, truncated=(3,))
    ctx = _context(model, reference, rollout, loss_fn, seed=0)
    with torch.no_grad():  # move off π_old, so the PPO family's ratios and clips are not all 1
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    rows = list(range(len(rollout)))
    totals = update_totals(ctx, rows, 8, lambda t: t)
    assert (totals.tokens, totals.sequences) == (
        int(ctx.loss_mask.sum()),
        int((ctx.loss_mask.sum(dim=1) > 0).sum()),
    )
    whole, g_whole = _grads(model, ctx, [rows], loss_fn, totals)
    split, g_split = _grads(model, ctx, [[0, 1], [2, 3, 4], [5]], loss_fn, totals)
    assert split == pytest.approx(whole, rel=1e-5, abs=1e-9)
    for name, g in g_whole.items():  # float32 sums in another order: equal to a few ulps of the largest entry
        torch.testing.assert_close(g_split[name], g, rtol=1e-5, atol=1e-5 * float(g.abs().max()))
    # Two ranks: each holds every other prompt's responses; the counts are summed over both (the all-reduce).
    parts = [[0, 1, 4, 5], [2, 3]]
    contexts = []
    for part in parts:
        sub = _context(model, reference, _sub_rollout(rollout, part), loss_fn, seed=0)
        sub.advantages = ctx.advantages[part]
        sub.logp_trainer = ctx.logp_trainer[part][:, : sub.packed.response_mask.shape[1]]
        contexts.append(sub)
    local = [update_totals(c, list(range(len(c.rollout))), 8, lambda t: t) for c in contexts]
    summed = torch.tensor([[t.tokens, t.sequences] for t in local], dtype=torch.float64).sum(dim=0)
    rank_totals = [update_totals(c, list(range(len(c.rollout))), 8, lambda t: summed) for c in contexts]
    assert rank_totals[0] == rank_totals[1] == totals
    ranks = [_grads(model, c, [list(range(len(c.rollout)))], loss_fn, rank_totals[0]) for c in contexts]
    assert sum(r[0] for r in ranks) == pytest.approx(whole, rel=1e-5, abs=1e-9)
    for name, g in g_whole.items():
        torch.testing.assert_close(
            ranks[0][1][name] + ranks[1][1][name], g, rtol=1e-5, atol=1e-5 * float(g.abs().max())
        )
    assert any(float(g.abs().max()) > 0 for g in g_whole.values())
    if loss_fn.needs_reference_policy:
        assert ctx.loss_stats["kl_reference"][1] > 0


def test_entropy_is_the_loop_over_the_vocabulary(qwen2_factory) -> None:
    model = qwen2_factory(seed=3)
    rollout = _rollout(1)
    packed = pack_responses(rollout.prompt_ids, rollout.response_ids, 0)
    with torch.no_grad():
        logp, entropy = response_logprobs_and_entropy(model, packed, 0.7)
        assert torch.equal(logp, response_logprobs(model, packed, 0.7))  # the same pass, the same log-probs
        logits = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask).logits.double()
    for b, response in enumerate(rollout.response_ids):
        for t in range(entropy.shape[1]):
            if t >= len(response):
                assert entropy[b, t] == 0.0
                continue
            z = [float(v) / 0.7 for v in logits[b, int(packed.starts[b]) + t]]
            top = max(z)
            norm = math.log(sum(math.exp(v - top) for v in z)) + top
            h = -sum(math.exp(v - norm) * (v - norm) for v in z)
            assert float(entropy[b, t]) == pytest.approx(h, rel=1e-5)
    assert float(token_entropy(torch.log_softmax(torch.tensor([[[0.0, -math.inf]]]), -1))) == 0.0  # p = 0 adds 0


# ----------------------------------------------------------------------------------------- settings
@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: PPOClip(clip_eps=0.2, eps_high=0.28), r"clip_eps=0\.2 is the symmetric spelling.*remove clip_eps"),
        (lambda: PPOClip(clip_eps=0.2, eps_low=0.1), r"remove clip_eps and set eps_low and eps_high"),
        (lambda: PPOClip(eps_low=1.0), r"loss\.eps_low must lie in \(0, 1\)"),
        (lambda: GSPO(eps_high=0), r"loss\.eps_high must lie in \(0, inf\)"),
        (lambda: CISPO(eps_high=-1), r"loss\.eps_high must lie in \(0, inf\)"),
        (lambda: ReinforceTIS(aggregation="seq_mean"), r"unknown loss\.aggregation 'seq_mean': use one of"),
        (lambda: ReinforceTIS(aggregation_length=8), r"aggregation_length=8 is Dr\.GRPO's constant.*used only"),
        (lambda: ReinforceTIS(kl_coef=-0.1), r"loss\.kl_coef must lie in \[0, inf\)"),
        (lambda: ReinforceTIS(kl_estimator="k4"), r"unknown loss\.kl_estimator 'k4'"),
        (lambda: ReinforceTIS(reference_device="cuda"), r"unknown loss\.reference_device 'cuda'"),
        (lambda: ReinforceTIS(reference_dtype="int8"), r"unknown loss\.reference_dtype 'int8'"),
        (lambda: CISPO(mask_truncated="yes"), r"loss\.mask_truncated must be true or false"),
    ],
)
def test_bad_settings_name_the_problem(build, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build()


def test_symmetric_and_asymmetric_spellings_round_trip() -> None:
    assert (PPOClip().low, PPOClip().high, PPOClip().clip_eps) == (0.2, 0.2, 0.2)
    assert (PPOClip(clip_eps=0.1, eps_high=0.1).high, PPOClip(clip_eps=0.1).low) == (0.1, 0.1)
    dapo = PPOClip(eps_low=0.2, eps_high=0.28)
    assert (dapo.low, dapo.high, dapo.clip_eps) == (0.2, 0.28, None)
    for loss in (PPOClip(), PPOClip(clip_eps=0.3), dapo, GSPO(), CISPO(kl_coef=0.1), ReinforceTIS(mask_truncated=True)):
        again = build_loss(loss.to_config())
        assert type(again) is type(loss) and again.to_config() == loss.to_config()
    for name, cls in (("gspo", GSPO), ("cispo", CISPO), ("ppo", PPOClip)):
        assert type(build_loss(name)) is cls
    assert (
        repr(dapo)
        == "PPOClip(clip_eps=None, epochs=2, minibatches=2, length_reference=None, eps_low=0.2, eps_high=0.28)"
    )


def test_a_loss_of_your_own_keeps_its_own_kl_coef() -> None:
    """The shared settings live in ``loss.shared``, set only by ``_shared``: a loss of your own with an attribute
    named ``kl_coef`` (docs/extending.md's ReinforceK2) gets no reference policy and no second penalty."""
    from logra_pl.losses import Loss, SharedSettings

    class OwnK2(Loss):
        def __init__(self, kl_coef: float = 0.5) -> None:
            self.kl_coef = kl_coef

        def __call__(self, logp, ref_logp, advantages, mask, num_tokens, weights=None):
            return ((0.5 * self.kl_coef * (logp - ref_logp) ** 2) * mask).sum() / num_tokens

    own = build_loss(OwnK2())
    assert own.shared == SharedSettings() and not own.needs_reference_policy
    assert own.row_scale(torch.tensor([3, 1]), UpdateTotals(4, 2, 8)) is None  # token mean
    offered = ReinforceTIS(kl_coef=0.5, aggregation="seq_mean_token_mean")
    assert offered.shared.kl_coef == 0.5 and offered.needs_reference_policy


# ---------------------------------------------------------------------------------- the reference policy
def test_reference_policy_is_frozen_digested_and_streamed(tiny_model_dir) -> None:
    from logra_pl.train.reference import ReferencePolicy, weights_digest

    ref = ReferencePolicy.load(str(tiny_model_dir), "float32", "cpu")
    half = ReferencePolicy.load(str(tiny_model_dir), "bfloat16", "same")
    assert not any(p.requires_grad for p in ref.model.parameters()) and not ref.model.training
    assert half.nbytes * 2 == pytest.approx(ref.nbytes, rel=0.01)
    assert ref.digest == weights_digest(ReferencePolicy.load(str(tiny_model_dir), "float32", "cpu").model)
    assert ref.digest != half.digest
    rollout = _rollout(2)
    packed = pack_responses(rollout.prompt_ids, rollout.response_ids, 0)
    plain = ref.logprobs(packed, 1.0)
    streamed = ReferencePolicy.load(str(tiny_model_dir), "float32", "cpu")
    streamed.stream(torch.device("cpu"))  # accelerate's offload hooks; on an accelerator the same, to its device
    assert all(p.device.type == "meta" for p in streamed.model.parameters())  # the weights live in the hook's copy
    torch.testing.assert_close(streamed.logprobs(packed, 1.0), plain, rtol=0, atol=0)
    ref.check(ref.state_dict())
    with pytest.raises(ResumeMismatchError, match=r"reference policy rebuilt from .* is not the one this run started"):
        ref.check(half.state_dict())


def test_validation_loads_no_reference(tmp_path) -> None:
    """``logra-pl validate`` of a KL config evaluates the policy; the reference policy is for training only, and a
    fit after a validate loads it then."""
    from conftest import chain_sum_data, quick_trainer

    from logra_pl.module import LoGRAPolicyModule, RolloutSettings
    from logra_pl.sketch import LoGRAConfig

    module = LoGRAPolicyModule(
        policy="tiny",
        logra=LoGRAConfig(rank=16),
        rollout=RolloutSettings(max_new_tokens=2),
        loss=ReinforceTIS(kl_coef=0.1),
    )
    quick_trainer(tmp_path, 1).validate(module, datamodule=chain_sum_data(eval_size=4))
    assert module.policy is not None and module.reference_policy is None
    quick_trainer(tmp_path, 1).fit(module, datamodule=chain_sum_data(eval_size=4))  # then training: it is loaded
    assert module.reference_policy is not None and module.reference_policy.source == module.policy_folder
    assert module.step_context.loss_stats["kl_reference"][1] > 0


def test_fsdp_refuses_a_reference_kept_in_every_process() -> None:
    from types import SimpleNamespace

    from logra_pl.strategy import LoGRAStrategy

    with pytest.raises(ConfigError, match=r"under the logra_fsdp strategy set loss\.reference_device: same"):
        LoGRAStrategy.check_reference(SimpleNamespace(placement="cpu"))
    LoGRAStrategy.check_reference(SimpleNamespace(placement="same"))


def test_plan_counts_the_reference_per_rank() -> None:
    from logra_pl.methods.memory_plan import plan
    from logra_pl.models.tiny import PRESETS

    config = PRESETS["tiny"].qwen2_config(PRESETS["tiny"].vocab_size, 0, 1)
    none, same, half = plan(config), plan(config, reference="same"), plan(config, ranks=2, reference="same")
    cpu16 = plan(config, reference="cpu", reference_dtype="bfloat16")
    params = 0
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    for p in {id(p): p for p in model.parameters()}.values():
        params += p.numel()
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert none["logra"].report.reference_policy == 0
    assert same["logra"].report.reference_policy == params * 4 + buffers
    assert cpu16["adamw"].report.reference_policy == params * 2 + buffers
    assert half["logra"].report.reference_policy < 0.51 * same["logra"].report.reference_policy
    assert same["logra"].report.total == none["logra"].report.total + same["logra"].report.reference_policy
    with pytest.raises(ValueError, match="reference 'cpu' keeps a whole copy in every process"):
        plan(config, ranks=2, reference="cpu")


def test_plan_command_prints_the_reference(capsys) -> None:
    from logra_pl.cli import main as cli_main

    cli_main(["plan", "--model", "tiny", "--reference", "cpu", "--reference-dtype", "bfloat16"])
    out = capsys.readouterr().out
    assert "KL reference on cpu in bfloat16" in out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("reference_policy")]
    assert all(float(v) > 0 for v in line.split()[1:])


@pytest.mark.slow
def test_a_kl_run_keeps_the_reference_counts_it_and_resumes_only_onto_the_same_one(tmp_path, rl_run) -> None:
    """ReinforceTIS + k3 penalty after a warm start: the reference is the warm-started policy (not the checkpoint's
    weights), its bytes are counted, the checkpoint keeps its digest, a resume rebuilds it from the warm start's
    folder and matches, and a checkpoint of another reference is refused."""
    from conftest import SMALL_CHAIN_SUM, chain_sum_data

    from logra_pl.callbacks import MemoryMonitor
    from logra_pl.module import LoGRAPolicyModule, RolloutSettings
    from logra_pl.sketch import LoGRAConfig
    from logra_pl.train.reference import weights_digest
    from logra_pl.train.warm_start import WarmStart

    def module():
        return LoGRAPolicyModule(
            policy="tiny",
            warm_start=WarmStart(task_config=SMALL_CHAIN_SUM, steps=20),
            logra=LoGRAConfig(rank=16, update_ratio=5e-2),
            rollout=RolloutSettings(max_new_tokens=4),
            microbatch_size=4,
            loss=ReinforceTIS(kl_coef=0.1, reference_dtype="bfloat16"),
        )

    first = module()
    monitor = MemoryMonitor(image_every=0)
    rl_run(first, tmp_path, 2, callbacks=[monitor], data=chain_sum_data())
    ref = first.reference_policy
    assert ref is not None and ref.dtype_name == "bfloat16" and "warm-" in Path(ref.source).name
    assert monitor.last["memory/state/reference_policy"] == ref.nbytes > 0
    kl, tokens = first.step_context.loss_stats["kl_reference"]
    assert tokens > 0 and kl / tokens > 0  # k3 ≥ 0, and the policy has moved from the reference
    assert first.step_context.metrics["train/kl_reference"] == kl / tokens
    ckpt = tmp_path / "kl.ckpt"
    first.trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)
    assert saved["logra_pl"]["reference"]["digest"] == ref.digest == weights_digest(ref.model)
    assert not any(k.startswith("reference") for k in saved["state_dict"])  # not in the weights: rebuilt
    resumed = module()
    # As the CLI launches a resume: the policy comes from the base and the checkpoint, the warm start is skipped; the
    # reference is rebuilt from the warm start's (cached) folder.
    resumed.set_launch(run_config=None, resume_from=str(ckpt), resume_checked=False)
    rl_run(resumed, tmp_path, 3, ckpt_path=ckpt, data=chain_sum_data())
    assert resumed.global_step == 3 and resumed.reference_policy.digest == ref.digest
    saved["logra_pl"]["reference"]["digest"] = "0" * 32
    torch.save(saved, tmp_path / "other.ckpt")
    other = module()
    other.set_launch(run_config=None, resume_from=str(tmp_path / "other.ckpt"), resume_checked=False)
    with pytest.raises(ResumeMismatchError, match="is not the one this run started with"):
        rl_run(other, tmp_path, 3, ckpt_path=tmp_path / "other.ckpt", data=chain_sum_data())


# ------------------------------------------------------------------------------------------ via the CLI
FAST = [
    "--trainer.max_steps=20",
    "--trainer.limit_val_batches=0",
    "--trainer.enable_progress_bar=false",
    "--model.warm_start.steps=20",
    "--data.train_size=256",
    "--data.eval_size=32",
    "--data.prompts_per_step=4",
    "--model.microbatch_size=16",
    "--checkpoint.every_n_updates=0",
]
KL = ["--model.loss.init_args.kl_coef=0.05", "--model.loss.init_args.reference_dtype=bfloat16"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overlay", "extra", "cls"),
    [("gspo", [], GSPO), ("cispo", KL, CISPO), ("dapo_clip_higher", [], PPOClip), ("dr_grpo", [], PPOClip)],
    ids=["gspo", "cispo+kl_penalty", "dapo_clip_higher", "dr_grpo"],
)
def test_twenty_updates_of_each_loss_through_the_cli(tmp_path, monkeypatch, overlay, extra, cls) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from logra_pl.cli import LoGRACLI

    monkeypatch.setattr(sys, "argv", ["logra-pl"])
    args = [
        "fit",
        f"--config={ROOT / 'configs' / 'tiny_cpu.yaml'}",
        f"--config={ROOT / 'configs/overlays' / overlay}.yaml",
    ]
    cli = LoGRACLI(args=[*args, *FAST, *extra, f"--trainer.logger.init_args.save_dir={tmp_path}"])
    module = cli.model
    assert cli.trainer.global_step == 20 and type(module.loss_config) is cls
    assert module.rollout_settings.responses_per_prompt == 4 and type(module.baseline).__name__ == "GroupBaseline"
    (events,) = glob.glob(str(tmp_path / "**" / "events.out.tfevents.*"), recursive=True)
    acc = EventAccumulator(events, size_guidance={"scalars": 0})
    acc.Reload()
    scalars = {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    train = {tag: values for tag, values in scalars.items() if tag.startswith("train/")}
    assert {"train/loss", "train/entropy", "train/clip_fraction", "train/reward_mean"} <= set(train)
    bad = {tag: values for tag, values in train.items() if not all(math.isfinite(v) for v in values)}
    assert not bad, bad
    assert all(0 < v < math.log(97) for v in train["train/entropy"])
    assert len(train["train/loss"]) == 20 // module.loss_config.epochs // module.loss_config.minibatches
    if extra:  # the KL penalty's run: the reference is kept, counted and pulled toward
        assert module.loss_config.kl_coef == 0.05 and module.reference_policy.dtype_name == "bfloat16"
        assert (
            all(v >= 0 and math.isfinite(v) for v in train["train/kl_reference"])
            and train["train/kl_reference"][-1] > 0
        )
        assert scalars["memory/state/reference_policy"][-1] == module.reference_policy.nbytes > 0
    else:
        assert "train/kl_reference" not in train and module.reference_policy is None
