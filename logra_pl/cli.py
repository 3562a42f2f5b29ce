"""``logra-pl``: the LightningCLI entry point (``logra-pl fit --config configs/tiny_cpu.yaml``).

Beyond LightningCLI's own behaviour, a run started here:

- saves a checkpoint every N updates (the ``checkpoint:`` section, :class:`UpdateCheckpoint`), atomically;
- resumes honestly: ``--ckpt_path last`` finds the newest ``last.ckpt`` of the run across logger versions (or
  says where it looked), continues in that version's folder (TensorBoard drops the steps the crash left after the
  checkpoint), refuses settings that change what the checkpoint's state means and prints the ones that change;
- checks the topology (vLLM engine vs training processes, prompts vs ranks) before any process is spawned;
- prints bad settings as one message, not a traceback, and says at the end where the logs, the last checkpoint
  and the export command are.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from logra_pl import resume
from logra_pl.callbacks.checkpoint import UpdateCheckpoint
from logra_pl.console import quiet_noise
from logra_pl.data import ReasoningGymDataModule
from logra_pl.errors import ConfigError, LoGRAError, PolicyDivergedError
from logra_pl.module import LoGRAPolicyModule
from logra_pl.rollout.registry import engine_name, max_training_processes
from logra_pl.strategy import LoGRAStrategy  # noqa: F401  (registers `--trainer.strategy logra_fsdp`)

log = logging.getLogger("logra_pl")

TRAINER_DEFAULTS = {
    "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": "runs", "name": "logra"},
    },
    "log_every_n_steps": 1,
    "num_sanity_val_steps": 0,
}
CHECKPOINT_DEFAULTS = {"checkpoint.every_n_updates": 50}


class LoGRACLI(LightningCLI):
    """LightningCLI for :class:`LoGRAPolicyModule` and any LightningDataModule (:class:`ReasoningGymDataModule` when
    ``data:`` names no ``class_path``).

    TensorBoard logging under ``runs/`` by default; every run saves its resolved ``config.yaml`` next to its
    event files (LightningCLI's ``SaveConfigCallback``) and checkpoints every 50 updates.
    """

    def __init__(self, args: list[str] | None = None, run: bool = True) -> None:
        self.resume_path: Path | None = None
        self.resume_checkpoint: dict[str, Any] | None = None
        super().__init__(
            LoGRAPolicyModule,
            LightningDataModule,
            subclass_mode_data=True,  # any data module by class_path; reasoning-gym by default
            trainer_defaults=TRAINER_DEFAULTS,
            save_config_kwargs={"overwrite": True},
            args=args,
            run=run,
            auto_configure_optimizers=False,
        )

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Every run checkpoints: ``checkpoint.*`` configures the :class:`UpdateCheckpoint` added to the Trainer."""
        parser.add_lightning_class_args(UpdateCheckpoint, "checkpoint")
        parser.set_defaults(CHECKPOINT_DEFAULTS)
        # `data:` without a class_path configures ReasoningGymDataModule, as every config before this did.
        parser.set_defaults({"data": {"class_path": f"{ReasoningGymDataModule.__module__}.ReasoningGymDataModule"}})

    # ------------------------------------------------------------------------------------------- resume
    def _parse_ckpt_path(self) -> None:
        """Resolve ``--ckpt_path last`` and compare the checkpoint's settings with these (before any model loads).

        LightningCLI's own version of this step overwrote the user's flags with the checkpoint's hyper-parameters,
        so a changed rank or optimizer was silently ignored.
        """
        sub = self.config.get("subcommand")
        if not sub or not self.config[sub].get("ckpt_path"):
            return
        cfg = self.config[sub]
        text = str(cfg["ckpt_path"])
        if text == "last":
            path = resume.find_last_checkpoint(self._run_roots(cfg))
            cfg["ckpt_path"] = str(path)
        else:
            path = Path(text)
            if not path.exists():
                raise ConfigError(f"--ckpt_path {text}: no such checkpoint file")
        self.resume_path = path
        ckpt = _read_checkpoint(path)
        # Keep only the loop counters (for TensorBoard's purge step), not a handle on the whole checkpoint.
        self.resume_checkpoint = {"loops": ckpt.get("loops"), "global_step": ckpt.get("global_step", 0)}
        state = ckpt.get("logra_pl") or {}
        saved = state.get("run_config") or {
            "model": state.get("settings") or ckpt.get("hyper_parameters") or {},
            "data": ckpt.get("datamodule_hyper_parameters") or {},
        }
        current = resume.plain(cfg)
        resume.check_resume(saved, current, path)
        log.info("resuming from %s (update %d)", path, int(ckpt.get("global_step", 0)))

    def _run_roots(self, cfg: Any) -> list[Path]:
        """Folders where this run's checkpoints live: the checkpoint dirpath, the logger's run family folder."""
        roots = []
        if cfg.get("checkpoint") and cfg["checkpoint"].get("dirpath"):
            roots.append(Path(cfg["checkpoint"]["dirpath"]))
        logger = cfg["trainer"].get("logger")
        loggers = logger if isinstance(logger, list) else [logger]
        for entry in loggers:
            args = entry.get("init_args") if hasattr(entry, "get") else None
            if args is not None and args.get("save_dir") is not None:
                roots.append(Path(args["save_dir"]) / str(args.get("name") or ""))
        root_dir = cfg["trainer"].get("default_root_dir") or os.getcwd()
        roots.append(Path(root_dir) / "lightning_logs")
        return roots

    # -------------------------------------------------------------------------------------- instantiate
    def before_instantiate_classes(self) -> None:
        """``trainer.enable_checkpointing: false`` turns the run's checkpoints off (the section stays, saving nothing).

        Lightning refuses a ModelCheckpoint in a Trainer without checkpointing; the user's intent is "no
        checkpoints", so the checkpoint callback is kept but never saves.
        """
        sub = self.config.get("subcommand")
        cfg = self.config[sub] if sub else self.config
        if cfg.get("trainer") is not None and cfg["trainer"].get("enable_checkpointing") is False:
            cfg["trainer"]["enable_checkpointing"] = True
            cfg["checkpoint"]["every_n_updates"] = 0
            cfg["checkpoint"]["at_end"] = False
            cfg["checkpoint"]["save_last"] = False
            log.warning("trainer.enable_checkpointing is false: this run saves no checkpoint and cannot be resumed")

    def instantiate_classes(self) -> None:
        """Build the objects; a setting rejected at construction is shown as its one-line message."""
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as err:
            message = _settings_error(err)
            if message is None:
                raise
            raise ConfigError(message) from None

    def before_fit(self) -> None:
        """Topology checks before any process is spawned, and the resume wiring (logger version, warm start)."""
        trainer, module, data = self.trainer, self.model, self.datamodule
        world = int(trainer.num_devices) * int(trainer.num_nodes)
        spec = module.engine_spec
        limit = max_training_processes(spec)
        if limit is not None and world > limit:
            raise ConfigError(
                f"model.engine={engine_name(spec)} runs one engine in the training process, but the trainer starts "
                f"{world} processes (trainer.devices × trainer.num_nodes): use model.engine=remote (engines started "
                "with `logra-pl serve`) or hf with several ranks, or trainer.devices=1"
            )
        per_step = getattr(data, "prompts_per_step", None)
        if per_step is not None and world > 1 and per_step % world:
            raise ConfigError(
                f"data.prompts_per_step={per_step} is not divisible by the {world} training processes: make it a "
                "multiple of trainer.devices × trainer.num_nodes"
            )
        module.run_config = _saved_config(self.config[self.subcommand])
        if self.resume_path is not None:
            module.resume_from = str(self.resume_path)
            module.resume_checked = True
            self._continue_logger_version()

    def _continue_logger_version(self) -> None:
        """Log a resumed run into the checkpoint's version folder; TensorBoard drops steps after the checkpoint."""
        from lightning.pytorch.loggers import TensorBoardLogger

        logger = self.trainer.logger
        version = resume.version_of(self.resume_path)
        if not isinstance(logger, TensorBoardLogger) or version is None or logger._version is not None:
            return
        if Path(logger.root_dir).resolve() != self.resume_path.resolve().parents[2]:
            return  # the checkpoint belongs to another run family: leave the new run its own folder
        logger._version = version
        ckpt = self.resume_checkpoint or {}
        loops = (ckpt.get("loops") or {}).get("fit_loop", {})
        stepped = loops.get("epoch_loop.state_dict", {}).get("_batches_that_stepped")
        if stepped is None:
            return
        # A checkpoint saved in on_train_batch_end has that batch processed but not completed; Lightning counts it
        # as stepped on restore, so the resumed run logs from the step after it.
        current = loops.get("epoch_loop.batch_progress", {}).get("current", {})
        in_flight = int(current.get("processed", 0)) > int(current.get("completed", 0))
        logger._kwargs["purge_step"] = int(stepped) + int(in_flight)

    def after_fit(self) -> None:
        """Say where the run's logs, last checkpoint and export command are."""
        if self.trainer.is_global_zero:
            log.info(where_things_are(self.trainer, self.config[self.subcommand]))


def where_things_are(trainer: Any, cfg: Any = None) -> str:
    """The end-of-run lines: TensorBoard command, last checkpoint (and how to resume), export command."""
    lines = []
    log_dir = trainer.logger.log_dir if trainer.logger is not None else None  # no collective: rank 0 only
    if log_dir:
        lines.append(f"logs:        tensorboard --logdir {log_dir}")
    ckpt = getattr(trainer.checkpoint_callback, "last_model_path", "") if trainer.checkpoint_callback else ""
    if ckpt:
        # The run's own resolved config (saved beside its logs) carries every command-line override, so the resumed
        # run looks for its checkpoint where this one wrote it; the --config files alone would lose the overrides.
        saved = Path(log_dir) / "config.yaml" if log_dir else None
        configs = [str(p) for p in (cfg.get("config") or [])] if cfg is not None else []
        if saved is not None and saved.is_file():
            configs = [str(saved)]
        again = "logra-pl fit " + "".join(f"--config {c} " for c in configs) if configs else "logra-pl fit ... "
        lines.append(f"checkpoint:  {ckpt}   (resume: {again}--ckpt_path last)")
        out = Path(ckpt).parent.parent / "hf"
        lines.append(f"export:      logra-pl export --ckpt {ckpt} --out {out}")
    exported = [p for cb in trainer.callbacks for p in getattr(cb, "exported", [])]
    if exported:
        lines.append(f"HF folder:   {exported[-1]}   (vllm serve / AutoModelForCausalLM.from_pretrained)")
    return "\n".join(lines)


def _read_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint's non-tensor content, memory-mapped (a sharded checkpoint's metadata file for a folder)."""
    import torch

    if path.is_dir():
        meta = path / "meta.pt"
        if not meta.is_file():
            raise ConfigError(f"--ckpt_path {path}: a folder, but not a Lightning distributed checkpoint (no meta.pt)")
        path = meta
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as err:
        raise ConfigError(f"--ckpt_path {path}: not a readable checkpoint ({type(err).__name__}: {err})") from None


def _saved_config(cfg: Any) -> dict[str, Any]:
    """The resolved config as plain data, for the checkpoint (what a resume compares against)."""
    data = resume.plain(cfg)
    data.pop("config", None)
    data.pop("ckpt_path", None)
    return data


def _settings_error(err: BaseException) -> str | None:
    """The user's message inside jsonargparse's union-type report (``Does not validate against any of...``)."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, LoGRAError):
            return str(seen)
        seen = seen.__cause__ or seen.__context__
    text = str(err)
    if "Errors:" not in text:
        return None
    found = re.findall(r"^\s+- (.+)$", text.split("Errors:", 1)[1].split("\nGiven value", 1)[0], flags=re.M)
    messages = [m for m in found if not m.startswith("Expected a <class 'NoneType'>")]
    return "; ".join(messages) or None


def _console() -> None:
    """logra-pl's INFO lines on the console; Lightning's promotional tips and known harmless warnings dropped."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    if not log.handlers:
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    quiet_noise()
    try:  # transformers' per-file bars ("Loading weights", "Writing model shards"): the CLI prints its own lines
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def main(args: list[str] | None = None) -> None:
    """Console-script entry point: LightningCLI subcommands (``fit``, ``validate``), ``plan``, ``export``, ``serve``."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("JSONARGPARSE_DEPRECATION_WARNINGS", "off")  # about LightningCLI's internals, not the user
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["plan"]:
        from logra_pl.memory import main as plan_main

        plan_main(argv[1:])
        return
    if argv[:1] == ["export"]:
        from logra_pl.export import main as export_main

        export_main(argv[1:])
        return
    if argv[:1] == ["serve"]:
        from logra_pl.rollout.server import main as serve_main

        try:
            sys.exit(serve_main(argv[1:]))
        except LoGRAError as err:
            print(f"logra-pl serve: error: {err}", file=sys.stderr)
            sys.exit(1)
    _console()
    cli: LoGRACLI | None = None
    try:
        cli = LoGRACLI(args=args)
    except LoGRAError as err:
        kind = "stopped" if isinstance(err, PolicyDivergedError) else "error"
        print(f"logra-pl: {kind}: {err}", file=sys.stderr)
        if os.environ.get("LOGRA_PL_TRACEBACK"):
            raise
        sys.exit(1)
    del cli


if __name__ == "__main__":
    main()
