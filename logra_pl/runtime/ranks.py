"""The collectives a policy update needs across data-parallel training processes (identities in one process)."""

from __future__ import annotations

from typing import Any

import torch


def all_reduce_sum(trainer: Any, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` summed over the training processes (on ``device`` for the collective, returned on the CPU)."""
    if trainer is None or trainer.world_size <= 1:
        return t
    return trainer.strategy.reduce(t.to(device), reduce_op="sum").cpu()


def any_rank(trainer: Any, flag: bool) -> bool:
    """``flag`` OR-ed over the training processes (one all-reduce)."""
    if trainer is None or trainer.world_size <= 1:
        return bool(flag)
    return bool(trainer.strategy.reduce_boolean_decision(bool(flag), all=False))


def all_reduce_max(trainer: Any, value: int, device: torch.device) -> int:
    """The largest ``value`` over the training processes (one all-reduce)."""
    if trainer is None or trainer.world_size <= 1:
        return int(value)
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    return int(trainer.strategy.reduce(t, reduce_op="max").item())
