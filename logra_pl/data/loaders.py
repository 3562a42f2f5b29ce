"""The loaders every prompt data module shares: one seeded, rank-split, resumable training stream and the eval loader.

One global order of the training prompts per epoch, whatever the number of ranks (rank ``r`` takes every
``world``-th prompt, ``prompts_per_step`` is global), so a 2-rank run trains on exactly the prompts of a 1-rank
run; a resumed run continues the same stream (:class:`PromptSampler` skips the batches of the epoch the checkpoint
already trained on), and the loader's state refuses a resume on other prompts (:class:`PromptLoader`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler

from logra_pl.data.schema import prompt_key
from logra_pl.errors import ConfigError, ResumeMismatchError, check_range

# The item key that tags an evaluation problem with its subset, and the subsets' names (``val/<subset>/pass@1``).
EVAL_SUBSET_KEY = "eval_subset"
EVAL_SUBSETS = ("tune", "report")


def listify(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return items


class PromptSampler(DistributedSampler):
    """A seeded shuffle shared by all ranks (rank ``r`` takes every ``world``-th prompt) that can resume mid-epoch.

    One global order per epoch, whatever the number of ranks: a 2-rank run trains on exactly the prompts of a
    1-rank run. ``batches_done()`` is read when an epoch's iteration starts: a resumed run skips the batches
    of the epoch it already trained on, so resuming from a checkpoint continues the same prompt stream.
    """

    def __init__(
        self,
        dataset: Any,
        num_replicas: int,
        rank: int,
        seed: int,
        batch_size: int,
        batches_done: Callable[[], int] | None = None,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.batch_size = batch_size
        self.batches_done = batches_done

    def __iter__(self):  # type: ignore[override]
        indices = list(super().__iter__())
        skip = int(self.batches_done()) * self.batch_size if self.batches_done is not None else 0
        return iter(indices[skip:])

    def batch_indices(self, epoch: int, batch: int) -> list[int]:
        """This rank's dataset indices of batch ``batch`` (0-based within the epoch) of epoch ``epoch``, whatever
        the sampler's current epoch and resume skip: the order is a function of (seed, epoch) alone, so a pipeline
        that samples batches ahead (asynchronous rollouts) can name a future batch's prompts without the loader."""
        if not 0 <= batch < len(self) // self.batch_size:
            raise IndexError(f"batch {batch} of an epoch of {len(self) // self.batch_size} batches")
        current, self.epoch = self.epoch, epoch
        try:
            indices = list(super().__iter__())
        finally:
            self.epoch = current
        return indices[batch * self.batch_size : (batch + 1) * self.batch_size]


class PromptLoader(DataLoader):
    """The training ``DataLoader``, resumable mid-epoch (it implements Lightning's ``state_dict`` interface).

    The position in the prompt stream is the number of batches the trainer completed in the current epoch, which
    Lightning restores with the loop state and :class:`PromptSampler` reads when an epoch's iteration starts. The
    loader's own state records that position with the data's identity (seed, prompt count, a digest of the
    prompts), so a checkpoint resumed on different prompts is refused instead of silently continuing elsewhere.
    """

    def __init__(self, *args: Any, position: Callable[[], int] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.position = position

    def batch_at(self, epoch: int, batch: int) -> list[dict[str, Any]]:
        """The items of batch ``batch`` of epoch ``epoch`` on this rank, as the loader will yield them."""
        return self.collate_fn([self.dataset[i] for i in self.sampler.batch_indices(epoch, batch)])

    def identity(self) -> dict[str, Any]:
        """What the saved position refers to: the sampler's seed and the training prompts."""
        digest = hashlib.blake2b(digest_size=8)
        for item in self.dataset:
            digest.update(prompt_key(item).encode())
        return {"seed": self.sampler.seed, "num_prompts": len(self.dataset), "digest": digest.hexdigest()}

    def state_dict(self) -> dict[str, Any]:
        """Position (batches done in this epoch) and the data identity."""
        return {"batches_done": int(self.position()) if self.position else 0, **self.identity()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Check that the checkpoint's prompts are these prompts (the trainer's loop state restores the position)."""
        saved = {k: state_dict.get(k) for k in ("seed", "num_prompts", "digest")}
        mine = self.identity()
        if saved != mine:
            diff = ", ".join(f"{k}: checkpoint {saved[k]!r} vs now {mine[k]!r}" for k in mine if saved[k] != mine[k])
            raise ResumeMismatchError(
                f"the training prompts differ from the checkpoint's ({diff}): the saved position in the prompt stream "
                "would point elsewhere. Resume with the checkpoint's data settings (tasks, train_size, eval_size, "
                "seed), or start a fresh run without ckpt_path"
            )


def prompt_loader(
    items: list[dict[str, Any]],
    prompts_per_step: int,
    seed: int,
    *,
    world_size: int = 1,
    rank: int = 0,
    num_workers: int = 0,
    batches_done: Callable[[], int] | None = None,
    position: Callable[[], int] | None = None,
) -> PromptLoader:
    """The training loader every prompt data module shares: one seeded global order, rank ``r`` takes every
    ``world_size``-th prompt, ``prompts_per_step`` prompts per update over all ranks, resumable mid-epoch.

    Arguments:
        items: the training items.
        prompts_per_step: prompts per update over all ranks (divisible by ``world_size``).
        seed: the shuffle's seed.
        world_size: data-parallel ranks.
        rank: this rank.
        num_workers: DataLoader workers.
        batches_done: batches of the current epoch already trained on (read when an epoch starts; resume).
        position: batches trained so far, saved in the loader's state.
    """
    if prompts_per_step % world_size:
        raise ConfigError(
            f"data.prompts_per_step={prompts_per_step} is not divisible by the {world_size} data-parallel ranks: "
            "make it a multiple of the number of devices"
        )
    per_rank = prompts_per_step // world_size
    sampler = PromptSampler(items, world_size, rank, seed, per_rank, batches_done=batches_done)
    return PromptLoader(
        items,
        batch_size=per_rank,
        sampler=sampler,
        drop_last=True,
        collate_fn=listify,
        num_workers=num_workers,
        position=position,
    )


def trainer_positions(trainer: Any) -> dict[str, Callable[[], int] | None]:
    """``prompt_loader``'s ``batches_done`` / ``position`` read from a Lightning trainer's loop (None without one).

    ``batches_done``: batches of this epoch already trained on (non-zero only when a resumed run starts mid-epoch);
    ``position``: at a checkpoint (saved in on_train_batch_end), the batches processed including the one in flight.
    """
    if trainer is None:
        return {"batches_done": None, "position": None}
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return {"batches_done": lambda: progress.current.completed, "position": lambda: progress.current.processed}


def eval_loader(items: list[dict[str, Any]], batch_size: int, num_workers: int = 0) -> DataLoader:
    """All evaluation items, in order; an empty eval set is a clear error."""
    if not items:
        raise ConfigError("eval_size is 0: there is nothing to validate on; set eval_size or limit_val_batches=0")
    return DataLoader(items, batch_size=batch_size, shuffle=False, collate_fn=listify, num_workers=num_workers)


def check_tune_fraction(name: str, value: Any) -> None:
    """``value`` is a valid ``eval_tune_fraction``: a number in ``[0, 1)`` (0: no tuning/report split)."""
    check_range(name, value, 0.0, 1.0, high_open=True, hint="the share of evaluation problems in the tuning subset")


def tag_eval_subsets(items: list[dict[str, Any]], tune_fraction: float) -> None:
    """Tag every evaluation item with the subset it belongs to, ``"tune"`` or ``"report"`` (``item["eval_subset"]``).

    Why: a protocol that tunes each method's step size on the evaluation problems must report on other problems,
    or the chosen setting's score is biased upwards. The split is fixed (the same problems in every run, whatever
    the seed or the method) and spread evenly through the evaluation order, so a mixture's tasks are shared about
    equally: item ``i`` (0-based, in evaluation order) is a tuning problem exactly when
    ``floor((i + 1)·f) > floor(i·f)``, computed in exact fractions. ``f = 0.5`` makes every second problem (the
    2nd, 4th, ...) a tuning problem; ``floor(n·f)`` of ``n`` items are. ``f = 0`` tags nothing (no split; items are
    left as they are), so validation logs what it always did.

    Arguments:
        items: the evaluation items, in evaluation order (tagged in place).
        tune_fraction: the share of tuning problems, in ``[0, 1)``.
    """
    check_tune_fraction("eval_tune_fraction", tune_fraction)
    if not tune_fraction:
        return
    f = Fraction(str(tune_fraction))
    for i, item in enumerate(items):
        tune = int((i + 1) * f) > int(i * f)  # int() floors a non-negative Fraction
        item[EVAL_SUBSET_KEY] = EVAL_SUBSETS[0] if tune else EVAL_SUBSETS[1]
