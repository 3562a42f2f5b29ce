"""``MemoryMonitor``: per-update peak memory and training state by kind, as scalars and a stacked-bar image.

On CUDA the peak allocated and reserved bytes of each update (the peak counters are reset when the update starts).
On CPU the process's peak resident set size during the update: Linux keeps a resettable high-water mark
(``VmHWM`` in ``/proc/self/status``, reset by writing ``5`` to ``/proc/self/clear_refs``); where that is not
available the lifetime peak (``ru_maxrss``) is logged instead and ``memory/peak_rss_is_lifetime`` is 1. On both,
the bytes of training state by kind (weights, gradients, optimizer state, sketches, projections, row statistics,
a KL penalty's reference policy) from :func:`logra_pl.sketch.memory.memory_report`, counted just before the (last)
optimizer step of the update, when gradients and filled sketches exist.
"""

from __future__ import annotations

import io
import resource
import sys
from dataclasses import fields
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from logra_pl.callbacks.contract import view_of
from logra_pl.sketch.memory import MemoryReport, memory_report

STATE_KINDS = [f.name for f in fields(MemoryReport) if f.name != "dense_gradient_equivalent"]


def _status_kib(field: str) -> int | None:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``), or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int:
    """Current resident set size of this process."""
    kib = _status_kib("VmRSS")
    if kib is not None:
        return kib * 1024
    return peak_rss_lifetime_bytes()


def peak_rss_lifetime_bytes() -> int:
    """Peak resident set size over the process's life (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (``VmHWM``) to the current RSS; False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak RSS since the last :func:`reset_peak_rss` (``VmHWM``), or the lifetime peak off Linux.

    The kernel updates ``VmHWM`` lazily, so it is combined with the current RSS read at the same moment.
    """
    kib = _status_kib("VmHWM")
    if kib is None:
        return peak_rss_lifetime_bytes()
    return max(kib * 1024, rss_bytes())


class MemoryMonitor(pl.Callback):
    """Logs ``memory/*`` every update and a stacked bar chart of state by kind every ``image_every`` updates.

    Scalars: ``memory/state/<kind>`` and ``memory/state_bytes`` (their sum); on CPU ``memory/peak_rss_bytes``
    (peak during the update) and ``memory/rss_bytes`` (at its end); on CUDA ``memory/cuda_peak_allocated_bytes``
    and ``memory/cuda_peak_reserved_bytes``. The last update's values stay in :attr:`last`, every update's in
    :attr:`history`; :attr:`peaks_within_update` holds the update's starting value and the peak so far read
    before each optimizer step and at its end (CPU: RSS; CUDA: allocated bytes). A peak is never below an
    earlier reading: the kernel keeps its peak-RSS mark lazily.

    Arguments:
        image_every: add the state-by-kind image to TensorBoard every N updates; 0 never.
        max_image_bars: updates shown in the image (the most recent ones).
    """

    READS = ("policy", "method", "step_context")  # of the policy contract (any other module: its parameters)

    def __init__(self, image_every: int = 100, max_image_bars: int = 20) -> None:
        if image_every < 0:
            raise ValueError(f"image_every must be >= 0, got {image_every}")
        self.image_every = image_every
        self.max_image_bars = max_image_bars
        self.history: list[dict[str, float]] = []
        self.last: dict[str, float] = {}
        self._cuda = False
        self._resettable = True
        self._start_rss = 0
        self.peaks_within_update: list[float] = []  # RSS at the start, then the peak so far at each sample
        self._state: MemoryReport | None = None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._cuda = pl_module.device.type == "cuda"
        if self._cuda:
            torch.cuda.synchronize(pl_module.device)
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        self._resettable = reset_peak_rss()
        self._start_rss = rss_bytes()  # after the reset: the mark starts at (about) this value
        start = torch.cuda.memory_allocated(pl_module.device) if self._cuda else self._start_rss
        self.peaks_within_update = [float(start)]
        self._state = None

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        # After backward, before the merge: gradients (AdamW) and filled sketches (LoGRA) exist now, so this is
        # when the state is counted (the dense baseline frees its gradients right after the step).
        self.peaks_within_update.append(self._peak(pl_module))
        self._state = self.state(pl_module)

    def _peak(self, pl_module: pl.LightningModule) -> float:
        """The peak so far in this update: never below an earlier reading (the kernel's mark is kept lazily)."""
        if self._cuda:
            now = float(torch.cuda.max_memory_allocated(pl_module.device))
        else:
            now = float(peak_rss_bytes() if self._resettable else peak_rss_lifetime_bytes())
        return max([now, *self.peaks_within_update])

    def sample(self, pl_module: pl.LightningModule) -> dict[str, float]:
        """The memory numbers right now (peaks since the update started)."""
        out: dict[str, float] = {}
        if self._cuda:
            torch.cuda.synchronize(pl_module.device)
            out["memory/cuda_peak_allocated_bytes"] = float(torch.cuda.max_memory_allocated(pl_module.device))
            out["memory/cuda_peak_reserved_bytes"] = float(torch.cuda.max_memory_reserved(pl_module.device))
        out["memory/rss_bytes"] = float(rss_bytes())
        peak = peak_rss_bytes() if self._resettable else peak_rss_lifetime_bytes()
        earlier = [] if self._cuda else self.peaks_within_update  # on CUDA these track allocated bytes
        out["memory/peak_rss_bytes"] = float(max(peak, out["memory/rss_bytes"], *earlier))
        out["memory/rss_at_start_bytes"] = float(self._start_rss)
        out["memory/peak_rss_is_lifetime"] = 0.0 if self._resettable else 1.0
        return out

    def state(self, pl_module: Any) -> MemoryReport:
        """Training state by kind from the module's policy, optimizer and sketcher (and its reference policy, when
        the module counts one: ``state_memory``)."""
        state_memory = getattr(pl_module, "state_memory", None)
        if callable(state_memory):
            return state_memory()
        if view_of(pl_module, self.READS) is not None:
            return pl_module.method.memory(pl_module.policy)
        return memory_report(pl_module, optimizer=_optimizer(pl_module))  # any module: its parameters and optimizer

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        metrics = self.sample(pl_module)
        self.peaks_within_update.append(self._peak(pl_module))
        report = self._state if self._state is not None else self.state(pl_module)
        for kind in STATE_KINDS:
            metrics[f"memory/state/{kind}"] = float(getattr(report, kind))
        metrics["memory/state_bytes"] = float(report.total)
        self.last = metrics
        self.history.append({"update": float(trainer.global_step), **metrics})
        view = view_of(pl_module, self.READS)
        ctx = view.step_context if view is not None else None
        bs = len(ctx.rollout) if ctx is not None else 1
        for key, value in metrics.items():
            pl_module.log(key, value, on_step=True, on_epoch=False, batch_size=bs)
        if ctx is not None:
            ctx.metrics.update(metrics)
        if self.image_every and trainer.global_step % self.image_every == 0 and trainer.is_global_zero:
            self._add_image(trainer)

    def figure(self) -> Any:
        """A matplotlib figure: one stacked bar of state by kind (MiB) per recorded update."""
        # A bare Figure, not pyplot: no backend switch, no global figure registry, so a notebook that runs this
        # callback keeps its inline plots (matplotlib.use("Agg") here turned them off for the rest of the session).
        from matplotlib.figure import Figure

        rows = self.history[-self.max_image_bars :]
        fig = Figure(figsize=(max(4.0, 0.4 * len(rows) + 2), 3.5))
        ax = fig.subplots()
        bottom = [0.0] * len(rows)
        x = [str(int(r["update"])) for r in rows]
        for kind in STATE_KINDS:
            values = [r[f"memory/state/{kind}"] / 2**20 for r in rows]
            if any(values):
                ax.bar(x, values, bottom=bottom, label=kind.replace("_", " "))
                bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.set_xlabel("update")
        ax.set_ylabel("MiB per rank")
        ax.set_title("training state by kind")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        return fig

    def _add_image(self, trainer: pl.Trainer) -> None:
        loggers = [lg for lg in trainer.loggers if hasattr(getattr(lg, "experiment", None), "add_figure")]
        if not loggers:
            return
        fig = self.figure()
        for logger in loggers:
            logger.experiment.add_figure("memory/state_by_kind", fig, global_step=trainer.global_step)

    def png(self) -> bytes:
        """The state-by-kind figure as PNG bytes (for notebooks and reports)."""
        buf = io.BytesIO()
        self.figure().savefig(buf, format="png")
        return buf.getvalue()


def _optimizer(pl_module: Any) -> torch.optim.Optimizer | None:
    """A plain Lightning module's (first) optimizer, unwrapped from Lightning's wrapper; None before one exists."""
    trainer = getattr(pl_module, "_trainer", None)
    optimizers = trainer.optimizers if trainer is not None else []
    return optimizers[0] if optimizers else None
