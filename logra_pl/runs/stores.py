"""Where each kind of logger keeps a run, and how ``--ckpt_path last`` continues it: the same run, each step once.

A run killed after its last checkpoint has logged steps the resumed run logs again (it restarts at the
checkpoint). Each store below makes the resumed run continue the checkpoint's run and end with every step once:

===============  ==========================================  =====================================================
logger           the run continued                           the steps the crash logged after the checkpoint
===============  ==========================================  =====================================================
TensorBoard      the checkpoint's ``version_N`` folder       dropped by TensorBoard's ``purge_step`` (first step
                                                             the resumed run logs)
W&B              the run id the checkpoint records           dropped by W&B's rewind: the resumed run starts with
                 (``id=``)                                   ``resume_from="<id>?_step=<k>"``, ``k`` the last
                                                             history row before the first resumed step, read from
                                                             the run's own logs; online, the server rewinds at
                                                             once; offline, ``wandb sync`` replays the run's
                                                             segments oldest first and rewinds at ``k``
MLflow           the run id the checkpoint records           removed from the metric files before the resumed run
                 (``run_id=``)                               logs (file store); other stores keep them (said once)
any other        a new run/version (Lightning's default)     kept (said once)
===============  ==========================================  =====================================================

The checkpoint records each logger's run (:func:`records`, in ``checkpoint["logra_pl"]["loggers"]``), so the run id
survives a ``kill -9``. A resume with another kind of logger than the checkpoint's starts a new run of that logger
at the first resumed step; the CLI says where the earlier steps are. What each backend's files look like is in
:mod:`logra_pl.runs.store_formats`.

W&B's rewind is applied by W&B's server (at ``wandb.init`` online, at ``wandb sync`` offline) and is a preview
feature there; ``trainer.logger.init_args.resume: must`` opts out (W&B's plain resume, the later steps then logged
twice, as the CLI says).

W&B writes its logs from a helper process (wandb-core) that flushes them on a timer and dies with the training
process, so a ``kill -9`` loses what was logged in the last interval. The CLI sets the interval
(``WANDB__TRANSACTION_LOG_FLUSH_INTERVAL``, wandb's ``x_transaction_log_flush_interval``, 15 s by default) to
:data:`WANDB_FLUSH_INTERVAL_S` unless it is set; a resume that finds steps missing says which.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlparse
from urllib.request import url2pathname

import logra_pl.runs.store_formats as store_formats
from logra_pl.config import import_dotted
from logra_pl.errors import ConfigError
from logra_pl.runtime import compat

log = logging.getLogger("logra_pl")

WANDB_FLUSH_INTERVAL_S = 1.0
WANDB_FLUSH_ENV = "WANDB__TRANSACTION_LOG_FLUSH_INTERVAL"
MLFLOW_FILE_STORE_ENV = "MLFLOW_ALLOW_FILE_STORE"


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run restarts.

    Arguments:
        first_step: the first step the resumed run logs (every step before it was logged by the stopped run).
        ckpt: the checkpoint resumed from.
        log_every_n_steps: the Trainer's logging period (the stopped run logged step ``s`` when ``(s+1) % n == 0``).
    """

    first_step: int
    ckpt: Path
    log_every_n_steps: int = 1

    @property
    def last_logged_step(self) -> int:
        """The last step before :attr:`first_step` that the stopped run logged (-1: none)."""
        every = max(1, self.log_every_n_steps)
        return (self.first_step // every) * every - 1


class RunStore:
    """How one kind of logger keeps a run (the base: any logger, nothing continued).

    Arguments:
        logger: the Lightning logger of this run.
    """

    kind: ClassVar[str] = "other"
    label: ClassVar[str] = "this logger"
    logger_class: ClassVar[str | None] = None  # the Lightning class handled (its subclasses too)
    on_every_rank: ClassVar[bool] = False  # resume() runs on every rank (in-memory changes only), else on rank 0

    def __init__(self, logger: Any) -> None:
        self.logger = logger

    # ------------------------------------------------------------------------------------ chosen by class
    @classmethod
    def handles(cls, logger_type: type) -> bool:
        """Whether this store handles loggers of ``logger_type``."""
        if cls.logger_class is None:
            return False
        return issubclass(logger_type, import_dotted(cls.logger_class, "a run store's logger_class"))

    @classmethod
    def family_roots(cls, init_args: Mapping[str, Any], default_root: Path) -> list[Path]:
        """Folders holding the checkpoints of this logger's runs (``--ckpt_path last`` searches
        ``<root>/*/checkpoints/last*.ckpt``), from the logger's ``init_args`` before it is built."""
        if init_args.get("save_dir") is not None:
            return [Path(init_args["save_dir"]) / str(init_args.get("name") or "")]
        return []

    @classmethod
    def before_build(cls, init_args: Mapping[str, Any]) -> None:
        """Settings the backend reads from the environment, set before the logger is built (fresh or resumed)."""

    # --------------------------------------------------------------------------------------------- a run
    def record(self) -> dict[str, Any]:
        """What a checkpoint keeps about this logger's run (plain data)."""
        return {"kind": self.kind, "class_path": _class_path(self.logger), "run_id": _plain_id(self.run_id())}

    def run_id(self) -> Any:
        """The logger's run or version (``version``); None when the logger fails to say it (a third-party one
        may): the checkpoint is still written, and a resume then starts a new run of that logger."""
        try:
            return self.logger.version
        except Exception:  # a logger of any kind: nothing it raises may stop the checkpoint being written
            return None

    def resume(self, saved: Mapping[str, Any] | None, point: ResumePoint) -> list[str]:
        """Make the logger continue the checkpoint's run ``saved`` (its :meth:`record`, None when the checkpoint
        recorded none of this kind) from ``point``; returns what to tell the user."""
        first_step = point.first_step
        return [
            f"{type(self.logger).__name__}: logra-pl continues TensorBoard, W&B and MLflow runs on resume; this "
            f"logger starts a new run at step {first_step}, and the steps the stopped run logged after its last "
            "checkpoint stay in that run"
        ]

    def where(self) -> str | None:
        """The end-of-run line saying where the logs are, or None."""
        log_dir = getattr(self.logger, "log_dir", None)
        return f"logs:        {log_dir}" if log_dir else None


class TensorBoardStore(RunStore):
    """TensorBoard: the run is the ``version_N`` folder; ``purge_step`` drops the steps logged after the checkpoint."""

    kind = "tensorboard"
    label = "TensorBoard"
    logger_class = "lightning.pytorch.loggers.TensorBoardLogger"
    on_every_rank = True  # every rank's logger must agree on the version folder

    def resume(self, saved: Mapping[str, Any] | None, point: ResumePoint) -> list[str]:
        from logra_pl.runs.resume import version_of

        version = version_of(point.ckpt)
        if version is None or compat.tensorboard_version(self.logger) is not None:
            return []  # not in a version folder, or the user chose a version
        if Path(self.logger.root_dir).resolve() != point.ckpt.resolve().parents[2]:
            return []  # the checkpoint belongs to another run family: the new run keeps its own folder
        compat.set_tensorboard_version(self.logger, version)
        compat.set_purge_step(self.logger, point.first_step)
        return []

    def where(self) -> str | None:
        return f"logs:        tensorboard --logdir {self.logger.log_dir}"


class WandbStore(RunStore):
    """Weights & Biases (online or offline): the run id is kept; a resume rewinds the run to the checkpoint."""

    kind = "wandb"
    label = "W&B"
    logger_class = "lightning.pytorch.loggers.WandbLogger"

    @classmethod
    def family_roots(cls, init_args: Mapping[str, Any], default_root: Path) -> list[Path]:
        root = init_args.get("save_dir") or init_args.get("dir") or default_root
        project = init_args.get("project") or os.environ.get("WANDB_PROJECT") or "lightning_logs"
        return [Path(root) / str(project)]

    @classmethod
    def before_build(cls, init_args: Mapping[str, Any]) -> None:
        """W&B's log flush interval (see the module's docstring), unless the user set it."""
        os.environ.setdefault(WANDB_FLUSH_ENV, str(WANDB_FLUSH_INTERVAL_S))

    def wandb_dir(self) -> Path:
        """The ``wandb/`` folder of this logger's runs: its run's own (once started), else where wandb will put it
        (``<save_dir or dir or cwd>/wandb``)."""
        run = compat.wandb_run_if_started(self.logger)
        if run is not None:
            return Path(run.settings.wandb_dir)
        root = Path(self.logger.save_dir or compat.wandb_init_args(self.logger).get("dir") or os.getcwd())
        return root / (".wandb" if (root / ".wandb").is_dir() else "wandb")

    def record(self) -> dict[str, Any]:
        return {
            **super().record(),
            "project": self.logger.name,
            "wandb_dir": str(self.wandb_dir().resolve()),
            "offline": bool(self.logger.experiment.offline),
        }

    def resume(self, saved: Mapping[str, Any] | None, point: ResumePoint) -> list[str]:
        first_step = point.first_step
        if saved is None or not saved.get("run_id"):
            return []
        run_id, project = str(saved["run_id"]), saved.get("project")
        chosen = compat.wandb_init_args(self.logger).get("id")
        if chosen is not None and chosen != run_id:
            return [_elsewhere("W&B", f"run {run_id}", f"run {chosen} (trainer.logger.init_args.id)", first_step)]
        if project != self.logger.name:
            return [_elsewhere("W&B", f"run {run_id} of project {project}", f"project {self.logger.name}", first_step)]
        if compat.wandb_init_args(self.logger).get("resume") == "must":  # the user's choice: W&B's plain resume
            compat.continue_wandb_run(self.logger, run_id, rewind_to=None)
            return [
                f"W&B: continuing run {run_id} at step {first_step} without a rewind (trainer.logger.init_args.resume: "
                f"must): the rows the stopped run logged from step {first_step} on stay, so those steps appear twice"
            ]
        folders = [Path(saved["wandb_dir"])] if saved.get("wandb_dir") else []
        folder = next((f for f in [*folders, self.wandb_dir()] if f.is_dir()), self.wandb_dir())
        rows = store_formats.wandb_history(store_formats.wandb_segments(folder, run_id))
        before = [row for row in rows if _global_step(row) is not None and _global_step(row) < first_step]
        notes = []
        if not rows:
            compat.continue_wandb_run(self.logger, run_id, rewind_to=None)
            notes.append(f"W&B: continuing run {run_id} at step {first_step}; its logs in {folder} hold no step")
        else:
            rewind_to = before[-1]["_step"] if before else -1
            compat.continue_wandb_run(self.logger, run_id, rewind_to=rewind_to)
            dropped = sum(row["_step"] > rewind_to for row in rows)
            notes.append(
                f"W&B: continuing run {run_id} at step {first_step}, rewound to its history row _step={rewind_to} "
                f"({dropped} row(s) the stopped run logged after the checkpoint are dropped"
                + (" by `wandb sync`)" if saved.get("offline") else ")")
                + "; rewinding is a preview feature of W&B's servers: if yours refuses it, resume with "
                "--trainer.logger.init_args.resume must (no rewind: those steps then appear twice)"
            )
        last = max((_global_step(row) for row in before), default=None)
        if point.last_logged_step >= 0 and (last is None or last < point.last_logged_step):
            lost = f"{0 if last is None else last + 1}..{first_step - 1}"
            notes.append(
                f"W&B: steps {lost} are missing from run {run_id}: the stopped process logged them, but W&B had not "
                f"written them to {folder} when it died (it writes every {os.environ.get(WANDB_FLUSH_ENV, '15')} s: "
                f"{WANDB_FLUSH_ENV})"
            )
        return notes

    def where(self) -> str | None:
        run = self.logger.experiment
        folder = self.wandb_dir()
        if run.offline:
            return f"logs:        W&B offline run {run.id} in {folder}   (upload: wandb sync {folder})"
        return f"logs:        W&B run {getattr(run, 'url', None) or run.id}"


class MLflowStore(RunStore):
    """MLflow: the run id is kept; with a file store, the points logged after the checkpoint are removed."""

    kind = "mlflow"
    label = "MLflow"
    logger_class = "lightning.pytorch.loggers.MLFlowLogger"

    @classmethod
    def tracking_uri_of(cls, init_args: Mapping[str, Any]) -> str:
        """The tracking URI MLFlowLogger will use (``tracking_uri``, ``$MLFLOW_TRACKING_URI``, ``file:<save_dir>``)."""
        uri = init_args.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI")
        return str(uri) if uri else f"file:{init_args.get('save_dir') or './mlruns'}"

    @classmethod
    def family_roots(cls, init_args: Mapping[str, Any], default_root: Path) -> list[Path]:
        uri = cls.tracking_uri_of(init_args)
        allow_file_store(uri)
        from mlflow.tracking import MlflowClient

        experiment = MlflowClient(uri).get_experiment_by_name(init_args.get("experiment_name") or "lightning_logs")
        if experiment is None:
            return []
        root = file_store_root(uri) or default_root
        return [root / str(experiment.experiment_id)]

    @property
    def tracking_uri(self) -> str:
        return str(self.logger.experiment.tracking_uri)

    @classmethod
    def before_build(cls, init_args: Mapping[str, Any]) -> None:
        """MLFlowLogger opens its store when it is built: a file store must be allowed first."""
        allow_file_store(cls.tracking_uri_of(init_args))

    def record(self) -> dict[str, Any]:
        return {**super().record(), "experiment_id": self.logger.experiment_id, "tracking_uri": self.tracking_uri}

    def resume(self, saved: Mapping[str, Any] | None, point: ResumePoint) -> list[str]:
        first_step = point.first_step
        if saved is None or not saved.get("run_id"):
            return []
        run_id, uri = str(saved["run_id"]), str(saved["tracking_uri"])
        chosen = compat.mlflow_run_id(self.logger)
        if chosen is not None and chosen != run_id:
            return [
                _elsewhere("MLflow", f"run {run_id}", f"run {chosen} (trainer.logger.init_args.run_id)", first_step)
            ]
        now = compat.mlflow_tracking_uri(self.logger)
        if not _same_uri(now, uri):
            return [_elsewhere("MLflow", f"run {run_id} in {uri}", now, first_step)]
        compat.set_mlflow_run_id(self.logger, run_id)
        self._keep_first_params(run_id, first_step)
        root = file_store_root(uri)
        if root is None:
            return [
                f"MLflow: continuing run {run_id} at step {first_step}; {uri} is not a file store, and MLflow has no "
                f"API to delete metric points: the points the stopped run logged at steps >= {first_step} stay, "
                "beside the resumed run's"
            ]
        run_dir = root / str(saved["experiment_id"]) / run_id
        removed = store_formats.drop_mlflow_metric_steps(run_dir, first_step)
        return [
            f"MLflow: continuing run {run_id} at step {first_step} ({removed} metric point(s) the stopped run logged "
            f"at steps >= {first_step} removed from {run_dir})"
        ]

    def _keep_first_params(self, run_id: str, first_step: int) -> None:
        """MLflow params cannot change (``log_param`` of another value raises), but a resume may change settings that
        are logged as params (``model.rollout.max_new_tokens``...). The resumed logger's ``log_hyperparams`` logs the
        new and unchanged params and writes each changed one as the tag ``logra_pl.resumed/step_<N>/<key>`` (its
        value from step N on); the param keeps the value the run started with."""
        logger, log_params = self.logger, self.logger.log_hyperparams

        def log_hyperparams(params: Any) -> None:
            client = logger.experiment
            before = client.get_run(run_id).data.params
            values = compat.mlflow_param_values(params)
            changed = {key: value for key, value in values.items() if before.get(key, value) != value}
            log_params({key: value for key, value in values.items() if key not in changed})
            for key, value in changed.items():
                client.set_tag(run_id, f"logra_pl.resumed/step_{first_step}/{key}", value)
            if changed:
                log.warning(
                    "MLflow: params cannot change; run %s keeps the values it started with, and the resumed values "
                    "are the tags logra_pl.resumed/step_%d/<key>: %s",
                    run_id,
                    first_step,
                    ", ".join(f"{key} {before[key]} → {value}" for key, value in changed.items()),
                )

        logger.log_hyperparams = log_hyperparams

    def where(self) -> str | None:
        return f"logs:        MLflow run {self.logger.run_id}   (mlflow ui --backend-store-uri {self.tracking_uri})"


STORES: tuple[type[RunStore], ...] = (TensorBoardStore, WandbStore, MLflowStore)


def store_class(logger_type: type) -> type[RunStore]:
    """The store class for loggers of ``logger_type`` (:class:`RunStore` for any other)."""
    return next((store for store in STORES if store.handles(logger_type)), RunStore)


def store_for(logger: Any) -> RunStore:
    """The store of a built logger."""
    return store_class(type(logger))(logger)


def configured(entry: Any) -> tuple[type[RunStore], Mapping[str, Any]] | None:
    """The store class and ``init_args`` of a logger given as a ``{class_path, init_args}`` config entry (before it
    is built), or None for an entry that names no importable class (``trainer.logger: false``)."""
    class_path = entry.get("class_path") if hasattr(entry, "get") else None
    if not class_path:
        return None
    try:
        logger_type = import_dotted(str(class_path), "trainer.logger")
    except ConfigError:
        return None
    return store_class(logger_type), entry.get("init_args") or {}


def family_roots(entry: Any, default_root: Path) -> list[Path]:
    """Checkpoint folders of a configured logger's runs (see :meth:`RunStore.family_roots`)."""
    found = configured(entry)
    return found[0].family_roots(found[1], default_root) if found else []


def before_build(entry: Any) -> None:
    """What a configured logger's backend needs before the logger is built (see :meth:`RunStore.before_build`)."""
    found = configured(entry)
    if found:
        found[0].before_build(found[1])


def records(trainer: Any) -> list[dict[str, Any]]:
    """Each logger's run, for the checkpoint (rank 0 only: the other ranks' loggers hold no run)."""
    if trainer is None or not getattr(trainer, "is_global_zero", True):
        return []
    return [store_for(logger).record() for logger in trainer.loggers]


def saved_run(saved: list[Mapping[str, Any]], kind: str) -> Mapping[str, Any] | None:
    """The checkpoint's record of a ``kind`` logger, or None."""
    return next((entry for entry in saved if entry.get("kind") == kind), None)


def other_runs_note(saved: list[Mapping[str, Any]], kinds_now: set[str], first_step: int) -> str | None:
    """When the checkpoint's runs were logged by loggers this run does not have: where the steps before are."""
    gone = [entry for entry in saved if entry.get("kind") not in kinds_now and entry.get("kind") != "other"]
    if not gone:
        return None
    where = ", ".join(f"{_LABELS.get(e['kind'], e['kind'])} run {e.get('run_id')}" for e in gone)
    return (
        f"steps 0..{first_step - 1} of this run were logged to {where}; this run's loggers start at step {first_step}"
    )


def allow_file_store(uri: str) -> None:
    """MLflow >= 3.7 refuses its file store unless ``MLFLOW_ALLOW_FILE_STORE`` is true; a config naming a ``file:``
    tracking URI (or MLFlowLogger's default ``./mlruns``) chose it, so it is allowed unless the variable is set."""
    if file_store_root(uri) is not None and MLFLOW_FILE_STORE_ENV not in os.environ:
        os.environ[MLFLOW_FILE_STORE_ENV] = "true"
        log.info("MLflow: file store %s (MLflow keeps it in maintenance mode; %s=true set)", uri, MLFLOW_FILE_STORE_ENV)


def file_store_root(uri: str) -> Path | None:
    """The folder of a ``file:`` tracking URI (``file:./mlruns``, ``file:///abs``), None for other stores."""
    parsed = urlparse(uri)
    if parsed.scheme != "file":
        return None
    return Path(url2pathname(parsed.path))


_LABELS = {store.kind: store.label for store in STORES}


def _elsewhere(label: str, saved: str, now: str, first_step: int) -> str:
    return (
        f"{label}: the checkpoint's steps 0..{first_step - 1} are in {saved}; this run logs to {now}, which starts "
        f"at step {first_step}"
    )


def _same_uri(a: str, b: str) -> bool:
    ra, rb = file_store_root(a), file_store_root(b)
    if ra is not None and rb is not None:
        return ra.resolve() == rb.resolve()
    return a == b


def _global_step(row: Mapping[str, Any]) -> int | None:
    value = row.get("trainer/global_step")
    return int(value) if isinstance(value, int | float) else None


def _class_path(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _plain_id(version: Any) -> Any:
    return version if isinstance(version, int | str) or version is None else str(version)
