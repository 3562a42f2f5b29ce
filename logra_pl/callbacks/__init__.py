"""Lightning callbacks, each usable alone in any Trainer or YAML config, in any order."""

from logra_pl.callbacks.checkpoint import AtomicCheckpointIO, UpdateCheckpoint
from logra_pl.callbacks.diagnostics import SketchDiagnostics
from logra_pl.callbacks.export import HFExport
from logra_pl.callbacks.heldout_kl import HeldOutKL
from logra_pl.callbacks.kl_control import BudgetSchedule, PredictedKLControl, step_multiplier
from logra_pl.callbacks.memory import MemoryMonitor
from logra_pl.callbacks.mismatch import RolloutMismatch, observed_mismatch
from logra_pl.callbacks.next_batch_gain import NextBatchGain
from logra_pl.callbacks.rollouts import RolloutLog, read_rollouts
from logra_pl.callbacks.summary import RunSummary
from logra_pl.callbacks.sync import PolicySync

__all__ = [
    "AtomicCheckpointIO",
    "BudgetSchedule",
    "HFExport",
    "HeldOutKL",
    "MemoryMonitor",
    "NextBatchGain",
    "PolicySync",
    "PredictedKLControl",
    "RolloutLog",
    "RolloutMismatch",
    "RunSummary",
    "SketchDiagnostics",
    "UpdateCheckpoint",
    "observed_mismatch",
    "read_rollouts",
    "step_multiplier",
]
