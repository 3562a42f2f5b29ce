"""Update methods: how a policy update becomes new weights (``model.method``).

``LoGRAMethod`` (sketches, merged factors), ``DenseAdamW`` (the dense baseline), ``LoRAMethod`` (peft adapters);
chosen by ``class_path`` with their own init args, or by the short names ``logra | adamw | lora``
(``model.method: adamw``, or the older ``model.optimizer: adamw`` with the ``model.logra`` / ``model.adamw`` /
``model.lora`` sections, which :func:`resolve_method` turns into the same objects).
"""

from __future__ import annotations

from typing import Any

from logra_pl.errors import ConfigError, import_dotted
from logra_pl.methods.adamw import AdamWConfig, DenseAdamW
from logra_pl.methods.base import StepResult, UpdateMethod
from logra_pl.methods.logra import LoGRAMethod
from logra_pl.methods.lora import LoRAConfig, LoRAMethod
from logra_pl.sketch import LoGRAConfig

SHORT_NAMES = ("logra", "adamw", "lora")

__all__ = [
    "SHORT_NAMES",
    "DenseAdamW",
    "LoGRAMethod",
    "LoRAMethod",
    "StepResult",
    "UpdateMethod",
    "checkpoint_kind",
    "resolve_method",
]


def resolve_method(
    method: str | UpdateMethod | None,
    optimizer: str = "logra",
    logra: LoGRAConfig | None = None,
    adamw: AdamWConfig | None = None,
    lora: LoRAConfig | None = None,
) -> UpdateMethod:
    """The update method of a module's settings.

    ``method`` wins when given: an :class:`UpdateMethod`, a short name, or a class's dotted path (built with no
    arguments). Otherwise the short form ``optimizer`` with its sections builds it.
    """
    if isinstance(method, UpdateMethod):
        return method
    if optimizer not in SHORT_NAMES:
        raise ConfigError(f"unknown optimizer {optimizer!r}: use {', '.join(map(repr, SHORT_NAMES))}")
    name = optimizer if method is None else method
    if name == "logra":
        return LoGRAMethod(logra)
    if name == "adamw":
        return DenseAdamW(adamw)
    if name == "lora":
        return LoRAMethod(lora, adamw)
    if isinstance(name, str) and "." in name:
        cls = import_dotted(name, "model.method")
        built = cls() if isinstance(cls, type) else None
        if isinstance(built, UpdateMethod):
            return built
    raise ConfigError(
        f"unknown update method {name!r}: use one of {', '.join(SHORT_NAMES)}, or "
        "model.method: {class_path: my_pkg.MyMethod, init_args: {...}} (a subclass of logra_pl.methods.UpdateMethod)"
    )


def checkpoint_kind(checkpoint: dict[str, Any]) -> str | None:
    """The method a checkpoint was written by: recorded by the module, or read off the optimizer state of
    checkpoints that predate the record (``logra`` state vs torch's ``param_groups``)."""
    state = checkpoint.get("logra_pl") or {}
    if state.get("optimizer"):
        return str(state["optimizer"])
    states = checkpoint.get("optimizer_states") or []
    if not states:
        return None
    return "logra" if "logra" in states[0] else ("adamw" if "param_groups" in states[0] else None)
