"""PredictedKLControl on dense updates (DenseAdamW, LoRA, DenseSGD) in real Trainer runs: α from the budget,
calibration, measurement without control, the schedule counting applied updates (and resuming with them), and a NaN
prediction's skip."""

from __future__ import annotations

import copy
import math
import warnings

import lightning.pytorch as pl
import pytest
import torch

from logra_pl.callbacks import BudgetSchedule, PredictedKLControl
from logra_pl.data import ReasoningGymDataModule
from logra_pl.methods import DenseAdamW, LoRAMethod
from logra_pl.methods.adamw import AdamWConfig
from logra_pl.methods.guard import DivergenceGuard
from logra_pl.methods.lora import LoRAConfig
from logra_pl.methods.sgd import DenseSGD, SGDConfig
from logra_pl.module import LoGRAPolicyModule, RolloutSettings

SMALL = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}
KL_LOGGED = ("kl/predicted", "kl/alpha", "kl/predicted_scaled", "kl/realized")


# LoRA's KL leaves α² sooner than a dense step's (the adapters' product adds a B·A term of order α²: at this lr
# the relative gap is ~10% per unit α, where dense AdamW's is ~1%), so its budgets here keep α ≲ 0.2.
BUDGETS = {"adamw": (1e-4, 2e-5), "lora": (4e-6, 1e-6), "sgd": (1e-4, 2e-5)}
SGD_LR = 1.0  # the tiny model's gradients are ~1e-3 per entry: SGD's nominal step is about AdamW's at lr 1e-3


def _method(kind: str, lr: float = 1e-3):
    if kind == "sgd":
        return DenseSGD(SGDConfig(lr=SGD_LR * lr / 1e-3, momentum=0.9))
    adamw = AdamWConfig(lr=lr, warmup_steps=0)
    return DenseAdamW(adamw) if kind == "adamw" else LoRAMethod(LoRAConfig(rank=4, alpha=8.0), adamw)


def _run(callbacks, kind: str = "adamw", steps: int = 3, guard: DivergenceGuard | None = None, lr: float = 1e-3):
    pl.seed_everything(0)
    module = LoGRAPolicyModule(
        policy="tiny",
        method=_method(kind, lr),
        rollout=RolloutSettings(max_new_tokens=6),
        microbatch_size=8,
        guard=guard,
    )
    data = ReasoningGymDataModule({"chain_sum": {"config": SMALL}}, train_size=64, eval_size=8, prompts_per_step=8)
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


def _weights(module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.policy.state_dict().items()}


@pytest.mark.parametrize("kind", ["adamw", "lora", "sgd"])
def test_dense_alpha_follows_the_budget_and_the_realized_kl_matches(kind: str) -> None:
    """α = min(α_max, sqrt(δ/pred)) from an annealed budget that advances with applied updates; after each step
    the realized KL equals α²·pred within 5%; the engine holds the trainer's weights."""
    high, low = BUDGETS[kind]
    schedule = BudgetSchedule("cosine", delta_max=high, delta_min=low, horizon=3)
    kl = PredictedKLControl(schedule, calibrate=True)
    module, trainer = _run([kl], kind)
    assert kl.updates == 3 and len(kl.history) == 3 and module.method.applied_updates == 3
    assert [h["effective_budget"] for h in kl.history] == pytest.approx([schedule(1), schedule(2), schedule(3)])
    for h in kl.history:
        assert h["predicted"] > 0
        assert h["alpha"] == pytest.approx(min(3.0, math.sqrt(h["effective_budget"] / h["predicted"])))
        assert abs(h["realized"] - h["predicted_scaled"]) / h["realized"] < 0.05
    assert any(h["alpha"] != 1.0 for h in kl.history)
    for name in (*KL_LOGGED, "kl/budget", "kl/effective_budget"):
        assert name in trainer.logged_metrics, name
    trainer_state, engine_state = module.method.trained_tensors(module.policy), module.engine.model.state_dict()
    assert all(torch.equal(t, engine_state[n]) for n, t in trainer_state.items())


def test_sgd_under_step_control_resumes_bit_for_bit(tmp_path, rl_run) -> None:
    """SGD with momentum under a cosine budget: 2 updates, a checkpoint, 2 more resumed from it end exactly where 4
    straight updates do — the weights, the momentum buffers, and the budget schedule's position (SGD counts its
    applied steps in its state, so the resumed controller continues the schedule rather than restarting it)."""

    def module() -> LoGRAPolicyModule:
        pl.seed_everything(0)
        return LoGRAPolicyModule(
            policy="tiny", method=_method("sgd"), rollout=RolloutSettings(max_new_tokens=6), microbatch_size=8
        )

    def control() -> PredictedKLControl:
        return PredictedKLControl(BudgetSchedule("cosine", delta_max=1e-4, delta_min=2e-5, horizon=4))

    # The straight run writes its checkpoint at update 2 as a run does (ModelCheckpoint, mid-epoch).
    from lightning.pytorch.callbacks import ModelCheckpoint

    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    straight, kl = module(), control()
    rl_run(straight, tmp_path / "straight", 4, [kl, saver], enable_checkpointing=True)
    ckpt = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    resumed, kl_resumed = module(), control()
    rl_run(resumed, tmp_path / "resumed", 4, [kl_resumed], ckpt_path=str(ckpt))
    assert resumed.method.applied_updates == straight.method.applied_updates == 4
    # The controller's history travels in the checkpoint: the resumed one holds all 4 updates, as the straight one.
    assert [h["effective_budget"] for h in kl_resumed.history] == [h["effective_budget"] for h in kl.history]
    assert len(set(h["effective_budget"] for h in kl.history)) == 4  # the schedule moved at every update
    assert [h["alpha"] for h in kl_resumed.history] == [h["alpha"] for h in kl.history]
    assert all(torch.equal(a, b) for a, b in zip(_weights(resumed).values(), _weights(straight).values(), strict=True))
    buffers = [
        resumed.method.optimizer.state[p]["momentum_buffer"] for p in resumed.method.optimizer.param_groups[0]["params"]
    ]
    want = [
        straight.method.optimizer.state[p]["momentum_buffer"]
        for p in straight.method.optimizer.param_groups[0]["params"]
    ]
    assert all(torch.equal(a, b) for a, b in zip(buffers, want, strict=True))


def test_dense_measurement_without_control_keeps_the_weights() -> None:
    """``kind="none"`` + ``calibrate`` on dense AdamW: α stays 1 and the weights equal a run without the callback
    bit for bit, yet every update's predicted and realized KL are logged and agree to first order (at a nominal
    step of KL ~1e-3: lr 1e-4)."""
    kl = PredictedKLControl(BudgetSchedule("none"), calibrate=True)
    module, trainer = _run([kl], steps=2, lr=1e-4)
    plain, _ = _run([], steps=2, lr=1e-4)
    assert all(torch.equal(a, b) for a, b in zip(_weights(module).values(), _weights(plain).values(), strict=True))
    assert len(kl.history) == 2 and all(h["alpha"] == 1.0 for h in kl.history)
    for h in kl.history:
        assert h["predicted_scaled"] == h["predicted"] > 0
        assert abs(h["realized"] - h["predicted"]) / h["realized"] < 0.25
    for name in KL_LOGGED:
        assert name in trainer.logged_metrics, name
    assert "kl/budget" not in trainer.logged_metrics


def test_dense_rejected_updates_do_not_advance_the_schedule_or_calibrate() -> None:
    """The guard judges the α-scaled step after the controller; rejected steps leave AdamW's count at 0, so every
    proposal gets the first budget, and nothing is calibrated (no step was taken)."""
    schedule = BudgetSchedule("cosine", delta_max=1e-3, delta_min=1e-4, horizon=3)
    kl = PredictedKLControl(schedule, calibrate=True)
    guard = DivergenceGuard(max_update_ratio=1e-12, max_consecutive=10)
    module, trainer = _run([kl], guard=guard)
    assert module.rejections.total == 3 and module.method.applied_updates == 0
    assert [h["effective_budget"] for h in kl.history] == pytest.approx([schedule(1)] * 3)
    assert all("realized" not in h for h in kl.history) and "kl/realized" not in trainer.logged_metrics


def test_dense_nan_prediction_skips_the_update() -> None:
    """A NaN gradient makes the previewed step, and so the prediction, NaN: the controller vetoes the update, which
    leaves the weights bit-identical and is counted."""

    class Poison(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 1:
                next(p for p in pl_module.policy.parameters() if p.grad is not None).grad[0, 0] = float("nan")
                self.before = copy.deepcopy(pl_module.policy.state_dict())

    seen = {}

    class Snapshot(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen[batch_idx] = copy.deepcopy(pl_module.policy.state_dict())

    poison = Poison()
    kl = PredictedKLControl(BudgetSchedule("constant", delta_max=1e-4))
    module, _ = _run([poison, kl, Snapshot()])
    assert kl.skipped == 1 and module.rejections.total == 1 and module.method.applied_updates == 2
    assert all(torch.equal(seen[1][k], poison.before[k]) for k in poison.before)
    assert not all(torch.equal(seen[2][k], poison.before[k]) for k in poison.before)


def test_a_method_without_proposals_is_named_before_training() -> None:
    """A method that makes no proposals gets a warning at setup (the controller would silently do nothing)."""

    class NoProposals(DenseAdamW):
        name = "no-proposals"
        makes_proposals = False

    module = LoGRAPolicyModule(policy="tiny", method=NoProposals())
    with pytest.warns(UserWarning, match="'no-proposals' .*makes no proposals"):
        PredictedKLControl().setup(None, module, "fit")
    for method in (DenseAdamW(), LoRAMethod(), DenseSGD()):  # the built-in methods all do
        module = LoGRAPolicyModule(policy="tiny", method=method)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            PredictedKLControl().setup(None, module, "fit")
