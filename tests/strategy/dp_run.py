"""A LoGRA run under LoGRAStrategy, launched as its own script (Lightning re-launches it once per rank).

    python tests/strategy/dp_run.py DEVICES STEPS OUT [--ckpt-dir DIR] [--ckpt-resume PATH] [--hf-export DIR]
        [--optimizer adamw] [--kl-control] [--snapshot-at K] [--loss-menu] [--per-matrix]
        [--sketch-side outputs] [--projection-storage packed] [--input-scaling] [--moment-reference-kl KL]

Rank 0 writes the full (gathered) policy state dict and the LoGRA state to OUT (and, with ``--kl-control``, the KL
controller's history).
"""

from __future__ import annotations

import argparse
import json
import os
import signal

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from logra_pl.callbacks import BudgetSchedule, HFExport, PredictedKLControl, UpdateCheckpoint
from logra_pl.data import ReasoningGymDataModule
from logra_pl.losses import ReinforceTIS
from logra_pl.methods.adamw import AdamWConfig
from logra_pl.module import LoGRAPolicyModule, RolloutSettings
from logra_pl.sketch import LoGRAConfig, memory_report
from logra_pl.strategy import LoGRAStrategy

SMALL = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}


class CountLayerForwards(pl.Callback):
    """Forward calls of the decoder layers made with grad enabled (loss forwards, and checkpoint replays)."""

    def __init__(self) -> None:
        self.calls = 0

    def on_train_start(self, trainer, pl_module) -> None:
        from logra_pl.runtime.checkpointing import decoder_layers

        def count(*_args) -> None:
            if torch.is_grad_enabled():
                self.calls += 1

        for layer in decoder_layers(pl_module.policy):
            layer.register_forward_pre_hook(count)  # a pre-hook: a replay stops early, before post-hooks


class Snapshot(pl.Callback):
    """What the run held after update ``at``: the gathered policy, the engine's copy, the LoGRA state, the layer
    forwards so far (a collective on every rank; rank 0 keeps it). One run then stands for a shorter one too."""

    def __init__(self, at: int, counter: CountLayerForwards) -> None:
        self.at, self.counter = at, counter
        self.taken: dict | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.at:
            return
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        # Copies: on one CPU rank the "gathered" state holds the live parameters, which later merges change in place.
        state = {k: v.clone() for k, v in get_model_state_dict(pl_module.policy, options=options).items()}
        sketcher = pl_module.method.sketcher
        self.taken = {
            "policy": state,
            "engine": {k: v.clone() for k, v in pl_module.engine.model.state_dict().items()},
            "logra": sketcher.state_dict() if sketcher is not None else None,
            "layer_forwards": self.counter.calls,
        }


class Record(pl.Callback):
    """What each rank trained on: (update, question, response ids) per response."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, str, list[int]]] = []
        self.padded = 0  # zero-loss microbatches this rank ran to match the others' forward count

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        ctx = pl_module.step_context
        self.padded += ctx.padded_microbatches
        for i, resp in zip(ctx.rollout.prompt_index, ctx.rollout.response_ids, strict=True):
            self.rows.append((ctx.update_index, ctx.items[i]["question"], resp))


class Gains(pl.Callback):
    """The update method's first-order gain of each update (``method.last_gain``, reduced over ranks) and the gain
    of the step before it on this update's loss (``method.next_batch_gain``, with the method keeping its steps)."""

    def __init__(self) -> None:
        self.values: list[float] = []
        self.next: list[float | None] = []

    def setup(self, trainer, pl_module, stage) -> None:
        pl_module.method.keep_last_step()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.values.append(pl_module.method.last_gain)
        self.next.append(pl_module.method.next_batch_gain)


class SigtermAt(pl.Callback):
    """Send SIGTERM to this process at the end of update ``update`` on rank ``rank`` only (a scheduler's signal that
    reached one rank first)."""

    def __init__(self, update: int, rank: int) -> None:
        self.update, self.rank = update, rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.update:
            os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("devices", type=int)
    parser.add_argument("steps", type=int)
    parser.add_argument("out")
    parser.add_argument("--ckpt-dir", default=None, help="save a checkpoint every 3 updates (ModelCheckpoint)")
    parser.add_argument("--ckpt-resume", default=None)
    parser.add_argument("--optimizer", default="logra", choices=["logra", "adamw"])
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--param-dtype", default=None, help="FSDP2 compute dtype (bfloat16: bf16 compute, fp32 master)")
    parser.add_argument("--distributed-ckpt", action="store_true", help="save sharded checkpoints")
    parser.add_argument("--hf-export", default=None, help="HFExport every 3 updates and at the end to this folder")
    parser.add_argument("--snapshot-at", type=int, default=None, help="also record the state after this update")
    parser.add_argument("--kl-control", action="store_true", help="PredictedKLControl (constant budget, calibrating)")
    parser.add_argument("--max-tokens", type=int, default=None, help="model.max_tokens_per_microbatch")
    parser.add_argument(
        "--loss-menu",
        action="store_true",
        help="sequence-mean aggregation and a k3 KL penalty to a reference kept with the policy (sharded)",
    )
    parser.add_argument("--sigterm-at", type=int, default=None, help="SIGTERM after this update (on --sigterm-rank)")
    parser.add_argument("--sigterm-rank", type=int, default=1)
    parser.add_argument("--preempt-dir", default=None, help="UpdateCheckpoint's folder (saves on SIGTERM)")
    parser.add_argument("--input-scaling", action="store_true", help="logra.input_scaling: rms")
    parser.add_argument("--sketch-side", default="inputs", choices=["inputs", "outputs"], help="logra.sketch_side")
    parser.add_argument(
        "--projection-storage", default="dense", choices=["dense", "packed"], help="logra.projection_storage"
    )
    parser.add_argument("--moment-reference-kl", type=float, default=None, help="logra.moment_reference_kl")
    parser.add_argument(
        "--per-matrix", action="store_true", help="LoGRA's step one matrix at a time (the reference, not the grouped)"
    )
    args = parser.parse_args()
    if args.per_matrix:  # the method builds this class; the reference shares every other part of the run
        import logra_pl.methods.logra as logra_method
        from logra_pl.sketch.reference import PerMatrixSketcher

        logra_method.LoGRASketcher = PerMatrixSketcher
    torch.set_num_threads(1)
    pl.seed_everything(0)
    module = LoGRAPolicyModule(
        policy="tiny",
        optimizer=args.optimizer,
        adamw=AdamWConfig(lr=1e-3, warmup_steps=0),
        logra=LoGRAConfig(
            rank=16,
            update_ratio=1e-3,
            input_scaling="rms" if args.input_scaling else "none",
            sketch_side=args.sketch_side,
            projection_storage=args.projection_storage,
            moment_reference_kl=args.moment_reference_kl,
        ),
        rollout=RolloutSettings(max_new_tokens=6),
        microbatch_size=4,
        max_tokens_per_microbatch=args.max_tokens,
        loss=ReinforceTIS(aggregation="seq_mean_token_mean", kl_coef=0.05, reference_device="same")
        if args.loss_menu
        else None,
    )
    data = ReasoningGymDataModule({"chain_sum": {"config": SMALL}}, train_size=64, eval_size=8, prompts_per_step=8)
    callbacks: list[pl.Callback] = [record := Record(), counter := CountLayerForwards(), gains := Gains()]
    if args.ckpt_dir:
        callbacks.append(
            ModelCheckpoint(dirpath=args.ckpt_dir, filename="{step}", every_n_train_steps=3, save_top_k=-1)
        )
    if args.hf_export:
        callbacks.append(HFExport(every_n_updates=3, dirpath=args.hf_export))
    kl = PredictedKLControl(BudgetSchedule("constant", delta_max=1e-4), calibrate=True) if args.kl_control else None
    if kl is not None:
        callbacks.append(kl)
    if args.sigterm_at is not None:
        callbacks += [SigtermAt(args.sigterm_at, args.sigterm_rank), UpdateCheckpoint(0, dirpath=args.preempt_dir)]
    snapshot = Snapshot(args.snapshot_at, counter) if args.snapshot_at else None
    if snapshot is not None:
        callbacks.append(snapshot)
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=args.devices,
        strategy=LoGRAStrategy(
            activation_checkpointing=args.activation_checkpointing,
            save_distributed_checkpoint=args.distributed_ckpt,
            param_dtype=args.param_dtype,
        ),
        logger=False,
        enable_checkpointing=bool(args.ckpt_dir or args.preempt_dir),
        enable_progress_bar=False,
        limit_val_batches=0,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    try:
        trainer.fit(module, datamodule=data, ckpt_path=args.ckpt_resume)
    except SIGTERMException:  # each rank says where it stopped (the process group is gone: no gather)
        stopped = {"rank": trainer.global_rank, "global_step": trainer.global_step}
        with open(f"{args.out}.rank{trainer.global_rank}.json", "w") as f:
            json.dump(stopped, f)
        raise SystemExit(143) from None
    state = get_model_state_dict(module.policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    rows, padded = [None] * trainer.world_size, [None] * trainer.world_size
    torch.distributed.all_gather_object(rows, record.rows)
    torch.distributed.all_gather_object(padded, record.padded)
    report = memory_report(module.policy, optimizer=module.optimizers().optimizer, sketcher=module.method.sketcher)
    if trainer.global_rank == 0:
        torch.save(
            {
                "policy": state,
                "logra": module.method.sketcher.state_dict() if module.method.sketcher is not None else None,
                "rows": sorted(r for part in rows for r in part),
                "padded": padded,
                "engine": module.engine.model.state_dict(),
                "stats": trainer.strategy.stats,
                "layer_forwards": counter.calls,
                "sketch_dtypes": sorted({str(s.dtype) for s in module.method.sketcher.sketches().values()})
                if module.method.sketcher is not None
                else [],
                "persistent_bytes": report.persistent,
                "projection_bytes": report.projections,
                "kl": kl.history if kl is not None else None,
                "gains": gains.values,
                "next_gains": gains.next,
                "reference": None
                if module.reference_policy is None
                else {
                    "sharded": module.reference_policy.sharded,
                    "nbytes": module.reference_policy.nbytes,
                    "digest": module.reference_policy.digest,
                    "kl_reference": module.step_context.metrics.get("train/kl_reference"),
                },
                "snapshot": snapshot.taken if snapshot is not None else None,
            },
            args.out,
        )


if __name__ == "__main__":
    main()
