"""Every deprecated name and old module path of logra-pl, in this one folder (Lightning's ``_graveyard`` is the model).

Checkpoints pickle their settings objects by module path, and configs and user code import by module path, so a
module that moves keeps its old path here, and a deprecated name keeps working until it is removed:

- :data:`OLD_PATHS` maps each module path of an earlier layout to the modules that now define its names. Importing
  an old path gives a stand-in module whose attributes are looked up there (a ``DeprecationWarning`` names the new
  path), so ``from logra_pl.optim import AdamWConfig`` and the unpickling of ``logra_pl.settings.RolloutSettings``
  both work. The stand-ins are made by a finder on ``sys.meta_path`` that this package installs when ``logra_pl`` is
  imported; nothing of the new layout is imported until an old path is used.
- :data:`DEPRECATED` maps each deprecated name of a module that still exists to the module of this folder that
  defines it. Such a module ends with ``__getattr__ = deprecated_names(__name__)`` (PEP 562): the name is looked up
  here only when it is asked for.

This module imports nothing of the package: the live modules only name it, the folder's own modules import them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

# Old module path -> the modules that define its names now (looked up in this order).
OLD_PATHS: dict[str, tuple[str, ...]] = {
    **{f"logra_pl.{name}": (f"logra_pl.runtime.{name}",) for name in ("ranks", "heap", "workers", "compat")},
    **{f"logra_pl.{name}": (f"logra_pl.runtime.{name}",) for name in ("console", "checkpointing")},
    "logra_pl.resume": ("logra_pl.runs.resume",),
    "logra_pl.run_stores": ("logra_pl.runs.stores",),
    "logra_pl.store_formats": ("logra_pl.runs.store_formats",),
    "logra_pl.export": ("logra_pl.runs.export",),
    **{
        f"logra_pl.{name}": (f"logra_pl.train.{name}",)
        for name in (
            "step",
            "batching",
            "logprobs",
            "backward",
            "shaping",
            "async_rollouts",
            "engine_link",
            "reference",
            "validation",
            "metrics",
            "warm_start",
            "policy_setup",
        )
    },
    "logra_pl.settings": ("logra_pl.train.settings", "logra_pl._graveyard.losses"),
    "logra_pl.module_state": ("logra_pl.train.state",),
    "logra_pl.optim": ("logra_pl.methods.adamw", "logra_pl.methods.logra"),
    "logra_pl.lora": ("logra_pl.methods.lora",),
    "logra_pl.guard": ("logra_pl.methods.guard",),
    "logra_pl.memory": ("logra_pl.methods.memory_plan",),
    "logra_pl.rollout.server": ("logra_pl.rollout.serve.server", "logra_pl.rollout.serve.settings"),
    "logra_pl.rollout.serve_app": ("logra_pl.rollout.serve.app",),
    "logra_pl.rollout.serve_state": ("logra_pl.rollout.serve.state",),
}

# (live module, deprecated name) -> the module of this folder that defines it.
DEPRECATED: dict[tuple[str, str], str] = {
    **{
        ("logra_pl.losses", name): "logra_pl._graveyard.losses"
        for name in (
            "LossSpec",
            "LOSSES",
            "register_loss",
            "resolve_loss",
            "SpecLoss",
            "Baseline",
            "BaselineKind",
            "LegacyBaselineSettings",
            "LossConfig",
            "LegacyLossSettings",
        )
    },
    **{
        (module, name): "logra_pl._graveyard.losses"
        for module in ("logra_pl.train.settings", "logra_pl.module")
        for name in ("LossConfig", "LegacyLossSettings")
    },
    **{
        ("logra_pl.rollout.registry", name): "logra_pl._graveyard.engines"
        for name in ("ENGINES", "resolve_engine", "build_hf_engine", "engine_model_folder")
    },
}


def _lookup(homes: tuple[str, ...], name: str, where: str) -> Any:
    for home in homes:
        module = importlib.import_module(home)
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {where!r} has no attribute {name!r} (its names now live in {', '.join(homes)})")


class _OldModule(types.ModuleType):
    """An old module path: its attributes are those of the modules that define them now."""

    def __init__(self, name: str, homes: tuple[str, ...]) -> None:
        super().__init__(name, f"Old path of {', '.join(homes)} (deprecated: import from there).")
        self.__homes = homes

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _lookup(self.__homes, name, self.__name__)

    def __dir__(self) -> list[str]:
        names: set[str] = set()
        for home in self.__homes:
            names |= set(dir(importlib.import_module(home)))
        return sorted(names)


class _OldPathFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old module paths of :data:`OLD_PATHS` (and nothing else)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in OLD_PATHS:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _OldModule(spec.name, OLD_PATHS[spec.name])

    def exec_module(self, module: types.ModuleType) -> None:
        homes = " / ".join(OLD_PATHS[module.__name__])
        warnings.warn(f"{module.__name__} is an old module path: import from {homes}", DeprecationWarning, stacklevel=2)


def install() -> None:
    """Put the old-path finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, _OldPathFinder) for finder in sys.meta_path):
        sys.meta_path.append(_OldPathFinder())


def deprecated_names(module: str) -> Callable[[str], Any]:
    """The ``__getattr__`` of a live module with deprecated names: each is looked up in this folder when asked for."""

    def __getattr__(name: str) -> Any:
        home = DEPRECATED.get((module, name))
        if home is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        return getattr(importlib.import_module(home), name)

    return __getattr__


install()
