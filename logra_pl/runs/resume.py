"""Resuming honestly: find the run's last checkpoint, and compare what it was trained with to what is asked now.

A checkpoint's state only means something under the settings that wrote it: RowAdam row statistics belong to
one rank and target set, projections to one seed and distribution, optimizer state to one optimizer, weights to
one policy, the saved position in the prompt stream to one data set. Changing such a setting on resume is
refused with the list of differences and the two ways out. Everything else (``max_steps``, budgets, logging,
sampling) may change; each change is printed, so the resumed run says what it does differently.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from logra_pl.config import class_path_of, import_dotted, translated
from logra_pl.errors import CheckpointNotFoundError, LoGRAError, ResumeMismatchError
from logra_pl.runtime.compat import distributed_checkpoint_metadata

log = logging.getLogger(__name__)

# Settings that change what the saved state means (flat keys; a key also covers everything below it).
STRUCTURAL: tuple[str, ...] = (
    "model.policy",
    "model.warm_start",
    "model.method.class_path",  # the method, whichever form chose it (short name, object, old optimizer: canonical)
    "model.dtype",
    "model.loss.class_path",  # the loss, whichever form chose it (short name, object, old kind: see canonical)
    "model.method.logra.targets",
    "model.method.logra.rank",
    "model.method.logra.distribution",
    "model.method.logra.refresh",  # canonical() writes both spellings (old checkpoints: refresh)
    "model.method.logra.refresh_every",
    "model.method.logra.base_seed",
    "model.method.logra.update_rule",
    "model.method.logra.beta2",
    "model.method.adamw.train_all",
    "model.method.lora.rank",
    "model.method.lora.alpha",
    "model.method.lora.dropout",
    "data.class_path",
    "data.tasks",
    "data.train_size",
    "data.eval_size",
    "data.seed",
    "data.system_prompt",
    "data.path",
    "data.split",
    "data.name",
    "data.dedup",
    "data.first_n",
    "data.prompt_column",
    "data.answer_column",
    "data.eval_path",
    "data.per_task_train",
    "data.per_task_eval",
    "data.eval_default_difficulty",
)
# Keys that are not settings of the run (where it runs, how it is logged): never reported.
IGNORED: tuple[str, ...] = ("ckpt_path", "config", "seed_everything", "trainer.logger", "trainer.default_root_dir")


def plain(value: Any) -> Any:
    """Settings as plain Python: objects built by ``class_path`` (losses, baselines: ``to_config``) to their
    ``{class_path, init_args}``, dataclasses and namespaces to dicts, tuples to lists."""
    if callable(getattr(value, "to_config", None)) and not isinstance(value, type):
        return plain(value.to_config())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if hasattr(value, "as_dict") and callable(value.as_dict):  # jsonargparse Namespace
        return plain(value.as_dict())
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def flatten(settings: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"model.logra.rank": 64, ...}``; lists of ``class_path`` entries (callbacks) are keyed by class name."""
    out: dict[str, Any] = {}
    for key, value in settings.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and "init_args" in value and "class_path" in value:
            # {class_path, init_args} (e.g. `data:` in subclass mode): the arguments sit beside the class path.
            out[f"{name}.class_path"] = value["class_path"]
            out.update(flatten(value.get("init_args") or {}, name + "."))
        elif isinstance(value, Mapping) and value:
            out.update(flatten(value, name + "."))
        elif isinstance(value, list) and value and all(isinstance(v, Mapping) and "class_path" in v for v in value):
            for entry in value:
                cls = str(entry["class_path"]).rsplit(".", 1)[-1]
                out[f"{name}.{cls}"] = True
                out.update(flatten(entry.get("init_args") or {}, f"{name}.{cls}."))
        else:
            out[name] = value
    return out


def _covered(key: str, prefixes: Iterable[str]) -> bool:
    return any(key == p or key.startswith(p + ".") or key.startswith(p + "[") for p in prefixes)


def compare(
    saved: Mapping[str, Any], current: Mapping[str, Any], structural: Iterable[str] = STRUCTURAL
) -> tuple[list[tuple[str, Any, Any]], list[tuple[str, Any, Any]]]:
    """``(structural differences, other differences)`` between two flat settings dicts, as ``(key, saved, now)``.

    A key that only one side records is compared only when it is structural and the checkpoint has it (a
    checkpoint of an older version may lack newer settings; those are not differences).
    """
    structural = tuple(structural)
    hard, soft = [], []
    for key in sorted(set(saved) | set(current)):
        if _covered(key, IGNORED):
            continue
        if key not in saved:
            continue
        a, b = saved.get(key), current.get(key)
        if key not in current and not _covered(key, structural):
            continue
        if a != b:
            (hard if _covered(key, structural) else soft).append((key, a, b))
    return hard, soft


def mismatch_message(diffs: list[tuple[str, Any, Any]], ckpt_path: str | Path | None) -> str:
    """The refusal: each difference, then how to resume as saved or start fresh."""
    lines = [f"  {key}: checkpoint {a!r}, now {b!r}" for key, a, b in diffs]
    flags = " ".join(f"--{key} {a!r}" if not isinstance(a, str) else f"--{key} {a}" for key, a, _ in diffs[:3])
    where = f" {ckpt_path}" if ckpt_path else ""
    return (
        f"cannot resume from checkpoint{where}: it was trained with different settings that change what its saved "
        "state means:\n" + "\n".join(lines) + "\nEither resume as saved — drop those changes (or pass the "
        f"checkpoint's values: {flags}) — or start a fresh run without --ckpt_path (to start from these weights, "
        "`logra-pl export` the checkpoint and pass the folder as --model.policy)"
    )


def describe_changes(diffs: list[tuple[str, Any, Any]]) -> str:
    """One line per non-structural change applied on resume."""
    return "resuming with changed settings (checkpoint → now):\n" + "\n".join(
        f"  {key}: {a!r} → {b!r}" for key, a, b in diffs
    )


def canonical(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Plain nested settings, written one way whichever way they were given, so a resume compares like with like:

    - ``model.loss`` and ``model.baseline`` in their ``{class_path, init_args}`` form, from a short name (``ppo``), an
      object, or the old ``{kind: ...}`` section and its dataclasses (checkpoints of earlier versions);
    - every ``class_path`` named by its shortest import path (``logra_pl.losses.PPOClip``, whichever module defines
      it, and whatever path of an earlier layout a checkpoint recorded);
    - LoGRA's ``refresh`` and ``refresh_every`` both written out.
    """
    out = translated("settings", dict(settings))  # older spellings (a checkpoint's), the current way
    model = out.get("model")
    if isinstance(model, Mapping):
        model = dict(model)
        for key in ("loss", "baseline"):
            if key in model:  # None is the module's default (ReinforceTIS, RunningBaseline)
                model[key] = plain(_class_path_form(model[key], key))
        model["method"] = method = plain(_method_form(model.get("method")))
        logra = (method.get("init_args") or {}).get("logra") if isinstance(method, Mapping) else None
        if isinstance(logra, Mapping):
            method["init_args"]["logra"] = canonical_refresh(logra)
        out["model"] = model
    return _shortest_class_paths(out)


def _method_form(value: Any) -> Any:
    """``model.method`` as ``{class_path, init_args}``: a mapping as it is (a CLI's, every init arg written out), an
    object by its :meth:`~logra_pl.methods.UpdateMethod.to_config`, a short name, a path or None as the method with
    its defaults; what cannot be built is returned unchanged."""
    from logra_pl.methods import resolve_method

    if isinstance(value, Mapping) and "class_path" in value:
        return value
    try:
        return resolve_method(value).to_config()
    except (LoGRAError, TypeError, ValueError, AttributeError, ImportError):
        return value


def _class_path_form(value: Any, kind: str) -> Any:
    """A loss or baseline setting as ``{class_path, init_args}``; what cannot be built is returned unchanged."""
    from logra_pl.losses import build_baseline, build_loss

    if isinstance(value, Mapping) and "class_path" in value:
        return value
    old = translated("setting", value, kind)  # an old spelling, written the current way by its translators
    if old is not value:
        return old
    try:
        return (build_loss if kind == "loss" else build_baseline)(value).to_config()
    except (LoGRAError, TypeError, ValueError, AttributeError, ImportError):
        return value


def _shortest_class_paths(value: Any) -> Any:
    """``value`` with every importable ``class_path`` replaced by the shortest path of the same class."""
    if isinstance(value, Mapping):
        out = {k: _shortest_class_paths(v) for k, v in value.items()}
        path = out.get("class_path")
        if isinstance(path, str):
            try:
                found = import_dotted(path, "class_path")
            except LoGRAError:
                found = None
            if found is not None:
                out["class_path"] = class_path_of(found)
        return out
    if isinstance(value, list):
        return [_shortest_class_paths(v) for v in value]
    return value


def canonical_refresh(logra: Mapping[str, Any]) -> dict[str, Any]:
    """LoGRA settings with ``refresh`` and ``refresh_every`` both written out, from whichever spelling set them.

    A checkpoint from before ``refresh_every`` says ``refresh: true``; a run now may say ``refresh_every: 1``, or
    neither (the default): all three mean a new projection every update and compare equal. Values that contradict
    each other are left as they are (the run's own config refuses them).
    """
    from logra_pl.sketch.config import LoGRAConfigError, resolve_refresh_every

    out = dict(logra)
    try:
        every = resolve_refresh_every(out.get("refresh"), out.get("refresh_every"))
    except LoGRAConfigError:
        return out
    out["refresh"], out["refresh_every"] = every != 0, every
    return out


def check_resume(saved: Mapping[str, Any], current: Mapping[str, Any], ckpt_path: str | Path | None = None) -> None:
    """Raise :class:`ResumeMismatchError` on structural differences; log the others (flat or nested settings)."""
    hard, soft = compare(flatten(canonical(plain(saved))), flatten(canonical(plain(current))))
    if hard:
        raise ResumeMismatchError(mismatch_message(hard, ckpt_path))
    if soft:
        log.warning(describe_changes(soft))


def find_last_checkpoint(roots: Iterable[str | Path]) -> Path:
    """The newest ``last*.ckpt`` under ``roots`` (each a run family folder or a checkpoint folder).

    Searched: ``<root>/last*.ckpt``, ``<root>/checkpoints/last*.ckpt`` and ``<root>/*/checkpoints/last*.ckpt`` —
    every run of the family (TensorBoard's ``version_N`` folders, W&B and MLflow run ids), since a ``fit`` may open
    a new one. Raises
    :class:`~logra_pl.errors.CheckpointNotFoundError` naming the folders searched when there is none: a resume that
    finds nothing must not silently train from scratch.
    """
    searched, found = [], []
    for root in roots:
        root = Path(root)
        for pattern in ("last*.ckpt", "checkpoints/last*.ckpt", "*/checkpoints/last*.ckpt"):
            searched.append(str(root / pattern))
            # A sharded (distributed) checkpoint is a folder holding Lightning's metadata file.
            found += [p for p in root.glob(pattern) if p.is_file() or distributed_checkpoint_metadata(p).is_file()]
    if not found:
        raise CheckpointNotFoundError(
            "--ckpt_path last: no last checkpoint was found; searched " + ", ".join(searched) + ". Pass the "
            "checkpoint file itself, or drop --ckpt_path to start a fresh run"
        )
    return max(found, key=lambda p: p.stat().st_mtime)


def version_of(ckpt: Path) -> int | str | None:
    """The logger version a checkpoint was written under (``.../version_3/checkpoints/last.ckpt`` → 3)."""
    parts = ckpt.resolve().parts
    if len(parts) >= 3 and parts[-2] == "checkpoints" and parts[-3].startswith("version_"):
        tail = parts[-3][len("version_") :]
        return int(tail) if tail.isdigit() else parts[-3]
    return None
