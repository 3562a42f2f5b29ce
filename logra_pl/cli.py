"""``logra-pl``: the LightningCLI entry point (``logra-pl fit --config configs/tiny_cpu.yaml``).

Beyond LightningCLI's own behaviour, a run started here:

- saves a checkpoint every N updates (the ``checkpoint:`` section, :class:`UpdateCheckpoint`), atomically;
- resumes honestly: ``--ckpt_path last`` finds the newest ``last.ckpt`` of the run across logger versions (or
  says where it looked), continues the checkpoint's run in its logger (TensorBoard's version folder, the W&B or
  MLflow run id) so that each step is logged once (:mod:`logra_pl.runs.stores`), refuses settings that change what
  the checkpoint's state means and prints the ones that change;
- checks the topology (vLLM engine vs training processes, prompts vs ranks) before any process is spawned;
- prints bad settings as one message, not a traceback: a bad value as the setting's own message, a mistyped key,
  a missing config file or a class path that does not import in a few lines (:class:`LoGRAArgumentParser`) instead
  of jsonargparse's usage dump; and says at the end where the logs, the last checkpoint and the export command are.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any, NoReturn

import yaml
from jsonargparse import get_loader, set_loader
from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException

from logra_pl.callbacks.checkpoint import UpdateCheckpoint
from logra_pl.config import import_dotted, translated
from logra_pl.data import ReasoningGymDataModule
from logra_pl.errors import (
    ConfigError,
    EnvironmentFailedError,
    LoGRAError,
    PolicyDivergedError,
    VerifierFailedError,
)
from logra_pl.module import LoGRAPolicyModule
from logra_pl.rollout.registry import engine_name, max_training_processes
from logra_pl.runs import resume, stores
from logra_pl.runtime import compat
from logra_pl.runtime.console import quiet_noise
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
# Set either to see jsonargparse's own report (usage and the whole error) instead of the short one.
FULL_REPORT_ENV = ("LOGRA_PL_TRACEBACK", "JSONARGPARSE_DEBUG")
# The parser mode of the CLI's configs: jsonargparse's YAML, with the sections of earlier versions translated.
CONFIG_MODE = "logra_yaml"
_YAML = get_loader("yaml")


def load_config_text(text: str) -> Any:
    """A config (or a command-line value) as jsonargparse's YAML loader reads it, with the old ``model.loss`` /
    ``model.baseline: {kind: ...}`` sections in their ``class_path`` form (the ``config`` translators of
    :func:`logra_pl.config.translated`)."""
    return translated("config", _YAML(text))


set_loader(CONFIG_MODE, load_config_text, exceptions=(yaml.YAMLError,))


class LoGRAArgumentParser(LightningArgumentParser):
    """LightningCLI's parser, with its command-line and config errors cut to the lines that name the mistake.

    jsonargparse answers a mistyped key, a missing ``--config`` file or a class path that does not import with the
    whole usage (~80 lines) and a union-type report, the mistake near the bottom. This parser prints at most five
    lines (:func:`parse_error_lines`) and exits with status 2, as jsonargparse does. Set ``LOGRA_PL_TRACEBACK=1`` for
    jsonargparse's full report. Nested parsers that raise instead of exiting (``exit_on_error=False``) keep
    jsonargparse's behaviour: their message is part of the one the outer parser reports.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parser_mode", CONFIG_MODE)
        super().__init__(*args, **kwargs)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error or any(os.environ.get(name) for name in FULL_REPORT_ENV):
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self  # the root parser reports its subcommand's errors
        sys.stderr.write("\n".join(parse_error_lines(message, parser)) + "\n")
        self.exit(2)


def _current_flags(args: list[str] | None) -> list[str] | None:
    """The command line with the flags of older spellings written the current way (the ``argv`` translators); None
    (read ``sys.argv``, as LightningCLI does) when there are none."""
    if args is not None:
        return translated("argv", list(args))
    argv = translated("argv", sys.argv[1:])
    return None if argv == sys.argv[1:] else argv


class LoGRACLI(compat.CheckpointPathHook, LightningCLI):
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
            parser_class=LoGRAArgumentParser,
            subclass_mode_data=True,  # any data module by class_path; reasoning-gym by default
            trainer_defaults=TRAINER_DEFAULTS,
            save_config_kwargs={"overwrite": True},
            args=_current_flags(args),
            run=run,
            auto_configure_optimizers=False,
        )

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """``fit`` and ``validate``: Lightning's ``test`` and ``predict`` have no step in this module, so they are not
        offered (``logra-pl --help`` lists the other verbs)."""
        return {name: keys for name, keys in LightningCLI.subcommands().items() if name in _SUBCOMMANDS}

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Every run checkpoints: ``checkpoint.*`` configures the :class:`UpdateCheckpoint` added to the Trainer."""
        parser.add_lightning_class_args(UpdateCheckpoint, "checkpoint")
        parser.set_defaults(CHECKPOINT_DEFAULTS)
        # `data:` without a class_path configures ReasoningGymDataModule, as every config before this did.
        parser.set_defaults({"data": {"class_path": f"{ReasoningGymDataModule.__module__}.ReasoningGymDataModule"}})

    # ------------------------------------------------------------------------------------------- resume
    def resolve_ckpt_path(self) -> None:
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
        state = ckpt.get("logra_pl") or {}
        # Keep only the loop counters (the first step the resumed run logs) and the loggers' runs, not a handle on
        # the whole checkpoint.
        self.resume_checkpoint = {
            "loops": ckpt.get("loops"),
            "global_step": ckpt.get("global_step", 0),
            "loggers": list(state.get("loggers") or []),
        }
        saved = state.get("run_config") or {
            "model": state.get("settings") or ckpt.get("hyper_parameters") or {},
            "data": ckpt.get("datamodule_hyper_parameters") or {},
        }
        current = resume.plain(cfg)
        resume.check_resume(saved, current, path)
        log.info("resuming from %s (update %d)", path, int(ckpt.get("global_step", 0)))

    def _run_roots(self, cfg: Any) -> list[Path]:
        """Folders where this run's checkpoints live: the checkpoint dirpath, each logger's run family folder
        (TensorBoard ``<save_dir>/<name>``, W&B ``<save_dir>/<project>``, MLflow ``<store>/<experiment id>``)."""
        roots = []
        if cfg.get("checkpoint") and cfg["checkpoint"].get("dirpath"):
            roots.append(Path(cfg["checkpoint"]["dirpath"]))
        root_dir = Path(cfg["trainer"].get("default_root_dir") or os.getcwd())
        logger = cfg["trainer"].get("logger")
        for entry in logger if isinstance(logger, list) else [logger]:
            roots += stores.family_roots(entry, root_dir)
        roots.append(root_dir / "lightning_logs")
        return roots

    # -------------------------------------------------------------------------------------- instantiate
    def before_instantiate_classes(self) -> None:
        """``trainer.enable_checkpointing: false`` turns the run's checkpoints off (the section stays, saving nothing);
        each logger's backend gets the environment it reads when the logger is built (:mod:`logra_pl.runs.stores`).

        Lightning refuses a ModelCheckpoint in a Trainer without checkpointing; the user's intent is "no
        checkpoints", so the checkpoint callback is kept but never saves.
        """
        sub = self.config.get("subcommand")
        cfg = self.config[sub] if sub else self.config
        logger = cfg["trainer"].get("logger") if cfg.get("trainer") is not None else None
        for entry in logger if isinstance(logger, list) else [logger]:
            stores.before_build(entry)
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
                "with `logra-pl serve`) or hf with several ranks, or one process (trainer.devices=1, "
                "trainer.num_nodes=1)"
            )
        per_step = getattr(data, "prompts_per_step", None)
        if per_step is not None and world > 1 and per_step % world:
            raise ConfigError(
                f"data.prompts_per_step={per_step} is not divisible by the {world} training processes: make it a "
                "multiple of trainer.devices × trainer.num_nodes"
            )
        resumed = self.resume_path is not None
        module.set_launch(
            _saved_config(self.config[self.subcommand]), str(self.resume_path) if resumed else None, resumed
        )
        if resumed:
            self._continue_runs()

    def _continue_runs(self) -> None:
        """Each logger continues the checkpoint's run from the first resumed step, dropping what the stopped run
        logged after the checkpoint (:mod:`logra_pl.runs.stores`); what it could not do is said once. Stores that
        read or change files act on rank 0 only (the other ranks' loggers log nothing)."""
        zero = self.trainer.is_global_zero
        saved = (self.resume_checkpoint or {}).get("loggers") or []
        first_step = compat.checkpoint_first_log_step(self.resume_checkpoint or {})
        if first_step is None:  # a checkpoint without loop state: it was saved after its last logged step
            first_step = int((self.resume_checkpoint or {}).get("global_step", 0))
        point = stores.ResumePoint(first_step, self.resume_path, int(self.trainer.log_every_n_steps))
        active = [stores.store_for(logger) for logger in self.trainer.loggers]
        notes = []
        for store in active:
            if zero or store.on_every_rank:
                notes += store.resume(stores.saved_run(saved, store.kind), point)
        other = stores.other_runs_note(saved, {store.kind for store in active}, first_step)
        notes += [other] if other else []
        for note in notes if zero else []:
            log.warning(note)

    def after_fit(self) -> None:
        """Say where the run's logs, last checkpoint and export command are."""
        if self.trainer.is_global_zero:
            log.info(where_things_are(self.trainer, self.config[self.subcommand]))


def where_things_are(trainer: Any, cfg: Any = None) -> str:
    """The end-of-run lines: TensorBoard command, last checkpoint (and how to resume), export command."""
    lines = []
    for logger in trainer.loggers:
        where = stores.store_for(logger).where()
        lines += [where] if where else []
    log_dir = _config_dir(trainer)
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


def _config_dir(trainer: Any) -> str | None:
    """Where LightningCLI saved the run's ``config.yaml``: ``Trainer.log_dir`` without its collective (this runs on
    rank 0 only): the first logger's ``log_dir`` (TensorBoard, CSV) or else its ``save_dir``."""
    if not trainer.loggers:
        return None
    logger = trainer.loggers[0]
    return getattr(logger, "log_dir", None) or logger.save_dir


def _read_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint's non-tensor content, memory-mapped (a sharded checkpoint's metadata file for a folder)."""
    import torch

    if path.is_dir():
        meta = compat.distributed_checkpoint_metadata(path)
        if not meta.is_file():
            raise ConfigError(
                f"--ckpt_path {path}: a folder, but not a Lightning distributed checkpoint (no {meta.name})"
            )
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


# ---------------------------------------------------------------------------------------------- parse errors
_PARSER_KEY = re.compile(r'Parser key "([^"]+)"')
_CLASS_PATH = re.compile(r"Problem with given class_path '([^']+)'")
_NOT_ACCEPTED = re.compile(r"Option '([^']+)' is not accepted")
_GROUP_REFUSES = re.compile(r"(Group|Subcommand) '([^']+)' does not accept option '([^']+)'")
_NO_FILE = re.compile(r"File does not exist: '([^']+)'")
_ABSTRACT = re.compile(r"Expected an instantiatable class, but (\S+) is abstract")
_SHORT_NAME = re.compile(r"Expected a dot import path string: (\S+)")
_NOISE = re.compile(
    r"^(Does not validate against any of the Union subtypes|Subtypes:|Errors:|Given value type:|Given value:|"
    r"- Expected a <class 'NoneType'>|Parser key \"[^\"]+\":$|- Problem with given class_path '[^']+':$)"
)
_NOT_PROTOCOL = re.compile(r"does not implement protocol (\w+)")
_PATH_GIVEN = re.compile(r"Expected a path but (\S+) either not accessible or invalid")
_SUBCOMMANDS = ("fit", "validate")
MAX_ERROR_LINES = 5


def parse_error_lines(message: str, parser: Any = None) -> list[str]:
    """At most five lines for a jsonargparse error ``message`` raised by ``parser`` (the subcommand's parser).

    - a key no class or group takes (``--model.method.logra.rnak``, ``--trainer.max_stpes``, a key in a YAML file):
      the key, the nearest valid key at that level (``did you mean 'model.method.logra.rank'?``) and the valid keys
      there;
    - a file that does not exist (``--config nowhere.yaml``): the setting and the path;
    - a ``class_path`` that does not import: the path and the import error (``ModuleNotFoundError: ...``);
    - anything else: the setting and jsonargparse's reasons, without the union-type report around them.

    The last line says how to see everything (``--help``, ``LOGRA_PL_TRACEBACK=1``).
    """
    lines = _explain(message, parser)
    lines = [f"logra-pl: error: {lines[0]}", *(f"  {line}" for line in lines[1:])][: MAX_ERROR_LINES - 1]
    if getattr(parser, "_subcommands_action", None) is not None:  # the root parser: its error is about the verb
        what = "logra-pl --help lists the verbs"
    else:  # a verb's parser, or the options-only parser of ``LoGRACLI(run=False)``, which holds fit's options
        what = f"logra-pl {_subcommand(parser) or 'fit'} --help lists every option"
    lines.append(f"  ({what}; LOGRA_PL_TRACEBACK=1 prints jsonargparse's full report)")
    return [_clip(line) for line in lines]


def _explain(message: str, parser: Any) -> list[str]:
    """The lines after ``error:`` (without the help tip)."""
    outer = _PARSER_KEY.search(message)
    key = outer.group(1) if outer else None
    if (found := _NO_FILE.search(message)) is not None:
        setting = "--config" if key in (None, "config") else key
        return [f"{setting}: no such file: {found.group(1)}"]
    if (found := _NOT_ACCEPTED.search(message)) is not None:
        before = message[: found.start()]
        classes = _CLASS_PATH.findall(before)
        keys = _PARSER_KEY.findall(before)
        option = found.group(1)
        if classes:
            return _unknown_option(".".join(keys), option, _class_options(classes[-1]), classes[-1])
        return _unknown_key(".".join([*keys, option]), parser)
    if (found := _GROUP_REFUSES.search(message)) is not None:
        kind, group, option = found.groups()
        return _unknown_key(option if kind == "Subcommand" else f"{group}.{option}", parser)
    if message.startswith("unrecognized arguments: "):
        return _unrecognized(message.split(": ", 1)[1].split(), parser)
    where = ".".join(k for k in _PARSER_KEY.findall(message) if k)
    if (found := _ABSTRACT.search(message)) is not None:  # `baseline: {momentum: 0.5}`: arguments, no class
        what = where.rpartition(".")[2]
        return [
            f"{where} gives arguments but no class_path ({found.group(1)} is abstract): write {what}: "
            f"{{class_path: CLASS, init_args: {{...}}}}, or --{where} CLASS --{where}.ARG VALUE"
        ]
    if (found := _SHORT_NAME.search(message)) is not None:  # `--model.baseline rloo --model.baseline.momentum 0.5`
        what = where.rpartition(".")[2]
        return [
            f"{where}: a short name ({found.group(1)}) takes no arguments: name the class instead "
            f"(--{where} CLASS --{where}.ARG VALUE), or write {what}: {{class_path: CLASS, init_args: {{...}}}}"
        ]
    if (found := _NOT_PROTOCOL.search(message)) is not None and (path := _PATH_GIVEN.search(message)) is not None:
        return [f"{where}: {_protocol_mismatch(path.group(1), found.group(1))}"]
    for class_path in _CLASS_PATH.findall(message):
        failure = _import_failure(class_path)
        if failure is not None:
            return [f"{key or 'class_path'}: class_path {class_path!r} cannot be imported ({failure})"]
    reasons = _reasons(message)
    return [f"{where}: {reasons[0]}" if where else reasons[0], *reasons[1:]] if reasons else [message]


# The plug-in contracts a config's class_path is checked against (protocols), by the name jsonargparse reports.
_PROTOCOLS = {"Environment": "logra_pl.envs.base.Environment", "Verifier": "logra_pl.rewards.base.Verifier"}


def _protocol_mismatch(class_path: str, protocol: str) -> str:
    """Why ``class_path`` does not meet ``protocol``: the methods it lacks, or those it cannot be called as."""
    import inspect

    failure = _import_failure(class_path)
    if failure is not None or protocol not in _PROTOCOLS:
        return f"{class_path} does not implement {protocol}" + (f" ({failure})" if failure else "")
    cls = _import(class_path)
    proto = import_dotted(_PROTOCOLS[protocol], protocol)
    problems = []
    for member, fn in vars(proto).items():
        if not inspect.isfunction(fn) or (member.startswith("_") and member != "__call__"):
            continue
        wanted = [p for p in inspect.signature(fn).parameters if p != "self"]
        call = f"{'' if member == '__call__' else member}({', '.join(wanted)})"
        method = getattr(cls, member, None)
        if not callable(method):
            problems.append(f"it has no {member} method (called as {call})")
            continue
        try:
            inspect.signature(method).bind(None, *wanted)
        except TypeError:
            problems.append(f"its {member}{inspect.signature(method)} cannot be called as {call}")
        except ValueError:
            continue
    detail = "; ".join(problems) or "its methods do not match the contract"
    return f"{class_path} is not an {protocol}: {detail} (the contract: {_PROTOCOLS[protocol]})"


def _import(class_path: str) -> Any:
    return import_dotted(class_path, "class_path")


def _reasons(message: str) -> list[str]:
    """jsonargparse's own reasons inside a (nested) union-type report, each once, without the report's frame."""
    out: list[str] = []
    for line in message.splitlines():
        text = line.strip()
        if text and not _NOISE.match(text) and (text := text.removeprefix("- ")) not in out:
            out.append(text)
    return out


def _unknown_option(prefix: str, option: str, valid: list[str], class_path: str) -> list[str]:
    """A key a class does not take: the nearest of its parameters, and all of them."""
    where = f"{prefix}.{option}" if prefix else option
    lines = [f"unknown option {where!r}{_did_you_mean(option, valid, prefix)}"]
    if valid:
        lines.append(_listing(f"{prefix} ({class_path}) takes" if prefix else f"{class_path} takes", valid))
    if option == "kind" and prefix in ("model.loss", "model.baseline"):  # the old {kind: ...} sections
        from logra_pl.losses import AdvantageBaseline, Loss

        menu = (Loss if prefix == "model.loss" else AdvantageBaseline).registry.names
        lines.insert(1, f"{prefix}.kind is the old form: write --{prefix} <name>, one of {', '.join(menu)}")
    return lines


def _unknown_key(key: str, parser: Any) -> list[str]:
    """A dotted key the parser has no option for: the nearest key at the first level that does not match."""
    parts = [p for p in key.lstrip("-").split(".") if p]
    known = _parser_keys(parser)
    depth = 0
    while depth < len(parts) and any(k.split(".")[: depth + 1] == parts[: depth + 1] for k in known):
        depth += 1
    prefix = parts[:depth]
    level = sorted({k.split(".")[depth] for k in known if k.split(".")[:depth] == prefix and len(k.split(".")) > depth})
    bad = parts[depth] if depth < len(parts) else parts[-1]
    where = ".".join(prefix)
    lines = [f"unknown option {'.'.join(parts)!r}{_did_you_mean(bad, level, where)}"]
    if level:
        lines.append(_listing(f"valid under {where}" if where else "valid at the top level", level))
    return lines


def _unrecognized(tokens: list[str], parser: Any) -> list[str]:
    """``unrecognized arguments: --a.b 1 --c 2``: one line per unknown option (values dropped)."""
    flags = [t.split("=", 1)[0] for t in tokens if t.startswith("-")]
    if not flags:
        return [f"unexpected arguments: {' '.join(tokens)}"]
    lines: list[str] = []
    for flag in flags:
        lines += _unknown_key(flag, parser)[: 1 if len(flags) > 1 else 2]
    return lines


def _listing(label: str, names: list[str], width: int = 116) -> str:
    """``label: a, b, c, … (N more)``, as many names as fit in ``width`` characters (at least one)."""

    def line(shown: list[str]) -> str:
        rest = len(names) - len(shown)
        return f"{label}: {', '.join(shown)}" + (f", … ({rest} more)" if rest else "")

    shown: list[str] = []
    for name in names:
        if shown and len(line([*shown, name])) > width:
            break
        shown.append(name)
    return line(shown)


def _did_you_mean(bad: str, valid: list[str], prefix: str) -> str:
    """`` (did you mean 'prefix.nearest'?)`` for the valid name nearest to ``bad`` (difflib), or ``""``."""
    close = difflib.get_close_matches(bad, valid, n=3, cutoff=0.6)
    if not close:
        return ""
    # Swapped letters (`lgora`) are the commonest typo; difflib alone would rank the shorter `lora` first.
    best = next((name for name in close if sorted(name) == sorted(bad)), close[0])
    return f" (did you mean {'.'.join(p for p in (prefix, best) if p)!r}?)"


def _class_options(class_path: str) -> list[str]:
    """The top-level parameters jsonargparse accepts for ``class_path`` (``**kwargs`` followed to the parent)."""
    try:
        from jsonargparse import ArgumentParser

        cls = _import(class_path)
        sub = ArgumentParser(exit_on_error=False)
        sub.add_class_arguments(cls, fail_untyped=False, sub_configs=True)
        keys = sub.get_defaults().keys()  # a jsonargparse Namespace: flat dotted keys
        return list(dict.fromkeys(k.split(".")[0] for k in keys))
    except Exception:
        return []


def _parser_keys(parser: Any) -> list[str]:
    """Every option key (``dest``) of a parser: ``trainer.max_steps``, ``model.logra``, ``data``, ..."""
    actions = getattr(parser, "_actions", None) or []  # argparse's list of options (stable since Python 2.7)
    dests = [getattr(action, "dest", None) for action in actions]
    return [d for d in dests if isinstance(d, str) and d not in ("help", argparse.SUPPRESS)]


def _import_failure(class_path: str) -> str | None:
    """Why ``class_path`` does not import (``ModuleNotFoundError: No module named 'x'``), or None when it does."""
    module, _, name = class_path.rpartition(".")
    if not module:
        return None
    try:
        getattr(importlib.import_module(module), name)
    except Exception as err:  # the user's module may fail in any way while importing
        return f"{type(err).__name__}: {err}"
    return None


def _subcommand(parser: Any) -> str:
    last = str(getattr(parser, "prog", "") or "").split()[-1:]
    return last[0] if last and last[0] in _SUBCOMMANDS else ""


def _clip(line: str, width: int = 400) -> str:
    return line if len(line) <= width else line[: width - 1] + "…"


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


# Every verb of ``logra-pl``, one line each: what ``logra-pl`` and ``logra-pl --help`` print.
VERBS: dict[str, str] = {
    "fit": "train a policy from a YAML recipe: LoGRA RL, or a dense AdamW / LoRA baseline (configs/README.md)",
    "validate": "score a policy or a checkpoint on the validation set (pass@1, reward) without training",
    "serve": "run vLLM rollout engines behind an HTTP API that takes LoGRA factor updates (docs/serving.md)",
    "plan": "the memory each update method needs for a model, before any run (logra-pl plan --model ...)",
    "export": "write a checkpoint's policy as a Hugging Face folder, or a GGUF file",
}


def verbs_help() -> str:
    """The top-level help: usage, the verbs and where each verb's own options are listed."""
    width = max(map(len, VERBS))
    lines = ["usage: logra-pl VERB [options]", "", "verbs:"]
    lines += [f"  {verb:<{width}}  {text}" for verb, text in VERBS.items()]
    lines += ["", "logra-pl VERB --help lists its options (logra-pl fit --config configs/tiny_cpu.yaml --help)"]
    return "\n".join(lines)


def main(args: list[str] | None = None) -> None:
    """Console-script entry point: LightningCLI subcommands (``fit``, ``validate``), ``plan``, ``export``, ``serve``."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("JSONARGPARSE_DEPRECATION_WARNINGS", "off")  # about LightningCLI's internals, not the user
    argv = sys.argv[1:] if args is None else list(args)
    if not argv or argv[0] in ("-h", "--help"):
        print(verbs_help())
        sys.exit(0 if argv else 2)
    if not argv[0].startswith("-") and argv[0] not in VERBS:
        close = difflib.get_close_matches(argv[0], list(VERBS), n=1, cutoff=0.5)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        print(f"logra-pl: error: unknown verb {argv[0]!r}{hint}; the verbs are {', '.join(VERBS)}", file=sys.stderr)
        print("  (logra-pl --help says what each does)", file=sys.stderr)
        sys.exit(2)
    if argv[:1] == ["plan"]:
        from logra_pl.methods.memory_plan import main as plan_main

        plan_main(argv[1:])
        return
    if argv[:1] == ["export"]:
        from logra_pl.runs.export import main as export_main

        export_main(argv[1:])
        return
    if argv[:1] == ["serve"]:
        from logra_pl.rollout.serve.server import main as serve_main

        try:
            sys.exit(serve_main(argv[1:]))
        except LoGRAError as err:
            print(f"logra-pl serve: error: {err}", file=sys.stderr)
            sys.exit(1)
    _console()
    cli: LoGRACLI | None = None
    try:
        cli = LoGRACLI(args=args)
    except SIGTERMException:
        # A scheduler's preemption: the update in progress finished and last.ckpt holds it (UpdateCheckpoint).
        # 128 + SIGTERM, as a process killed by it would report: the job did not finish, and says why.
        print("logra-pl: stopped: SIGTERM; resume with the same command and --ckpt_path last", file=sys.stderr)
        sys.exit(128 + signal.SIGTERM)
    except LoGRAError as err:
        stops = PolicyDivergedError | VerifierFailedError | EnvironmentFailedError
        kind = "stopped" if isinstance(err, stops) else "error"
        print(f"logra-pl: {kind}: {err}", file=sys.stderr)
        if os.environ.get("LOGRA_PL_TRACEBACK"):
            raise
        sys.exit(1)
    del cli


if __name__ == "__main__":
    main()
