"""Paper data recipes: :class:`HFPromptDataModule` with the settings of a published selection.

``DapoMath7_5kDataModule`` — training prompts as in DAPO-style math RL on a 7.5k subset:

1. load the ``train`` split of ``BytedTsinghua-SIA/DAPO-Math-17k`` (or a local copy with the same columns); rows are
   read in source order;
2. the prompt is the ``prompt`` column, a chat list (one user message that already holds DAPO's instruction
   "Solve the following math problem step by step ... Answer: $Answer"), used as is; the answer is
   ``reward_model.ground_truth``; the id is ``dapo_math/<extra_info.index>``;
3. dedup: a row whose first user message's content equals that of an earlier row is dropped (the dataset repeats
   each of its ~17.9k problems many times), so the first occurrence is kept;
4. the first 7,500 remaining prompts, in source order, are the selection (``first_n=7500``);
5. evaluation: all problems of ``HuggingFaceH4/MATH-500`` (split ``test``; prompt ``problem``, answer ``answer``,
   id ``math500/<unique_id>``); any selected training prompt whose user message equals an evaluation problem
   exactly is removed from training (so training can hold slightly fewer than 7,500).

``Math500DataModule`` — evaluation only: the 500 problems of ``HuggingFaceH4/MATH-500`` (split ``test``), in source
order, no dedup, no cut; ``messages`` = the ``problem`` as one user message (after the optional system prompt),
``answer`` = ``answer``, ``task = "math500"`` (the subject stays in ``metadata``, since verifiers dispatch on ``task``),
``id = "math500/<unique_id>"``; ``metadata`` keeps ``solution``, ``subject``, ``level``, ``unique_id`` (and
``answer``, ``source_row``). Use it with ``logra-pl validate``; it has no training prompts.

Each recipe passes :class:`HFPromptDataModule` only what it fixes and its own defaults; every other argument goes
through unchanged (``**kwargs``, which jsonargparse follows, so ``--data.init_args.<any HFPromptDataModule argument>``
works), and a new :class:`HFPromptDataModule` argument reaches the recipes without an edit here.

Both take local files instead of the hub ids (``path``, ``eval_path``), e.g. from YAML or the command line:
``--data.class_path logra_pl.data.DapoMath7_5kDataModule --data.init_args.path dapo.parquet
--data.init_args.eval_path math500.jsonl``.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader

from logra_pl.data.hf import HFPromptDataModule
from logra_pl.data.loaders import tag_eval_subsets
from logra_pl.errors import ConfigError

DAPO_MATH_17K = "BytedTsinghua-SIA/DAPO-Math-17k"
MATH_500 = "HuggingFaceH4/MATH-500"


class DapoMath7_5kDataModule(HFPromptDataModule):
    """The first 7,500 unique prompts of DAPO-Math-17k (source order), evaluated on MATH-500 (see the module docstring).

    The recipe fixes the columns, tasks, ids and dedup of both datasets; everything else is an
    :class:`HFPromptDataModule` argument with its default (``**kwargs``: ``split``, ``eval_split``, ``system_prompt``
    — none in the recipe: DAPO's prompt carries its instruction —, ``prompts_per_step``, ``eval_batch_size``,
    ``seed``, ``num_workers``, ``cache_dir``, ...).

    Arguments:
        path: DAPO-Math-17k hub id, or a local file/folder with its columns (``prompt`` chat list, ``reward_model``
            with ``ground_truth``, ``extra_info`` with ``index``).
        first_n: unique prompts kept, in source order (7,500 in the recipe).
        eval_path: MATH-500 hub id or a local file/folder with its columns (``problem``, ``answer``, ``unique_id``).
        **kwargs: further :class:`HFPromptDataModule` arguments.
    """

    def __init__(
        self, path: str = DAPO_MATH_17K, first_n: int = 7500, eval_path: str = MATH_500, **kwargs: Any
    ) -> None:
        super().__init__(
            path=path,
            first_n=first_n,
            eval_path=eval_path,
            prompt_column="prompt",
            answer_column="reward_model.ground_truth",
            task="dapo_math",
            id_column="extra_info.index",
            dedup=True,
            eval_prompt_column="problem",
            eval_answer_column="answer",
            eval_id_column="unique_id",
            eval_task="math500",
            **kwargs,
        )


class Math500DataModule(HFPromptDataModule):
    """The 500 MATH-500 problems, for evaluation only (see the module docstring).

    The recipe fixes the columns, task, ids, no dedup and no held-out draw; the other :class:`HFPromptDataModule`
    arguments pass through (``**kwargs``: ``name``, ``system_prompt``, ``first_n`` for the first N problems,
    ``eval_batch_size``, ``num_workers``, ``cache_dir``, ...). The problems are the evaluation set, so the settings
    of a separate evaluation dataset and of training (``eval_*``, ``seed``) are fixed too: they would do nothing,
    and a config that sets one is refused as an unknown key instead.

    Arguments:
        path: MATH-500 hub id, or a local file/folder with its columns.
        split: split of ``path``.
        **kwargs: further :class:`HFPromptDataModule` arguments.
    """

    def __init__(self, path: str = MATH_500, split: str = "test", **kwargs: Any) -> None:
        super().__init__(
            path=path,
            split=split,
            prompt_column="problem",
            answer_column="answer",
            task="math500",
            id_column="unique_id",
            dedup=False,
            eval_size=0,
            prompts_per_step=1,
            # No separate evaluation dataset and no training shuffle: fixed, so that they are not settings here.
            eval_path=None,
            eval_split="test",
            eval_name=None,
            eval_prompt_column=None,
            eval_answer_column=None,
            eval_id_column=None,
            eval_task=None,
            seed=0,
            shuffle_seed=None,
            **kwargs,
        )

    def setup(self, stage: str | None = None) -> None:
        """Load every problem as an evaluation item (once)."""
        if not self.eval_items:
            self.eval_items = self.load_train_pool()
            tag_eval_subsets(self.eval_items, self.eval_tune_fraction)

    def train_dataloader(self) -> DataLoader:
        """MATH-500 is an evaluation set: training on it is refused."""
        raise ConfigError(
            "Math500DataModule is for evaluation only (`logra-pl validate`); to train, use a training data module "
            "with MATH-500 as its eval_path (e.g. DapoMath7_5kDataModule)"
        )


def dapo_math_7_5k(path: str = DAPO_MATH_17K, **kwargs: Any) -> DapoMath7_5kDataModule:
    """:class:`DapoMath7_5kDataModule` (factory spelling).

    Arguments:
        path: DAPO-Math-17k hub id or local file/folder.
        **kwargs: further :class:`DapoMath7_5kDataModule` arguments.
    """
    return DapoMath7_5kDataModule(path=path, **kwargs)


def math500(path: str = MATH_500, **kwargs: Any) -> Math500DataModule:
    """:class:`Math500DataModule` (factory spelling).

    Arguments:
        path: MATH-500 hub id or local file/folder.
        **kwargs: further :class:`Math500DataModule` arguments.
    """
    return Math500DataModule(path=path, **kwargs)
