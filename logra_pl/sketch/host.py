"""Reading per-matrix device scalars on the host in one transfer.

``float(t)``, ``bool(t)`` or ``t.item()`` on a CUDA tensor waits until the device has run everything queued
before it (a stream synchronisation). Done once per matrix, that serialises host and device hundreds of times
per update, and the update becomes bound by launch latency instead of GPU work. The decisions that need Python
values (the non-finite guard, the step scale, the divergence guard) therefore compute their per-matrix scalars
as tensors and read them back together, with :func:`host_values`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def host_values(*groups: Sequence[torch.Tensor]) -> list[list[float]]:
    """The elements of every tensor of every group as Python floats, in one device→host copy (one sync in all).

    Each tensor contributes its elements in order (a 0-dim tensor one value, a group's ``(k,)`` stack of
    per-matrix values ``k``). The values are concatenated (dtypes promote: bool < float32 < float64, all
    exactly) and read as float64, so each equals ``float(t)`` of its element: float32 and float64 values are
    unchanged, booleans become ``1.0``/``0.0``. Returns one flat list per group, in order; empty groups are
    allowed. Tensors on another device than the first are moved to it.
    """
    flat = [t if t.dim() == 1 else t.reshape(-1) for group in groups for t in group]
    if not flat:
        return [[] for _ in groups]
    device = flat[0].device
    values = torch.cat([t if t.device == device else t.to(device) for t in flat]).to(torch.float64).tolist()
    out: list[list[float]] = []
    start = 0
    for group in groups:
        size = sum(t.numel() for t in group)
        out.append(values[start : start + size])
        start += size
    return out
