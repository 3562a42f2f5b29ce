"""Keeping the console for what matters: what a user cannot act on is not printed."""

from __future__ import annotations

import logging
import warnings


def quiet_noise() -> None:
    """Drop console noise a user cannot act on (Lightning's cloud tips, third-party deprecation warnings)."""

    class _NoTips(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            text = str(record.msg)
            return not (text.startswith("💡 Tip") or text.startswith("The following callbacks returned in `Lightning"))

    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        target = logging.getLogger(name)
        if not any(isinstance(f, _NoTips) for f in target.filters):
            target.addFilter(_NoTips())
    try:  # transformers' per-file bars ("Loading weights", "Writing model shards") for 1-file tiny models
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*is deprecated.*")
    warnings.filterwarnings("ignore", message=r".*`isinstance\(treespec, LeafSpec\)`.*")
