"""Update methods: how a policy update becomes new weights (``model.method``), each method whole in one file.

A method is an :class:`UpdateMethod` (``base.py``, the whole contract): its optimizer, the guarded update, what the
engine receives, its memory (live and planned), its plan for ``logra-pl plan``, its export and console line. The
built-in ones register their short names: ``logra`` (:class:`LoGRAMethod`: sketches, merged factors), ``adamw``
(:class:`DenseAdamW`: the dense baseline), ``lora`` (:class:`LoRAMethod`: peft adapters), ``sgd`` (:class:`DenseSGD`).
A config chooses one as ``model.method: {class_path: logra_pl.methods.DenseAdamW, init_args: {adamw: {lr: ...}}}``
(or by a short name, with its defaults). Adding a built-in method is one file here and its name in the import line
below; a method of a user's own package is chosen by its ``class_path`` alone.
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
from logra_pl.methods.sgd import DenseSGD, SGDConfig

__all__ = [
    "AdamWConfig",
    "DenseAdamW",
    "DenseSGD",
    "LoGRAMethod",
    "LoRAConfig",
    "LoRAMethod",
    "PlanShapes",
    "SGDConfig",
    "StepResult",
    "UpdateMethod",
    "checkpoint_kind",
    "method_class",
    "resolve_method",
    "same_method",
]


def resolve_method(method: str | Mapping[str, Any] | UpdateMethod | None = None) -> UpdateMethod:
    """The update method of ``model.method`` (:func:`logra_pl.config.resolve`): an :class:`UpdateMethod` as it is; a
    short name (``logra``, ``adamw``, ``lora``, ``sgd``) or a class's dotted path, built with its defaults; a
    ``{class_path, init_args}`` mapping; None: ``logra`` with its defaults."""
    return resolve("logra" if method is None else method, UpdateMethod.registry)


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
