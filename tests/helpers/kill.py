"""``KillAt``: a callback that kills its own process with SIGKILL after a given update — a real ``kill -9``."""

from __future__ import annotations

import os
import signal
from typing import Any

import lightning.pytorch as pl


class KillAt(pl.Callback):
    """``os.kill(getpid(), SIGKILL)`` at the end of update ``update``: no cleanup, no finally, no atexit.

    Arguments:
        update: the 1-based update after which the process dies.
    """

    def __init__(self, update: int) -> None:
        self.update = update

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step >= self.update:
            os.kill(os.getpid(), signal.SIGKILL)
