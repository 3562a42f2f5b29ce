"""The sketch-space first moment, the Adam-style step and the lr schedule (algorithm.md §4), against references here."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

import logra_pl.sketch.sketcher as sketcher_module
from logra_pl.methods.adamw import AdamWConfig
from logra_pl.methods.memory_plan import main as plan_main
from logra_pl.methods.memory_plan import plan
from logra_pl.sketch import LoGRAConfig, LoGRASketcher
from logra_pl.sketch.config import LoGRAConfigError
from logra_pl.sketch.memory import memory_report
from logra_pl.sketch.update import lr_factor, transfer_moment

D_OUT, D_IN = 6, 8


class OneLayer(nn.Module):
    """One sketched matrix, ``up_proj`` (D_OUT × D_IN), and nothing else."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.up_proj = nn.Linear(D_IN, D_OUT, bias=False)


def _orthogonal(seed: int, rank: int, d_in: int, distribution: str = "rademacher", device=None) -> torch.Tensor:
    """A square orthogonal ``P`` (Q of a seeded Gaussian's QR), standing in for the sketcher's draw."""
    assert rank == d_in
    gen = torch.Generator().manual_seed(seed % 2**31)
    q, _ = torch.linalg.qr(torch.randn(d_in, d_in, generator=gen, dtype=torch.float64))
    return q.float()


def _orthogonal_stack(seeds, rank: int, d_in: int, distribution: str = "rademacher", device=None) -> torch.Tensor:
    """:func:`_orthogonal` for each seed, stacked as the sketcher draws a group's projections."""
    return torch.stack([_orthogonal(seed, rank, d_in) for seed in seeds])


def test_transfer_matches_its_definition() -> None:
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(5, 4, generator=gen)
    p_old, p_new = (torch.randn(4, 16, generator=gen) / 2 for _ in range(2))
    mo, po, pn = m.double().numpy(), p_old.double().numpy(), p_new.double().numpy()
    expected = mo @ np.linalg.inv(po @ po.T) @ po @ pn.T
    np.testing.assert_allclose(transfer_moment(m, p_old, p_new).double().numpy(), expected, rtol=1e-5, atol=1e-6)
    # To the same basis: the identity. With orthonormal rows: m · P_old · P_newᵀ.
    torch.testing.assert_close(transfer_moment(m, p_old, p_old), m, rtol=1e-5, atol=1e-6)
    q_old = torch.linalg.qr(p_old.double().T)[0].T.float()
    q_new = torch.linalg.qr(p_new.double().T)[0].T.float()
    torch.testing.assert_close(transfer_moment(m, q_old, q_new), m @ q_old @ q_new.T, rtol=1e-5, atol=1e-6)


def _dense_reference(grads: list[torch.Tensor], w0: torch.Tensor, cfg: LoGRAConfig) -> list[torch.Tensor]:
    """The same rule on the dense gradient, in float64: what a square orthogonal ``P`` must reproduce exactly."""
    w, v, m = w0.double().clone(), torch.zeros(D_OUT, 1, dtype=torch.float64), torch.zeros_like(w0, dtype=torch.float64)
    out = []
    for t, g in enumerate(grads, start=1):
        g = g.double()
        v = cfg.beta2 * v + (1 - cfg.beta2) * g.square().mean(dim=1, keepdim=True)  # = mean_j S_ij² (P orthogonal)
        m = cfg.beta1 * m + (1 - cfg.beta1) * g
        m_hat = m / (1 - cfg.beta1**t)
        root = torch.sqrt(v / (1 - cfg.beta2**t))
        den = root + max(cfg.eps * float(root.mean()), torch.finfo(torch.float32).tiny)
        if cfg.step_mode == "adam":
            step = cfg.lr * lr_factor(t - 1, cfg.lr_warmup_steps, cfg.lr_decay_steps, cfg.lr_min_ratio) * m_hat / den
        else:
            s = den.min() / den
            s = s / torch.sqrt(s.square().mean())
            d = s * m_hat
            d = d * (m_hat.norm() / d.norm())
            step = cfg.update_ratio * w.norm() / d.norm() * d
        w = w - step
        out.append(w.clone())
    return out


@pytest.mark.parametrize(
    "settings",
    [
        {"beta1": 0.9, "update_ratio": 1e-2},
        {"beta1": 0.8, "step_mode": "adam", "lr": 1e-2, "lr_warmup_steps": 2, "lr_decay_steps": 3, "lr_min_ratio": 0.1},
    ],
    ids=["rowadam-ratio", "adam-lr-schedule"],
)
def test_square_orthogonal_projection_gives_the_dense_rule(monkeypatch, settings: dict) -> None:
    """r = d_in and an orthogonal ``P`` refreshed every update: the sketch-space moment, carried across every change,
    is the dense moment's sketch, so the merged weights follow the dense computation (momentum, RowAdam, step)."""
    monkeypatch.setattr(sketcher_module, "make_projections", _orthogonal_stack)
    model = OneLayer()
    # "gaussian": the merge multiplies by P as drawn (a Rademacher merge would take its signs).
    cfg = LoGRAConfig.paper(
        targets=("up_proj",), rank=D_IN, distribution="gaussian", factor_dtype="float32", **settings
    )
    sketcher = LoGRASketcher(model, cfg)
    w0 = model.up_proj.weight.detach().clone()
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(D_OUT, D_IN, generator=gen) * (1 + torch.arange(D_OUT).unsqueeze(1)) for _ in range(6)]
    expected = _dense_reference(grads, w0, cfg)
    seeds = set()
    for g, ref in zip(grads, expected, strict=True):
        matrix = sketcher.matrices["up_proj"]
        seeds.add(matrix.seed)
        matrix.sketch.copy_(g @ matrix.projection.T)  # S = G Pᵀ, what the backward hook accumulates
        assert sketcher.step() is not None
        torch.testing.assert_close(model.up_proj.weight.double(), ref, rtol=0, atol=1e-6)
    assert len(seeds) == 6 and sketcher.moment_age == 6  # a new basis every update, the moment carried each time


def _run(cfg: LoGRAConfig, updates: int, state: dict | None = None, seed: int = 5):
    model = OneLayer()
    sketcher = LoGRASketcher(model, cfg)
    if state is not None:
        model.load_state_dict(state["model"])
        sketcher.load_state_dict(state["sketcher"])
    factors = []
    for _ in range(updates):
        gen = torch.Generator().manual_seed(100 * seed + sketcher.update_index)  # the sketch of update k: fixed
        sketcher.matrices["up_proj"].sketch.copy_(torch.randn(D_OUT, D_IN, generator=gen)[:, : cfg.rank])
        proposal = sketcher.propose()
        factors.append(proposal.matrices["up_proj"].factor.clone())
        sketcher.apply(proposal)
    return model, sketcher, factors


def test_reset_on_every_change_is_no_moment_at_all() -> None:
    """``momentum_transfer: reset`` with a new basis every update: m̂ = S each time, the paper's rule exactly."""
    base = {"targets": ("up_proj",), "rank": 4, "update_ratio": 1e-2}
    _, plain, without = _run(LoGRAConfig.paper(**base), 4)
    _, reset, with_reset = _run(LoGRAConfig.paper(beta1=0.9, momentum_transfer="reset", **base), 4)
    for a, b in zip(without, with_reset, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)  # (0.1·S)/(1 − 0.9) = S up to rounding
    assert reset.moment_age == 0 and plain.moments == {}
    # A fixed basis keeps the moment: the steps differ from the second update on.
    _, fixed, kept = _run(LoGRAConfig.paper(beta1=0.9, refresh=False, **base), 4)
    assert fixed.moment_age == 4 and not torch.allclose(
        kept[1], _run(LoGRAConfig.paper(refresh=False, **base), 2)[2][1]
    )


def test_moment_resumes_bit_for_bit() -> None:
    cfg = LoGRAConfig.paper(targets=("up_proj",), rank=4, beta1=0.9, step_mode="adam", lr=1e-2, lr_warmup_steps=2)
    straight, s_sketcher, _ = _run(cfg, 5)
    first, f_sketcher, _ = _run(cfg, 2)
    state = {"model": {k: v.clone() for k, v in first.state_dict().items()}, "sketcher": f_sketcher.state_dict()}
    resumed, r_sketcher, _ = _run(cfg, 3, state)
    assert torch.equal(straight.up_proj.weight, resumed.up_proj.weight)
    assert torch.equal(s_sketcher.moments["up_proj"], r_sketcher.moments["up_proj"])
    assert r_sketcher.moment_age == s_sketcher.moment_age == 5
    # A checkpoint without a moment does not resume under one (and an old one, without the key, means beta1 = 0).
    saved = _run(LoGRAConfig.paper(targets=("up_proj",), rank=4), 1)[1].state_dict()
    with pytest.raises(LoGRAConfigError, match="beta1"):
        LoGRASketcher(OneLayer(), cfg).load_state_dict(saved)
    del saved["config"]["beta1"]
    LoGRASketcher(OneLayer(), LoGRAConfig.paper(targets=("up_proj",), rank=4)).load_state_dict(saved)


def test_lr_schedule_of_the_adam_step() -> None:
    cfg = LoGRAConfig.paper(
        targets=("up_proj",), rank=4, step_mode="adam", lr=0.1, lr_warmup_steps=2, lr_decay_steps=4, lr_min_ratio=0.2
    )
    sketcher = LoGRASketcher(OneLayer(), cfg)
    scales = []
    for k in range(8):
        sketcher.matrices["up_proj"].sketch.fill_(1.0 + k)
        proposal = sketcher.propose()
        scales.append(proposal.scale)
        sketcher.apply(proposal)
    expected = [1 / 3, 2 / 3, 1.0] + [0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in (1, 2, 3, 4, 4)]
    assert scales == pytest.approx([0.1 * e for e in expected], rel=1e-12)
    assert [lr_factor(k, 9, 300, 0.1) for k in range(0, 400, 37)] == [
        AdamWConfig().lr_factor(k) for k in range(0, 400, 37)
    ]  # the dense baseline's schedule, the same function


def test_bad_settings_name_the_fix() -> None:
    with pytest.raises(LoGRAConfigError, match="update_rule 'rowadam'"):
        LoGRAConfig.paper(step_mode="adam", update_rule="sgd")
    with pytest.raises(LoGRAConfigError, match="beta1"):
        LoGRAConfig.paper(beta1=1.0)
    with pytest.raises(LoGRAConfigError, match="momentum_transfer"):
        LoGRAConfig.paper(momentum_transfer="flora")
    with pytest.raises(LoGRAConfigError, match="lr_warmup_steps"):
        LoGRAConfig.paper(lr_warmup_steps=-1)


def test_the_moment_is_counted_and_planned(qwen2_factory) -> None:
    model = qwen2_factory(seed=1)
    sketcher = LoGRASketcher(model, LoGRAConfig.paper(rank=8, beta1=0.9))
    report = memory_report(model, sketcher=sketcher)
    assert report.sketch_moments == sum(m.d_out * 8 * 4 for m in sketcher.matrices.values()) == report.sketches
    assert report.persistent == report.weights + report.row_statistics + report.sketch_moments
    planned = plan(model.config.to_dict(), rank_r=8, optimizers=["logra"], logra_rule="paper", logra_moments=True)[
        "logra"
    ].report
    assert planned.sketch_moments == report.sketch_moments
    assert (
        memory_report(model, sketcher=LoGRASketcher(qwen2_factory(seed=1), LoGRAConfig.paper(rank=8))).sketch_moments
        == 0
    )


def test_bf16_storage_is_the_fp32_rule_rounded_at_each_commit() -> None:
    """``moment_dtype: bfloat16``: each update forms ``β1·m + (1−β1)·S`` in fp32 from the stored bf16 ``m``, steps
    with that fp32 value, and keeps it rounded to bf16. Checked with SGD at a constant lr (the factor is lr·m̂) on a
    fixed basis, against the recurrence written here."""
    base = {"targets": ("up_proj",), "rank": 4, "beta1": 0.9, "refresh": False, "update_rule": "sgd"}
    cfg = LoGRAConfig.paper(**base, step_mode="lr", lr=0.5, factor_dtype="float32", moment_dtype="bfloat16")
    _, sketcher, factors = _run(cfg, 5)
    stored = torch.zeros(D_OUT, 4, dtype=torch.bfloat16)
    for t, factor in enumerate(factors, start=1):
        gen = torch.Generator().manual_seed(100 * 5 + t - 1)
        s = torch.randn(D_OUT, D_IN, generator=gen)[:, :4]
        m = 0.9 * stored.float() + 0.1 * s
        assert torch.equal(factor, 0.5 * (m / (1 - 0.9**t)))  # the step uses the unrounded fp32 moment
        stored = m.to(torch.bfloat16)
    assert sketcher.moments["up_proj"].dtype == torch.bfloat16 and torch.equal(sketcher.moments["up_proj"], stored)
    # Not the fp32-stored run: the rounding is real (and the fp32 default is unchanged by the option's existence).
    _, _, fp32 = _run(LoGRAConfig.paper(**base, step_mode="lr", lr=0.5, factor_dtype="float32"), 5)
    assert torch.equal(fp32[0], factors[0]) and not torch.equal(fp32[-1], factors[-1])


def test_bf16_moment_resumes_bit_for_bit_and_transfers_in_bf16() -> None:
    cfg = LoGRAConfig.paper(targets=("up_proj",), rank=4, beta1=0.9, update_ratio=1e-2, moment_dtype="bfloat16")
    straight, s_sketcher, _ = _run(cfg, 5)  # a new basis every update: the moment is carried (projected) 4 times
    first, f_sketcher, _ = _run(cfg, 2)
    state = {"model": {k: v.clone() for k, v in first.state_dict().items()}, "sketcher": f_sketcher.state_dict()}
    assert state["sketcher"]["moments"]["up_proj"].dtype == torch.bfloat16
    resumed, r_sketcher, _ = _run(cfg, 3, state)
    assert torch.equal(straight.up_proj.weight, resumed.up_proj.weight)
    assert torch.equal(s_sketcher.moments["up_proj"], r_sketcher.moments["up_proj"])
    assert r_sketcher.moments["up_proj"].dtype == torch.bfloat16
    with pytest.raises(LoGRAConfigError, match="moment_dtype"):
        LoGRAConfig.paper(moment_dtype="float16")


def test_bf16_moment_is_counted_and_planned_at_half(qwen2_factory, tmp_path) -> None:
    model = qwen2_factory(seed=1)
    sketcher = LoGRASketcher(model, LoGRAConfig.paper(rank=8, beta1=0.9, moment_dtype="bfloat16"))
    report = memory_report(model, sketcher=sketcher)
    assert report.sketch_moments == sum(m.d_out * 8 * 2 for m in sketcher.matrices.values())
    planned = plan(
        model.config.to_dict(), rank_r=8, optimizers=["logra"], logra_rule="paper", logra_moments=True,
        moment_dtype="bfloat16",
    )  # fmt: skip
    assert planned["logra"].report.sketch_moments == report.sketch_moments
    # The CLI: the paper's rule with `--logra-moments` alone is fp32, with a dtype that dtype; the default rule keeps
    # two moments (first and per-entry second) in bf16, and the paper's rule none.
    model.config.to_json_file(tmp_path / "config.json")
    paper = ["--logra-rule", "paper"]
    for flag, bytes_each in (
        ([], 2 * 2),
        (paper, 0),
        ([*paper, "--logra-moments"], 4),
        ([*paper, "--logra-moments", "bfloat16"], 2),
    ):
        out = tmp_path / "plan.json"
        plan_main(["--model", str(tmp_path / "config.json"), "--rank", "8", *flag, "--json", str(out)])
        planned_cli = json.loads(out.read_text())["logra"]["sketch_moments"]
        assert planned_cli == sum(m.d_out * 8 * bytes_each for m in sketcher.matrices.values()), flag
    default = memory_report(qwen2_factory(seed=1), sketcher=LoGRASketcher(qwen2_factory(seed=1), LoGRAConfig(rank=8)))
    assert default.sketch_moments == sum(m.d_out * 8 * 2 * 2 for m in sketcher.matrices.values())
