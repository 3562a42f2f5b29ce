"""glibc's mmap threshold pinned by the CLI: freed temporaries go back to the OS whatever was freed before."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from logra_pl.allocator import ENV, pin_mmap_threshold

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="the threshold is glibc's"
)

# In a fresh process: free one 24 MiB block (glibc then raises its dynamic threshold to 24 MiB), allocate and touch
# 24 blocks of 4 MiB, keep the last, free the rest, and report how much of their 92 MiB left the process's RSS.
CHILD = r"""
import ctypes, json, os, sys
from logra_pl.allocator import pin_mmap_threshold
pinned = pin_mmap_threshold() if sys.argv[1] == "pin" else False
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
MiB = 1 << 20
big = libc.malloc(24 * MiB); ctypes.memset(big, 1, 24 * MiB); libc.free(big)
before = rss()
blocks = [libc.malloc(4 * MiB) for _ in range(24)]
for b in blocks:
    ctypes.memset(b, 1, 4 * MiB)
held = rss()
for b in blocks[:-1]:
    libc.free(b)
after = rss()
print(json.dumps({"pinned": pinned, "released": (held - after) / (23 * 4 * MiB), "grew": (held - before) / MiB}))
"""


def _child(mode: str, extra_env: dict[str, str] | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != ENV} | (extra_env or {})
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout)


@glibc
def test_pinned_threshold_returns_freed_blocks_that_the_dynamic_one_keeps() -> None:
    default = _child("default")
    pinned = _child("pin")
    assert default["grew"] > 90 and pinned["grew"] > 90  # the blocks were touched: RSS held them
    assert not default["pinned"] and pinned["pinned"]
    # glibc's dynamic threshold (raised to 24 MiB by the first free) put the 4 MiB blocks in the heap: kept.
    assert default["released"] < 0.5, default
    # Pinned at 1 MiB: each block was its own mapping, unmapped on free.
    assert pinned["released"] > 0.95, pinned


@glibc
def test_glibc_environment_variable_wins() -> None:
    out = _child("pin", extra_env={ENV: "4194304"})
    assert out["pinned"] is False  # the user's own setting stays
    assert out["released"] > 0.95  # and glibc honours it (4 MiB blocks at a fixed 4 MiB threshold are mapped)


def test_threshold_out_of_glibc_range_is_refused() -> None:
    with pytest.raises(ValueError, match="0 to 33554432"):
        pin_mmap_threshold(64 << 20)
