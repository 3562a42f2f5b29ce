"""The asynchronous schedule's rules against a simulated ordered worker, and the stale-KL ledger against sums."""

from __future__ import annotations

import math

import pytest

from logra_pl.errors import ConfigError
from logra_pl.rollout.staleness import StaleKL, StalenessSchedule


def simulate(k: int, epochs: list[int]) -> dict[int, int]:
    """An ordered worker fed as the pipeline feeds it: at an epoch's start the prefill, after each update a payload
    (the engine's version moves on) then the next request. Returns the version each batch was sampled by."""
    schedule, sampled, version, start = StalenessSchedule(k), {}, 0, 0
    for length in epochs:
        end = start + length
        queue: list[tuple[str, int]] = [("generate", b) for b in schedule.prefill(start, end)]
        for update in range(start, end):
            while update not in sampled:  # the trainer waits for its batch: the worker runs the queue in order
                kind, arg = queue.pop(0)
                if kind == "generate":
                    sampled[arg] = version
                else:
                    version = arg
            queue.append(("payload", update + 1))
            nxt = schedule.request_after(update, end)
            if nxt is not None:
                queue.append(("generate", nxt))
        for kind, arg in queue:  # what is left: payloads only (no request crosses the epoch's end)
            assert kind == "payload"
            version = arg
        start = end
    return sampled


@pytest.mark.parametrize("k", [0, 1, 2, 5])
def test_every_batch_is_sampled_by_the_version_the_rule_names(k: int) -> None:
    epochs = [7, 3, 1, 6]
    sampled = simulate(k, epochs)
    schedule, start = StalenessSchedule(k), 0
    assert sorted(sampled) == list(range(sum(epochs)))  # every batch once
    for length in epochs:
        for b in range(start, start + length):
            assert sampled[b] == schedule.version_of(b, start)
            assert 0 <= schedule.staleness(b, start) <= k
            assert schedule.staleness(b, start) == min(b - start, k)
        start += length
    if k == 0:  # synchronous: each batch by the weights it trains
        assert all(v == b for b, v in sampled.items())


def test_schedule_refuses_bad_staleness_and_batches_before_their_epoch() -> None:
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ConfigError, match="max_staleness"):
            StalenessSchedule(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="precedes"):
        StalenessSchedule(1).version_of(3, 4)
    assert list(StalenessSchedule(3).prefill(10, 12)) == [10, 11]  # a short epoch: no request past its end
    assert StalenessSchedule(3).request_after(8, 12) is None and StalenessSchedule(3).request_after(7, 12) == 11


def test_stale_kl_sums_the_updates_since_the_version_and_drops_past_the_bound() -> None:
    kls = [0.004, 0.0, 0.003, 0.006, 0.001]
    ledger = StaleKL(max_stale_kl=0.0065, window=3)
    for u, kl in enumerate(kls):
        ledger.record(u, kl)
    assert sorted(ledger.kl) == [2, 3, 4]  # the window
    assert ledger.since(2, 5) == math.fsum([0.003, 0.006, 0.001])  # correctly rounded
    assert ledger.since(4, 4) == 0.0 and ledger.keeps(4, 4)
    assert ledger.keeps(4, 5) and not ledger.keeps(3, 5) and not ledger.keeps(2, 5)  # 0.007 > 0.0065
    assert ledger.aligned_bound(3, 5) == pytest.approx((math.sqrt(0.006) + math.sqrt(0.001)) ** 2)
    assert ledger.aligned_bound(3, 5) >= ledger.since(3, 5)
    with pytest.raises(KeyError, match=r"updates \[1\]"):
        ledger.since(1, 5)  # forgotten: older than the window
    assert StaleKL(None, window=1).keeps(0, 9)  # no KL bound: staleness alone decides


def test_stale_kl_refuses_bad_values_and_round_trips() -> None:
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ConfigError, match="max_stale_kl"):
            StaleKL(bad)
    ledger = StaleKL(0.01, window=2)
    ledger.record(0, 0.002)
    with pytest.raises(ValueError, match="in order"):
        ledger.record(0, 0.001)
    with pytest.raises(ValueError, match="not a number"):
        ledger.record(1, math.nan)
    ledger.record(1, 1e-3)
    again = StaleKL(0.01, window=2)
    again.load_state_dict(ledger.state_dict())
    assert again.kl == ledger.kl and again.since(0, 2) == ledger.since(0, 2)
