"""MemoryMonitor under a real Trainer on CPU: values present, peaks monotone within an update, image written."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import TensorBoardLogger

from logra_pl.callbacks import MemoryMonitor
from logra_pl.callbacks.memory import STATE_KINDS, peak_rss_bytes, reset_peak_rss, rss_bytes
from logra_pl.data import ReasoningGymDataModule
from logra_pl.module import LoGRAPolicyModule, RolloutSettings
from logra_pl.sketch import LoGRAConfig

SMALL = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}


def _own_rss() -> int:
    """VmRSS read by the test itself (independent of the monitor's reader)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class PeakOrder(pl.Callback):
    """Copies the monitor's within-update peaks, and reads RSS itself after backward (before the monitor does)."""

    def __init__(self, monitor: MemoryMonitor) -> None:
        self.monitor = monitor
        self.per_update: list[list[float]] = []
        self.after_backward: list[int] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.after_backward.append(_own_rss())

    # Runs before the monitor in every hook: the previous update's list is complete at the next batch start.
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.monitor.peaks_within_update:
            self.per_update.append(list(self.monitor.peaks_within_update))

    def on_train_end(self, trainer, pl_module) -> None:
        self.per_update.append(list(self.monitor.peaks_within_update))


@pytest.mark.parametrize("optimizer", ["logra", "adamw"])
def test_memory_monitor_on_cpu(tmp_path, optimizer: str) -> None:
    module = LoGRAPolicyModule(
        policy="tiny",
        optimizer=optimizer,
        logra=LoGRAConfig(rank=16, update_ratio=1e-2),
        rollout=RolloutSettings(max_new_tokens=4),
        microbatch_size=4,
    )
    monitor = MemoryMonitor(image_every=2)
    order = PeakOrder(monitor)
    logger = TensorBoardLogger(tmp_path, name="mem")
    data = ReasoningGymDataModule(
        {"chain_sum": {"config": SMALL}}, train_size=64, eval_size=8, prompts_per_step=8, eval_batch_size=8
    )
    trainer = pl.Trainer(
        max_steps=3,
        accelerator="cpu",
        devices=1,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        callbacks=[order, monitor],
    )
    trainer.fit(module, datamodule=data)
    assert len(monitor.history) == 3
    for i, (row, peaks) in enumerate(zip(monitor.history, order.per_update, strict=True)):
        assert row["memory/peak_rss_is_lifetime"] == 0.0  # Linux: the peak is reset every update
        assert row["memory/peak_rss_bytes"] >= row["memory/rss_bytes"] > 50 * 2**20
        assert row["memory/peak_rss_bytes"] >= row["memory/rss_at_start_bytes"]
        assert len(peaks) == 3 and peaks == sorted(peaks)  # start RSS <= peak before the step <= peak at the end
        # The update's peak covers what the test itself saw after backward (4 MiB: the kernel's lazy accounting).
        assert row["memory/peak_rss_bytes"] >= order.after_backward[i] - 4 * 2**20
        assert sum(row[f"memory/state/{k}"] for k in STATE_KINDS) == row["memory/state_bytes"]
        assert row["memory/state/weights"] > 0
        if optimizer == "logra":
            assert row["memory/state/sketches"] > 0 and row["memory/state/optimizer_state"] == 0
        else:  # counted before the step: gradients exist; AdamW allocates its state at the first step
            assert row["memory/state/gradients"] > 0 and row["memory/state/sketches"] == 0
            if i > 0:
                assert row["memory/state/optimizer_state"] == 2 * row["memory/state/gradients"] + 4 * 14
    logged = trainer.callback_metrics
    assert "memory/peak_rss_bytes" in logged and "memory/state/weights" in logged
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(logger.log_dir)
    events.Reload()
    assert "memory/state_by_kind" in events.Tags()["images"]  # written at update 2
    assert len(events.Scalars("memory/state_bytes")) == 3
    assert monitor.png()[:8] == b"\x89PNG\r\n\x1a\n"


def test_peak_rss_reset_tracks_a_real_allocation() -> None:
    assert reset_peak_rss()
    before = peak_rss_bytes()
    block = bytearray(200 * 2**20)  # touch 200 MiB
    block[::4096] = b"x" * len(block[::4096])
    assert peak_rss_bytes() >= before + 150 * 2**20
    del block
    assert reset_peak_rss()
    assert peak_rss_bytes() < rss_bytes() + 50 * 2**20  # the mark dropped back to about the current RSS
    with pytest.raises(ValueError, match="image_every"):
        MemoryMonitor(image_every=-1)


def test_images_leave_a_notebooks_matplotlib_backend_alone() -> None:
    """The callbacks draw on bare Figures: a notebook's backend (inline plots) survives MemoryMonitor's and
    SketchDiagnostics' images (``matplotlib.use("Agg")`` inside them used to switch it off for the session)."""
    import matplotlib

    from logra_pl.callbacks import SketchDiagnostics

    before = matplotlib.get_backend()
    matplotlib.use("svg")  # stands for the notebook's inline backend: anything but Agg
    try:
        monitor = MemoryMonitor()
        monitor.history = [{"update": 1.0, **{f"memory/state/{k}": float(2**20) for k in STATE_KINDS}}]
        diagnostics = SketchDiagnostics()
        diagnostics.last = {"logra/recon_cosine/0.q_proj": 0.5, "logra/recon_cosine/1.down_proj": 0.3}
        diagnostics.last_update = 1
        for png in (monitor.png(), diagnostics.png()):
            assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(before)
