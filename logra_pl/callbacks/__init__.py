"""Lightning callbacks, each usable alone in any Trainer or YAML config."""

from logra_pl.callbacks.summary import RunSummary

__all__ = ["RunSummary"]
