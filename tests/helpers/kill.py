"""``KillAt``: a callback that kills its own process with SIGKILL after a given update — a real ``kill -9``."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import lightning.pytorch as pl


class KillAt(pl.Callback):
    """``os.kill(getpid(), SIGKILL)`` at the end of update ``update``: no cleanup, no finally, no atexit.

    Arguments:
        update: the 1-based update after which the process dies.
        wait_s: seconds to sleep first, so that a logger writing from another process on a timer (W&B's wandb-core
            flushes its log every ``WANDB__TRANSACTION_LOG_FLUSH_INTERVAL`` seconds) has written the steps before
            the kill; 0: die at once.
    """

    def __init__(self, update: int, wait_s: float = 0.0) -> None:
        self.update = update
        self.wait_s = wait_s

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step >= self.update:
            time.sleep(self.wait_s)
            os.kill(os.getpid(), signal.SIGKILL)
