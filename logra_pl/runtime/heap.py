"""The C library's memory calls the trainer makes: the heap's free pages handed back to the operating system before
every optimizer step (glibc ``malloc_trim``), and large float64 scratch blocks backed by huge pages (``madvise``).

Why: a CPU training process's resident set keeps the memory its rollout and backward freed. glibc serves
allocations below its mmap threshold (128 KiB, raised up to 32 MiB by the process's own frees) from its heap and
keeps what is freed there for reuse; only a free run at the heap's top goes back on its own. Activations,
log-prob buffers and the engine's caches leave tens of MiB of such free but resident pages behind every update,
and the optimizer step's temporaries then come on top of them. ``malloc_trim(0)`` returns every whole free page of
every arena (``madvise(MADV_DONTNEED)``), so the step's temporaries fault in fresh pages where the freed ones were:
the process's peak RSS is what it holds plus what the step needs, not plus the heap's history.

The module calls :func:`release_free_heap` once per update, after the backward pass and before the update method's step,
for every method alike (dense AdamW, LoRA, LoGRA), so memory comparisons between them stay fair. Measured with
``benchmarks/compare.py --model-size medium`` (docs/benchmarks.md, "Memory and speed on a CPU"). Nothing numerical
depends on it: pages hold no values the program reads again. Where the C library has no ``malloc_trim`` (macOS, musl) it
does nothing. On a GPU the device memory is PyTorch's caching allocator's; this only trims the host's heap.

:func:`advise_huge_pages` asks the kernel to back a large CPU buffer with 2 MiB pages (transparent huge pages,
``madvise(MADV_HUGEPAGE)``; Linux's default THP mode, ``madvise``, gives them only to regions that ask). The sketch
step's float64 scratch blocks (:func:`~logra_pl.sketch.merge.float64_scratch`) are mapped fresh for every formula and
every update, so that they never stay resident between updates; with 4 KiB pages each block's first touch costs a
page fault per 4 KiB (68,000 per ``propose()`` + ``apply()`` on ``tiny:medium``), with 2 MiB pages one per 2 MiB.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable

import torch

HUGE_PAGE_BYTES = 2 * 2**20  # the x86-64 and arm64 (4 KiB base pages) transparent huge page
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library the process already has loaded (its own symbols), on Linux; else ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """``int madvise(void *addr, size_t length, int advice)``, or ``None`` where there is none."""
    libc = _libc()
    advise = getattr(libc, "madvise", None) if libc is not None else None
    if advise is None:
        return None
    advise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advise.restype = ctypes.c_int
    return advise


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``int malloc_trim(size_t pad)``, or ``None`` where the process's C library has none."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None  # glibc only
    if trim is None:
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


def advise_huge_pages(buffer: torch.Tensor) -> bool:
    """Ask for 2 MiB pages behind the whole huge pages inside ``buffer``'s bytes (a CPU tensor); ``True`` if asked.

    Only pages lying entirely within the buffer are advised, so no page outside it becomes resident, and a buffer
    smaller than two huge pages is left alone. The advice changes how pages are backed, never their values, and the
    kernel falls back to 4 KiB pages when it has no free huge page. ``False`` where there is no ``madvise`` (not
    Linux) or the kernel refused (THP disabled: ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``never``).
    """
    advise = _madvise()
    nbytes = buffer.numel() * buffer.element_size()
    if advise is None or buffer.device.type != "cpu" or nbytes < 2 * HUGE_PAGE_BYTES:
        return False
    start = -(-buffer.data_ptr() // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    stop = (buffer.data_ptr() + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    return stop > start and advise(start, stop - start, MADV_HUGEPAGE) == 0
