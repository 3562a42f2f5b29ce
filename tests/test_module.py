"""LoGRAPolicyModule under a real Lightning Trainer: engine/trainer weight identity every update, PPO, validate."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from logra_pl.cli import LoGRACLI
from logra_pl.data import ReasoningGymDataModule
from logra_pl.module import LoGRAPolicyModule, RolloutSettings
from logra_pl.sketch import LoGRAConfig

SMALL = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}


class EngineEqualsTrainer(pl.Callback):
    """After every update: the engine's weights equal the trainer's, bit for bit."""

    def __init__(self) -> None:
        self.checked = 0
        self.alphas: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        proposal = getattr(optimizer, "proposal", None)
        if proposal is not None:  # the proposal exists before the merge, for step controllers
            self.alphas.append(proposal.alpha)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        for (name, a), b in zip(
            pl_module.policy.state_dict().items(), pl_module.engine.model.state_dict().values(), strict=True
        ):
            assert torch.equal(a, b), name
        self.checked += 1


def _data() -> ReasoningGymDataModule:
    return ReasoningGymDataModule(
        {"chain_sum": {"config": SMALL}}, train_size=128, eval_size=16, prompts_per_step=8, eval_batch_size=16
    )


@pytest.mark.parametrize("kind", ["reinforce_tis", "ppo"])
def test_engine_follows_trainer_every_update(tmp_path, kind: str) -> None:
    module = LoGRAPolicyModule(
        policy="tiny",
        logra=LoGRAConfig(rank=16, update_ratio=1e-2),
        loss=kind,  # the short names: ReinforceTIS(), PPOClip() with epochs = minibatches = 2
        rollout=RolloutSettings(max_new_tokens=6),
        microbatch_size=4,
    )
    check = EngineEqualsTrainer()
    trainer = pl.Trainer(
        max_steps=4,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        callbacks=[check],
        default_root_dir=tmp_path,
    )
    module.configure_model()
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    trainer.fit(module, datamodule=_data())
    updates = 4
    assert trainer.global_step == updates
    assert module.method.sketcher.num_applied == updates
    # REINFORCE: one update per rollout; PPO: epochs × minibatches = 4 updates from one rollout.
    assert check.checked == (4 if kind == "reinforce_tis" else 1)
    assert check.alphas == [1.0] * updates
    changed = [k for k, v in module.policy.state_dict().items() if not torch.equal(v, before[k])]
    assert len(changed) == 14 and all(k.endswith("proj.weight") for k in changed)


def test_validate_subcommand(tmp_path) -> None:
    cli = LoGRACLI(
        args=[
            "validate",
            "--model.policy=tiny",
            "--data.tasks=[chain_sum]",
            "--data.train_size=64",
            "--data.eval_size=16",
            "--data.prompts_per_step=8",
            "--data.eval_batch_size=8",
            "--model.rollout.max_new_tokens=4",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.logger=false",
            "--trainer.enable_progress_bar=false",
        ]
    )
    metrics = cli.trainer.callback_metrics
    assert "val/pass@1" in metrics and "val/reward_mean" in metrics
    assert 0.0 <= float(metrics["val/pass@1"]) <= 1.0


@pytest.mark.parametrize("optimizer", ["logra", "adamw"])
def test_shared_engine_weights_train_without_a_copy(tmp_path, optimizer: str) -> None:
    from logra_pl.callbacks import PolicySync

    module = LoGRAPolicyModule(
        policy="tiny",
        optimizer=optimizer,
        logra=LoGRAConfig(rank=16, update_ratio=1e-2),
        rollout=RolloutSettings(max_new_tokens=4, share_weights=True),
        microbatch_size=4,
    )
    module.configure_model()
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    trainer = pl.Trainer(
        max_steps=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=_data())
    assert module.engine.model is module.policy  # one copy of the weights
    changed = [k for k, v in module.policy.state_dict().items() if not torch.equal(v, before[k])]
    assert len(changed) == 14  # both optimizers trained the 14 target matrices (the engine froze nothing)
    again = LoGRAPolicyModule(policy="tiny", rollout=RolloutSettings(share_weights=True))
    with pytest.raises(ValueError, match="PolicySync has nothing to send"):
        pl.Trainer(max_steps=1, logger=False, enable_progress_bar=False, callbacks=[PolicySync()]).fit(
            again, datamodule=_data()
        )
