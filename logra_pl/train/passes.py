"""``TrainerPasses``: the trainer's forward passes over a step's responses, and the microbatch plan they share.

Every pass — the log-probs (and entropy) before the update, the reference policy's log-probs of a KL penalty, the
backward — cuts the packed batch into microbatches of at most ``microbatch_size`` rows and, with a token budget,
rows × longest row within it. Sharded parameters are gathered once per forward on every rank (FSDP), so every rank
must run as many forwards: a rank with fewer microbatches (token budgets cut ranks' rows differently) repeats its
first row in padding microbatches at the end, whose outputs are dropped (and whose loss counts zero).
"""

from __future__ import annotations

from typing import Any

import torch

from logra_pl.runtime.ranks import Ranks
from logra_pl.train.batching import microbatches, select_rows
from logra_pl.train.logprobs import PackedResponses, response_logprobs, response_logprobs_and_entropy


class TrainerPasses:
    """The trainer's no-grad passes over packed responses, microbatched alike on every rank.

    Arguments:
        policy: the trained policy.
        microbatch_size: responses per forward pass (at most).
        max_tokens: the token budget of one pass (rows × longest row); None: ``microbatch_size`` rows.
        ranks: the training processes (their device; the agreed microbatch count).
        reference: a KL penalty's reference policy (:class:`~logra_pl.train.reference.ReferencePolicy`), or None.
        chunk_tokens: score response tokens this many at a time (:mod:`logra_pl.train.chunked_logprobs`: no
            ``(B, R, V)`` tensor); None: the whole microbatch at once.
    """

    def __init__(
        self,
        policy: torch.nn.Module,
        microbatch_size: int,
        max_tokens: int | None,
        ranks: Ranks,
        reference: Any = None,
        chunk_tokens: int | None = None,
    ) -> None:
        self.policy, self.microbatch_size, self.max_tokens = policy, microbatch_size, max_tokens
        self.ranks, self.reference, self.chunk_tokens = ranks, reference, chunk_tokens

    @property
    def trim(self) -> bool:
        """Whether microbatches drop the input columns beyond their longest row (with a token budget)."""
        return self.max_tokens is not None

    def microbatches(self, rows: list[int], packed: PackedResponses | None = None) -> tuple[list[list[int]], int]:
        """The microbatches of ``rows``, as many on every rank, and how many of them at the end are padding."""
        groups = microbatches(rows, self.microbatch_size, self.max_tokens, packed)
        padding = self.ranks.max(len(groups)) - len(groups)
        return groups + [groups[0][:1]] * padding, padding

    def _parts(self, packed: PackedResponses) -> tuple[list[PackedResponses], int]:
        """The packed batch in microbatches (every row), and how many at the end are padding."""
        groups, padding = self.microbatches(list(range(packed.input_ids.shape[0])), packed)
        return [select_rows(packed, mb, self.trim) for mb in groups], padding

    @torch.no_grad()
    def logprobs(self, packed: PackedResponses, temperature: float) -> torch.Tensor:
        """The trainer's log-probs of the packed responses (``(N, R)``, on the CPU)."""
        parts, padding = self._parts(packed)
        device = self.ranks.device
        scored = [response_logprobs(self.policy, p.to(device), temperature, self.chunk_tokens) for p in parts]
        return torch.cat(scored[: len(scored) - padding]).cpu()

    @torch.no_grad()
    def scores(self, packed: PackedResponses, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The trainer's log-probs and entropy at each response position, from one pass (on the CPU)."""
        parts, padding = self._parts(packed)
        device = self.ranks.device
        chunk = self.chunk_tokens
        scored = [response_logprobs_and_entropy(self.policy, p.to(device), temperature, chunk) for p in parts]
        scored = scored[: len(scored) - padding]
        return torch.cat([s[0] for s in scored]).cpu(), torch.cat([s[1] for s in scored]).cpu()

    def forward(self, packed: PackedResponses, temperature: float) -> torch.Tensor:
        """The policy's log-probs of one microbatch with the caller's grad mode (the backward's forward)."""
        return response_logprobs(self.policy, packed, temperature, self.chunk_tokens)

    def forward_and_entropy(self, packed: PackedResponses, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The backward's forward of a single-pass update: the log-probs with the caller's grad mode and the entropy
        (no gradient) of one microbatch, the values :meth:`scores` gives at the same weights."""
        return response_logprobs_and_entropy(self.policy, packed, temperature, self.chunk_tokens)

    def reference_logprobs(self, packed: PackedResponses, temperature: float) -> torch.Tensor:
        """The reference policy's log-probs of the packed responses (a sharded reference runs the padding
        microbatches too, as the policy does)."""
        self.reference.place(self.ranks.device)
        parts, padding = self._parts(packed)
        scored = [self.reference.logprobs(p, temperature) for p in parts]
        return torch.cat(scored[: len(scored) - padding])
