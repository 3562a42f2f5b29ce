"""Every use of a Lightning private attribute, in one place.

Lightning does not promise anything about names that start with ``_``; logra-pl needs a few of them (what each works
around is said beside it). Code elsewhere calls the functions here instead of touching the names, so a Lightning
upgrade is checked here alone: ``tests/runtime/test_compat.py`` asserts that every name listed in :data:`PRIVATE_NAMES`
still exists and that each function still does what it says. Checked on Lightning :data:`CHECKED_LIGHTNING`.

Overrides of private Lightning methods cannot be functions: :class:`CheckpointPathHook` turns LightningCLI's one
into a public hook, and the private methods the progress bars override are listed in :data:`PRIVATE_NAMES`.

This module imports nothing from Lightning at import time (``resume`` and ``export`` use it without Lightning).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import lightning.pytorch as pl

CHECKED_LIGHTNING = "2.6.6"

# (module, class or None for a module attribute, name): every private Lightning name this project relies on.
# tests/runtime/test_compat.py imports each and checks it is there.
PRIVATE_NAMES: tuple[tuple[str, str | None, str], ...] = (
    ("lightning.pytorch.cli", "LightningCLI", "_parse_ckpt_path"),
    ("lightning.pytorch.callbacks", "TQDMProgressBar", "_leave"),  # instance attribute (set in __init__)
    ("lightning.pytorch.callbacks", "RichProgressBar", "_leave"),  # instance attribute
    ("lightning.pytorch.callbacks", "RichProgressBar", "_add_task"),
    ("lightning.pytorch.callbacks", "RichProgressBar", "_update"),
    ("lightning.pytorch.callbacks", "RichProgressBar", "_update_metrics"),
    ("lightning.pytorch.callbacks", "RichProgressBar", "_get_train_description"),  # overridden
    ("lightning.pytorch.callbacks", "RichProgressBar", "_initialize_train_progress_bar_id"),  # overridden
    ("lightning.pytorch.callbacks", "ModelSummary", "_max_depth"),  # instance attribute
    ("lightning.pytorch.callbacks", "ModelSummary", "_summarize_kwargs"),  # instance attribute
    ("lightning.pytorch.callbacks", "ModelSummary", "_summary"),
    ("lightning.pytorch.utilities.model_summary", "ModelSummary", "_get_summary_data"),
    ("lightning.pytorch.callbacks", "ModelCheckpoint", "_last_global_step_saved"),  # instance attribute
    ("lightning.pytorch.callbacks", "ModelCheckpoint", "_should_skip_saving_checkpoint"),
    ("lightning.pytorch.callbacks", "ModelCheckpoint", "_monitor_candidates"),
    ("lightning.pytorch.callbacks", "ModelCheckpoint", "_save_topk_checkpoint"),
    ("lightning.pytorch.callbacks", "ModelCheckpoint", "_save_last_checkpoint"),
    ("lightning.pytorch.loggers", "TensorBoardLogger", "_version"),  # instance attribute
    ("lightning.pytorch.loggers", "TensorBoardLogger", "_kwargs"),  # instance attribute
    ("lightning.pytorch.loggers", "WandbLogger", "_wandb_init"),  # instance attribute
    ("lightning.pytorch.loggers", "WandbLogger", "_experiment"),  # instance attribute
    ("lightning.pytorch.loggers", "WandbLogger", "_id"),  # instance attribute
    ("lightning.pytorch.loggers", "MLFlowLogger", "_run_id"),  # instance attribute
    ("lightning.pytorch.loggers", "MLFlowLogger", "_tracking_uri"),  # instance attribute
    ("lightning.pytorch.loggers", "MLFlowLogger", "_initialized"),  # instance attribute
    ("lightning.fabric.utilities.logger", None, "_convert_params"),
    ("lightning.fabric.utilities.logger", None, "_flatten_dict"),
    ("lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop", "_batches_that_stepped"),  # instance
    ("lightning.pytorch.core.module", "LightningModule", "_trainer"),  # instance attribute
    ("lightning.pytorch.core.optimizer", "LightningOptimizer", "_optimizer"),  # instance attribute
    ("lightning.pytorch.strategies", "ModelParallelStrategy", "_data_parallel_size"),  # instance attribute
    ("lightning.fabric.utilities.load", None, "_METADATA_FILENAME"),
)
# Private methods a logra-pl subclass overrides (and may call on itself), by the file that does.
OVERRIDDEN: dict[str, str] = {
    "_get_train_description": "callbacks/progress.py",  # RichUpdateProgressBar: "update", not "Epoch N"
    "_initialize_train_progress_bar_id": "callbacks/progress.py",  # its total is max_steps, not batches
}


# ------------------------------------------------------------------------------------------- module and trainer
def trainer_of(module: Any) -> pl.Trainer | None:
    """The Trainer ``module`` is attached to, or None (any object without one: None).

    ``LightningModule.trainer`` raises "is not attached to a Trainer" when there is none; code that also runs outside
    a Trainer (tests, notebooks, engines built by hand) reads the attribute behind it (``_trainer``, 2.6.6).
    """
    return getattr(module, "_trainer", None)


def inner_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a ``LightningOptimizer`` (``.optimizer``; ``_optimizer`` behind it, 2.6.6), or
    ``optimizer`` itself when it is not wrapped."""
    return getattr(optimizer, "optimizer", getattr(optimizer, "_optimizer", optimizer))


# ------------------------------------------------------------------------------------------------------- CLI
class CheckpointPathHook:
    """Mixin for a LightningCLI subclass (``class MyCLI(CheckpointPathHook, LightningCLI)``): LightningCLI's private
    ``_parse_ckpt_path`` step (2.6.6: called in ``__init__`` after parsing, before any class is instantiated) becomes
    the public hook :meth:`resolve_ckpt_path`.

    Lightning's own step replaces the parsed model settings with the checkpoint's hyper-parameters; logra-pl's CLI
    overrides the hook to find ``--ckpt_path last`` and compare settings instead (``logra_pl.cli``).
    """

    def _parse_ckpt_path(self) -> None:
        self.resolve_ckpt_path()

    def resolve_ckpt_path(self) -> None:
        """Lightning's behaviour unless overridden."""
        super()._parse_ckpt_path()  # type: ignore[misc]


def hparams_class_path(hparams: Mapping[str, Any], default: str) -> str:
    """The class a checkpoint's ``hyper_parameters`` were saved from: LightningCLI's private ``_class_path`` entry
    (2.6.6: written when the module was built in subclass mode), else ``default``."""
    return str(hparams.get("_class_path", default))


# ------------------------------------------------------------------------------------------------ TensorBoard
def tensorboard_version(logger: Any) -> int | str | None:
    """The version a TensorBoardLogger was given or has chosen, without choosing one.

    ``logger.version`` picks the next free ``version_N`` folder on first access; the resume wiring must know
    whether a version is still open (``_version``, 2.6.6).
    """
    return logger._version


def set_tensorboard_version(logger: Any, version: int | str) -> None:
    """Make a TensorBoardLogger log into ``version`` (a resumed run continues in its checkpoint's folder).

    There is no setter; ``_version`` (2.6.6) is read when the log folder is first needed, so call this before.
    """
    logger._version = version


def set_purge_step(logger: Any, step: int) -> None:
    """TensorBoard's ``purge_step`` for a logger whose SummaryWriter does not exist yet.

    The logger keeps its SummaryWriter arguments in ``_kwargs`` (2.6.6) and passes them when the writer is first
    created; there is no public way to add one after construction.
    """
    logger._kwargs["purge_step"] = int(step)


# ------------------------------------------------------------------------------------------------------- W&B
def wandb_init_args(logger: Any) -> dict[str, Any]:
    """The arguments a WandbLogger will pass to ``wandb.init`` (``_wandb_init``, 2.6.6: its constructor's ``name``,
    ``project``, ``dir``, ``id``, ``resume="allow"`` and extra keyword arguments), to read or change before the run
    starts (the logger has no public way to change them)."""
    return logger._wandb_init


def wandb_run_if_started(logger: Any) -> Any:
    """A WandbLogger's wandb run if it has started one, else None (``logger.experiment`` would start it;
    ``_experiment``, 2.6.6)."""
    return logger._experiment


def continue_wandb_run(logger: Any, run_id: str, rewind_to: int | None) -> None:
    """Make a WandbLogger that has not started its run continue run ``run_id``.

    ``rewind_to``: W&B's rewind, ``resume_from="<run_id>?_step=<rewind_to>"`` (history after that row dropped);
    None: W&B's plain resume, the ``resume`` mode given (``"must"``) or Lightning's ``"allow"`` (nothing dropped).
    ``wandb.init`` refuses ``resume`` together with
    ``resume_from``, so Lightning's ``resume="allow"`` is cleared for a rewind. ``_id`` (2.6.6) is what the logger
    reports as its version before the run starts.
    """
    if logger._experiment is not None:
        raise RuntimeError("continue_wandb_run: the W&B run has already started")
    args = logger._wandb_init
    args["id"] = run_id
    logger._id = run_id
    if rewind_to is None:
        args["resume"] = args.get("resume") or "allow"
        args.pop("resume_from", None)
    else:
        args["resume"] = None
        args["resume_from"] = f"{run_id}?_step={int(rewind_to)}"


# ---------------------------------------------------------------------------------------------------- MLflow
def mlflow_run_id(logger: Any) -> str | None:
    """The run id an MLFlowLogger was given or has created, without creating one (``_run_id``, 2.6.6)."""
    return logger._run_id


def mlflow_tracking_uri(logger: Any) -> str:
    """The tracking URI of an MLFlowLogger, without starting its run (``_tracking_uri``, 2.6.6)."""
    return logger._tracking_uri


def set_mlflow_run_id(logger: Any, run_id: str) -> None:
    """Make an MLFlowLogger that has not started log into the existing run ``run_id`` (what its ``run_id`` argument
    does; ``_run_id`` is read when the run is first needed, ``_initialized`` says whether it was, 2.6.6)."""
    if logger._initialized:
        raise RuntimeError("set_mlflow_run_id: the MLflow run has already started")
    logger._run_id = run_id


def mlflow_param_values(params: Any) -> dict[str, str]:
    """Hyper-parameters as MLFlowLogger writes them as MLflow params: converted and flattened with ``/`` by
    Lightning's private helpers (``_convert_params``, ``_flatten_dict`` of ``lightning.fabric.utilities.logger``,
    2.6.6), each value ``str()``-ed and cut to 250 characters (``MLFlowLogger.log_hyperparams``)."""
    from lightning.fabric.utilities.logger import _convert_params, _flatten_dict

    return {key: str(value)[:250] for key, value in _flatten_dict(_convert_params(params)).items()}


# ------------------------------------------------------------------------------------------------------ loops
def batches_that_stepped(trainer: Any) -> int:
    """The step Lightning logs this batch's scalars at (``fit_loop.epoch_loop._batches_that_stepped``, 2.6.6); a
    callback that writes to the loggers itself uses it so its values line up with ``self.log``'s.

    Falls back to ``trainer.global_step`` (equal to it for one optimizer step per batch).
    """
    return int(getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step))


def batch_position(trainer: Any) -> tuple[int, int]:
    """``(batches completed in the run, batches completed in this epoch)`` during a training step: the index of the
    batch being trained, over the run and within its epoch (``fit_loop.epoch_loop.batch_progress``'s ``total`` and
    ``current`` counts, 2.6.6; restored on resume)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return int(progress.total.completed), int(progress.current.completed)


def checkpoint_first_log_step(checkpoint: Mapping[str, Any]) -> int | None:
    """The first step a run resumed from ``checkpoint`` logs at, or None when the checkpoint does not say.

    Read from the fit loop's state in the checkpoint (keys ``epoch_loop.state_dict._batches_that_stepped`` and
    ``epoch_loop.batch_progress``, 2.6.6). A checkpoint saved in ``on_train_batch_end`` has that batch processed but
    not completed; Lightning counts it as stepped on restore, so the resumed run logs from the step after it.
    """
    loops = (checkpoint.get("loops") or {}).get("fit_loop", {})
    stepped = loops.get("epoch_loop.state_dict", {}).get("_batches_that_stepped")
    if stepped is None:
        return None
    current = loops.get("epoch_loop.batch_progress", {}).get("current", {})
    in_flight = int(current.get("processed", 0)) > int(current.get("completed", 0))
    return int(stepped) + int(in_flight)


# -------------------------------------------------------------------------------------- progress and summary
def progress_bar_args(bar: Any) -> dict[str, Any]:
    """``refresh_rate`` and ``leave`` of a TQDM or rich progress bar, to build a replacement with the same settings
    (``leave`` is stored only as ``_leave``, 2.6.6)."""
    return {"refresh_rate": bar.refresh_rate, "leave": bar._leave}


def summary_depth(callback: Any) -> int:
    """``max_depth`` of a ModelSummary / RichModelSummary callback (stored only as ``_max_depth``, 2.6.6)."""
    return callback._max_depth


def summarize_kwargs(callback: Any) -> dict[str, Any]:
    """The extra ``summarize`` arguments a ModelSummary callback was built with (``_summarize_kwargs``, 2.6.6)."""
    return callback._summarize_kwargs


def layer_summary(callback: Any, trainer: Any, pl_module: Any) -> Any:
    """The layer summary a ModelSummary callback would print, and its table rows: ``(summary, rows)``.

    ``ModelSummary.on_fit_start`` (2.6.6) builds both with private calls (``_summary``, ``_get_summary_data``); a
    summary that prints other totals has to repeat it.
    """
    summary = callback._summary(trainer, pl_module)
    return summary, summary._get_summary_data()


def rich_add_task(bar: Any, total: float, description: str) -> Any:
    """A new task (row) of a RichProgressBar (``_add_task``, 2.6.6); its id."""
    return bar._add_task(total, description)


def rich_update(bar: Any, task_id: Any, completed: float) -> None:
    """Move a RichProgressBar task to ``completed`` (``_update``, 2.6.6)."""
    bar._update(task_id, completed)


def rich_update_metrics(bar: Any, trainer: Any, pl_module: Any) -> None:
    """Refresh the metrics a RichProgressBar shows (``_update_metrics``, 2.6.6)."""
    bar._update_metrics(trainer, pl_module)


# ------------------------------------------------------------------------------------------------ checkpoints
def last_saved_step(callback: Any) -> int:
    """The global step a ModelCheckpoint last saved at (``_last_global_step_saved``, 2.6.6)."""
    return callback._last_global_step_saved


def set_last_saved_step(callback: Any, step: int) -> None:
    """Tell a ModelCheckpoint it last saved at ``step`` (a resumed run starts from a checkpoint of that step)."""
    callback._last_global_step_saved = step


def forward_signal_to_launched_ranks(trainer: Any, signum: int) -> None:
    """Pass a signal on to the rank processes Lightning itself started (its subprocess launcher on rank 0), as
    Lightning's own SIGTERM handler does (2.6.6: ``_SignalConnector._sigterm_notifier_fn``)."""
    launcher = trainer.strategy.launcher
    if launcher is not None:
        launcher.kill(signum)


def set_received_sigterm(trainer: Any) -> None:
    """Mark the run as stopping after this update: Lightning's loops raise ``SIGTERMException`` at the update's end
    (2.6.6: ``_SignalConnector.received_sigterm``, read by ``Trainer.received_sigterm``)."""
    trainer._signal_connector.received_sigterm = True


def skips_saving(callback: Any, trainer: Any) -> bool:
    """Whether a ModelCheckpoint would not save now: fast_dev_run, sanity check, not fitting, or already saved at
    this step (``_should_skip_saving_checkpoint``, 2.6.6)."""
    return callback._should_skip_saving_checkpoint(trainer)


def save_checkpoints(callback: Any, trainer: Any) -> None:
    """Save what a ModelCheckpoint saves when it triggers: the top-k file, then ``last`` (2.6.6: the private steps
    ``_monitor_candidates``, ``_save_topk_checkpoint``, ``_save_last_checkpoint`` of its own triggers)."""
    candidates = callback._monitor_candidates(trainer)
    callback._save_topk_checkpoint(trainer, candidates)
    callback._save_last_checkpoint(trainer, candidates)


DISTRIBUTED_METADATA = "meta.pt"  # == lightning.fabric.utilities.load._METADATA_FILENAME (tests/runtime/test_compat.py)


def distributed_checkpoint_metadata(folder: str | Path) -> Path:
    """The metadata file of a Lightning distributed (sharded) checkpoint folder: the Trainer's state without the
    shards. Lightning names it in a private constant (``lightning.fabric.utilities.load._METADATA_FILENAME``,
    ``meta.pt`` in 2.6.6); the name is repeated here so this module needs no Lightning import."""
    return Path(folder) / DISTRIBUTED_METADATA


# --------------------------------------------------------------------------------------------------- strategy
def data_parallel_size(strategy: Any) -> int | str:
    """``ModelParallelStrategy``'s data-parallel size as given (``"auto"`` or a number; ``_data_parallel_size``)."""
    return strategy._data_parallel_size


def set_data_parallel_size(strategy: Any, size: int) -> None:
    """Resolve ``ModelParallelStrategy``'s ``"auto"`` data-parallel size before ``setup_environment`` builds the mesh
    (2.6.6 resolves ``"auto"`` to one rank per *node*; logra-pl wants one per process)."""
    strategy._data_parallel_size = size
