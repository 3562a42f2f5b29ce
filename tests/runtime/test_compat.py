"""``logra_pl.runtime.compat``: every private Lightning name it relies on still exists, and each accessor does what it
says.

A Lightning upgrade that renames or drops one of them fails here, naming it, instead of somewhere in a run.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import lightning
import pytest
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelSummary, RichProgressBar, TQDMProgressBar
from lightning.pytorch.loggers import TensorBoardLogger

from logra_pl.runtime import compat


def _defined(cls: type, name: str) -> bool:
    """``name`` is an attribute of ``cls`` or is assigned as ``self.<name>`` in one of its classes' source."""
    if hasattr(cls, name):
        return True
    for base in inspect.getmro(cls):
        try:
            source = inspect.getsource(base)
        except (OSError, TypeError):
            continue
        if f"self.{name} =" in source or f"self.{name}:" in source:
            return True
    return False


@pytest.mark.parametrize("entry", compat.PRIVATE_NAMES, ids=lambda e: ".".join(p for p in e if p))
def test_private_name_exists(entry: tuple[str, str | None, str]) -> None:
    module_name, class_name, name = entry
    module = importlib.import_module(module_name)
    owner = getattr(module, class_name) if class_name else module
    assert _defined(owner, name) if class_name else hasattr(owner, name), (
        f"Lightning {lightning.__version__} has no {'.'.join(p for p in entry if p)}: update "
        "logra_pl/runtime/compat.py "
        f"(checked on {compat.CHECKED_LIGHTNING})"
    )


# Accesses not migrated yet (none: every site calls compat). A new entry needs its reason.
PENDING: set[tuple[str, str]] = set()
# logra-pl's own names that happen to equal a Lightning private one.
OWN = {
    ("module.py", "_update"),  # LoGRAPolicyModule._update (one update's microbatches), not RichProgressBar's
    ("sketch/sketcher.py", "_version"),  # torch.Tensor._version (the in-place counter), not a logger's version
}


def _private_uses() -> set[tuple[str, str]]:
    """``(file, name)`` for every use of a name of PRIVATE_NAMES in logra_pl/ outside compat.py: an attribute
    (``x._leave``), a getattr string (``"_leave"``) or a definition (``def _leave``)."""
    root = Path(compat.__file__).parent
    names = {name for _, _, name in compat.PRIVATE_NAMES}
    found = set()
    for path in sorted(root.rglob("*.py")):
        relative = str(path.relative_to(root))
        if relative == "compat.py":
            continue
        text = path.read_text()
        found |= {(relative, n) for n in names if re.search(rf"(\.|[\"']|def ){re.escape(n)}\b", text)}
    return found


def test_every_private_lightning_access_goes_through_compat() -> None:
    uses = _private_uses()
    overridden = {(file, name) for name, file in compat.OVERRIDDEN.items()}
    unwrapped = sorted(uses - PENDING - OWN - overridden)
    assert not unwrapped, (
        f"Lightning privates used outside logra_pl/runtime/compat.py (call the compat function): {unwrapped}"
    )
    stale = sorted(PENDING - uses)
    assert not stale, f"migrated, drop from PENDING: {stale}"


def test_metadata_file_name_is_lightnings() -> None:
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    assert compat.DISTRIBUTED_METADATA == _METADATA_FILENAME
    assert compat.distributed_checkpoint_metadata("ckpt") == Path("ckpt") / _METADATA_FILENAME


def test_trainer_of() -> None:
    module = LightningModule()
    assert compat.trainer_of(module) is None
    assert compat.trainer_of(object()) is None
    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    module.trainer = trainer
    assert compat.trainer_of(module) is trainer


def test_progress_and_summary_settings() -> None:
    assert compat.progress_bar_args(TQDMProgressBar(refresh_rate=3, leave=True)) == {"refresh_rate": 3, "leave": True}
    assert compat.progress_bar_args(RichProgressBar(refresh_rate=2, leave=False)) == {"refresh_rate": 2, "leave": False}
    summary = ModelSummary(max_depth=3, extra=1)
    assert compat.summary_depth(summary) == 3 and compat.summarize_kwargs(summary) == {"extra": 1}


def test_tensorboard_version_and_purge_step(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, name="run")
    assert compat.tensorboard_version(logger) is None
    compat.set_tensorboard_version(logger, 4)
    compat.set_purge_step(logger, 7)
    assert compat.tensorboard_version(logger) == 4 and logger.version == 4
    assert Path(logger.log_dir).name == "version_4"
    # The writer consumes purge_step when it opens its file: a SESSION_LOG "purge" event at step 7 (TensorBoard then
    # drops the older run's events from step 7 on).
    logger.experiment.flush()
    (events,) = Path(logger.log_dir).glob("events.out.tfevents.*")
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    purges = [e.step for e in EventFileLoader(str(events)).Load() if e.HasField("session_log")]
    assert purges == [7]


def test_wandb_logger_accessors(tmp_path: Path) -> None:
    """Read and change what a WandbLogger passes to ``wandb.init``, before any run starts (no wandb process here)."""
    from lightning.pytorch.loggers import WandbLogger

    logger = WandbLogger(save_dir=str(tmp_path), project="p", offline=True)
    assert compat.wandb_run_if_started(logger) is None
    assert compat.wandb_init_args(logger)["project"] == "p" and compat.wandb_init_args(logger)["resume"] == "allow"
    compat.continue_wandb_run(logger, "abc", rewind_to=4)
    args = compat.wandb_init_args(logger)
    assert (args["id"], args["resume"], args["resume_from"]) == ("abc", None, "abc?_step=4")
    assert logger.version == "abc"  # what checkpoint folders are named after, before the run starts
    compat.continue_wandb_run(logger, "abc", rewind_to=None)
    assert compat.wandb_init_args(logger)["resume"] == "allow" and "resume_from" not in compat.wandb_init_args(logger)


def test_mlflow_logger_accessors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.loggers import MLFlowLogger

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file:{tmp_path}"
    first = MLFlowLogger(experiment_name="e", tracking_uri=uri)
    run_id = first.run_id
    logger = MLFlowLogger(experiment_name="e", tracking_uri=uri)
    assert compat.mlflow_run_id(logger) is None and compat.mlflow_tracking_uri(logger) == uri
    compat.set_mlflow_run_id(logger, run_id)
    assert logger.run_id == run_id  # the existing run, not a new one
    with pytest.raises(RuntimeError, match="already started"):
        compat.set_mlflow_run_id(logger, run_id)
    assert compat.mlflow_param_values({"a": {"b": 1}, "c": "x" * 300}) == {"a/b": "1", "c": "x" * 250}


def test_checkpoint_first_log_step() -> None:
    def ckpt(stepped: int, processed: int, completed: int) -> dict:
        progress = {"current": {"processed": processed, "completed": completed}}
        loop = {"epoch_loop.state_dict": {"_batches_that_stepped": stepped}, "epoch_loop.batch_progress": progress}
        return {"loops": {"fit_loop": loop}}

    assert compat.checkpoint_first_log_step(ckpt(5, 5, 5)) == 5
    assert compat.checkpoint_first_log_step(ckpt(5, 6, 5)) == 6  # saved inside on_train_batch_end
    assert compat.checkpoint_first_log_step({}) is None
