"""``ReasoningGymDataModule``: weighted task mixtures of reasoning-gym problems as chat prompts.

Items are reasoning-gym entries (``question``, ``answer``, ``metadata``) plus ``messages``, the chat the
policy sees (an optional system prompt, then the question). Eval problems are drawn first, from their own
seed; training problems exclude every eval question, and each split holds no duplicate question.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import reasoning_gym
from reasoning_gym.factory import DATASETS
from torch.utils.data import DataLoader

from logra_pl.data.loaders import (
    check_tune_fraction,
    eval_loader,
    prompt_loader,
    tag_eval_subsets,
    trainer_positions,
)
from logra_pl.data.schema import validate_item
from logra_pl.errors import ConfigError, check_int

# How many candidates to draw per wanted item before giving up on small problem spaces.
_OVERDRAW = 4


def _task_seed(seed: int, task: str, split: str) -> int:
    digest = hashlib.blake2b(f"{task}/{split}".encode(), digest_size=4).digest()
    return (seed * 1_000_003 + int.from_bytes(digest, "little")) % 2**31


class ReasoningGymDataModule(pl.LightningDataModule):
    """Prompts from a weighted mixture of reasoning-gym tasks.

    Arguments:
        tasks: ``{task name: {"weight": w, "config": {...}}}`` (or a list of names, weight 1, default config).
        train_size: training problems in total, split across tasks by weight (unused with ``per_task_train``).
        eval_size: evaluation problems in total, split likewise (unused with ``per_task_eval``).
        prompts_per_step: prompts per policy update (the training batch size).
        eval_batch_size: prompts per validation batch.
        seed: data seed (problems, split, shuffling).
        shuffle_seed: seed of the training prompts' order alone; ``None`` (default): ``seed``. Seeds of one experiment
            that should see the same problems and held-out set but each its own prompt stream set this, not ``seed``.
        system_prompt: optional system message; a key of ``reasoning_gym.utils.SYSTEM_PROMPTS`` is expanded.
        num_workers: DataLoader workers (0: in the main process).
        per_task_train: up to this many training problems from *each* task (weights are then ignored); ``None``:
            ``train_size`` split by weight. A task yields fewer when its problem space runs out of distinct questions
            outside the eval set.
        per_task_eval: this many evaluation problems from each task; ``None``: ``eval_size`` split by weight.
        eval_default_difficulty: draw evaluation problems with each task's default reasoning-gym config (ignoring
            its ``config`` overrides, which still shape training), as the Reasoning-Gym Hard protocol evaluates.
        eval_tune_fraction: split the evaluation problems into a tuning and a report subset (this share in the
            tuning one, spread evenly: :func:`~logra_pl.data.loaders.tag_eval_subsets`), so that validation also
            logs ``val/tune/pass@1`` and ``val/report/pass@1``; ``val/pass@1`` stays the mean over all of them.
            0 (default): no split.
    """

    def __init__(
        self,
        tasks: Mapping[str, Mapping[str, Any]] | list[str] = ("chain_sum",),
        train_size: int = 5000,
        eval_size: int = 128,
        prompts_per_step: int = 64,
        eval_batch_size: int = 128,
        seed: int = 0,
        system_prompt: str | None = None,
        num_workers: int = 0,
        per_task_train: int | None = None,
        per_task_eval: int | None = None,
        eval_default_difficulty: bool = False,
        eval_tune_fraction: float = 0.0,
        shuffle_seed: int | None = None,
    ) -> None:
        super().__init__()
        # Recorded in checkpoints (a resumed run is checked against them), not sent to the logger: the CLI saves the
        # whole config, and Lightning refuses to log a module and a datamodule that share a key (`seed`) with
        # different values.
        self.save_hyperparameters(logger=False)
        spec = {t: {} for t in tasks} if isinstance(tasks, list | tuple) else {k: dict(v) for k, v in tasks.items()}
        unknown = sorted(t for t in spec if t not in DATASETS)
        if unknown:
            raise ConfigError(f"unknown reasoning-gym task(s) {unknown}; available tasks: {sorted(DATASETS)}")
        if not spec:
            raise ConfigError("no tasks given: name at least one reasoning-gym task")
        for name, cfg in spec.items():
            extra = set(cfg) - {"weight", "config"}
            if extra:
                raise ConfigError(f"task {name!r}: unknown keys {sorted(extra)}; use 'weight' and 'config'")
            if float(cfg.get("weight", 1.0)) <= 0:
                raise ConfigError(f"task {name!r}: weight must be > 0, got {cfg.get('weight')}")
        check_int("data.train_size", train_size, 1)
        check_int("data.eval_size", eval_size, 0)
        check_int("data.prompts_per_step", prompts_per_step, 1)
        check_int("data.eval_batch_size", eval_batch_size, 1)
        check_int("data.seed", seed, 0)
        if shuffle_seed is not None:
            check_int("data.shuffle_seed", shuffle_seed, 0)
        check_int("data.num_workers", num_workers, 0)
        if per_task_train is not None:
            check_int("data.per_task_train", per_task_train, 1)
        if per_task_eval is not None:
            check_int("data.per_task_eval", per_task_eval, 0)
        if not isinstance(eval_default_difficulty, bool):
            raise ConfigError(f"data.eval_default_difficulty must be true or false, got {eval_default_difficulty!r}")
        check_tune_fraction("data.eval_tune_fraction", eval_tune_fraction)
        self.tasks = spec
        self.train_size = train_size
        self.eval_size = eval_size
        self.prompts_per_step = prompts_per_step
        self.eval_batch_size = eval_batch_size
        self.seed = seed
        self.shuffle_seed = seed if shuffle_seed is None else shuffle_seed
        self.system_prompt = reasoning_gym.utils.SYSTEM_PROMPTS.get(system_prompt, system_prompt)
        self.num_workers = num_workers
        self.per_task_train = per_task_train
        self.per_task_eval = per_task_eval
        self.eval_default_difficulty = eval_default_difficulty
        self.eval_tune_fraction = eval_tune_fraction
        self.train_items: list[dict[str, Any]] = []
        self.eval_items: list[dict[str, Any]] = []

    def _quota(self, total: int, per_task: int | None = None) -> dict[str, int]:
        if per_task is not None:
            return dict.fromkeys(self.tasks, per_task)
        weights = {t: float(c.get("weight", 1.0)) for t, c in self.tasks.items()}
        norm = sum(weights.values())
        quota = {t: int(total * w / norm) for t, w in weights.items()}
        leftover = total - sum(quota.values())
        for t in sorted(weights, key=lambda k: -weights[k])[:leftover]:
            quota[t] += 1
        return quota

    def _draw(
        self, task: str, want: int, split: str, exclude: set[str], default_config: bool = False
    ) -> list[dict[str, Any]]:
        if want == 0:
            return []
        config = {} if default_config else dict(self.tasks[task].get("config", {}))
        data = reasoning_gym.create_dataset(
            task, size=want * _OVERDRAW, seed=_task_seed(self.seed, task, split), **config
        )
        out, seen = [], set(exclude)
        for item in data:
            if item["question"] in seen:
                continue
            seen.add(item["question"])
            out.append(self.to_item(item))
            if len(out) == want:
                break
        return out

    def to_item(self, entry: Mapping[str, Any]) -> dict[str, Any]:
        """A reasoning-gym entry, unchanged, plus the item schema (:mod:`logra_pl.data.schema`).

        reasoning-gym's ``question``, ``answer`` and ``metadata`` (with ``source_dataset``) stay as they are, because
        its scorers read the whole entry. Added: ``messages`` (an optional system prompt, then the question),
        ``task = metadata["source_dataset"]`` and ``id = f"{task}/{metadata['source_index']}"`` (``source_idx`` for
        tasks that spell it so, e.g. ``kakurasu``; a 16-hex-digit blake2b of the question when there is neither).
        Source indices restart in each split's draw, so ids are unique within a split. A few tasks (``boxnet``,
        ``graph_color``, ``propositional_logic``, ``rubiks_cube``, ``rush_hour``) have no single gold answer
        (``answer`` is ``None``; their scorers check a response against ``metadata``): ``answer`` becomes ``""``
        there, and any non-string answer is kept as it was under ``metadata["original_answer"]``.

        Arguments:
            entry: one reasoning-gym dataset entry (``question``, ``answer``, ``metadata``).
        """
        messages = [] if not self.system_prompt else [{"role": "system", "content": self.system_prompt}]
        messages.append({"role": "user", "content": entry["question"]})
        metadata = entry["metadata"]
        task = str(metadata["source_dataset"])
        index = metadata.get("source_index", metadata.get("source_idx"))
        if index is None:
            index = hashlib.blake2b(str(entry["question"]).encode(), digest_size=8).hexdigest()
        item = {**entry, "messages": messages, "task": task, "id": f"{task}/{index}"}
        answer = entry["answer"]
        if not isinstance(answer, str):
            item["answer"] = "" if answer is None else str(answer)
            item["metadata"] = {**metadata, "original_answer": answer}
        validate_item(item)
        return item

    def setup(self, stage: str | None = None) -> None:
        """Draw both splits (once); eval first so training can exclude its questions."""
        if self.train_items:
            return
        eval_quota = self._quota(self.eval_size, self.per_task_eval)
        train_quota = self._quota(self.train_size, self.per_task_train)
        for task in self.tasks:
            self.eval_items += self._draw(
                task, eval_quota[task], "eval", set(), default_config=self.eval_default_difficulty
            )
        tag_eval_subsets(self.eval_items, self.eval_tune_fraction)
        eval_questions = {it["question"] for it in self.eval_items}
        for task in self.tasks:
            self.train_items += self._draw(task, train_quota[task], "train", eval_questions)
        if len(self.train_items) < self.prompts_per_step:
            raise ConfigError(
                f"only {len(self.train_items)} distinct training problems could be drawn from {sorted(self.tasks)} "
                f"(after removing eval questions), fewer than prompts_per_step={self.prompts_per_step}: widen the "
                "task configs, lower eval_size (per_task_eval) or prompts_per_step"
            )

    @property
    def eval_questions(self) -> set[str]:
        """Every evaluation question (kept out of training and of any warm start)."""
        self.setup()
        return {it["question"] for it in self.eval_items}

    def _world_size(self) -> int:
        trainer = self.trainer
        return int(trainer.world_size) if trainer is not None else 1

    def train_dataloader(self) -> DataLoader:
        """Shuffled prompts (seeded), ``prompts_per_step`` per update over all ranks: each rank takes its share."""
        trainer = self.trainer
        return prompt_loader(
            self.train_items,
            self.prompts_per_step,
            self.shuffle_seed,
            world_size=self._world_size(),
            rank=int(trainer.global_rank) if trainer is not None else 0,
            num_workers=self.num_workers,
            **trainer_positions(trainer),
        )

    def val_dataloader(self) -> DataLoader:
        """All eval problems, in order."""
        return eval_loader(self.eval_items, self.eval_batch_size, self.num_workers)
