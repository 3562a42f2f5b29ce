"""The collectives a policy update needs across data-parallel training processes (identities in one process)."""

from __future__ import annotations

from collections.abc import Callable
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


class Ranks:
    """The training processes as the parts of one update see them: collectives over ranks (identities in one process),
    this process's device, and the Trainer when there is one — so that sampling, scoring and the engine link never
    reach back into the module for them.

    Arguments:
        trainer: the Trainer the module is attached to now (None outside one: a module set up by hand).
        device: the device the module's tensors are on.
    """

    def __init__(
        self,
        trainer: Callable[[], Any] = lambda: None,
        device: Callable[[], torch.device] = lambda: torch.device("cpu"),
    ) -> None:
        self._trainer_now, self._device = trainer, device

    @property
    def trainer(self) -> Any:
        """The Trainer now, or None."""
        return self._trainer_now()

    @property
    def device(self) -> torch.device:
        """This process's device (collectives run on it: NCCL has no CPU tensors)."""
        return self._device()

    @property
    def is_zero(self) -> bool:
        """Whether this is global rank 0 (the one that prints and writes), or there is no Trainer."""
        trainer = self.trainer
        return trainer is None or bool(trainer.is_global_zero)

    @property
    def last_checkpoint(self) -> str:
        """The last checkpoint the run saved, for messages that say where to resume from."""
        trainer = self.trainer
        callback = getattr(trainer, "checkpoint_callback", None) if trainer is not None else None
        return getattr(callback, "last_model_path", "") or "the last checkpoint"

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the training processes (returned on the CPU)."""
        return all_reduce_sum(self.trainer, t, self.device)

    def any(self, flag: bool) -> bool:
        """``flag`` OR-ed over the training processes."""
        return any_rank(self.trainer, flag)

    def max(self, value: int) -> int:
        """The largest ``value`` over the training processes."""
        return all_reduce_max(self.trainer, value, self.device)
