"""``release_free_heap`` returns freed heap pages to the OS: the process's RSS drops by what was freed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from logra_pl.runtime.heap import _malloc_trim, release_free_heap

pytestmark = pytest.mark.skipif(_malloc_trim() is None, reason="the C library has no malloc_trim (not glibc)")

# In a fresh process (this one's heap holds whatever earlier tests left): 64 MiB of 64 KiB tensors, below glibc's
# mmap threshold so they come from the heap, all written; then every one freed but the last, which pins the heap's
# top so glibc cannot give the freed run back by itself.
SCRIPT = textwrap.dedent(
    """
    import torch
    from logra_pl.callbacks.memory import rss_bytes
    from logra_pl.runtime.heap import release_free_heap
    blocks = [torch.ones(16384) for _ in range(1024)]
    last = blocks.pop()
    del blocks
    held = rss_bytes()
    assert release_free_heap()
    print(held, rss_bytes(), float(last.sum()))
    """
)


def test_release_free_heap_returns_freed_pages() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout.split()
    held, after, checksum = int(out[0]), int(out[1]), float(out[2])
    assert checksum == 16384.0  # the block still held is intact
    assert held - after > 48 * 2**20, f"RSS {held / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB"


def test_release_free_heap_is_harmless_to_live_tensors() -> None:
    import torch

    kept = torch.arange(100_000, dtype=torch.float64)
    assert release_free_heap()
    assert torch.equal(kept, torch.arange(100_000, dtype=torch.float64))


def test_advise_huge_pages_keeps_values_and_skips_small_buffers() -> None:
    import torch

    from logra_pl.runtime.heap import HUGE_PAGE_BYTES, advise_huge_pages

    small = torch.arange(1000, dtype=torch.float64)
    assert not advise_huge_pages(small)  # under two huge pages: nothing to advise
    big = torch.arange(3 * HUGE_PAGE_BYTES // 8, dtype=torch.float64)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")  # [always], [madvise] or [never]
    assert advise_huge_pages(big) == (thp.is_file() and "[never]" not in thp.read_text())
    assert torch.equal(big, torch.arange(3 * HUGE_PAGE_BYTES // 8, dtype=torch.float64))  # values untouched
