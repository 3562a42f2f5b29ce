"""Update methods: how a policy update becomes new weights (``model.method``), each method whole in one file.

A method is an :class:`UpdateMethod` (``base.py``, the whole contract): its optimizer, the guarded update, what the
engine receives, its memory (live and planned), its export and console line. The built-in ones register their short
names: ``logra`` (:class:`LoGRAMethod`: sketches, merged factors), ``adamw`` (:class:`DenseAdamW`: the dense
baseline), ``lora`` (:class:`LoRAMethod`: peft adapters). A config chooses one by ``class_path`` with its own init
args, or by a short name (``model.method: adamw``, or the older ``model.optimizer: adamw`` with the ``model.logra`` /
``model.adamw`` / ``model.lora`` sections, which :func:`resolve_method` turns into the same objects). Adding a built-in
method is one file here and its name in the import line below.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from logra_pl.config import class_path_of, import_dotted, resolve, translated
from logra_pl.errors import ConfigError
from logra_pl.methods import adamw, logra, lora, sgd  # noqa: F401  (the built-in methods register their short names)
from logra_pl.methods.adamw import AdamWConfig, DenseAdamW
from logra_pl.methods.base import PlanShapes, StepResult, UpdateMethod
from logra_pl.methods.logra import LoGRAMethod
from logra_pl.methods.lora import LoRAConfig, LoRAMethod

__all__ = [
    "AdamWConfig",
    "DenseAdamW",
    "LoGRAMethod",
    "LoRAConfig",
    "LoRAMethod",
    "PlanShapes",
    "StepResult",
    "UpdateMethod",
    "checkpoint_kind",
    "method_class",
    "resolve_method",
    "same_method",
]


def resolve_method(method: str | UpdateMethod | None = None, optimizer: str = "logra", **sections: Any) -> UpdateMethod:
    """The update method of a module's settings (:func:`logra_pl.config.resolve`).

    ``method`` wins when given: an :class:`UpdateMethod`, a short name, or a class's dotted path. Otherwise the short
    form ``optimizer`` names it. A method named by a short name or a path is built from the module's ``sections``
    (``logra=``, ``adamw=``, ``lora=``: :meth:`UpdateMethod.from_sections`).
    """
    if isinstance(method, UpdateMethod):
        return method
    names = UpdateMethod.registry.names
    if optimizer not in names:
        raise ConfigError(f"unknown optimizer {optimizer!r}: use {', '.join(map(repr, names))}")

    def build(target: Any, name: str) -> Any:
        if isinstance(target, type) and issubclass(target, UpdateMethod):
            return target.from_sections(sections)
        return target

    return resolve(optimizer if method is None else method, UpdateMethod.registry, build=build)


def method_class(kind: str) -> type[UpdateMethod] | None:
    """The method class of a checkpoint's record (:func:`checkpoint_kind`): a class path, or a registered short name
    (checkpoints that recorded only that); None when it names no importable method."""
    found = UpdateMethod.registry.names.get(kind)
    if found is None and "." in kind:
        try:
            found = import_dotted(kind, "the checkpoint's method")
        except ConfigError:
            return None
    return found if isinstance(found, type) and issubclass(found, UpdateMethod) else None


def checkpoint_kind(checkpoint: Mapping[str, Any]) -> str | None:
    """The method that wrote a checkpoint, as the module records it (``logra_pl.method``: its class path; older
    checkpoints: ``logra_pl.optimizer``, a short name, which the ``checkpoint`` translators supply for those that
    recorded neither); None when it says nothing."""
    state = translated("checkpoint", checkpoint).get("logra_pl") or {}
    kind = state.get("method") or state.get("optimizer")
    return str(kind) if kind else None


def same_method(kind: str, method: UpdateMethod) -> bool:
    """Whether a checkpoint's recorded method (:func:`checkpoint_kind`) is ``method``'s: the same class path, or (a
    checkpoint that recorded a short name) the same short name."""
    return kind == (class_path_of(method) if "." in kind else method.name)
