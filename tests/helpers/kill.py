"""``KillAt``: a callback that kills its own process with SIGKILL after a given update — a real ``kill -9``."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import lightning.pytorch as pl


class KillAt(pl.Callback):
    """``os.kill(getpid(), SIGKILL)`` at the end of update ``update``: no cleanup, no finally, no atexit (or, with
    ``signum="SIGTERM"``, what a scheduler sends before it kills a preempted job).

    Arguments:
        update: the 1-based update after which the process dies.
        wait_s: seconds to sleep first, so that a logger writing from another process on a timer (W&B's wandb-core
            flushes its log every ``WANDB__TRANSACTION_LOG_FLUSH_INTERVAL`` seconds) has written the steps before
            the kill; 0: die at once.
        signum: the signal's name (sent once).
    """

    def __init__(self, update: int, wait_s: float = 0.0, signum: str = "SIGKILL") -> None:
        self.update = update
        self.wait_s = wait_s
        self.signum = getattr(signal, signum)
        self.sent = False

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step >= self.update and not self.sent:
            time.sleep(self.wait_s)
            self.sent = True
            os.kill(os.getpid(), self.signum)
