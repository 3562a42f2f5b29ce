"""Handing the C heap's free pages back to the operating system before every optimizer step (glibc ``malloc_trim``).

Why: a CPU training process's resident set keeps the memory its rollout and backward freed. glibc serves
allocations below its mmap threshold (128 KiB, raised up to 32 MiB by the process's own frees) from its heap and
keeps what is freed there for reuse; only a free run at the heap's top goes back on its own. Activations,
log-prob buffers and the engine's caches leave tens of MiB of such free but resident pages behind every update,
and the optimizer step's temporaries then come on top of them. ``malloc_trim(0)`` returns every whole free page of
every arena (``madvise(MADV_DONTNEED)``), so the step's temporaries fault in fresh pages where the freed ones were:
the process's peak RSS is what it holds plus what the step needs, not plus the heap's history.

The module calls :func:`release_free_heap` once per update, after the backward pass and before the update method's
step, for every method alike (dense AdamW, LoRA, LoGRA), so memory comparisons between them stay fair. Measured
with ``benchmarks/compare.py --model-size medium`` (README "Measure memory and speed"). Nothing numerical depends
on it: pages hold no values the program reads again. Where the C library has no ``malloc_trim`` (macOS, musl) it
does nothing. On a GPU the device memory is PyTorch's caching allocator's; this only trims the host's heap.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``int malloc_trim(size_t pad)``, or ``None`` where the process's C library has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the symbols the process already has loaded: its own libc
    except (AttributeError, OSError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_free_heap() -> bool:
    """Return the free pages of every malloc arena to the OS; ``True`` if the C library could (glibc), else ``False``.

    Costs a walk over the heap's free chunks (milliseconds for a GiB-sized process) and one ``madvise`` per free run;
    the pages it returns are faulted in again, zeroed, when next used.
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
