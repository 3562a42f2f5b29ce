"""LoGRA's update-rule options under a real Trainer: the engine follows every update exactly, and a resume is exact."""

from __future__ import annotations

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from logra_pl.callbacks import PolicySync
from logra_pl.module import LoGRAPolicyModule, RolloutSettings
from logra_pl.sketch import LoGRAConfig

# Every new option at once: orthogonal (Hadamard) rows refreshed every 3 updates, a sketch-space first moment (stored
# in bf16) carried across the refresh, the Adam-style step with warmup and cosine decay. The checkpoint at update 2
# lies inside the first basis period; the resumed run crosses the refresh at update 3.
LEVERS = dict(
    rank=16,
    distribution="hadamard",
    refresh_every=3,
    beta1=0.9,
    moment_dtype="bfloat16",
    step_mode="adam",
    lr=3e-3,
    lr_warmup_steps=1,
    lr_decay_steps=3,
    lr_min_ratio=0.1,
)


def _module() -> LoGRAPolicyModule:
    return LoGRAPolicyModule(policy="tiny", logra=LoGRAConfig(**LEVERS), rollout=RolloutSettings(max_new_tokens=4))


def _sync() -> PolicySync:
    return PolicySync(verify_every=1, tolerance=1e-5, probe_lengths=[20], probe_new_tokens=2)


def test_levers_reach_the_engine_and_resume_bit_for_bit(tmp_path, rl_run) -> None:
    straight = _module()
    every2 = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=2, save_top_k=-1)
    rl_run(straight, tmp_path, 4, callbacks=[_sync(), every2], enable_checkpointing=True)
    sketcher = straight.method.sketcher
    assert sketcher.num_applied == 4 and sketcher.moment_age == 4
    mine, engine = straight.policy.state_dict(), straight.engine.model.state_dict()
    assert all(torch.equal(mine[k], engine[k]) for k in mine)  # factors of the new rules merge alike on both sides
    resumed = _module()
    rl_run(resumed, tmp_path, 4, callbacks=[_sync()], ckpt_path=tmp_path / "ckpt" / "step=2.ckpt")
    assert resumed.method.sketcher.moment_age == 4 and resumed.method.sketcher.config.refresh_every == 3
    for name, value in straight.policy.state_dict().items():
        assert torch.equal(value, resumed.policy.state_dict()[name]), name
    for name, moment in sketcher.moments.items():
        assert moment.dtype == torch.bfloat16 and torch.equal(moment, resumed.method.sketcher.moments[name]), name


def _outputs_module(storage: str = "dense") -> LoGRAPolicyModule:
    from logra_pl.methods import LoGRAMethod

    config = LoGRAConfig(
        **{**LEVERS, "distribution": "rademacher", "sketch_side": "outputs", "projection_storage": storage}
    )
    return LoGRAPolicyModule(policy="tiny", method=LoGRAMethod(config), rollout=RolloutSettings(max_new_tokens=4))


def _outputs_callbacks() -> list:
    from logra_pl.callbacks import BudgetSchedule, NextBatchGain, PredictedKLControl

    control = PredictedKLControl(BudgetSchedule("constant", delta_max=1e-3), probe_responses=2)
    return [_sync(), control, NextBatchGain()]


def test_outputs_side_reaches_the_engine_and_resumes_bit_for_bit(tmp_path, rl_run) -> None:
    """``sketch_side: outputs`` under the KL controller (its probe) and the next-batch gain (its kept step), across a
    refresh of ``R`` (moments carried into the new basis): the engine, merged from ``d_in × r`` factors, equals the
    policy after every update (PolicySync verifies), and a resume from update 2 ends on the same bits, though it
    holds its projections packed (``projection_storage: packed``: each ``R`` built from its draws where read)."""
    straight = _outputs_module()
    every2 = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=2, save_top_k=-1)
    trainer = rl_run(straight, tmp_path, 4, callbacks=[*_outputs_callbacks(), every2], enable_checkpointing=True)
    sketcher = straight.method.sketcher
    assert sketcher.num_applied == 4 and sketcher.moment_age == 4
    for name, m in sketcher.matrices.items():
        assert tuple(sketcher.moments[name].shape) == (m.d_in, 16), name  # one row per input channel
    mine, engine = straight.policy.state_dict(), straight.engine.model.state_dict()
    assert all(torch.equal(mine[k], engine[k]) for k in mine)
    assert "train/next_batch_gain" in trainer.callback_metrics  # the kept step met the next update's sketches
    resumed = _outputs_module("packed")
    rl_run(resumed, tmp_path, 4, callbacks=_outputs_callbacks(), ckpt_path=tmp_path / "ckpt" / "step=2.ckpt")
    assert all(g.packed is not None and g.projection is None for g in resumed.method.sketcher.groups)
    for name, value in straight.policy.state_dict().items():
        assert torch.equal(value, resumed.policy.state_dict()[name]), name
    for name, moment in sketcher.moments.items():
        assert torch.equal(moment, resumed.method.sketcher.moments[name]), name
