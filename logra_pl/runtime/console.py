"""Keeping the console for what matters: what a user cannot act on is not printed."""

from __future__ import annotations

import logging
import warnings


class _NoTips(logging.Filter):
    """Drops Lightning's promotional tips and its note that the module's callbacks replace the Trainer's."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        return not (text.startswith("💡 Tip") or text.startswith("The following callbacks returned in `Lightning"))


def quiet_noise() -> None:
    """Drop console noise a user cannot act on (Lightning's cloud tips, third-party deprecation warnings).

    Called when the module is imported, so notebooks get it too; idempotent.
    """
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        target = logging.getLogger(name)
        if not any(isinstance(f, _NoTips) for f in target.filters):
            target.addFilter(_NoTips())
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*is deprecated.*")
    warnings.filterwarnings("ignore", message=r".*`isinstance\(treespec, LeafSpec\)`.*")
