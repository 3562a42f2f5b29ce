"""``HFExport``: write the policy as a Hugging Face folder during and at the end of training.

Each export is a ``save_pretrained`` folder (weights, config, tokenizer with its chat template) that ``vllm serve``,
``transformers`` and evaluation harnesses load, written atomically by :func:`~logra_pl.runs.export.save_policy_folder`:
a kill during an export never leaves a half-written folder at an export's name.
"""

from __future__ import annotations

import re
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from logra_pl.callbacks.contract import require_view
from logra_pl.runs.export import as_dtype, remove_policy_folder, save_policy_folder

_PERIODIC = re.compile(r"update-(\d+)")


class HFExport(pl.Callback):
    """Export the trained policy to ``<dirpath>/update-<global_step:06d>`` every N updates and to ``<dirpath>/final``.

    The final export happens in ``on_train_end``, which Lightning reaches only when ``fit`` completes (max steps,
    max epochs or a requested stop); an interrupted or failed run writes no ``final`` folder. With data parallelism
    every rank takes part in gathering the FSDP shards (the method's ``full_state``) and rank 0 writes.

    Arguments:
        every_n_updates: export after every N policy updates (global steps); 0: only at the end.
        at_end: export to ``final`` when training completes.
        dirpath: where exports go; None: ``<the run's folder>/hf`` (TensorBoard: ``<log_dir>/hf``; W&B, MLflow: beside
            the run's ``checkpoints``).
        dtype: cast the exported weights (``"bfloat16"``, ``"float16"``, ``"float32"``); None: the training dtype.
        keep: how many periodic exports to keep (the newest); None keeps all. ``final`` is never removed.
    """

    READS = ("policy", "tokenizer", "method")  # what it reads of the policy contract (docs/extending.md)
    READS_IF_PRESENT = ("policy_source", "dtype_name")  # recorded in the export's metadata when the module has them

    def __init__(
        self,
        every_n_updates: int = 0,
        at_end: bool = True,
        dirpath: str | None = None,
        dtype: str | None = None,
        keep: int | None = None,
    ) -> None:
        if every_n_updates < 0:
            raise ValueError(f"every_n_updates must be >= 0, got {every_n_updates}")
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be >= 1 or None (keep all), got {keep}")
        as_dtype(dtype)  # an unknown dtype fails now, not after the first N updates
        self.every_n_updates = every_n_updates
        self.at_end = at_end
        self.dirpath = dirpath
        self.dtype = dtype
        self.keep = keep
        self.exported: list[Path] = []
        self._last_period = 0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        require_view(pl_module, "HFExport", self.READS)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A resumed run continues the count: no export for the period the checkpoint already passed.
        self._last_period = trainer.global_step // self.every_n_updates if self.every_n_updates else 0

    def export_dir(self, trainer: pl.Trainer) -> Path:
        """The folder exports go to: ``dirpath``, else the run's folder + ``hf``.

        The run's folder is ``Trainer.log_dir`` for loggers with a folder per run (TensorBoard, CSV). For the others
        (W&B, MLflow) ``Trainer.log_dir`` is their ``save_dir``, shared by every run, so the exports of two runs
        would overwrite each other: there the run's folder is the one holding its checkpoints (``<save_dir>/
        <project>/<run id>``, ``<store>/<experiment id>/<run id>``).
        """
        if self.dirpath is not None:
            return Path(self.dirpath)
        first = trainer.loggers[0] if trainer.loggers else None
        checkpoints = getattr(trainer.checkpoint_callback, "dirpath", None)
        if first is not None and not getattr(first, "log_dir", None) and checkpoints:  # Logger.log_dir: None
            return Path(checkpoints).parent / "hf"
        return Path(trainer.log_dir or trainer.default_root_dir) / "hf"

    def export(self, trainer: pl.Trainer, pl_module: pl.LightningModule, name: str) -> Path:
        """Gather the policy on every rank and write it to ``<export_dir>/<name>`` on rank 0."""
        path = self.export_dir(trainer) / name
        state = dict(pl_module.method.full_state(pl_module.policy))  # a collective under FSDP: on every rank
        if trainer.is_global_zero:
            provenance = {
                "global_step": trainer.global_step,
                "epoch": trainer.current_epoch,
                "base_policy": getattr(pl_module, "policy_source", None),
                "training_dtype": getattr(pl_module, "dtype_name", None),
                "written_by": "HFExport",
            }
            save_policy_folder(
                pl_module.policy, pl_module.tokenizer, path, state_dict=state, dtype=self.dtype, provenance=provenance
            )
            self.exported.append(path)
            rank_zero_info(f"HFExport: update {trainer.global_step} -> {path}")
        del state
        trainer.strategy.barrier("HFExport.export")
        return path

    def _prune(self, trainer: pl.Trainer) -> None:
        """Remove all but the newest ``keep`` periodic exports (rank 0)."""
        root = self.export_dir(trainer)
        if self.keep is None or not trainer.is_global_zero or not root.is_dir():
            return
        periodic = sorted(
            (int(m.group(1)), p) for p in root.iterdir() if (m := _PERIODIC.fullmatch(p.name)) and p.is_dir()
        )
        for _, path in periodic[: -self.keep]:
            remove_policy_folder(path)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: object, batch: object, batch_idx: int
    ) -> None:
        if not self.every_n_updates:
            return
        period = trainer.global_step // self.every_n_updates  # PPO makes several updates per batch: crossing counts
        if period <= self._last_period:
            return
        self._last_period = period
        self.export(trainer, pl_module, f"update-{trainer.global_step:06d}")
        self._prune(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.at_end and not trainer.interrupted:
            self.export(trainer, pl_module, "final")
