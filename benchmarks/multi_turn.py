"""The tool-calling example learns, on every engine: ``logra-pl fit`` with ``configs/overlays/calculator.yaml``.

    python benchmarks/multi_turn.py [--updates 60] [--seeds 0 1 2] [--engines hf vllm served] [--jobs 1]
        [--out results/multi_turn] [--dry-run]

Each run is one ``logra-pl fit`` process: ``configs/tiny_cpu.yaml`` + ``configs/overlays/calculator.yaml`` (the
calculator environment, its warm start on demonstrations), seed ``s`` (``seed_everything``, ``model.seed``,
``model.logra.base_seed``), ``--updates`` updates and one validation at the end, on one engine:

- ``hf``: the trainer's own HF generate;
- ``vllm``: ``configs/overlays/vllm.yaml`` (in-process vLLM, factor sync verified by PolicySync);
- ``served``: a ``logra-pl serve --model tiny`` process started here on a free port, the run's engine
  ``RemoteSettings`` pointed at it (factor payloads over HTTP, the same PolicySync).

The report (``<out>/results.md``, ``results.json``) gives per engine the mean ± std over seeds of the mean train
reward of the first and last 10% of updates, the tool calls and tool errors per trajectory (first → last 10%), the
replies per trajectory, the greedy val pass@1 at the end, and seconds per run. Runs are resumable: a finished run
(``result.json`` with the same arguments) is reused.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grid
from grid import ROOT, logra_pl_command, read_scalars, recorded_args

BASE = ("configs/tiny_cpu.yaml",)
OVERLAY = "configs/overlays/calculator.yaml"
ENGINES: dict[str, tuple[str, ...]] = {
    "hf": (),
    "vllm": ("--config", "configs/overlays/vllm.yaml"),
    "served": ("--config", "configs/overlays/vllm.yaml"),  # PolicySync; the engine itself is set per run
}
TAGS = ("train/reward_mean", "env/tool_calls", "env/tool_errors", "env/turns", "env/truncated", "val/pass@1")


def run_args(engine: str, seed: int, updates: int, folder: Path, url: str | None) -> list[str]:
    """``logra-pl fit``'s arguments of one run."""
    args = ["fit", "--config", BASE[0], *ENGINES[engine], "--config", OVERLAY]
    args += [f"--seed_everything={seed}", f"--model.seed={seed}", f"--model.logra.base_seed={seed}"]
    args += [f"--trainer.max_steps={updates}", f"--trainer.val_check_interval={updates}"]
    args += [f"--trainer.logger.init_args.save_dir={folder}", "--trainer.logger.init_args.name=tb"]
    args += ["--trainer.logger.init_args.version=0", "--trainer.enable_progress_bar=false"]
    args += ["--checkpoint.every_n_updates=0", "--checkpoint.save_last=false", "--checkpoint.at_end=false"]
    if engine == "served":
        args += ["--model.engine=logra_pl.rollout.remote.RemoteSettings", f"--model.engine.init_args.urls=[{url}]"]
    return args


def window_means(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Mean of the first and of the last 10% of a curve (at least one point each)."""
    values = [v for _, v in points]
    if not values:
        return float("nan"), float("nan")
    w = max(1, len(values) // 10)
    return statistics.fmean(values[:w]), statistics.fmean(values[-w:])


def summarize(scalars: dict[str, list[tuple[int, float]]], wall_s: float) -> dict[str, Any]:
    """One run's numbers (see the module docstring); metrics an update did not log count as 0 there (a batch
    without any tool call logs no ``env/tool_calls``)."""
    steps = [s for s, _ in scalars.get("train/reward_mean", [])]
    out: dict[str, Any] = {"updates": len(steps), "wall_s": wall_s}
    for tag in TAGS[:-1]:
        have = dict(scalars.get(tag, []))
        first, last = window_means([(s, have.get(s, 0.0)) for s in steps])
        name = tag.split("/")[1]
        out[f"{name}_first"], out[f"{name}_last"] = first, last
    val = scalars.get("val/pass@1", [])
    out["val_final"] = val[-1][1] if val else float("nan")
    out["curves"] = {tag: scalars[tag] for tag in TAGS if tag in scalars}
    return out


@contextlib.contextmanager
def served_engine(log_dir: Path):
    """A ``logra-pl serve --model tiny`` process (the tests' ``Server``: its own process group, a free port) for the
    duration; yields its URL."""
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.serve import Server

    log_dir.mkdir(parents=True, exist_ok=True)
    server = Server(log_dir).start(timeout=600)
    try:
        yield server.url
    finally:
        server.kill()


def run_one(engine: str, seed: int, updates: int, out: Path, threads: int) -> dict[str, Any]:
    """One run (reused when its ``result.json`` holds the same arguments)."""
    folder = out / engine / f"seed{seed}"
    recorded = recorded_args(run_args(engine, seed, updates, folder, "<served>"))
    done = folder / "result.json"
    if done.exists() and json.loads(done.read_text()).get("args") == recorded:
        print(f"  {engine} seed {seed}: finished earlier, reused", flush=True)
        return json.loads(done.read_text())
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(served_engine(out / engine / f"serve-seed{seed}")) if engine == "served" else None
        if folder.exists():
            for path in sorted(folder.rglob("*"), reverse=True):  # an unfinished run starts over
                path.unlink() if path.is_file() else path.rmdir()
        wall = grid.run_one([*logra_pl_command(), *run_args(engine, seed, updates, folder, url)], folder, threads)
    result = {"engine": engine, "seed": seed, "args": recorded, **summarize(read_scalars(folder / "tb"), wall)}
    done.write_text(json.dumps(result))
    print(
        f"  {engine} seed {seed}: {result['updates']} updates in {wall:.0f} s, reward {result['reward_mean_first']:.3f}"
        f" -> {result['reward_mean_last']:.3f}, tool calls {result['tool_calls_first']:.2f} -> "
        f"{result['tool_calls_last']:.2f}, val pass@1 {result['val_final']:.3f}",
        flush=True,
    )
    return result


ROWS = (
    ("reward (first 10% → last 10%)", "reward_mean"),
    ("tool calls per trajectory", "tool_calls"),
    ("tool errors per trajectory", "tool_errors"),
    ("replies per trajectory", "turns"),
)


def _pm(values: Sequence[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} ± {sd:.3f}"


def report(results: Sequence[dict], updates: int) -> str:
    """results.md: one table, a column per engine (its seeds named)."""
    engines = [e for e in ENGINES if any(r["engine"] == e for r in results)]
    seeds = {e: sorted(r["seed"] for r in results if r["engine"] == e) for e in engines}
    lines = [
        "# The calculator example over seeds and engines (`benchmarks/multi_turn.py`)",
        "",
        f"`logra-pl fit --config configs/tiny_cpu.yaml [--config configs/overlays/vllm.yaml] --config {OVERLAY}`, "
        f"{updates} updates; mean ± std over each engine's seeds; first / last: the mean over the first / last 10% "
        "of updates (train rewards are sampled at temperature 1; val pass@1 is greedy, on the 256 held-out problems).",
        "",
        "| | " + " | ".join(f"{e} (seeds {', '.join(map(str, seeds[e]))})" for e in engines) + " |",
        "| --- | " + " | ".join("---" for _ in engines) + " |",
    ]
    by = {e: [r for r in results if r["engine"] == e] for e in engines}
    for label, key in ROWS:
        cells = [
            f"{_pm([r[key + '_first'] for r in by[e]])} → {_pm([r[key + '_last'] for r in by[e]])}" for e in engines
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    gains = [_pm([r["reward_mean_last"] - r["reward_mean_first"] for r in by[e]]) for e in engines]
    lines.append("| reward gain | " + " | ".join(gains) + " |")
    lines.append(
        "| val pass@1 (greedy, end) | " + " | ".join(_pm([r["val_final"] for r in by[e]]) for e in engines) + " |"
    )
    lines.append("| seconds per run | " + " | ".join(_pm([r["wall_s"] for r in by[e]]) for e in engines) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--updates", type=int, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--engines", nargs="+", choices=list(ENGINES), default=list(ENGINES))
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (served runs each start their server)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "multi_turn")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and stop")
    args = parser.parse_args(argv)
    plan = [(e, s) for e in args.engines for s in args.seeds]
    if args.dry_run:
        for engine, seed in plan:
            url = "http://127.0.0.1:<port>" if engine == "served" else None
            print(
                f"[{engine} seed {seed}] logra-pl "
                + " ".join(run_args(engine, seed, args.updates, args.out / engine / f"seed{seed}", url))
            )
        return
    threads = max(1, (os.cpu_count() or 2) // args.jobs)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(lambda p: run_one(p[0], p[1], args.updates, args.out, threads), plan))
    # The report holds every finished run under --out at these settings, whichever invocation ran it (an engine may
    # have been run on fewer seeds than another).
    results = [
        r
        for path in sorted(args.out.glob("*/seed*/result.json"))
        if (r := json.loads(path.read_text()))["updates"] == args.updates
        and r["args"] == recorded_args(run_args(r["engine"], r["seed"], args.updates, path.parent, "<served>"))
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    slim = [{k: v for k, v in r.items() if k != "curves"} for r in results]
    (args.out / "results.json").write_text(json.dumps(slim, indent=1))
    text = report(results, args.updates)
    (args.out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
