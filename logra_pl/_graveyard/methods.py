"""The short form of an update method (deprecated; removed in logra-pl 0.3.0, :data:`logra_pl._graveyard.REMOVED_IN`):
``model.optimizer: adamw`` with the sections ``model.logra`` / ``model.adamw`` / ``model.lora`` / ``model.sgd``.

``model.method`` is the one spelling now: ``{class_path: logra_pl.methods.DenseAdamW, init_args: {adamw: {...}}}``,
each built-in method taking its section under the section's own name (LoRA takes ``lora`` and ``adamw``). The short
form is translated where configs, command lines and checkpoints are read — the CLI's YAML loader and its arguments,
resume comparisons, ``load_from_checkpoint``, and the keyword arguments of ``LoGRAPolicyModule`` — with a
``FutureWarning`` that gives the form to write from now on.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from logra_pl.config import class_path_of, flow
from logra_pl.errors import ConfigError

SECTIONS = ("logra", "adamw", "lora", "sgd")
SHORT_FORM = ("optimizer", *SECTIONS)


def _method_class(name: str) -> type:
    from logra_pl.methods import method_class

    cls = method_class(name)
    if cls is None:
        from logra_pl.methods import UpdateMethod

        names = ", ".join(map(repr, UpdateMethod.registry.names))
        raise ConfigError(f"model.optimizer {name!r} names no update method: write model.method, one of {names}")
    return cls


def _init_parameters(cls: type) -> list[str]:
    return [p for p in inspect.signature(cls.__init__).parameters if p != "self"]


def method_setting(model: Mapping[str, Any]) -> Any:
    """The ``model.method`` that ``model``'s short form means: the class that ``model.method`` (a short name or a
    path) or else ``model.optimizer`` names (default ``logra``), with the sections it takes as its init args — plain
    data as ``{class_path, init_args}``, settings objects (a notebook's checkpoint) as the method object. A
    ``model.method`` already given as a mapping or an object stays (the sections were never read with it)."""
    method = model.get("method")
    if method is not None and not isinstance(method, str):
        return method
    cls = _method_class(str(method or model.get("optimizer") or "logra"))
    init = {p: model[p] for p in _init_parameters(cls) if p in SECTIONS and model.get(p) is not None}
    if any(not isinstance(v, Mapping) for v in init.values()):
        return cls(**init)
    return {"class_path": class_path_of(cls), **({"init_args": init} if init else {})}


def translate_model(model: dict[str, Any], warn: bool = True) -> dict[str, Any]:
    """``model`` (a module's settings) with its short form replaced by ``model.method``; unchanged without one."""
    if not any(key in model for key in SHORT_FORM):
        return model
    method = method_setting(model)
    given = {key: model[key] for key in SHORT_FORM if model.get(key) is not None}
    out = {key: value for key, value in model.items() if key not in SHORT_FORM} | {"method": method}
    if warn and given:
        shown = method if isinstance(method, Mapping) else class_path_of(method)
        warnings.warn(
            f"model.optimizer and the model.{'/'.join(SECTIONS)} sections are the deprecated form of an update "
            f"method ({', '.join(sorted(given))}; removed in logra-pl 0.3.0): read as model.method: {flow(shown)}, "
            "the form to write from now on",
            FutureWarning,
            stacklevel=3,
        )
    return out


def translate_config(config: Any) -> Any:
    """A whole config (or one subcommand's) with the short form of ``model`` translated (the CLI's YAML loader)."""
    if not isinstance(config, dict):
        return config
    for holder in [config, *(v for v in config.values() if isinstance(v, dict))]:
        if isinstance(holder.get("model"), dict):
            holder["model"] = translate_model(holder["model"])
    return config


def translate_quietly(config: Any) -> Any:
    """:func:`translate_config` without the warning: for comparing a checkpoint's settings with a run's."""
    if not isinstance(config, dict):
        return config
    out = dict(config)
    if isinstance(out.get("model"), Mapping):
        out["model"] = translate_model(dict(out["model"]), warn=False)
    return out


def translate_hparams(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """A checkpoint's module hyper-parameters with the short form translated (``load_from_checkpoint``)."""
    return translate_model(dict(hparams))


def translate_argv(argv: Sequence[str]) -> list[str]:
    """Command-line arguments with the short form's flags written the current way: ``--model.optimizer=X`` becomes
    ``--model.method=<X's class path>``, ``--model.<section>.<key>=V`` becomes ``--model.method.<section>.<key>=V``
    (also with the value as the next argument)."""
    out: list[str] = []
    old: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        key, eq, value = arg.partition("=")
        if key == "--model.optimizer":
            if not eq and i + 1 < len(args):
                value, i = args[i + 1], i + 1
            out.append(f"--model.method={class_path_of(_method_class(value))}")
            old.append(arg)
        elif any(key == f"--model.{s}" or key.startswith(f"--model.{s}.") for s in SECTIONS):
            out.append(f"--model.method.{key.removeprefix('--model.')}{eq}{value}")
            old.append(arg)
        else:
            out.append(arg)
        i += 1
    if old:
        warnings.warn(
            f"{', '.join(old)}: the deprecated flags of an update method (removed in logra-pl 0.3.0); read as "
            f"{', '.join(a for a in out if a.startswith('--model.method'))}, the flags to write from now on",
            FutureWarning,
            stacklevel=3,
        )
    return out


def translate_on_init(module_class: type) -> None:
    """Patch ``module_class.__init__`` (``LoGRAPolicyModule``'s) to take the short form's keyword arguments
    (``optimizer="adamw"``, ``logra=LoGRAConfig(...)``...) as the method they mean."""
    init = module_class.__init__
    if getattr(init, "translates_old_settings", False):
        return

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if any(key in kwargs for key in SHORT_FORM):
            kwargs = translate_model(kwargs)
        init(self, *args, **kwargs)

    __init__.translates_old_settings = True  # type: ignore[attr-defined]
    # Its signature stays the module's own (jsonargparse, Lightning's filter of saved hyper-parameters read it).
    __init__.__signature__ = inspect.signature(init)  # type: ignore[attr-defined]
    module_class.__init__ = __init__
