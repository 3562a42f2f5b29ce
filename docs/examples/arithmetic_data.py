"""A data source: seeded in-memory addition problems, as schema items, through the shared prompt stream."""

from __future__ import annotations

import random
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from logra_pl.data import make_item
from logra_pl.data.loaders import prompt_loader, trainer_positions


class ArithmeticDataModule(pl.LightningDataModule):
    """``a + b`` problems with one-digit terms; the first ``eval_size`` distinct ones are held out.

    Arguments:
        train_size: training problems.
        eval_size: evaluation problems (never trained on).
        prompts_per_step: prompts per policy update over all ranks.
        seed: seed of the problems and of the training shuffle.
    """

    def __init__(self, train_size: int = 64, eval_size: int = 8, prompts_per_step: int = 8, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()  # kept in checkpoints: a resume on other data is refused
        self.train_size, self.eval_size = train_size, eval_size
        self.prompts_per_step, self.seed = prompts_per_step, seed
        self.train_items: list[dict[str, Any]] = []
        self.eval_items: list[dict[str, Any]] = []  # read by the module for per-task validation metrics

    def setup(self, stage: str | None = None) -> None:
        if self.train_items:
            return
        rng = random.Random(self.seed)
        pairs = list(dict.fromkeys((rng.randint(0, 9), rng.randint(0, 9)) for _ in range(10 * self.train_size)))
        items = [
            make_item(
                messages=[{"role": "user", "content": f"What is {a} + {b}?"}],
                answer=str(a + b),
                task="addition",
                id=f"addition/{a}+{b}",
                metadata={"a": a, "b": b},
            )
            for a, b in pairs
        ]
        self.eval_items = items[: self.eval_size]
        self.train_items = items[self.eval_size :][: self.train_size]
        if len(self.train_items) < self.prompts_per_step:
            raise ValueError(
                f"{len(self.train_items)} training problems (of {len(items)} distinct ones, {self.eval_size} held out) "
                f"are fewer than prompts_per_step={self.prompts_per_step}: lower eval_size or prompts_per_step"
            )

    def train_dataloader(self) -> DataLoader:
        # The stream every logra-pl data module uses: one seeded global order, split over ranks, resumable.
        trainer = self.trainer
        return prompt_loader(
            self.train_items,
            self.prompts_per_step,
            self.seed,
            world_size=trainer.world_size,
            rank=trainer.global_rank,
            **trainer_positions(trainer),  # where a resumed run continues in the stream
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.eval_items, batch_size=len(self.eval_items), collate_fn=list)
