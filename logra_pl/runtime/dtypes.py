"""The one table of dtype names: what a setting may call a floating dtype, and the ``torch.dtype`` it means.

Each setting that takes a dtype by name accepts a subset of it (:func:`dtypes_of`): weights and exports take the
half-precision types, sketch moments only ``float32`` and ``bfloat16``, a reference policy also ``float64``.
"""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def dtypes_of(*names: str) -> dict[str, torch.dtype]:
    """The entries of :data:`DTYPES` a setting accepts, in the order given."""
    unknown = [name for name in names if name not in DTYPES]
    if unknown:
        raise KeyError(f"no dtype named {unknown}: the names are {', '.join(DTYPES)}")
    return {name: DTYPES[name] for name in names}
