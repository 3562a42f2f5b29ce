"""``RolloutLog``: every training rollout as JSON lines, one file per rank — for reading what the policy said.

RL runs are debugged by reading samples: which prompts, what the policy answered, what it was paid, how the engine
and the trainer scored the tokens. ``RolloutLog`` appends one JSON object per response to
``<dirpath>/rollouts.rank<R>.jsonl``:

``{"update", "rank", "write", "item_id", "task", "prompt_index", "prompt_ids", "response_ids", "response", "reward",
"advantage", "finish_reason", "rollout_logprobs"}``, and for a multi-turn trajectory (:mod:`logra_pl.envs`)
``"sampled_mask"``: 1 at the tokens the policy sampled, 0 at those its environment inserted (tool results,
observations); ``response`` is then the whole trajectory after the prompt.

``update`` is the 1-based index of the update the response trained; ``write`` identifies one call. ``reward`` is
null for a response the verifier failed on (it was left out of the update). A resumed run
appends to the same files; :func:`read_rollouts` keeps, per update, the rows of its last write.
"""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from logra_pl.callbacks.contract import view_of


class RolloutLog(pl.Callback):
    """Append every training response (ids, text, reward, log-probs) to a JSON-lines file per rank.

    Arguments:
        dirpath: folder of the files; default ``<run>/rollouts`` (the logger's version folder).
        every_n_updates: log the rollouts of every N-th update (1: all).
        text: also store the decoded response text.
    """

    READS = ("step_context", "tokenizer")  # what it reads of the policy contract (any other module: nothing logged)

    def __init__(self, dirpath: str | None = None, every_n_updates: int = 1, text: bool = True) -> None:
        if every_n_updates < 1:
            raise ValueError(f"every_n_updates must be >= 1, got {every_n_updates}")
        self.dirpath = dirpath
        self.every_n_updates = every_n_updates
        self.text = text
        self.path: Path | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        root = Path(self.dirpath) if self.dirpath else Path(trainer.log_dir or trainer.default_root_dir) / "rollouts"
        root.mkdir(parents=True, exist_ok=True)
        self.path = root / f"rollouts.rank{trainer.global_rank}.jsonl"

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        view = view_of(pl_module, self.READS)
        ctx = view.step_context if view is not None else None
        if ctx is None or self.path is None:
            return
        update = ctx.update_index + 1
        if update % self.every_n_updates:
            return
        r = ctx.rollout
        tokenizer = view.tokenizer
        write = uuid.uuid4().hex[:12]  # one id per write: a resumed run's rows of an update replace the earlier ones
        with self.path.open("a") as f:
            for row, i in enumerate(r.prompt_index):
                item = ctx.items[i]
                record = {
                    "update": update,
                    "rank": trainer.global_rank,
                    "write": write,
                    "item_id": item.get("id"),
                    "task": item.get("task"),
                    "prompt_index": i,
                    "prompt_ids": r.prompt_ids[row],
                    "response_ids": r.response_ids[row],
                    "reward": reward if math.isfinite(reward := float(ctx.rewards[row])) else None,  # None: failed
                    "advantage": float(ctx.advantages[row]),
                    "finish_reason": r.finish_reasons[row],
                    "rollout_logprobs": r.logprobs[row],
                }
                if r.response_masks is not None:
                    record["sampled_mask"] = r.sampled_mask(row)
                if self.text and tokenizer is not None:
                    record["response"] = tokenizer.decode(r.response_ids[row], skip_special_tokens=True)
                f.write(json.dumps(record) + "\n")


def read_rollouts(dirpath: str | Path) -> list[dict[str, Any]]:
    """Every row of every rank's file under ``dirpath``, by update and rank; an update written twice (a resumed
    run repeats the updates after its checkpoint) keeps the rows of its last write."""
    blocks: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for path in sorted(Path(dirpath).glob("rollouts.rank*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            key = (rec["update"], rec["rank"])
            rows = blocks.setdefault(key, [])
            if rows and rows[-1].get("write") != rec.get("write"):
                rows.clear()  # a later write of this update replaces the earlier one
            rows.append(rec)
    return [r for key in sorted(blocks) for r in blocks[key]]
