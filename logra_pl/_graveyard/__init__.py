"""Every deprecated name, old module path and old spelling of logra-pl, in this one folder, attached from outside.

Lightning's ``_graveyard`` is the model: the live modules never import this folder and know none of its names; the
package's root imports it last, and it attaches itself to the live code from outside. Deleting the folder and that one
import leaves a working package that simply no longer reads the old spellings. It attaches three kinds of entry, each
naming the release that removes it (:data:`REMOVED_IN`):

- :data:`OLD_PATHS`: each module path of an earlier layout -> the modules that define its names now. Importing an old
  path gives a stand-in module whose attributes are looked up there (a ``DeprecationWarning`` names the new path), so
  ``from logra_pl.optim import AdamWConfig`` and the unpickling of ``logra_pl.settings.RolloutSettings`` both work.
- :data:`DEPRECATED`: each deprecated name of a live module -> the module of this folder that defines it. When the
  live module is imported, this folder gives it a PEP 562 ``__getattr__`` that looks the name up here; and
  :data:`PATCHES` changes what a live module defines after it ran (``LoGRAPolicyModule.load_from_checkpoint`` reads
  the old sections of a checkpoint's hyper-parameters). Both are done by the finder on ``sys.meta_path`` that
  :func:`install` puts first: it loads the live module as usual, then patches it; nothing of the new layout is
  imported before it is asked for.
- the translators of old settings (:data:`TRANSLATORS`), added to the points where configs and checkpoints are read
  (:func:`logra_pl.config.add_translator`): the old ``{kind: ...}`` loss and baseline sections, the short form of
  an update method (``model.optimizer`` with the ``model.logra`` / ``adamw`` / ``lora`` / ``sgd`` sections: in
  configs, command lines, checkpoints and ``LoGRAPolicyModule``'s keyword arguments), checkpoints that predate the
  record of the method that wrote them.

This module imports nothing of the package at import time but :mod:`logra_pl.config`; the folder's other modules
import the live ones when an old spelling is met.
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

from logra_pl.config import add_translator

# The release of logra-pl that removes every entry below (they were deprecated in the 0.1 series).
REMOVED_IN = "0.3.0"

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
    "logra_pl.train.view": ("logra_pl.callbacks.contract",),
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
    ("logra_pl.rollout.base", "GatheredState"): "logra_pl.methods.base",  # moved to the methods' contract
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


def _removal_note() -> str:
    return f"(removed in logra-pl {REMOVED_IN})"


def _deprecated_getattr(module: str) -> Callable[[str], Any]:
    """The PEP 562 ``__getattr__`` given to a live module with deprecated names: each is looked up in this folder
    when asked for."""

    def __getattr__(name: str) -> Any:
        home = DEPRECATED.get((module, name))
        if home is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        return getattr(importlib.import_module(home), name)

    return __getattr__


def _patch_checkpoint_loading(module: types.ModuleType) -> None:
    from logra_pl._graveyard.checkpoints import translate_on_load

    translate_on_load(module.LoGRAPolicyModule)


def _patch_short_method_form(module: types.ModuleType) -> None:
    from logra_pl._graveyard.methods import translate_on_init

    translate_on_init(module.LoGRAPolicyModule)


# Live module -> what this folder changes in it once it has run (besides the deprecated names' ``__getattr__``).
PATCHES: dict[str, tuple[Callable[[types.ModuleType], None], ...]] = {
    "logra_pl.module": (_patch_checkpoint_loading, _patch_short_method_form),
}


def _patch(module: types.ModuleType) -> None:
    """Attach this folder's entries to a live module that has just run."""
    name = module.__name__
    if any(live == name for live, _ in DEPRECATED):
        module.__getattr__ = _deprecated_getattr(name)  # type: ignore[method-assign]
    for patch in PATCHES.get(name, ()):
        patch(module)


def _patched_modules() -> set[str]:
    return {live for live, _ in DEPRECATED} | set(PATCHES)


class _PatchingLoader(importlib.abc.Loader):
    """A live module's own loader, which patches the module (:func:`_patch`) once it has run."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.loader.exec_module(module)
        _patch(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename...: the live module's own loader answers
        return getattr(self.loader, name)


class _GraveyardFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old module paths of :data:`OLD_PATHS` (stand-ins), and the live modules this folder patches (found
    where they always are, loaded by their own loader, patched after)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname in OLD_PATHS:
            return importlib.machinery.ModuleSpec(fullname, self)
        if fullname not in _patched_modules():
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader)
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _OldModule(spec.name, OLD_PATHS[spec.name])

    def exec_module(self, module: types.ModuleType) -> None:
        homes = " / ".join(OLD_PATHS[module.__name__])
        warnings.warn(
            f"{module.__name__} is an old module path: import from {homes} {_removal_note()}",
            DeprecationWarning,
            stacklevel=2,
        )


def _translator(module: str, name: str) -> Callable[..., Any]:
    """A translator of this folder, imported when it is first called (the live modules it needs load then)."""

    def translate(*args: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args)

    translate.__qualname__ = f"{module}.{name}"
    return translate


# Translation point (logra_pl.config.add_translator) -> this folder's translators, in order.
TRANSLATORS: dict[str, tuple[Callable[..., Any], ...]] = {
    "config": (
        _translator("logra_pl._graveyard.losses", "translate_config"),
        _translator("logra_pl._graveyard.methods", "translate_config"),
    ),
    "argv": (_translator("logra_pl._graveyard.methods", "translate_argv"),),
    "settings": (_translator("logra_pl._graveyard.methods", "translate_quietly"),),
    "setting": (_translator("logra_pl._graveyard.losses", "class_path_form"),),
    "hparams": (
        _translator("logra_pl._graveyard.losses", "translate_hparams"),
        _translator("logra_pl._graveyard.methods", "translate_hparams"),
    ),
    "checkpoint": (_translator("logra_pl._graveyard.checkpoints", "record_method"),),
    "plugin": (_translator("logra_pl._graveyard.losses", "built_form"),),
}


def install() -> None:
    """Attach this folder (once): the finder first on ``sys.meta_path`` (a live module already imported is patched
    now), and the translators at their points."""
    if not any(isinstance(finder, _GraveyardFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _GraveyardFinder())
        for name in _patched_modules():
            if name in sys.modules:
                _patch(sys.modules[name])
    for point, translators in TRANSLATORS.items():
        for translator in translators:
            add_translator(point, translator)


install()
