"""What a LoGRA run shows on the console: progress in policy updates, and what the model summary means.

Both replace Lightning's defaults of the same kind when the module adds them (``configure_callbacks``): an RL
run is counted in updates (``max_steps``), not epochs — Lightning's bar read "Epoch 0/-2" — and a LoGRA policy
has no trainable parameters in autograd's sense (sketched weights have ``requires_grad=False``), so Lightning's
summary read "Trainable params: 0".
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary, RichProgressBar, TQDMProgressBar
from typing_extensions import override

from logra_pl.callbacks.contract import view_of
from logra_pl.runtime import compat

log = logging.getLogger("lightning.pytorch.callbacks.model_summary")  # printed where Lightning prints its table


class UpdateProgressBar(TQDMProgressBar):
    """A training bar over policy updates: ``update 120/800``, with the module's progress-bar metrics."""

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)  # the logger version is in the run folder's name
        return metrics

    @override
    def on_train_start(self, trainer: pl.Trainer, *_: Any) -> None:
        super().on_train_start(trainer)
        bar = self.train_progress_bar
        bar.reset(total=trainer.max_steps if trainer.max_steps > 0 else None)
        bar.initial = bar.n = trainer.global_step  # a resumed run starts at its checkpoint's update
        bar.set_description("update")

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        pass  # one bar for the whole run: epochs of prompts are not what an RL run counts

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        bar = self.train_progress_bar
        if bar is None or bar.disable:
            return
        if trainer.global_step % max(self.refresh_rate, 1) == 0 or trainer.global_step == bar.total:
            bar.n = trainer.global_step
            bar.set_postfix(self.get_metrics(trainer, pl_module))
            bar.refresh()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pass  # one bar for the whole run, closed in on_train_end


class RichUpdateProgressBar(RichProgressBar):
    """:class:`UpdateProgressBar` for Lightning's rich console (chosen by Lightning when ``rich`` is installed)."""

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        return "update"

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics

    def _total(self) -> float:
        return self.trainer.max_steps if self.trainer.max_steps > 0 else float("inf")

    @override
    def _initialize_train_progress_bar_id(self) -> None:
        self.train_progress_bar_id = compat.rich_add_task(self, self._total(), "update")

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.is_disabled or self.progress is None:
            return
        if self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()
            compat.rich_update(self, self.train_progress_bar_id, trainer.global_step)
        self.refresh()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.is_disabled:
            return
        if self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()
        compat.rich_update(self, self.train_progress_bar_id, trainer.global_step)
        compat.rich_update_metrics(self, trainer, pl_module)
        self.refresh()


class _TrainedCounts:
    """Mixin for Lightning's summaries: count what the optimizer trains, then say how (see the module doc)."""

    READS = ("policy", "method", "targets")  # of the policy contract (any other module: Lightning's count)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not compat.summary_depth(self):
            return
        summary, rows = compat.layer_summary(self, trainer, pl_module)
        view = view_of(pl_module, self.READS)  # a policy module's method counts what it trains (LoGRA sets no grad)
        trained = summary.trainable_parameters
        if view is not None and view.policy is not None:
            trained = int(view.method.trained_parameter_count(view.policy))
        if not trainer.is_global_zero:
            return
        self.summarize(  # type: ignore[attr-defined]
            rows,
            summary.total_parameters,
            trained,
            summary.model_size,
            summary.total_training_modes,
            total_flops=getattr(summary, "total_flops", 0),
            **compat.summarize_kwargs(self),
        )
        if view is not None and view.policy is not None:
            log.info(view.method.report(view.policy, view.targets))


class LoGRAModelSummary(_TrainedCounts, ModelSummary):
    """Lightning's layer table with "Trainable params" counting what the run trains — LoGRA's sketched matrices
    included — and one line after it on how (the update method's ``report``)."""


class LoGRARichModelSummary(_TrainedCounts, RichModelSummary):
    """:class:`LoGRAModelSummary` for Lightning's rich console."""


def replace_default_callbacks(callbacks: list[pl.Callback]) -> list[pl.Callback]:
    """Update-counting progress bars and an honest model summary in place of Lightning's defaults of those kinds
    (what ``LightningModule.configure_callbacks`` returns; Lightning then drops the defaults of the same types)."""
    out: list[pl.Callback] = []
    for cb in callbacks:
        if type(cb) is TQDMProgressBar:
            out.append(UpdateProgressBar(**compat.progress_bar_args(cb)))
        elif type(cb) is RichProgressBar:
            out.append(RichUpdateProgressBar(**compat.progress_bar_args(cb), theme=cb.theme))
        elif type(cb) is ModelSummary:
            out.append(LoGRAModelSummary(max_depth=compat.summary_depth(cb)))
        elif type(cb) is RichModelSummary:
            out.append(LoGRARichModelSummary(max_depth=compat.summary_depth(cb)))
    return out
