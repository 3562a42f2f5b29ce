"""``RGHardDataModule``: the paper's Reasoning-Gym Hard protocol (algorithm.md §10) as a data module.

8 reasoning-gym tasks, each with up to 5,000 training problems and 25 evaluation problems drawn at the task's
*default* difficulty; duplicates within a split and train/eval overlaps are removed (by question). Validation
logs ``val/<task>/pass@1`` for each task and ``val/macro_pass@1``, their equally weighted mean (with
``val/reward_mean`` the pooled raw verifier score). Use it from a config or the command line::

    logra-pl validate --config configs/eval/rg_hard.yaml --model.policy path/to/policy
    logra-pl fit ... --data.class_path logra_pl.data.rg_hard.RGHardDataModule

**How the 8 tasks were chosen.** The paper's rule is per model: keep the tasks whose mean verifier score for the
*base* model lies in ``[0.25, 0.60]``, not counting responses that were truncated or had no extractable answer.
That base model cannot be run here, so :data:`RG_HARD_TASKS` is a stand-in picked from reasoning-gym 0.1.25 by
properties checked on this version, not by a model's scores:

- one or two tasks from each of the paper's families (logic, games, graphs, algorithmic, cognition, ARC), so the
  macro mean is not dominated by one kind of skill;
- generated offline (no download, no API) and deterministic per seed (the same seed gives the same questions);
- at least 5,025 distinct questions in the first ~5,800 draws at the default config (so 5,000 training plus 25
  eval problems exist), and cheap to generate (a few seconds per 5,000 problems);
- a verifier that gives graded credit in ``[0, 1]`` (partial credit for partly right answers), since the paper's
  score averages raw verifier scores.

**Re-derive the list for your model.** :data:`RG_HARD_TASKS` is a default, not the paper's list for any
particular model: run ``python scripts/select_rg_hard.py --policy <base model> --answer-format tags`` (it applies
the selection rule to any policy with the project's engine and prints the kept tasks as YAML), then pass that list
as ``--data.init_args.tasks``.

The tasks, one line each on why:

- ``knights_knaves`` (logic): truth-teller/liar deduction; credit ``0.3 + 0.7·(share of people labelled right)``.
- ``mini_sudoku`` (games): 4×4 sudoku; graded by the share of cells right (×0.9 outside the exact layout).
- ``shortest_path`` (graphs): grid path finding; 1.0 for a shortest path, 0.5 for a valid longer one.
- ``word_sorting`` (algorithmic): sort words by ASCII order; graded by the share of words in the right place.
- ``letter_jumble`` (algorithmic): unscramble each word of a sentence; graded by the share of words recovered.
- ``sentence_reordering`` (algorithmic): restore a shuffled sentence; graded by the share of words in place.
- ``spell_backward`` (cognition): spell a word backwards; graded by the share of characters in place.
- ``arc_1d`` (ARC): 1-D abstraction-and-reasoning grids; exact, with partial credit when the gold grid is contained
  in a longer answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from logra_pl.data.reasoning_gym import ReasoningGymDataModule

RG_HARD_TASKS: list[str] = [
    "knights_knaves",
    "mini_sudoku",
    "shortest_path",
    "word_sorting",
    "letter_jumble",
    "sentence_reordering",
    "spell_backward",
    "arc_1d",
]


class RGHardDataModule(ReasoningGymDataModule):
    """:class:`ReasoningGymDataModule` preset to the Reasoning-Gym Hard protocol (module docstring).

    Every argument can be overridden; the defaults are the paper's: :data:`RG_HARD_TASKS`, up to 5,000 training
    and 25 default-difficulty evaluation problems per task.

    Arguments:
        tasks: reasoning-gym task names (or ``{name: {"weight": w, "config": {...}}}``); default :data:`RG_HARD_TASKS`.
        per_task_train: up to this many training problems per task.
        per_task_eval: evaluation problems per task.
        eval_default_difficulty: evaluation problems at each task's default config (the paper's protocol).
        prompts_per_step: prompts per policy update (the training batch size).
        eval_batch_size: prompts per validation batch.
        seed: data seed (problems, split, shuffling).
        shuffle_seed: seed of the training prompts' order alone; ``None`` (default): ``seed``.
        system_prompt: optional system message; a key of ``reasoning_gym.utils.SYSTEM_PROMPTS`` is expanded.
        num_workers: DataLoader workers (0: in the main process).
        train_size: total training problems split by weight; only used when ``per_task_train`` is ``None``.
        eval_size: total evaluation problems split by weight; only used when ``per_task_eval`` is ``None``.
        eval_tune_fraction: share of the evaluation problems in the tuning subset (``val/tune/pass@1``; the rest:
            ``val/report/pass@1``); 0 (default): no split.
    """

    def __init__(
        self,
        tasks: Mapping[str, Mapping[str, Any]] | list[str] | None = None,
        per_task_train: int | None = 5000,
        per_task_eval: int | None = 25,
        eval_default_difficulty: bool = True,
        prompts_per_step: int = 64,
        eval_batch_size: int = 128,
        seed: int = 0,
        system_prompt: str | None = None,
        num_workers: int = 0,
        train_size: int = 5000,
        eval_size: int = 128,
        eval_tune_fraction: float = 0.0,
        shuffle_seed: int | None = None,
    ) -> None:
        super().__init__(
            tasks=list(RG_HARD_TASKS) if tasks is None else tasks,
            train_size=train_size,
            eval_size=eval_size,
            prompts_per_step=prompts_per_step,
            eval_batch_size=eval_batch_size,
            seed=seed,
            system_prompt=system_prompt,
            num_workers=num_workers,
            per_task_train=per_task_train,
            per_task_eval=per_task_eval,
            eval_default_difficulty=eval_default_difficulty,
            eval_tune_fraction=eval_tune_fraction,
            shuffle_seed=shuffle_seed,
        )
