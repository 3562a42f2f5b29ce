"""``UpdateCheckpoint``: save the run every N policy updates, atomically, so a crash loses minutes, not the run.

Lightning's default ``ModelCheckpoint`` saves after validation only, so an RL run that validates every few
hundred updates loses everything before its first validation and the tail after its last. Three more details
matter for RL runs, and are handled here:

- the trigger is "an update-count multiple was crossed", not "``global_step % N == 0``": a PPO step takes several
  optimizer steps and can jump over the multiple;
- a checkpoint is written to a temporary file in the same folder, flushed to disk and renamed over the old one
  (:class:`AtomicCheckpointIO`), so a kill mid-write leaves the previous checkpoint intact — Lightning's own
  writer stages the whole checkpoint in memory and in the system temp folder, where a kill leaves it behind;
- weights that are not finite are never saved: the last checkpoint stays the last good one;
- SIGTERM (what schedulers send before they kill a preempted job): the update in progress finishes, every rank
  stops after the same update, and ``last.ckpt`` is saved there, so the run resumes from it with
  ``--ckpt_path last`` (``logra-pl fit`` then exits with 143, not 0: the job did not finish). The signal handler
  only notes the signal; the ranks agree on it at the end of each update with one all-reduce of a flag. (Lightning's
  own handler broadcasts from inside the signal handler, wherever the signal lands: a rank interrupted before a
  collective that another rank is already in pairs the wrong calls, and the run hangs.)
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import uuid
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from logra_pl.errors import ConfigError, check_int
from logra_pl.runtime import compat

log = logging.getLogger(__name__)

_TEMP = re.compile(r"^\..+\.tmp-(\d+)-[0-9a-f]+$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_temps(folder: str | Path) -> list[Path]:
    """Remove ``.<name>.tmp-<pid>-<hex>`` files of interrupted writes whose writer process is gone; return them."""
    removed = []
    folder = Path(folder)
    if not folder.is_dir():
        return removed
    for path in folder.iterdir():
        match = _TEMP.match(path.name)
        if match and path.is_file() and not _pid_alive(int(match.group(1))):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` straight to a temp file beside the target, ``fsync``, then ``os.replace`` onto the target.

    Readers see the old checkpoint or the new one, never a partial file. A write that raises removes its temp
    file; a write killed outright leaves one, which the next save in that folder removes. Remote paths
    (``s3://`` and other fsspec URLs) use Lightning's writer.
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if "://" in str(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        sweep_stale_temps(target.parent)
        tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        try:  # make the rename itself durable
            fd = os.open(target.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass


class UpdateCheckpoint(ModelCheckpoint):
    """Save every ``every_n_updates`` policy updates and when training ends, atomically, finite weights only.

    The CLI adds one to every run (the ``checkpoint:`` section of a config); in your own Trainer pass it in
    ``callbacks``. With the defaults only ``last.ckpt`` is kept, replaced at each save; ``save_top_k=-1`` also keeps
    ``update=<N>.ckpt`` for every save. Resume with ``logra-pl fit ... --ckpt_path last`` (or the file).

    Arguments:
        every_n_updates: save after every N policy updates (optimizer steps); 0: only at the end.
        dirpath: folder of the checkpoints; default ``<log_dir>/checkpoints`` (Lightning's rule).
        filename: name pattern of the kept (top-k) checkpoints.
        save_last: keep ``last.ckpt`` current (what ``--ckpt_path last`` finds).
        save_top_k: ``0`` keeps no numbered checkpoint, ``-1`` keeps all, ``1`` the newest (no monitor is used).
        at_end: also save when training ends normally (the updates after the last multiple of N).
        kwargs: more :class:`~lightning.pytorch.callbacks.ModelCheckpoint` arguments.
    """

    def __init__(
        self,
        every_n_updates: int = 50,
        dirpath: str | None = None,
        filename: str | None = "update={step}",
        save_last: bool = True,
        save_top_k: int = 0,
        at_end: bool = True,
        **kwargs: Any,
    ) -> None:
        check_int("checkpoint.every_n_updates", every_n_updates, 0)
        if kwargs.get("monitor") is not None:
            raise ConfigError(
                "UpdateCheckpoint saves by update count; use ModelCheckpoint to keep the best by a metric"
            )
        super().__init__(
            dirpath=dirpath,
            filename=filename,
            save_last=save_last,
            save_top_k=save_top_k,
            every_n_train_steps=every_n_updates or None,
            auto_insert_metric_name=False,
            **kwargs,
        )
        self.every_n_updates = every_n_updates
        self.at_end = at_end
        self.refused = 0
        self.preempted_at: int | None = None  # the update after which SIGTERM stopped the run (saved there)
        self._sigterm = False  # this process received SIGTERM; the ranks agree on it at an update's end

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        super().setup(trainer, pl_module, stage)
        if trainer.is_global_zero and self.dirpath:
            sweep_stale_temps(self.dirpath)

    def _note_sigterm(self, trainer: pl.Trainer, signum: int) -> None:
        """The SIGTERM handler: note it (and pass it on to ranks this process launched); no collective here."""
        if not self._sigterm:
            log.info("rank %d: received SIGTERM: stopping after the update in progress", trainer.global_rank)
            compat.forward_signal_to_launched_ranks(trainer, signum)
        self._sigterm = True

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A resumed run starts from a checkpoint of this very step: the next save is at the next multiple.
        compat.set_last_saved_step(self, max(compat.last_saved_step(self), trainer.global_step))
        if threading.current_thread() is threading.main_thread():
            # Replaces the handler Lightning registered for this run (it restores the original at the run's end).
            signal.signal(signal.SIGTERM, lambda signum, _frame: self._note_sigterm(trainer, signum))

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stop = self._sigterm
        if trainer.world_size > 1:  # a SIGTERM on any rank stops every rank after this update
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if stop:
            compat.set_received_sigterm(trainer)
        n = self.every_n_updates
        if n < 1 or compat.skips_saving(self, trainer):
            return
        last = max(compat.last_saved_step(self), 0)
        if trainer.global_step // n > last // n:  # a multiple of N was reached or jumped over
            self.save_now(trainer, pl_module)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pass  # saves follow the update count only (epochs of prompts mean nothing to an RL run)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pass

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.at_end and not compat.skips_saving(self, trainer):
            self.save_now(trainer, pl_module)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """SIGTERM stopped the run after a finished update (every rank at the same one): save it as ``last.ckpt``."""
        if not isinstance(exception, SIGTERMException):
            return
        self.preempted_at = trainer.global_step
        if not compat.skips_saving(self, trainer):  # unless this very update was just saved
            self.save_now(trainer, pl_module)
        if trainer.is_global_zero:
            log.warning(
                "SIGTERM: stopped after update %d, saved in %s; resume with the same command and --ckpt_path last",
                trainer.global_step,
                self.last_model_path or self.dirpath,
            )

    def save_now(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Save ``last.ckpt`` (and a numbered one with ``save_top_k``) unless a weight is not finite."""
        finite = all(bool(torch.isfinite(_local(p)).all()) for p in pl_module.parameters())
        if not trainer.strategy.reduce_boolean_decision(finite, all=True):
            self.refused += 1
            if trainer.is_global_zero:
                log.warning(
                    "update %d: the policy holds non-finite weights; not saving, so %s stays the last good checkpoint",
                    trainer.global_step,
                    self.last_model_path or "the previous checkpoint",
                )
            return
        compat.save_checkpoints(self, trainer)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t
