"""``NextBatchGain``: how much of each update carries to the batch after it (algorithm.md §6).

An update's first-order gain on its own batch, ``−⟨∇L, Δθ⟩`` (``train/update_gain``), says how well the step fits the
batch it was made from. A step that spends the KL budget on what is particular to that batch fits it best and
teaches least: across the KL-matched grid, the rules with the largest in-batch gain per update learned the least
(docs/benchmarks.md). What a step is worth to the run is its gain on batches it has not seen. This callback asks the
update method to keep each applied step until the next update, which then measures

    −⟨∇L', Δθ⟩      ∇L' the gradient of the next update's loss, at the weights the step produced

and logs, after every training step where it was measured::

    train/next_batch_gain       = −⟨∇L', Δθ⟩ of the last applied step (method.next_batch_gain, over all ranks)
    train/next_batch_retention  = train/next_batch_gain / the in-batch gain of that same step

The dense methods measure it from their gradients and the kept step (LoRA's in adapter space); LoGRA exactly from the
next update's sketches (``⟨S', F⟩``), while its basis persists. The kept step is a diagnostic's: a copy of every
trained tensor for a dense method, ``d_out × r`` floats per matrix for LoGRA; the memory reports do not count it.
It is not checkpointed: the first update after a resume has nothing to measure.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from logra_pl.callbacks.contract import require_view
from logra_pl.errors import ConfigError


class NextBatchGain(pl.Callback):
    """Log each applied update's first-order gain on the next update's loss, and its ratio to its in-batch gain.

    Arguments:
        required: refuse a method that cannot keep its step (``ConfigError`` at setup; e.g. LoGRA with a new basis
            every update). False: warn once and log nothing for it (a grid whose every run carries the callback).
    """

    READS = ("method",)

    def __init__(self, required: bool = True) -> None:
        self.required = required
        self.measuring = False
        self._last_gain: float | None = None  # the in-batch gain of the last applied step

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Ask the method to keep its steps; refuse (or, not ``required``, warn about) one that cannot."""
        method = require_view(pl_module, "NextBatchGain", self.READS).method
        self.measuring = bool(method.keep_last_step())
        if self.measuring:
            return
        why = (
            f"NextBatchGain: the update method {type(method).__name__} cannot keep its step for the next update's "
            "measure (LoGRA: its basis changes every update, with refresh_every: 1 or input_scaling: rms)"
        )
        if self.required:
            raise ConfigError(
                f"{why}; use a basis that persists (refresh_every: 0 or N > 1, input_scaling: none), or "
                "NextBatchGain(required=False)"
            )
        rank_zero_warn(f"{why}; nothing is logged")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Log the last applied step's gain on this update's loss; remember this update's in-batch gain if applied."""
        if not self.measuring:
            return
        method = pl_module.method
        gain = method.next_batch_gain
        log: dict[str, float] = {}
        if gain is not None and math.isfinite(gain):
            log["train/next_batch_gain"] = gain
            if self._last_gain:
                log["train/next_batch_retention"] = gain / self._last_gain
        if log:
            pl_module.log_dict(log, on_step=True, batch_size=1)
        own = method.last_gain
        if own:  # 0: not applied, and the kept step is still the earlier one
            self._last_gain = own
