"""PredictedKLControl and RolloutMismatch as callbacks of a real Trainer: schedules, α, skips, order."""

from __future__ import annotations

import copy
import math

import lightning.pytorch as pl
import pytest
import torch

from logra_pl.callbacks import BudgetSchedule, PredictedKLControl, RolloutMismatch, step_multiplier
from logra_pl.data import ReasoningGymDataModule
from logra_pl.methods.guard import DivergenceGuard
from logra_pl.module import LoGRAPolicyModule, RolloutSettings
from logra_pl.sketch import LoGRAConfig
from logra_pl.sketch.config import LoGRAConfigError

SMALL = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}


def test_cosine_schedule() -> None:
    s = BudgetSchedule("cosine", delta_max=2e-4, delta_min=2e-5, horizon=300)
    assert s(1) == pytest.approx(2e-4)
    assert s(300) == pytest.approx(2e-5)
    assert s(350) == pytest.approx(2e-5)
    mid = 2e-5 + 0.5 * (2e-4 - 2e-5) * (1 + math.cos(math.pi * (150 - 1) / 299))
    assert s(150) == pytest.approx(mid)


def test_linear_constant_none() -> None:
    lin = BudgetSchedule("linear", delta_max=1e-3, delta_min=1e-4, horizon=11)
    assert [lin(1), lin(6), lin(11), lin(61)] == pytest.approx([1e-3, 5.5e-4, 1e-4, 1e-4])
    assert BudgetSchedule("constant", delta_max=3e-4)(1000) == 3e-4
    assert BudgetSchedule("none")(1) is None
    with pytest.raises(ValueError, match=r"unknown schedule\.kind 'step'"):
        BudgetSchedule("step")


def test_step_multiplier() -> None:
    assert step_multiplier(4e-4, 1e-4, 3.0) == pytest.approx(0.5)
    assert step_multiplier(1e-9, 1e-4, 3.0) == 3.0
    assert step_multiplier(0.0, 1e-4, 3.0) == 1.0


def _run(
    callbacks,
    steps: int = 3,
    seed: int = 0,
    prompts: int = 8,
    guard: DivergenceGuard | None = None,
    logra: LoGRAConfig | None = None,
):
    pl.seed_everything(seed)
    module = LoGRAPolicyModule(
        policy="tiny",
        logra=logra or LoGRAConfig(rank=16, update_ratio=1e-2),
        rollout=RolloutSettings(max_new_tokens=6),
        microbatch_size=8,
        guard=guard,
    )
    data = ReasoningGymDataModule(
        {"chain_sum": {"config": SMALL}}, train_size=64, eval_size=8, prompts_per_step=prompts
    )
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    trainer.fit(module, datamodule=data)
    return module, trainer


def test_budget_schedule_counts_applied_updates_only() -> None:
    """The schedule advances with merged updates, not proposals: rejected ones do not move it (paper D.1)."""
    schedule = BudgetSchedule("cosine", delta_max=1e-3, delta_min=1e-4, horizon=3)
    kl = PredictedKLControl(schedule)
    _run([kl])
    assert [h["effective_budget"] for h in kl.history] == pytest.approx([schedule(1), schedule(2), schedule(3)])
    rejected = PredictedKLControl(schedule)
    module, _ = _run([rejected], guard=DivergenceGuard(max_update_ratio=1e-12, max_consecutive=10))
    assert module.rejections.total == 3 and module.method.sketcher.num_applied == 0
    assert [h["effective_budget"] for h in rejected.history] == pytest.approx([schedule(1)] * 3)


def _weights(module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.policy.state_dict().items()}


def test_alpha_scales_proposal_to_budget() -> None:
    kl = PredictedKLControl(BudgetSchedule("constant", delta_max=1e-4), calibrate=True)
    _, trainer = _run([kl])
    assert kl.updates == 3 and len(kl.history) == 3
    for h in kl.history:
        assert h["alpha"] == pytest.approx(min(3.0, math.sqrt(1e-4 / h["predicted"])))
        assert h["predicted_scaled"] == pytest.approx(min(h["alpha"] ** 2 * h["predicted"], 1e-4))
        assert abs(h["realized"] - h["predicted_scaled"]) / h["realized"] < 0.05
    logged = trainer.logged_metrics
    for name in ("kl/predicted", "kl/alpha", "kl/budget", "kl/effective_budget", "kl/predicted_scaled", "kl/realized"):
        assert name in logged, name


def test_the_priced_kl_reaches_the_moments_horizon() -> None:
    """``logra.moment_reference_kl`` in a Trainer run: each merged update's ``α²·predicted`` (the controller's price)
    is what the sketcher keeps, and the moment's mass follows ``c ← β1^√(κ/κ_ref)·c + (1−β1)`` over those prices.
    Without a controller nothing prices the update and the run stops at its first merge, weights untouched."""
    logra = LoGRAConfig(rank=16, beta1=0.95, moment_reference_kl=1e-4)
    kl = PredictedKLControl(BudgetSchedule("constant", delta_max=4e-4))
    module, _ = _run([kl], logra=logra)
    sketcher = module.method.sketcher
    prices = [h["alpha"] ** 2 * h["predicted"] for h in kl.history]
    assert sketcher.num_applied == 3 and sketcher.moved_kl == pytest.approx(prices[-1])
    mass, previous = 0.0, None
    for price in prices:
        mass = (0.95 if previous is None else 0.95 ** math.sqrt(previous / 1e-4)) * mass + 0.05
        previous = price
    assert sketcher.moment_mass == pytest.approx(mass)
    assert mass != pytest.approx(1 - 0.95**3)  # the prices (4× the reference) decayed it faster than β1
    assert module.method.metrics()["logra/moment_decay"] == pytest.approx(0.95 ** math.sqrt(prices[-2] / 1e-4))
    with pytest.raises(LoGRAConfigError, match="PredictedKLControl"):
        _run([], logra=logra, steps=1)


def test_no_control_with_calibration_measures_the_kl_it_takes() -> None:
    """``kind="none"`` + ``calibrate``: α stays 1 (weights equal a run without the callback), yet the predicted and
    realized KL of every nominal-size update are logged and agree to first order."""
    kl = PredictedKLControl(BudgetSchedule("none"), calibrate=True)
    module, trainer = _run([kl])
    plain, _ = _run([])
    assert all(torch.equal(a, b) for a, b in zip(_weights(module).values(), _weights(plain).values(), strict=True))
    assert len(kl.history) == 3 and all(h["alpha"] == 1.0 for h in kl.history)
    for h in kl.history:
        assert h["predicted_scaled"] == h["predicted"] > 0
        assert abs(h["realized"] - h["predicted"]) / h["realized"] < 0.25  # second order at the nominal size
    assert math.isnan(kl.calibration()["mean_effective_budget"])
    for name in ("kl/predicted", "kl/predicted_scaled", "kl/realized", "kl/alpha"):
        assert name in trainer.logged_metrics, name
    assert "kl/budget" not in trainer.logged_metrics
    # Without calibrate, "none" does nothing at all: no probe, no history.
    idle = PredictedKLControl(BudgetSchedule("none"))
    _run([idle], steps=1)
    assert idle.history == []


def test_callbacks_in_either_order_and_alone() -> None:
    def both(order):
        kl = PredictedKLControl(BudgetSchedule("constant", delta_max=1e-4))
        mm = RolloutMismatch()
        module, trainer = _run([kl, mm] if order else [mm, kl])
        for name in ("mismatch/ema", "kl/alpha"):
            assert name in trainer.logged_metrics, (order, name)
        return _weights(module), [h["alpha"] for h in kl.history], [h["effective_budget"] for h in kl.history], mm

    w1, a1, b1, m1 = both(True)
    w2, a2, b2, m2 = both(False)
    assert a1 == a2 and b1 == b2 and m1.value == m2.value
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    # The HF engine samples from the trainer's own weights: the mismatch is float noise, the budget intact.
    assert m1.value < 1e-5 and all(b == pytest.approx(1e-4, rel=1e-3) for b in b1)

    # Mismatch alone: measured and logged, no step control (α = 1 → plain LoGRA steps).
    mm_alone = RolloutMismatch()
    module_m, _ = _run([mm_alone])
    module_plain, _ = _run([])
    assert all(
        torch.equal(a, b) for a, b in zip(_weights(module_m).values(), _weights(module_plain).values(), strict=True)
    )
    # KL alone: the budget is used as is.
    kl_alone = PredictedKLControl(BudgetSchedule("constant", delta_max=1e-4))
    _run([kl_alone])
    assert [h["effective_budget"] for h in kl_alone.history] == [1e-4] * 3
    assert [h["alpha"] for h in kl_alone.history] == pytest.approx(a1, rel=1e-3)


def test_nan_prediction_skips_update() -> None:
    class Poison(pl.Callback):
        """Make one proposal's factor NaN after it is formed (a numerical blow-up in the probe's input)."""

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 1:
                next(iter(optimizer.proposal.matrices.values())).factor[0, 0] = float("nan")
                self.before = copy.deepcopy(pl_module.policy.state_dict())

    poison = Poison()
    kl = PredictedKLControl(BudgetSchedule("constant", delta_max=1e-4))
    weights_seen = {}

    class Snapshot(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            weights_seen[batch_idx] = copy.deepcopy(pl_module.policy.state_dict())

    module, _ = _run([poison, kl, Snapshot()])
    assert kl.skipped == 1
    assert module.method.sketcher.num_skipped == 1 and module.method.sketcher.num_applied == 2
    assert "predicted KL is nan" in module.method.sketcher.last_skip_reason
    assert all(torch.equal(weights_seen[1][k], poison.before[k]) for k in poison.before)  # bit-identical


def test_state_round_trip() -> None:
    kl = PredictedKLControl()
    kl.updates, kl.skipped = 41, 2
    other = PredictedKLControl()
    other.load_state_dict(kl.state_dict())
    assert (other.updates, other.skipped) == (41, 2)
    mm = RolloutMismatch()
    mm.value = 0.0123
    fresh = RolloutMismatch()
    fresh.load_state_dict(mm.state_dict())
    assert fresh.value == 0.0123


def test_dense_params_in_a_trainer_run() -> None:
    """``logra.dense_params``: norms trained beside the sketches, probed by the controller, shipped to the engine."""
    kl = PredictedKLControl(BudgetSchedule("constant", delta_max=1e-4), calibrate=True)
    logra = LoGRAConfig(rank=16, update_ratio=1e-2, dense_params=("*norm.weight",), dense_lr=1e-3)
    module, _ = _run([kl], logra=logra)
    assert module.method.sketcher.num_applied == 3 and len(module.method.sketcher.dense) == 5
    trainer_state, engine_state = module.policy.state_dict(), module.engine.model.state_dict()
    assert all(torch.equal(trainer_state[k], engine_state[k]) for k in engine_state)
    assert not torch.equal(trainer_state["model.norm.weight"], torch.ones_like(trainer_state["model.norm.weight"]))
    for h in kl.history:
        assert abs(h["realized"] - h["predicted_scaled"]) / h["realized"] < 0.05
