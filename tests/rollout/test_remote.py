"""The parts of served rollouts that need no server: settings, request layout, rollout logs, the global probe rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from logra_pl.callbacks import read_rollouts
from logra_pl.callbacks.kl_control import _global_row
from logra_pl.data.loaders import prompt_loader
from logra_pl.errors import ConfigError
from logra_pl.rollout.remote import RemoteSettings, _nbytes, _plan_chunks, _split


def test_remote_settings_are_checked() -> None:
    assert RemoteSettings(urls="http://h:1/").urls == ["http://h:1"]
    with pytest.raises(ConfigError, match="empty"):
        RemoteSettings(urls=[])
    with pytest.raises(ConfigError, match="http"):
        RemoteSettings(urls=["h:8100"])
    with pytest.raises(ConfigError, match="retry_for_s"):
        RemoteSettings(retry_for_s=-1)


def test_prompts_split_evenly_over_engines() -> None:
    assert _split(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert _split(2, 4) == [(0, 1), (1, 2)]  # never an empty request
    assert _split(5, 1) == [(0, 5)]


def test_weight_chunks_respect_the_limit() -> None:
    tensors = {f"t{i}": torch.zeros(256) for i in range(5)}  # 1 KiB each
    sizes = {k: _nbytes(tensors, k) for k in tensors}
    assert sizes["t0"] == 1024
    assert _plan_chunks(sizes, 2048) == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    assert _plan_chunks({"big": 4096, "s": 4}, 1024) == [["big"], ["s"]]
    assert _plan_chunks({}, 1024) == []


def test_global_probe_rows_follow_the_prompt_layout() -> None:
    """``_global_row`` maps each rank's local response to its row in the 1-rank batch of the same update."""
    items = [{"messages": [{"role": "user", "content": f"q{i}"}], "answer": str(i), "id": i} for i in range(64)]
    n = 3  # responses per prompt, rows grouped by prompt
    one = next(iter(prompt_loader(items, 8, seed=5)))
    global_rows = [(it["id"], k) for it in one for k in range(n)]
    for world in (2, 4):
        for rank in range(world):
            local = next(iter(prompt_loader(items, 8, seed=5, world_size=world, rank=rank)))
            for row in range(len(local) * n):
                j, k = divmod(row, n)
                assert global_rows[_global_row(row, n, rank, world)] == (local[j]["id"], k)


def test_read_rollouts_keeps_the_last_block_of_a_repeated_update(tmp_path: Path) -> None:
    def rows(update: int, tag: str) -> str:
        rec = {"update": update, "rank": 0, "write": f"{tag}{update}", "tag": tag}
        return "".join(json.dumps(rec | {"i": i}) + "\n" for i in range(2))

    # A run logged updates 1-3, crashed, and its resume (from the checkpoint at 2) logged 3-4 again.
    (tmp_path / "rollouts.rank0.jsonl").write_text(
        rows(1, "a") + rows(2, "a") + rows(3, "a") + rows(3, "b") + rows(4, "b")
    )
    got = read_rollouts(tmp_path)
    assert [(r["update"], r["tag"]) for r in got] == [(1, "a")] * 2 + [(2, "a")] * 2 + [(3, "b")] * 2 + [(4, "b")] * 2
