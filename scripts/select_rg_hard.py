"""Apply the paper's Reasoning-Gym Hard selection rule to a policy (algorithm.md §10, ``logra_pl.data.rg_hard``).

For each candidate task, draw ``--problems`` problems at the task's default difficulty, sample one response each
with the project's rollout engine, and score it with the project's verifier. Responses that were truncated (finish
reason ``length``) and, with ``--answer-format tags``, responses without an extractable answer are excluded from the
task's mean. Tasks whose mean lies in ``[--low, --high]`` are kept; a table and the kept list (YAML, ready for
``--data.init_args.tasks``) are printed::

    python scripts/select_rg_hard.py --policy path/to/base --answer-format tags
    python scripts/select_rg_hard.py --policy tiny --tasks chain_sum basic_arithmetic leg_counting --problems 4

The selection problems come from their own seed stream (split ``select``), not from the RG-Hard eval problems.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import yaml
from reasoning_gym.factory import DATASETS

from logra_pl.data.reasoning_gym import ReasoningGymDataModule
from logra_pl.module import LoGRAPolicyModule, RolloutSettings, ScoringSettings
from logra_pl.rollout.base import SamplingConfig


@dataclass
class TaskResult:
    """One task's outcome.

    Arguments:
        task: the reasoning-gym task.
        scores: verifier scores of the responses that count (neither truncated nor without an answer).
        truncated: responses that hit the token limit.
        no_answer: responses without an extractable answer (``tags`` format only).
    """

    task: str
    scores: list[float]
    truncated: int
    no_answer: int

    @property
    def mean(self) -> float | None:
        """Mean verifier score of the counted responses; None when none counts."""
        return sum(self.scores) / len(self.scores) if self.scores else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line.

    Arguments:
        argv: arguments (default: ``sys.argv[1:]``).
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--policy", default="tiny", help="tiny | smollm2 | folder | file.gguf | hub id (default tiny)")
    p.add_argument("--tasks", nargs="+", default=None, help="candidate tasks (default: every reasoning-gym task)")
    p.add_argument("--problems", type=int, default=25, help="problems per task (default 25)")
    p.add_argument("--low", type=float, default=0.25, help="lowest kept mean (default 0.25)")
    p.add_argument("--high", type=float, default=0.60, help="highest kept mean (default 0.60)")
    p.add_argument("--answer-format", choices=("auto", "tags", "plain"), default="tags", help="default tags")
    p.add_argument(
        "--system-prompt", default="default", help="system message or a reasoning_gym SYSTEM_PROMPTS key (default)"
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="response limit (default 16384, the paper's; 32 for the tiny demo model, whose answers are 1-3 tokens)",
    )
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus mass (default 0.95)")
    p.add_argument("--seed", type=int, default=0, help="problem and sampling seed (default 0)")
    p.add_argument(
        "--scoring-timeout",
        type=float,
        default=5.0,
        help="seconds per verifier call, in worker processes (default 5); 0 scores in this process without a limit",
    )
    p.add_argument("--engine", default="hf", help="rollout engine: hf | vllm | a registered name (default hf)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float64"), default="float32", help="default float32")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    args = p.parse_args(argv)
    if args.problems < 1:
        p.error(f"--problems must be >= 1, got {args.problems}")
    if not 0.0 <= args.low <= args.high <= 1.0:
        p.error(f"need 0 <= --low <= --high <= 1, got {args.low} and {args.high}")
    if args.max_new_tokens is None:
        args.max_new_tokens = 32 if args.policy.split(":")[0] == "tiny" else 16384
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    unknown = sorted(set(args.tasks or []) - set(DATASETS))
    if unknown:
        p.error(f"unknown reasoning-gym task(s) {unknown}")
    return args


def evaluate(args: argparse.Namespace) -> list[TaskResult]:
    """Draw, generate, score: one :class:`TaskResult` per candidate task.

    Arguments:
        args: the parsed command line (:func:`parse_args`).
    """
    tasks = list(args.tasks or sorted(DATASETS))
    data = ReasoningGymDataModule(tasks, prompts_per_step=1, seed=args.seed, system_prompt=args.system_prompt)
    module = LoGRAPolicyModule(
        policy=args.policy,
        answer_format=args.answer_format,
        rollout=RolloutSettings(max_new_tokens=args.max_new_tokens),
        dtype=args.dtype,
        engine=args.engine,
        seed=args.seed,
        scoring=ScoringSettings(timeout_s=args.scoring_timeout or None),
    )
    module.configure_model()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    module.engine.place(device)
    context = getattr(module.engine, "context_limit", None)
    results = []
    try:
        for task in tasks:
            items: list[dict[str, Any]] = data._draw(task, args.problems, "select", set(), default_config=True)
            prompts = module.sampler.encode(items)
            limit = args.max_new_tokens
            if context is not None and max(map(len, prompts)) + limit > context:
                # A model with a shorter context than the paper's limit: stop at the context (counted as truncated).
                limit = max(1, context - max(map(len, prompts)))
                print(f"{task}: max_new_tokens lowered to {limit} (the model's context is {context})", file=sys.stderr)
            sampling = SamplingConfig(
                n=1, temperature=args.temperature, top_p=args.top_p, max_new_tokens=limit, seed=args.seed
            )
            rollout = module.engine.generate(prompts, sampling)
            found = module.sampler.score(rollout, items)
            if found.failed:  # a response without a reward would pass as 0 and bias the selection: stop instead
                first = found.first()
                raise SystemExit(
                    f"{task}: {found.failed} responses could not be scored ({found.counts()}); "
                    f"first: {first.message if first else 'unscored'}"
                )
            rewards = found.rewards
            texts = module.tokenizer.batch_decode(rollout.response_ids, skip_special_tokens=True)
            scores, truncated, no_answer = [], 0, 0
            for reward, text, cut in zip(rewards, texts, rollout.truncated, strict=True):
                if cut:
                    truncated += 1
                elif args.answer_format == "tags" and module.verifier.extract(text) is None:
                    no_answer += 1
                else:
                    scores.append(float(reward))
            results.append(TaskResult(task, scores, truncated, no_answer))
    finally:
        module.scorer.close()
        module.engine.close()
    return results


def report(results: list[TaskResult], low: float, high: float) -> tuple[str, list[str]]:
    """The table and the kept tasks (mean in ``[low, high]``).

    Arguments:
        results: per-task outcomes.
        low: lowest kept mean.
        high: highest kept mean.
    """
    width = max([len("task"), *(len(r.task) for r in results)])
    lines = [f"{'task':<{width}}  {'mean':>6}  {'counted':>7}  {'truncated':>9}  {'no_answer':>9}  kept"]
    kept = []
    for r in results:
        mean = r.mean
        keep = mean is not None and low <= mean <= high
        if keep:
            kept.append(r.task)
        shown = "-" if mean is None else f"{mean:.3f}"
        lines.append(
            f"{r.task:<{width}}  {shown:>6}  {len(r.scores):>7}  {r.truncated:>9}  {r.no_answer:>9}  "
            f"{'yes' if keep else 'no'}"
        )
    return "\n".join(lines), kept


def main(argv: list[str] | None = None) -> None:
    """Run the selection and print the table and the kept tasks as YAML.

    Arguments:
        argv: arguments (default: ``sys.argv[1:]``).
    """
    args = parse_args(argv)
    start = time.perf_counter()
    results = evaluate(args)
    table, kept = report(results, args.low, args.high)
    print(table)
    print(
        f"# {len(kept)} of {len(results)} tasks with mean verifier score in [{args.low:g}, {args.high:g}] for "
        f"{args.policy} ({args.problems} problems each, {time.perf_counter() - start:.1f} s); "
        "use as --data.init_args.tasks"
    )
    print(yaml.safe_dump({"tasks": kept}, default_flow_style=False), end="")


if __name__ == "__main__":
    main(sys.argv[1:])
