"""Pure functions that turn one rollout into the trainer's batches: prompt encoding, row selection, microbatch plans.

No Lightning and no model: each is tested on its own (``tests/test_batching.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from logra_pl.train.logprobs import PackedResponses


def encode_prompts(tokenizer: Any, items: Sequence[dict[str, Any]]) -> list[list[int]]:
    """Chat-template each item's ``messages`` and tokenize (no extra special tokens)."""
    texts = [tokenizer.apply_chat_template(it["messages"], add_generation_prompt=True, tokenize=False) for it in items]
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]


def microbatches(
    rows: list[int], size: int, budget: int | None = None, packed: PackedResponses | None = None
) -> list[list[int]]:
    """Consecutive groups of ``rows``: ``size`` each, or — with a token ``budget`` and the ``packed`` batch — while
    rows × longest row (padding included) fits the budget, at most ``size`` rows."""
    if budget is None or packed is None:
        return [rows[i : i + size] for i in range(0, len(rows), size)]
    lengths = packed.attention_mask.sum(dim=1).tolist()
    out: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for row in rows:
        width = max(longest, int(lengths[row]))
        if current and ((len(current) + 1) * width > budget or len(current) >= size):
            out.append(current)
            current, width = [], int(lengths[row])
        current.append(row)
        longest = width
    if current:
        out.append(current)
    return out


def select_rows(packed: PackedResponses, rows: list[int], trim: bool = False) -> PackedResponses:
    """Rows of a packed batch. Columns are kept (all-padding tail columns are harmless), or with ``trim`` the
    input columns beyond the longest selected row are dropped (rows are right-padded; response columns stay)."""
    idx = torch.tensor(rows, dtype=torch.long)
    out = PackedResponses(*(getattr(packed, f)[idx] for f in packed.__dataclass_fields__))
    if trim:
        width = max(int(out.attention_mask.sum(dim=1).max()), 1)
        out = dataclasses.replace(
            out,
            input_ids=out.input_ids[:, :width],
            attention_mask=out.attention_mask[:, :width],
            position_ids=out.position_ids[:, :width],
        )
    return out


def padded_logprobs(logprobs: Sequence[Sequence[float]], like: torch.Tensor) -> torch.Tensor:
    """Per-response log-prob lists as a zero-padded ``like``-shaped tensor of ``like``'s dtype (row ``b`` holds
    response ``b``'s log-probs from column 0)."""
    out = torch.zeros_like(like)
    for b, lp in enumerate(logprobs):
        out[b, : len(lp)] = torch.tensor(lp, dtype=like.dtype)
    return out
