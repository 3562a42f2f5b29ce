"""Which weights LoGRA trains through sketches (algorithm.md §1), and their wrapper-free names (algorithm.md §2)."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from logra_pl.sketch.config import LoGRAConfigError

# Name parts inserted anywhere in a path by module wrappers: FSDP1, activation checkpointing, torch.compile.
WRAPPER_PARTS: tuple[str, ...] = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")
# DDP (and DataParallel) wrap the root module as ``module``: stripped only as the first part.
ROOT_WRAPPER_PART = "module"


def canonical_name(name: str) -> str:
    """Strip wrapper prefixes so one matrix has the same name on every rank, in every wrapper, and in the engine.

    ``module.`` is only stripped as a leading part (DDP wraps at the root); the other wrapper parts may appear
    anywhere in the path.
    """
    parts = name.split(".")
    if parts and parts[0] == ROOT_WRAPPER_PART:
        parts = parts[1:]
    return ".".join(p for p in parts if p not in WRAPPER_PARTS)


def select_targets(model: nn.Module, targets: Iterable[str]) -> dict[str, nn.Linear]:
    """Return ``{canonical name: nn.Linear}`` for every module whose last name part is in ``targets``.

    Raises a :class:`LoGRAConfigError` naming the offending entry when a target name matches no module at all,
    or matches a module that is not an ``nn.Linear`` (LoGRA sketches only ``y = x Wᵀ + b``).
    """
    wanted = tuple(targets)
    found: dict[str, nn.Linear] = {}
    hits = dict.fromkeys(wanted, 0)
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if last not in hits:
            continue
        if not isinstance(module, nn.Linear):
            raise LoGRAConfigError(
                f"target {last!r} matches module {name!r} of type {type(module).__name__}, but LoGRA sketches "
                "only nn.Linear layers: remove it from `targets` or name the Linear sub-layers instead"
            )
        hits[last] += 1
        found[canonical_name(name)] = module
    missing = [t for t, n in hits.items() if n == 0]
    if missing:
        sample = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise LoGRAConfigError(
            f"target name(s) {missing} match no module of {type(model).__name__}; its nn.Linear name parts are "
            f"{sample[:20]}: fix `targets`"
        )
    return found
