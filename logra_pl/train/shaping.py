"""Batch shaping (DAPO, arXiv 2503.14476 §3.2 and §3.4): dynamic sampling of prompt groups and the soft overlong
punishment. Pure PyTorch and plain Python, no Lightning: the module passes in how to draw, score and agree.

**Dynamic sampling.** A prompt whose responses all got the same raw reward gives every one of them the same
advantage under a group baseline (zero), so it spends rollout and backward compute on no gradient, and it shrinks
the token-mean of the rest. With ``rollout.dynamic_sampling`` each update keeps only *mixed* groups (responses of a
prompt whose raw rewards are not all equal) and samples further prompts, round after round, until the update holds
as many mixed groups as it has prompts or ``rollout.max_sampling_rounds`` rounds were drawn. Uniformity is judged on
the verifier's raw reward, never on a shaped one (NeMo-RL #2431: a length penalty makes equal answers look unequal).
A batch still short after the last round is completed with uniform groups in the order they were drawn (zero
advantage under a group baseline: the update is then what it would have been without filtering, and never empty).

Rounds are global (every rank draws round ``j`` while any rank is short, one all-reduce per round), the selection is
per rank: each rank keeps its own first ``prompts_per_rank`` mixed groups, in draw order, so every rank trains the
same number of groups (equal microbatch counts, which FSDP's collectives need). A 2-rank run therefore trains other
groups than a 1-rank run of the same seed (each rank filters its own slice); either is deterministic and resumes
bit for bit.

The further prompts come from a stream of their own (:class:`RefillStream`): a seeded shuffle of the training
prompts, independent of the main loader's order, split over ranks as the main loader is, whose position (batches
drawn) is saved in checkpoints. The main stream is untouched: an epoch still means every training prompt once.

**Soft overlong punishment** (DAPO eq. 13). With ``L_max = max_new_tokens`` and a buffer ``L_buf``, a response of
``L`` tokens gets ``R_len = 0`` when ``L ≤ L_max − L_buf`` and ``(L_max − L_buf − L) / L_buf`` when ``L_max − L_buf <
L ≤ L_max`` (from 0 down to −1 at the limit), times ``overlong_penalty``, added to its reward for the advantages only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from logra_pl.errors import ConfigError
from logra_pl.rollout.base import Rollout


# ------------------------------------------------------------------------------------------- overlong punishment
def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment ``factor · R_len(L)`` per response (float64, ``≤ 0``); zeros when ``buffer``
    is 0. ``R_len`` is 0 up to ``max_new_tokens − buffer`` tokens, then falls linearly to −1 at ``max_new_tokens``
    (and stays −1 beyond, which an engine that honours the limit never produces)."""
    lengths = torch.as_tensor(lengths, dtype=torch.float64)
    if buffer <= 0:
        return torch.zeros_like(lengths)
    start = float(max_new_tokens - buffer)
    penalty = ((start - lengths) / buffer).clamp(min=-1.0, max=0.0)
    return factor * penalty


# ------------------------------------------------------------------------------------------- groups of a rollout
def group_rows(rollout: Rollout) -> list[list[int]]:
    """The rows of each prompt of ``rollout``, in prompt order (``prompt_index`` numbers prompts from 0)."""
    groups: dict[int, list[int]] = {}
    for row, prompt in enumerate(rollout.prompt_index):
        groups.setdefault(int(prompt), []).append(row)
    return [groups[p] for p in sorted(groups)]


def mixed_groups(rewards: torch.Tensor, groups: Sequence[Sequence[int]]) -> list[bool]:
    """Per group: do its responses' raw rewards differ (``max > min``)? Only responses with a reward count (a failed
    verifier call's NaN is left out, as it is of the update); a group with fewer than two of them is never mixed."""
    out = []
    for rows in groups:
        values = rewards[list(rows)]
        values = values[~torch.isnan(values)]
        out.append(bool(values.numel() > 1 and values.max() > values.min()))
    return out


def take_rows(rollout: Rollout, items: Sequence[dict[str, Any]], groups: Sequence[Sequence[int]]) -> Drawn:
    """The responses of ``groups`` (lists of rows of ``rollout``), prompts renumbered from 0 in the given order."""
    rows = [r for g in groups for r in g]
    prompt_index = [i for i, g in enumerate(groups) for _ in g]
    picked = Rollout(
        prompt_ids=[rollout.prompt_ids[r] for r in rows],
        response_ids=[rollout.response_ids[r] for r in rows],
        logprobs=[rollout.logprobs[r] for r in rows],
        finish_reasons=[rollout.finish_reasons[r] for r in rows],
        prompt_index=prompt_index,
        timings=dict(rollout.timings),
        response_masks=None if rollout.response_masks is None else [rollout.response_masks[r] for r in rows],
    )
    return Drawn([items[rollout.prompt_index[g[0]]] for g in groups], picked, torch.empty(0, dtype=torch.float64))


@dataclass
class Drawn:
    """One round's prompts (``items``), their responses, the responses' raw rewards (``(N,)`` float64, NaN for a
    response the verifier failed on) and the verifier's correctness (``(N,)`` bool; None: not recorded)."""

    items: list[dict[str, Any]]
    rollout: Rollout
    rewards: torch.Tensor
    correct: torch.Tensor | None = None


def concat(parts: Sequence[Drawn]) -> Drawn:
    """Several rounds' responses as one, prompts renumbered in order; timings summed."""
    items, rewards, correct = [], [], []
    rollout = Rollout([], [], [], [], [], {})
    masked = any(part.rollout.response_masks is not None for part in parts)
    rollout.response_masks = [] if masked else None
    for part in parts:
        offset = len(items)
        items += part.items
        rewards.append(part.rewards)
        correct.append(part.correct)
        r = part.rollout
        rollout.prompt_ids += r.prompt_ids
        rollout.response_ids += r.response_ids
        rollout.logprobs += r.logprobs
        rollout.finish_reasons += r.finish_reasons
        rollout.prompt_index += [offset + i for i in r.prompt_index]
        if rollout.response_masks is not None:
            rollout.response_masks += [r.sampled_mask(k) for k in range(len(r))]
        for name, seconds in r.timings.items():
            rollout.timings[name] = rollout.timings.get(name, 0.0) + seconds
    joined = torch.cat(rewards) if rewards else torch.empty(0, dtype=torch.float64)
    verdicts = torch.cat(correct) if correct and all(c is not None for c in correct) else None
    return Drawn(items, rollout, joined, verdicts)


# ---------------------------------------------------------------------------------------------- the selection
@dataclass
class DynamicBatch:
    """What :func:`dynamic_batch` assembled: the groups to train on, and counts for the logs.

    Arguments:
        batch: the selected groups' prompts, responses and raw rewards (``items[i]`` is prompt ``i``).
        rounds: sampling rounds drawn (1 = the loader's batch alone).
        groups_sampled: prompt groups sampled over all rounds.
        groups_mixed: of those, the mixed ones.
        filled_uniform: uniform groups the batch was completed with after the last round.
        sampled_rewards: every round's raw rewards (all sampled responses, trained or not).
    """

    batch: Drawn
    rounds: int
    groups_sampled: int
    groups_mixed: int
    filled_uniform: int
    sampled_rewards: list[torch.Tensor] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        """``shaping/*`` scalars of this rank (the share of uniform groups among those sampled, rounds drawn…)."""
        uniform = self.groups_sampled - self.groups_mixed
        sampled = torch.cat(self.sampled_rewards) if self.sampled_rewards else torch.zeros(1, dtype=torch.float64)
        sampled = sampled[~torch.isnan(sampled)]  # responses without a reward left out
        return {
            "shaping/rounds": float(self.rounds),
            "shaping/groups_sampled": float(self.groups_sampled),
            "shaping/groups_mixed": float(self.groups_mixed),
            "shaping/groups_uniform": float(uniform),
            "shaping/uniform_rate": uniform / max(self.groups_sampled, 1),
            "shaping/filled_uniform": float(self.filled_uniform),
            "shaping/sampled_reward_mean": float(sampled.mean()),
        }


def dynamic_batch(
    first: Drawn,
    draw: Callable[[int], Drawn],
    target_groups: int,
    max_rounds: int,
    any_short: Callable[[bool], bool] = bool,
) -> DynamicBatch:
    """Keep the mixed groups of ``first`` and of further rounds ``draw(1)``, ``draw(2)``… until ``target_groups``
    mixed groups are held on every rank (``any_short``: the OR over ranks of "this rank is short") or ``max_rounds``
    rounds were drawn; then the first ``target_groups`` mixed groups in draw order, completed (if short) with the
    uniform groups in draw order. Uniformity is judged on each round's raw rewards."""
    rounds = [first]
    mixed: list[tuple[int, list[int]]] = []  # (round, rows) of each mixed group, in draw order
    uniform: list[tuple[int, list[int]]] = []
    sampled = 0

    def sort(part: Drawn, index: int) -> None:
        nonlocal sampled
        groups = group_rows(part.rollout)
        sampled += len(groups)
        for rows, is_mixed in zip(groups, mixed_groups(part.rewards, groups), strict=True):
            (mixed if is_mixed else uniform).append((index, rows))

    sort(first, 0)
    while len(rounds) < max_rounds and any_short(len(mixed) < target_groups):
        rounds.append(draw(len(rounds)))
        sort(rounds[-1], len(rounds) - 1)
    chosen = mixed[:target_groups]
    filled = uniform[: max(target_groups - len(chosen), 0)]
    parts = []
    for index, rows in (*chosen, *filled):
        part = take_rows(rounds[index].rollout, rounds[index].items, [rows])
        part.rewards = rounds[index].rewards[rows]
        if rounds[index].correct is not None:
            part.correct = rounds[index].correct[rows]
        parts.append(part)
    return DynamicBatch(concat(parts), len(rounds), sampled, len(mixed), len(filled), [r.rewards for r in rounds])


# ---------------------------------------------------------------------------------------- the refill prompts
class RefillStream:
    """Where dynamic sampling's further prompts come from: a seeded shuffle of the training prompts of its own.

    Batch ``c`` of the stream (``c`` counts every refill batch the run drew, over all updates) is batch ``c mod B``
    of epoch ``c // B`` of a :class:`~logra_pl.data.loaders.PromptSampler` with its own seed (``B``: batches per
    epoch), so each rank takes every ``world``-th prompt of a global batch as the main loader does. The position is
    saved in checkpoints (:meth:`state_dict`): a resumed run draws the batches the interrupted one would have.

    Arguments:
        dataset: the training items (the main loader's dataset).
        world_size: data-parallel ranks.
        rank: this rank.
        prompts_per_rank: prompts per refill batch on this rank (the main loader's batch size).
        seed: the main loader's seed; the stream's own seed is derived from it.
    """

    def __init__(self, dataset: Sequence[dict[str, Any]], world_size: int, rank: int, prompts_per_rank: int, seed: int):
        from logra_pl.data.loaders import PromptSampler

        digest = hashlib.blake2b(f"{seed}/refill".encode(), digest_size=4).digest()
        self.seed = int.from_bytes(digest, "little")
        self.dataset = dataset
        self.sampler = PromptSampler(dataset, world_size, rank, self.seed, prompts_per_rank)
        self.batches = len(self.sampler) // prompts_per_rank
        self.position = 0

    def next_items(self) -> list[dict[str, Any]]:
        """This rank's prompts of the next refill batch (the position advances)."""
        epoch, batch = divmod(self.position, self.batches)
        self.position += 1
        return [self.dataset[i] for i in self.sampler.batch_indices(epoch, batch)]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


def refill_stream(trainer: Any) -> RefillStream:
    """Dynamic sampling's stream of further prompts over the training loader's dataset (its batch size per rank)."""
    loader = trainer.train_dataloader
    dataset, per_rank = getattr(loader, "dataset", None), getattr(loader, "batch_size", None)
    if dataset is None or not per_rank or not hasattr(dataset, "__getitem__"):
        raise ConfigError(
            "rollout.dynamic_sampling samples further prompts from the training loader's dataset, but this loader "
            "has no indexable dataset with a batch size (use the project's data modules, whose loaders do, or turn "
            "dynamic_sampling off)"
        )
    sampler = getattr(loader, "sampler", None)
    return RefillStream(dataset, trainer.world_size, trainer.global_rank, per_rank, getattr(sampler, "seed", 0))
