"""Which weights sample which batch in asynchronous RL, and how much the policy has moved since: the rules alone.

In asynchronous mode the engines generate the prompts of updates ``t+1 … t+k`` while update ``t`` trains. To keep
a run reproducible bit for bit (and resumable after a kill), which weights sample a batch is a fixed function of
the batch's index, not of timing:

- batch ``b`` (the prompts of update ``b``) is sampled by the weights of version ``max(e, b − k)``, where ``e`` is
  the first update of the batch's epoch and version ``v`` is the policy before update ``v`` (version 0: the start).
  So a response is at most ``k`` updates stale, and exactly ``min(b − e, k)``;
- at an epoch's first update the engines receive batches ``e … e+k`` at once (all sampled by version ``e``); after
  update ``t`` merges, batch ``t+k+1`` is requested (sampled by version ``t+1``). No request crosses an epoch's end,
  so the loader's position is the updates done plus the batches requested, within one epoch;
- the stale KL of batch ``b`` used at update ``t`` is ``Σ_{u=v}^{t−1} κ_u`` over the updates merged since its
  version ``v``, with ``κ_u`` the KL of update ``u`` (``α²·predicted``, or the realized KL when calibrated; 0 for a
  skipped update). A batch whose stale KL exceeds ``max_stale_kl`` is dropped and sampled again by the current
  weights. Summing is exact for independent step directions; for aligned ones the KL of the combined change is up
  to ``(Σ √κ_u)²``, which :meth:`StaleKL.aligned_bound` gives for comparison.

``max_staleness: 0`` gives ``version(b) = b``: the synchronous schedule. Plain state, no threads or I/O; the
pipeline that issues the requests and the checkpoint that stores the ledger build on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from logra_pl.errors import check_int, check_range


@dataclass(frozen=True)
class StalenessSchedule:
    """Which version samples each batch, and which batches to request when.

    Arguments:
        max_staleness: ``k``, the most updates a response's weights may lag the trainer's (0: synchronous).
    """

    max_staleness: int = 0

    def __post_init__(self) -> None:
        check_int("max_staleness", self.max_staleness, 0)

    def version_of(self, batch: int, epoch_start: int) -> int:
        """The weights version that samples ``batch``: ``max(epoch_start, batch − k)``."""
        if batch < epoch_start:
            raise ValueError(f"batch {batch} precedes its epoch's first update {epoch_start}")
        return max(epoch_start, batch - self.max_staleness)

    def staleness(self, batch: int, epoch_start: int) -> int:
        """Updates between the batch's sampling weights and the weights it trains: ``min(batch − e, k)``."""
        return batch - self.version_of(batch, epoch_start)

    def prefill(self, start: int, epoch_end: int) -> range:
        """The batches requested when the pipeline starts at batch ``start`` (an epoch's first batch, or a restart
        after a repair), all sampled by version ``start`` (``epoch_end``: one past the epoch's last batch)."""
        return range(start, min(start + self.max_staleness + 1, epoch_end))

    def request_after(self, update: int, epoch_end: int) -> int | None:
        """The batch requested once ``update`` has merged (None past the epoch's end)."""
        nxt = update + self.max_staleness + 1
        return nxt if nxt < epoch_end else None


@dataclass
class StaleKL:
    """The KL of each recent update, to price a stale batch: ``Σ κ_u`` over the updates since its version.

    Arguments:
        max_stale_kl: ``δ``; a batch whose stale KL exceeds it is dropped (None: no KL bound).
        window: updates kept (``k`` suffices: no batch is older); older entries are forgotten.
    """

    max_stale_kl: float | None = None
    window: int = 1
    kl: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_stale_kl is not None:
            check_range("max_stale_kl", self.max_stale_kl, 0.0, low_open=True, hint="nats per token, or null for none")
        if self.window < 1:
            raise ValueError(f"window={self.window}: keep at least one update")

    def record(self, update: int, kl: float) -> None:
        """The KL update ``update`` made (``α²·predicted`` or realized; 0 when it was skipped)."""
        if math.isnan(kl) or kl < 0:  # inf: not priced (every batch spanning it is dropped under a KL bound)
            raise ValueError(f"update {update}: KL {kl!r} is not a number >= 0")
        if self.kl and update <= max(self.kl):
            raise ValueError(f"update {update} recorded after update {max(self.kl)}: updates come in order")
        self.kl[update] = float(kl)
        for old in [u for u in self.kl if u <= update - self.window]:
            del self.kl[old]

    def since(self, version: int, now: int) -> float:
        """``Σ_{u=version}^{now−1} κ_u``: what the policy moved from ``version``'s weights to ``now``'s."""
        missing = [u for u in range(version, now) if u not in self.kl]
        if missing:
            raise KeyError(f"no KL recorded for updates {missing} (window {self.window}, kept {sorted(self.kl)})")
        return math.fsum(self.kl[u] for u in range(version, now))

    def aligned_bound(self, version: int, now: int) -> float:
        """``(Σ √κ_u)²``: the combined KL if every update since ``version`` pointed the same way."""
        return math.fsum(math.sqrt(self.kl[u]) for u in range(version, now)) ** 2

    def keeps(self, version: int, now: int) -> bool:
        """Whether a batch sampled by ``version`` may train update ``now`` (always, without a KL bound)."""
        return self.max_stale_kl is None or version == now or self.since(version, now) <= self.max_stale_kl

    def state_dict(self) -> dict[str, Any]:
        """The ledger for a checkpoint (update indices as strings: the file's keys)."""
        return {"kl": {str(u): v for u, v in self.kl.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.kl = {int(u): float(v) for u, v in state["kl"].items()}
