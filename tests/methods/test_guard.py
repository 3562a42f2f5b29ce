"""The divergence guard: a diverging policy is stopped cleanly, its weights never touched, its checkpoint finite."""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from logra_pl.callbacks import PredictedKLControl
from logra_pl.callbacks.checkpoint import UpdateCheckpoint
from logra_pl.errors import PolicyDivergedError
from logra_pl.methods.adamw import AdamWConfig, adamw_step_preview
from logra_pl.methods.guard import DivergenceGuard
from logra_pl.module import LoGRAPolicyModule, RolloutSettings
from logra_pl.rollout.base import SamplingConfig
from logra_pl.rollout.hf import HFEngine
from logra_pl.sketch import LoGRAConfig
from logra_pl.sketch.guard import rejection_reason, relative_update


@pytest.fixture
def fit(rl_run, tmp_path: Path):
    """Train with an UpdateCheckpoint that saves after every update (so the last good one is visible)."""

    def run(module: LoGRAPolicyModule, steps: int, callbacks: tuple = ()) -> pl.Trainer:
        saver = UpdateCheckpoint(every_n_updates=1, dirpath=str(tmp_path / "ckpt"))
        return rl_run(module, tmp_path, steps, [saver, *callbacks], enable_checkpointing=True)

    return run


def _module(**kwargs) -> LoGRAPolicyModule:
    return LoGRAPolicyModule(
        policy="tiny", rollout=RolloutSettings(max_new_tokens=4), microbatch_size=8, guard=DivergenceGuard(), **kwargs
    )


@pytest.mark.parametrize(
    ("name", "settings", "reason"),
    [
        (
            "update_ratio 10",
            dict(logra=LoGRAConfig.paper(rank=16, update_ratio=10.0)),
            "exceeds the guard's max_update_ratio",
        ),
        ("update_ratio 1e10", dict(logra=LoGRAConfig.paper(rank=16, update_ratio=1e10)), "exceeds|non-finite factors"),
        (
            "huge lr",
            dict(logra=LoGRAConfig(rank=16, step_mode="lr", lr=1e30)),
            "exceeds the guard's max_update_ratio|could overflow|non-finite",
        ),
        ("adamw huge lr", dict(optimizer="adamw", adamw=AdamWConfig(lr=1e3, warmup_steps=0)), "exceeds|non-finite"),
    ],
)
def test_diverging_settings_stop_cleanly_with_weights_and_checkpoint_untouched(
    tmp_path: Path, fit, caplog: pytest.LogCaptureFixture, name: str, settings: dict, reason: str
) -> None:
    module = _module(**settings)
    module.configure_model()
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    caplog.set_level(logging.WARNING, logger="logra_pl")
    with pytest.raises(PolicyDivergedError, match=r"policy diverged at update 5: 5 updates in a row were not applied"):
        fit(module, steps=20)
    assert module.global_step == 5 and module.rejections.total == 5
    # Nothing any rejected update proposed reached the weights (exact: it was never merged / stepped).
    for key, value in module.policy.state_dict().items():
        assert torch.equal(value, before[key]), key
    lines = [r.getMessage() for r in caplog.records if "not applied (weights unchanged)" in r.getMessage()]
    assert len(lines) == 5 and all(re.search(reason, line) for line in lines), lines
    # The checkpoint of every rejected update holds the last good (= initial) weights, all finite.
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 4
    for key, value in saved["state_dict"].items():
        assert torch.isfinite(value).all(), key
        assert torch.equal(value, before[key.removeprefix("policy.")]), key


def test_healthy_run_is_never_rejected(fit) -> None:
    module = _module(logra=LoGRAConfig(rank=16, update_ratio=1e-2))
    fit(module, steps=4, callbacks=(PredictedKLControl(),))
    assert module.rejections.total == 0 and module.method.sketcher.num_applied == 4
    assert 0 < module.method.sketcher.last_relative_update < 0.1


def test_guard_rejects_one_oversized_update_and_the_run_goes_on(fit) -> None:
    """A single bad update is dropped and counted; the next healthy one resets the streak."""
    module = _module(logra=LoGRAConfig(rank=16, update_ratio=1e-2))

    class SpikeOnce(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            if trainer.global_step == 1:
                optimizer.proposal.alpha = 1e4  # this update would move the weights by 100× their norm

    fit(module, steps=4, callbacks=(SpikeOnce(),))
    assert module.rejections.total == 1 and module.rejections.in_a_row == 0
    assert module.method.sketcher.num_rejected == 1 and module.method.sketcher.num_applied == 3


def test_rejection_reason_is_exact_about_overflow_and_size() -> None:
    w = {"a": 4.0, "b": 0.0}
    assert rejection_reason(w, {"a": 0.01, "b": 0.0}, max_relative=1.0) is None
    assert relative_update(w, {"a": 1.0, "b": 0.0}) == pytest.approx(0.5)
    assert "exceeds" in rejection_reason(w, {"a": 16.0, "b": 1.0}, max_relative=1.0)
    assert "non-finite update" in rejection_reason(w, {"a": math.inf, "b": 0.0}, max_relative=None)
    assert "already non-finite" in rejection_reason({"a": math.nan, "b": 1.0}, {"a": 1.0, "b": 1.0}, None)
    big = torch.finfo(torch.float32).max
    assert "overflow" in rejection_reason({"a": big**2 / 4}, {"a": big**2 / 4 * 1.01}, max_relative=None)


def test_adamw_step_preview_equals_the_step_torch_takes(qwen2_factory) -> None:
    """The preview of ΔW equals what ``AdamW.step`` then does, measured independently (before/after copies)."""
    model = qwen2_factory(seed=1)
    params = [p for n, p in model.named_parameters() if n.endswith("proj.weight")]
    opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p) * (step + 1)
        upd_sq, w_sq, bad = adamw_step_preview(opt)
        before = [p.detach().clone() for p in params]
        opt.step()
        real_upd = sum(
            float((p.detach().double() - b.double()).square().sum()) for p, b in zip(params, before, strict=True)
        )
        real_w = sum(float(b.double().square().sum()) for b in before)
        assert bad == 0
        assert upd_sq == pytest.approx(real_upd, rel=1e-4)
        assert w_sq == pytest.approx(real_w, rel=1e-9)


def test_non_finite_engine_logits_get_a_clear_error(qwen2_factory) -> None:
    model = qwen2_factory(seed=2)
    engine = HFEngine(model, eos_token_id=1, pad_token_id=0)
    with torch.no_grad():
        engine.model.model.layers[0].mlp.down_proj.weight[0, 0] = float("inf")
    with pytest.raises(PolicyDivergedError, match="logits hold inf/NaN: the policy weights are no longer finite"):
        engine.generate([[5, 6, 7]], SamplingConfig(max_new_tokens=3))
