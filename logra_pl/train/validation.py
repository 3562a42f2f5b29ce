"""``ValidationMetrics``: what one validation pass accumulates — mean reward, unbiased pass@j, per-task pass@1 and
reward with their macro means (the RG-Hard score), pass@1 per evaluation subset (``val/tune/pass@1``,
``val/report/pass@1`` when the data module splits its problems: ``eval_tune_fraction``), and a few samples for a
TensorBoard text panel.

An ``nn.Module`` of torchmetrics (synced over ranks), so Lightning reduces and resets them like any logged metric.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torchmetrics import MeanMetric

from logra_pl.data.loaders import EVAL_SUBSET_KEY
from logra_pl.data.schema import item_task, prompt_key
from logra_pl.train.metrics import MacroMean, MacroPassAt1, PassAtK


class ValidationMetrics(nn.Module):
    """Validation accumulators.

    Arguments:
        ks: the ``j`` of every ``val/pass@j``.
        samples: responses per problem.
    """

    def __init__(self, ks: Sequence[int], samples: int) -> None:
        super().__init__()
        self.samples = samples
        self.reward = MeanMetric()
        self.passes = PassAtK(ks=list(ks), samples=samples)
        self.tasks: MacroPassAt1 | None = None  # built at validation start when the eval set mixes tasks
        self.task_rewards: MacroMean | None = None  # per-task mean reward and its macro mean (RG-Hard score)
        # pass@1 per evaluation subset (tune / report), built at validation start when the items are tagged
        self.subsets: MacroPassAt1 | None = None
        self.shown: list[tuple[str, str, float]] = []

    def start(self, items: Sequence[dict[str, Any]], device: torch.device) -> None:
        """Per-task metrics when the evaluation problems mix tasks, per-subset pass@1 when they are tagged with an
        ``eval_subset`` (the same per-name counting as per task: :class:`MacroPassAt1`); a fresh sample panel."""
        tasks = sorted({item_task(it) for it in items})
        if len(tasks) > 1 and (self.tasks is None or self.tasks.tasks != tuple(tasks)):
            self.tasks = MacroPassAt1(tasks).to(device)
            self.task_rewards = MacroMean(tasks, "reward").to(device)
        subsets = sorted({str(it[EVAL_SUBSET_KEY]) for it in items if it.get(EVAL_SUBSET_KEY)})
        if subsets and (self.subsets is None or self.subsets.tasks != tuple(subsets)):
            self.subsets = MacroPassAt1(subsets).to(device)
        elif not subsets:
            self.subsets = None
        self.shown = []

    def panel_texts(self, rollout: Any, tokenizer: Any) -> list[str]:
        """The decoded responses of a batch's first four problems (``rollout``: the batch's), for the panel."""
        return tokenizer.batch_decode(rollout.response_ids[: 4 * self.samples], skip_special_tokens=True)

    def update(
        self,
        batch: Sequence[dict[str, Any]],
        rewards: torch.Tensor,
        texts: Sequence[str],
        device: torch.device,
        correct: torch.Tensor | None = None,
        scored: torch.Tensor | None = None,
    ) -> None:
        """One batch: ``rewards`` ``(len(batch)·samples,)`` grouped by prompt; ``texts`` the decoded responses of the
        first four problems (for the panel, first batch only; pass ``[]`` otherwise).

        Arguments:
            correct: ``(len(batch)·samples,)`` bool, the verifier's correctness (pass@j, per-task pass@1); None:
                ``reward >= 1``.
            scored: ``(len(batch)·samples,)`` bool, the responses that have a reward (None: all); the others count as
                not correct and stay out of the reward means.
        """
        n = self.samples
        if correct is None:
            correct = rewards >= 1.0
        correct = correct.reshape(len(batch), n)  # rows are grouped by prompt
        mask = None if scored is None or bool(scored.all()) else scored.reshape(len(batch), n)
        self.passes.update(correct.to(device))
        if self.tasks is not None and self.task_rewards is not None:
            tasks = [item_task(it) for it in batch]
            self.tasks.update(correct.to(device), tasks)
            self.task_rewards.update(rewards.reshape(len(batch), n), tasks, mask)
        if self.subsets is not None:
            rows = [i for i, it in enumerate(batch) if it.get(EVAL_SUBSET_KEY)]
            if rows:
                names = [str(batch[i][EVAL_SUBSET_KEY]) for i in rows]
                self.subsets.update(correct[rows].to(device), names)
        if mask is None:
            self.reward.update(rewards.float())
        elif bool(mask.any()):
            self.reward.update(rewards[mask.reshape(-1)].float())
        for k, text in enumerate(texts[::n][:4]):
            self.shown.append((prompt_key(batch[k]), text, float(rewards[k * n])))

    def compute(self) -> dict[str, Any] | None:
        """``val/pass@j`` (and per-task, per-subset values) of the pass, then reset; None when nothing was validated.

        ``val/pass@1`` is always the mean over every problem; a subset's is ``val/<subset>/pass@1`` (no macro mean
        over subsets: it would mean nothing)."""
        if self.passes.update_count == 0:
            return None
        out = {f"val/{name}": value for name, value in self.passes.compute().items()}
        for metric in (self.tasks, self.task_rewards):
            if metric is not None and metric.update_count:
                out |= {f"val/{name}": value for name, value in metric.compute().items()}
                metric.reset()
        if self.subsets is not None and self.subsets.update_count:
            values = self.subsets.compute()
            out |= {f"val/{name}": value for name, value in values.items() if not name.startswith("macro_")}
            self.subsets.reset()
        self.passes.reset()
        return out

    def show(self, logger: Any, step: int) -> None:
        """The sample panel as TensorBoard text (``val/samples``), for loggers that take text."""
        experiment = getattr(logger, "experiment", None) if logger is not None else None
        panel = self.panel()
        if panel and hasattr(experiment, "add_text"):
            experiment.add_text("val/samples", panel, global_step=step)

    def panel(self) -> str | None:
        """The samples as a markdown table (None when there are none)."""
        if not self.shown:
            return None
        rows = ["| prompt | response | reward |", "| --- | --- | --- |"]
        for question, text, reward in self.shown:
            cells = [c.replace("|", "\\|").replace("\n", " ")[:300] for c in (question, text)]
            rows.append(f"| {cells[0]} | {cells[1]} | {reward:.2f} |")
        return "\n".join(rows)
