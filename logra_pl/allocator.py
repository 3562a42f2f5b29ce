"""Pin glibc's mmap threshold, so a large temporary's memory goes back to the OS when it is freed.

glibc's ``malloc`` serves a request of at least ``M_MMAP_THRESHOLD`` bytes (128 KiB at start) with its own
``mmap``, which ``free`` unmaps at once. But the threshold is dynamic: each time such a block is freed, glibc raises
the threshold to the block's size (up to 32 MiB on 64-bit). After the first large temporary of a training step is
freed, later temporaries of up to that size come from the heap instead, where a freed block is kept for reuse and
fragmentation keeps it from being trimmed. A training step allocates and frees hundreds of MiB of such
temporaries (activations, gradients, merge chunks), so which of them landed in the heap, and how much RSS a run
holds, depends on the order of frees: measured on ``tiny:medium`` (``benchmarks/compare.py``), LoGRA's peak RSS was
933 MiB in one run and 1,228 MiB in the next, the same code and data.

Setting the threshold with ``mallopt`` turns the dynamic adjustment off, so every block of at least 1 MiB is its
own mapping for good and is returned on ``free``. The CLI does this at start (``logra-pl fit`` and ``validate``);
code that builds its own Trainer calls :func:`pin_mmap_threshold` once. glibc's own environment variable wins:
with ``MALLOC_MMAP_THRESHOLD_`` set (any value), nothing is changed. Off glibc (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h
DEFAULT_THRESHOLD = 1 << 20  # 1 MiB: below every tensor that matters for peak RSS, above Python's small objects
ENV = "MALLOC_MMAP_THRESHOLD_"

_pinned: int | None = None


def pin_mmap_threshold(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for this process; True if it was set now or before.

    Arguments:
        threshold: blocks of at least this many bytes are mapped on their own and unmapped when freed.
            glibc accepts 0 to 32 MiB.

    Returns False, changing nothing, off glibc or when ``MALLOC_MMAP_THRESHOLD_`` is in the environment (the
    user's own setting, read by glibc at process start).
    """
    global _pinned
    if not 0 <= threshold <= 32 << 20:
        raise ValueError(f"mmap threshold {threshold} bytes: glibc accepts 0 to {32 << 20} (32 MiB)")
    if _pinned == threshold:
        return True
    if ENV in os.environ or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(threshold)) != 1:
        return False
    _pinned = threshold
    return True


def pinned_threshold() -> int | None:
    """The threshold :func:`pin_mmap_threshold` set in this process, or None if it set none."""
    return _pinned
