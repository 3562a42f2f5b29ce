"""The training loader names any batch of any epoch ahead of time, equal to what it yields (asynchronous rollouts)."""

from __future__ import annotations

import pytest

from logra_pl.data.loaders import prompt_loader


def _items(n: int) -> list[dict]:
    return [{"question": f"q{i}", "answer": str(i)} for i in range(n)]


@pytest.mark.parametrize(("world", "rank"), [(1, 0), (2, 0), (2, 1)])
def test_batch_at_equals_the_yielded_batches_of_every_epoch(world: int, rank: int) -> None:
    items = _items(37)
    loader = prompt_loader(items, prompts_per_step=4, seed=5, world_size=world, rank=rank)
    per_epoch = 37 // world // (4 // world)
    assert len(loader) == per_epoch
    for epoch in (0, 1, 2):
        loader.sampler.set_epoch(epoch)
        yielded = list(loader)
        loader.sampler.set_epoch(7)  # peeking does not depend on (or change) the sampler's current epoch
        assert [loader.batch_at(epoch, b) for b in range(per_epoch)] == yielded
        assert loader.sampler.epoch == 7
    loader.sampler.set_epoch(0)
    assert loader.batch_at(1, 0) != next(iter(loader))  # epochs are shuffled apart


def test_batch_at_ignores_the_resume_skip_and_refuses_past_the_epoch() -> None:
    done = {"n": 0}
    loader = prompt_loader(_items(24), prompts_per_step=3, seed=1, batches_done=lambda: done["n"])
    full = list(loader)
    done["n"] = 5  # a run resumed after 5 batches of the epoch yields the rest, and batch_at still counts from 0
    assert list(loader) == full[5:] == [loader.batch_at(0, b) for b in range(5, 8)]
    with pytest.raises(IndexError, match="batch 8 of an epoch of 8"):
        loader.batch_at(0, 8)
