"""The LoGRA paper's ablations at CPU scale: a grid of the tiny demo over seeds, one process per run, resumable.

    python benchmarks/ablate.py [--grid default|quick|demo] [--seeds 0 1 2] [--budget-minutes 75 | --updates N]
        [--jobs 2] [--out runs/ablate/<grid>] [--cells NAME ...] [--figures DIR] [--dry-run]
    python benchmarks/ablate.py --grid parity [--model tiny|tiny:small] [--stage tune|report|all|levers]
        [--updates N] [--values K] [--methods NAME ...] [--jobs 2] [--out results/parity/<model>] [--dry-run]

Each cell of a grid is ``configs/tiny_cpu.yaml`` with ``configs/overlays/rowadam_demo.yaml`` (the LoGRA rule the
ablations vary) plus YAML overlays (``configs/ablations/``, ``configs/overlays/``),
run for every seed as ``logra-pl fit`` in its own process (``--jobs`` at a time, each with ``cpu_count / jobs``
threads). A seed sets ``seed_everything``, the sampling seed ``model.seed`` and, for LoGRA, the projection seed
``model.logra.base_seed``; the warm start, the training prompts and the held-out evaluation set stay fixed, so the
seeds vary the RL trajectory only. Every LoGRA run also carries :class:`~logra_pl.callbacks.SketchDiagnostics`
(``logra/recon_cosine``: the paper's D.3 reconstruction cosine, on a fixed probe batch). The greedy validation of
the warm-started policy before any update (one ``logra-pl validate`` run per grid: it is the same for every cell
and seed) is the starting point of every run's pass@1.

Grids (``default`` reproduces the paper's ablations; a cell shared by several comparisons runs once):

- rank: r = 4 / 16 / 64 / 128 (paper §3.4.1: pass@1 and the D.3 reconstruction cosine grow with r);
- basis: fixed Rademacher / refreshed Rademacher / refreshed Gaussian (§3.4.2: no consistent winner);
- KL control: none (α = 1) / large constant / small constant / annealed (§3.4.3: the large constant hurts);
- optimizer: LoGRA / dense AdamW / LoRA at LoGRA's rank (the paper's claim: LoGRA learns about as well as AdamW).

``quick`` is a 2-cell, 2-seed smoke version for the test suite; ``demo`` is the README's demo (LoGRA vs dense AdamW
at the configs' own length) over seeds 0-4 (its table: docs/benchmarks.md).

``parity`` (``benchmarks/parity.py``, whose docstring has the whole protocol) is the fair comparison the optimizer
cells above are not: the paper's LoGRA, LoGRA with the levers of ``configs/overlays/logra_levers.yaml``, dense
AdamW and LoRA r = 64, each tuned by its step knob (the KL budget's scale, or lr) over 4-6 log-spaced values on seeds
0-1 by the pass@1 of a tuning half of the held-out problems, then run at the chosen value on seeds 2-6 and scored
on the other half (reward gain, report-split pass@1, realized KL per update, training state, wall time, ratios to
tuned AdamW and the goal line). ``--stage tune|report|all`` (all: both, the report once the tuning is complete),
``--stage levers`` (``--grid levers``: each lever alone on the paper's LoGRA). About 1.7 hours on ``tiny``
(``--dry-run`` prints the estimate and every command); ``--budget-minutes``, ``--seeds`` and ``--cells`` do not
apply to it (``--updates``, ``--values``, ``--tune-seeds``, ``--report-seeds``, ``--methods`` do).

Resumable: a run that finished has ``result.json`` in ``<out>/<cell>/seed<S>/`` (with the settings it ran with) and
is not rerun when the settings are the same; an unfinished run starts over. With ``--budget-minutes`` the number of
updates per run is chosen from measured per-update costs of this harness on a 2-core CPU (``COSTS``) so that the
whole grid fits the budget; ``--updates`` sets it directly. Output in ``<out>``: ``results.json`` (every run's
curves and numbers, the per-cell mean ± std), ``results.md`` (the table and the findings, with the numbers) and PNG
plots: pass@1 vs rank, reconstruction cosine vs rank with the √(r/d_in) reference, reward curves with a seed band
(LoGRA vs AdamW vs LoRA), realized vs predicted KL. ``--figures DIR`` also copies the plots there
(docs/benchmarks.md shows them).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from grid import (
    BASE,
    BASELINE_EXTRA,
    COSTS,
    ROOT,
    VALIDATIONS,
    aggregate,
    delegate,
    logra_pl_command,
    pm,
    read_scalars,
    recorded_args,
    rolling_mean,
    run_one,
    settings_key,
    summarize_run,
)

ABL = "configs/ablations"


@dataclass(frozen=True)
class Cell:
    """One configuration of a grid.

    Arguments:
        name: folder and table name.
        overlays: YAML files applied after the base, in order.
        optimizer: ``logra`` | ``adamw`` | ``lora`` (LoGRA cells get a projection seed and sketch diagnostics).
        rank: LoGRA's sketch rank (the x axis of the rank plots); None for other optimizers.
        groups: the comparisons the cell belongs to, with its label in each (``{"rank": "r = 4"}``).
    """

    name: str
    overlays: tuple[str, ...] = ()
    optimizer: str = "logra"
    rank: int | None = 64
    groups: dict[str, str] = field(default_factory=dict)

    def __hash__(self) -> int:
        return hash(self.name)


BASE_CELL = Cell(
    "logra_r64",
    groups={"rank": "r = 64", "basis": "refreshed Rademacher", "kl": "annealed", "optimizer": "LoGRA (r = 64)"},
)
ADAMW_CELL = Cell("adamw", ("configs/overlays/adamw.yaml",), "adamw", None, {"optimizer": "dense AdamW"})
GRIDS: dict[str, list[Cell]] = {
    "default": [  # the demo's configs and KL variants first: they arrive early
        BASE_CELL,
        ADAMW_CELL,
        Cell("kl_none", (f"{ABL}/kl_none.yaml",), groups={"kl": "none (α = 1)"}),
        Cell("kl_large_constant", (f"{ABL}/kl_large_constant.yaml",), groups={"kl": "large constant (5e-2, α ≤ 3)"}),
        Cell("kl_small_constant", (f"{ABL}/kl_small_constant.yaml",), groups={"kl": "small constant (2.5e-3)"}),
        Cell("logra_r4", (f"{ABL}/rank_4.yaml",), rank=4, groups={"rank": "r = 4"}),
        Cell("logra_r16", (f"{ABL}/rank_16.yaml",), rank=16, groups={"rank": "r = 16"}),
        Cell("logra_r128", (f"{ABL}/rank_128.yaml",), rank=128, groups={"rank": "r = 128"}),
        Cell("basis_fixed_rademacher", (f"{ABL}/basis_fixed_rademacher.yaml",), groups={"basis": "fixed Rademacher"}),
        Cell(
            "basis_refreshed_gaussian",
            (f"{ABL}/basis_refreshed_gaussian.yaml",),
            groups={"basis": "refreshed Gaussian"},
        ),
        Cell("lora", (f"{ABL}/lora.yaml",), "lora", None, {"optimizer": "LoRA (r = 64)"}),
    ],
    "quick": [
        Cell("logra_r16", (f"{ABL}/rank_16.yaml",), rank=16, groups={"rank": "r = 16", "optimizer": "LoGRA (r = 16)"}),
        ADAMW_CELL,
    ],
    "demo": [
        Cell("logra", groups={"optimizer": "LoGRA (configs/tiny_cpu.yaml)"}),
        Cell("adamw", (), "adamw", None, {"optimizer": "dense AdamW (configs/tiny_cpu_adamw.yaml)"}),
    ],
}
# The demo grid runs the README's two configs exactly as users do (no overrides, no extra callbacks).
DEMO_CONFIGS = {"logra": "configs/tiny_cpu.yaml", "adamw": "configs/tiny_cpu_adamw.yaml"}
# The LoGRA rule the paper's ablations vary (the paper's RowAdam, a new projection every update, the per-matrix step),
# which the demo ran until it adopted Adam in sketch space on a fixed projection: pinned so the ablations keep their
# meaning (dense cells drop it: their overlays set model.logra to null).
RULE = "configs/overlays/rowadam_demo.yaml"
# Smaller everything for the test suite: a short warm start (its own cache entry), 16 prompts, 32 held-out problems.
QUICK_ARGS = (
    "--model.warm_start.steps=40",
    "--data.prompts_per_step=16",
    "--data.train_size=256",
    "--data.eval_size=32",
    "--data.eval_batch_size=32",
    "--model.microbatch_size=16",
)
# Grids of benchmarks/parity.py (the fair LoGRA vs tuned AdamW protocol; `levers` = `parity --stage levers`).
PARITY_GRIDS = ("parity", "levers")
DEFAULT_SEEDS = {"default": [0, 1, 2], "quick": [0, 1], "demo": [0, 1, 2, 3, 4]}


# ------------------------------------------------------------------------------------------------ planning
def plan_updates(cells: Sequence[Cell], seeds: Sequence[int], budget_minutes: float, jobs: int) -> int:
    """Updates per run so the grid's estimated wall time (``COSTS``, ``jobs`` runs at a time) meets the budget."""
    runs = len(cells) * len(seeds)
    per_run = budget_minutes * 60.0 * jobs / runs - COSTS["startup"] - VALIDATIONS * COSTS["validation"]
    per_update = statistics.fmean(COSTS[c.optimizer] for c in cells)
    updates = int(per_run / per_update) // VALIDATIONS * VALIDATIONS
    if updates < 2 * VALIDATIONS:
        raise SystemExit(
            f"--budget-minutes {budget_minutes} leaves {per_run:.0f} s per run for {runs} runs at {jobs} at a time: "
            f"too little for {2 * VALIDATIONS} updates; raise the budget, lower the seeds/cells or pass --updates"
        )
    return updates


def run_args(
    grid: str,
    cell: Cell,
    seed: int,
    updates: int | None,
    out: Path,
    diagnostics_every: int,
    extra: Sequence[str] = (),
) -> list[str]:
    """The ``logra-pl fit`` arguments of one run (after the program name); ``extra`` goes last."""
    configs = [DEMO_CONFIGS[cell.name]] if grid == "demo" else [BASE, RULE, *cell.overlays]
    args = ["fit"] + [a for c in configs for a in ("--config", c)]
    args += [f"--seed_everything={seed}", f"--model.seed={seed}"]
    if cell.optimizer == "logra":
        args.append(f"--model.logra.base_seed={seed}")
    if updates is not None:
        args += [f"--trainer.max_steps={updates}", f"--trainer.val_check_interval={max(1, updates // VALIDATIONS)}"]
    args += [
        f"--trainer.logger.init_args.save_dir={out}",
        "--trainer.logger.init_args.name=tb",
        "--trainer.logger.init_args.version=0",
        "--trainer.enable_progress_bar=false",
        "--checkpoint.every_n_updates=0",
        "--checkpoint.save_last=false",
        "--checkpoint.at_end=false",
    ]
    if grid == "quick":
        args += list(QUICK_ARGS)
    if cell.optimizer == "logra" and grid != "demo":
        args += [
            "--trainer.callbacks+=callbacks/sketch_diagnostics.yaml",
            f"--trainer.callbacks.init_args.every_n_updates={diagnostics_every}",
        ]
    return args + [a for a in extra if cell.optimizer == "logra" or not a.startswith("--model.logra.")]


# ------------------------------------------------------------------------------------------------ reading runs
# ------------------------------------------------------------------------------------------------ running
def baseline(grid: str, out: Path, threads: int, extra: Sequence[str] = ()) -> float:
    """Greedy val pass@1 of the warm-started policy (no update), once per grid; cached in ``<out>/baseline.json``.

    Of ``extra``, the overrides that change the warm-started policy or the evaluation problems apply here too.
    """
    args = ["validate", "--config", BASE if grid != "demo" else DEMO_CONFIGS["logra"]]
    args += [f"--trainer.logger.init_args.save_dir={out / 'baseline'}", "--trainer.logger.init_args.name=tb"]
    args += ["--trainer.logger.init_args.version=0", "--trainer.enable_progress_bar=false"]
    if grid == "quick":
        args += [a for a in QUICK_ARGS if not a.startswith("--data.prompts") and "microbatch" not in a]
    args += [a for a in extra if a.startswith(BASELINE_EXTRA)]
    key = settings_key(args)
    cached = out / "baseline.json"
    if cached.exists() and json.loads(cached.read_text()).get("key") == key:
        return json.loads(cached.read_text())["val_pass1"]
    shutil.rmtree(out / "baseline", ignore_errors=True)
    run_one([*logra_pl_command(), *args], out / "baseline", threads)
    points = read_scalars(out / "baseline").get("val/pass@1", [])
    if not points:
        raise RuntimeError(f"the baseline validation in {out / 'baseline'} logged no val/pass@1")
    cached.write_text(json.dumps({"key": key, "val_pass1": points[-1][1]}))
    return points[-1][1]


def run_grid(
    grid: str,
    cells: Sequence[Cell],
    seeds: Sequence[int],
    updates: int | None,
    out: Path,
    jobs: int,
    diagnostics_every: int,
    extra: Sequence[str] = (),
) -> dict:
    """Run (or reuse) every cell × seed; return the report (runs, per-cell summaries)."""
    threads = max(1, (os.cpu_count() or 2) // jobs)
    start = time.perf_counter()
    val0 = baseline(grid, out, threads, extra)
    todo, results = [], {}
    for cell in cells:
        for seed in seeds:
            folder = out / cell.name / f"seed{seed}"
            args = run_args(grid, cell, seed, updates, folder, diagnostics_every, extra)
            key = settings_key(args)
            done = folder / "result.json"
            if done.exists() and json.loads(done.read_text()).get("key") == key:
                results[(cell.name, seed)] = json.loads(done.read_text())
                print(f"  {cell.name} seed {seed}: finished earlier, reused", flush=True)
                continue
            todo.append((cell, seed, folder, args, key))

    def work(item: tuple) -> tuple[tuple[str, int], dict]:
        cell, seed, folder, args, key = item
        shutil.rmtree(folder, ignore_errors=True)  # an unfinished run starts over
        wall = run_one([*logra_pl_command(), *args], folder, threads)
        result = {"key": key, "cell": cell.name, "seed": seed, "args": recorded_args(args)}
        result.update(summarize_run(read_scalars(folder / "tb"), val0, wall))
        (folder / "result.json").write_text(json.dumps(result))
        print(
            f"  {cell.name} seed {seed}: {result['updates']} updates in {wall:.0f} s, reward gain "
            f"{result['reward_gain']:+.3f}, val pass@1 {val0:.3f} -> {result['val_final']:.3f}",
            flush=True,
        )
        return (cell.name, seed), result

    print(f"{len(todo)} runs to do, {len(results)} reused; {jobs} at a time, {threads} thread(s) each", flush=True)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for key, result in pool.map(work, todo):
            results[key] = result
    report = {
        "grid": grid,
        "seeds": list(seeds),
        "updates": updates,
        "val_start": val0,
        "wall_s": time.perf_counter() - start,
        "cells": {},
    }
    for cell in cells:
        runs = [results[(cell.name, s)] for s in seeds]
        report["cells"][cell.name] = {
            "optimizer": cell.optimizer,
            "rank": cell.rank,
            "groups": cell.groups,
            "overlays": list(cell.overlays) if grid != "demo" else [DEMO_CONFIGS[cell.name]],
            "summary": aggregate(runs),
            "runs": {str(r["seed"]): r for r in runs},
        }
    return report


# ------------------------------------------------------------------------------------------------ reporting
def table(report: dict) -> str:
    """The markdown table: one row per cell, mean ± std over seeds."""
    n = len(report["seeds"])
    lines = [
        f"| cell | comparison | val pass@1 (start {report['val_start']:.3f}) → final | reward gain | "
        "recon cosine | realized KL / budget | wall s per run |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, cell in report["cells"].items():
        s = cell["summary"]
        groups = "; ".join(f"{g}: {label}" for g, label in cell["groups"].items())
        lines.append(
            f"| `{name}` | {groups} | {pm(s['val_final'])} | {pm(s['reward_gain'], signed=True)} | "
            f"{pm(s['recon_cosine'])} | {pm(s['kl_realized_over_budget'], 2)} | {pm(s['wall_s'], 0)} |"
        )
    updates = report["updates"] or "the config's"
    lines.append("")
    lines.append(
        f"mean ± std over {n} seeds ({', '.join(map(str, report['seeds']))}), {updates} updates per run; "
        f"reward gain: mean train reward of the last 10% of updates minus the first 10% (at least 10 each)."
    )
    return "\n".join(lines)


def _cell(report: dict, name: str) -> dict | None:
    return report["cells"].get(name, {}).get("summary")


def findings(report: dict) -> list[str]:
    """Each of the paper's claims checked against this grid's numbers, with the numbers (only those it covers)."""
    out = []

    def m(name: str, key: str) -> float | None:
        s = _cell(report, name)
        return None if s is None or s.get(key) is None else s[key]["mean"]

    def sd(name: str, key: str) -> float:
        s = _cell(report, name)
        return 0.0 if s is None or s.get(key) is None else s[key]["std"]

    base = "logra_r64" if "logra_r64" in report["cells"] else "logra" if "logra" in report["cells"] else None
    if base and "adamw" in report["cells"]:
        g_l, g_a = m(base, "reward_gain"), m("adamw", "reward_gain")
        v_l, v_a = m(base, "val_final"), m("adamw", "val_final")
        if g_l is not None and g_a is not None:
            ratio = g_l / g_a if g_a else float("nan")
            verdict = "reproduces" if ratio >= 0.8 else "does not reproduce"
            out.append(
                f"LoGRA learns about as well as dense AdamW ({verdict} at 80%): reward gain {g_l:+.3f} ± "
                f"{sd(base, 'reward_gain'):.3f} vs {g_a:+.3f} ± {sd('adamw', 'reward_gain'):.3f} "
                f"({ratio:.0%} of AdamW's); final val pass@1 {v_l:.3f} vs {v_a:.3f}."
            )
    ranks = sorted(
        (c["rank"], name)
        for name, c in report["cells"].items()
        if "rank" in c["groups"] and c["rank"] is not None and c["summary"]["val_final"] is not None
    )
    if len(ranks) >= 2:
        passes = [m(n, "val_final") for _, n in ranks]
        recon = [m(n, "recon_cosine") for _, n in ranks]
        rs = ", ".join(f"r={r}: {p:.3f}" for (r, _), p in zip(ranks, passes, strict=True))
        mono = all(b >= a for a, b in itertools.pairwise(passes))
        out.append(
            f"Pass@1 grows with rank ({'reproduces' if mono else 'not monotone here'}): {rs} "
            f"(seed std about {statistics.fmean(sd(n, 'val_final') for _, n in ranks):.3f})."
        )
        if all(x is not None for x in recon):
            rc = ", ".join(f"r={r}: {x:.3f}" for (r, _), x in zip(ranks, recon, strict=True))
            grows = all(b > a for a, b in itertools.pairwise(recon))
            out.append(
                f"Reconstruction cosine grows with rank ({'reproduces' if grows else 'does not reproduce'}; "
                f"paper D.3: about 0.046 at r=4 to 0.348 at r=256 on d_in in the thousands): {rc}."
            )
    basis = [n for n, c in report["cells"].items() if "basis" in c["groups"]]
    if len(basis) >= 2:
        vals = {n: (m(n, "val_final"), sd(n, "val_final")) for n in basis}
        spread = max(v for v, _ in vals.values()) - min(v for v, _ in vals.values())
        noise = max(s for _, s in vals.values())
        verdict = "reproduces" if spread <= 2 * noise else "one basis stands out here"
        text = ", ".join(f"{report['cells'][n]['groups']['basis']}: {v:.3f} ± {s:.3f}" for n, (v, s) in vals.items())
        out.append(
            f"Refreshing the basis shows no consistent benefit ({verdict}: final pass@1 spread {spread:.3f} vs a "
            f"largest seed std of {noise:.3f}): {text}."
        )
    kl = [n for n, c in report["cells"].items() if "kl" in c["groups"]]
    if len(kl) >= 2:
        text = ", ".join(
            f"{report['cells'][n]['groups']['kl']}: pass@1 {m(n, 'val_final'):.3f}, realized KL "
            f"{m(n, 'kl_realized'):.2e}"
            + (
                f" ({m(n, 'kl_realized_over_budget'):.2f}x budget)"
                if m(n, "kl_realized_over_budget") is not None
                else ""
            )
            for n in kl
            if m(n, "val_final") is not None and m(n, "kl_realized") is not None
        )
        out.append(f"KL control: {text}.")
        if "kl_large_constant" in report["cells"] and base:
            large, anneal = m("kl_large_constant", "val_final"), m(base, "val_final")
            hurt = large < anneal - sd(base, "val_final")
            out.append(
                f"The large constant budget hurts ({'reproduces' if hurt else 'does not reproduce'}): final pass@1 "
                f"{large:.3f} ± {sd('kl_large_constant', 'val_final'):.3f} vs annealed {anneal:.3f} ± "
                f"{sd(base, 'val_final'):.3f}."
            )
    return out


def plots(report: dict, out: Path) -> list[Path]:
    """The grid's PNG plots (only those its cells support)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    cells = report["cells"]
    ranked = sorted(
        (c["rank"], n) for n, c in cells.items() if "rank" in c["groups"] and c["summary"]["val_final"] is not None
    )

    def save(fig, name: str) -> None:
        path = out / name
        fig.tight_layout()
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)

    if len(ranked) >= 2:
        fig, ax = plt.subplots(figsize=(5, 3.4))
        xs = [r for r, _ in ranked]
        ys = [cells[n]["summary"]["val_final"]["mean"] for _, n in ranked]
        es = [cells[n]["summary"]["val_final"]["std"] for _, n in ranked]
        ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label="LoGRA")
        for name, style in (("adamw", "--"), ("lora", ":")):
            s = cells.get(name, {}).get("summary", {}).get("val_final")
            if s:
                ax.axhline(s["mean"], linestyle=style, color="gray", label=cells[name]["groups"]["optimizer"])
        ax.axhline(report["val_start"], color="black", linewidth=0.8, label="before RL")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("sketch rank r")
        ax.set_ylabel("final val pass@1 (greedy)")
        ax.legend(fontsize=7)
        save(fig, "pass1_vs_rank.png")
        recon = [cells[n]["summary"]["recon_cosine"] for _, n in ranked]
        if all(recon):
            fig, ax = plt.subplots(figsize=(5, 3.4))
            ax.errorbar(xs, [s["mean"] for s in recon], yerr=[s["std"] for s in recon], marker="o", capsize=3,
                        label="measured (policy gradient)")  # fmt: skip
            d_ins = target_input_dims()
            grid = [2**k for k in range(1, 8)]
            ax.plot(grid, [statistics.fmean(math.sqrt(min(r, d) / d) for d in d_ins) for r in grid], "k--",
                    label="√(r/d_in): orthogonal projection of a random G")  # fmt: skip
            ax.plot(grid, [statistics.fmean(math.sqrt(min(r, d) / (d + min(r, d))) for d in d_ins) for r in grid],
                    "k:", label="√(r/(d_in+r)): G·PᵀP of a random G")  # fmt: skip
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sketch rank r")
            ax.set_ylabel("reconstruction cosine cos(G, G·PᵀP)")
            ax.legend(fontsize=7)
            save(fig, "recon_cosine_vs_rank.png")
    curves = [n for n in ("logra_r64", "logra", "adamw", "lora") if n in cells]
    if curves:
        fig, ax = plt.subplots(figsize=(5.5, 3.4))
        for name in curves:
            series = [run["curves"].get("train/reward_mean", []) for run in cells[name]["runs"].values()]
            length = min(len(s) for s in series)
            if length == 0:
                continue
            smooth = [rolling_mean([v for _, v in s[:length]], max(1, length // 25)) for s in series]
            steps = [st for st, _ in series[0][:length]]
            mean = [statistics.fmean(col) for col in zip(*smooth, strict=True)]
            std = [statistics.pstdev(col) for col in zip(*smooth, strict=True)]
            label = cells[name]["groups"].get("optimizer", name)
            ax.plot(steps, mean, label=label)
            ax.fill_between(steps, [a - b for a, b in zip(mean, std, strict=True)],
                            [a + b for a, b in zip(mean, std, strict=True)], alpha=0.25)  # fmt: skip
        ax.set_xlabel("update")
        ax.set_ylabel("train reward (rolling mean)")
        ax.set_title(f"band: ± std over {len(report['seeds'])} seeds", fontsize=8)
        ax.legend(fontsize=7)
        save(fig, "reward_curves.png")
    kl = [n for n, c in cells.items() if c["optimizer"] == "logra"]
    pairs = {}
    for name in kl:
        xs, ys = [], []
        for run in cells[name]["runs"].values():
            pred = dict(run["curves"].get("kl/predicted_scaled", []))
            for step, real in run["curves"].get("kl/realized", []):
                if step in pred:
                    xs.append(pred[step])
                    ys.append(real)
        if xs:
            pairs[name] = (xs, ys)
    if pairs:
        fig, ax = plt.subplots(figsize=(4.6, 4.2))
        lo, hi = math.inf, 0.0
        for name, (xs, ys) in pairs.items():
            label = cells[name]["groups"].get("kl") or next(iter(cells[name]["groups"].values()), name)
            ax.scatter(xs, ys, s=3, alpha=0.4, label=label)
            lo, hi = min(lo, *xs, *ys), max(hi, *xs, *ys)
        ax.plot([lo, hi], [lo, hi], "k--", linewidth=0.8, label="realized = predicted")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("predicted KL (α²·pred)")
        ax.set_ylabel("realized KL")
        ax.legend(fontsize=6, markerscale=3)
        save(fig, "kl_realized_vs_predicted.png")
    return written


def target_input_dims() -> list[int]:
    """``d_in`` of every LoGRA target matrix of the tiny policy (for the √(r/d_in) reference).

    Read off the model itself (built on the meta device: shapes only, no memory), so attention layouts whose
    ``o_proj`` input is not the hidden size are counted right.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from logra_pl.models.tiny import build_tiny_model
    from logra_pl.sketch import DEFAULT_TARGETS
    from logra_pl.sketch.targets import select_targets

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(build_tiny_model("tiny")))
    return [linear.in_features for linear in select_targets(model, DEFAULT_TARGETS).values()]


def write_report(report: dict, out: Path, figures: Path | None) -> None:
    """``results.json``, ``results.md`` and the plots; copies the plots to ``figures`` when given."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=1))
    pngs = plots(report, out)
    lines = [f"# Ablation grid `{report['grid']}`", "", table(report), "", "## Findings", ""]
    lines += [f"- {f}" for f in findings(report)]
    lines += ["", f"Grid wall time: {report['wall_s'] / 60:.1f} min.", ""]
    lines += [f"![{p.stem}]({p.name})" for p in pngs]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    if figures is not None:
        figures.mkdir(parents=True, exist_ok=True)
        for p in pngs:
            shutil.copy(p, figures / f"ablate_{p.name}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--grid", choices=sorted([*GRIDS, *PARITY_GRIDS]), default="default")
    parser.add_argument("--quick", action="store_true", help="shorthand for --grid quick (the test suite's run)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default: 0 1 2 (quick: 0 1; demo: 0-4)")
    parser.add_argument("--budget-minutes", type=float, default=75.0, help="wall-time budget of the whole grid")
    parser.add_argument("--updates", type=int, default=None, help="updates per run (overrides --budget-minutes)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, each with cpu_count/jobs threads")
    parser.add_argument("--cells", nargs="+", default=None, help="only these cells of the grid")
    parser.add_argument("--out", type=Path, default=None, help="default: runs/ablate/<grid>")
    parser.add_argument("--figures", type=Path, default=None, help="also copy the plots here (ablate_<plot>.png)")
    parser.add_argument("--diagnostics-every", type=int, default=None, help="SketchDiagnostics period (updates)")
    parser.add_argument(
        "--extra",
        nargs=argparse.REMAINDER,
        default=[],
        help="logra-pl arguments added to every run (last on the command line, so they win), e.g. --extra "
        "--model.logra.update_ratio=0.01; --model.logra.* ones reach LoGRA runs only",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the commands, run nothing")
    args, unknown = parser.parse_known_args(argv)
    if args.grid in PARITY_GRIDS:  # benchmarks/parity.py, with every argument as given
        raise SystemExit(delegate("parity.py", sys.argv[1:] if argv is None else list(argv)))
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    grid = "quick" if args.quick else args.grid
    cells = GRIDS[grid]
    if args.cells:
        unknown = sorted(set(args.cells) - {c.name for c in cells})
        if unknown:
            raise SystemExit(f"unknown cells {unknown} in grid {grid!r}: choose from {[c.name for c in cells]}")
        cells = [c for c in cells if c.name in args.cells]
    seeds = args.seeds if args.seeds is not None else DEFAULT_SEEDS[grid]
    if grid == "quick" and args.updates is None:
        updates: int | None = 8
    elif grid == "demo" and args.updates is None:
        updates = None  # the configs' own length
    else:
        updates = args.updates or plan_updates(cells, seeds, args.budget_minutes, args.jobs)
    out = (args.out or ROOT / "runs" / "ablate" / grid).resolve()
    every = args.diagnostics_every or (max(1, (updates or 800) // 8))
    print(
        f"grid {grid}: {len(cells)} cells x {len(seeds)} seeds, "
        f"{updates if updates is not None else 'config-length'} updates per run, {args.jobs} at a time -> {out}",
        flush=True,
    )
    if args.dry_run:
        for cell in cells:
            folder = out / cell.name / f"seed{seeds[0]}"
            print("logra-pl " + " ".join(run_args(grid, cell, seeds[0], updates, folder, every, args.extra)))
        return
    report = run_grid(grid, cells, seeds, updates, out, args.jobs, every, args.extra)
    write_report(report, out, args.figures)
    print((out / "results.md").read_text())


if __name__ == "__main__":
    main()
