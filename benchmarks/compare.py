"""LoGRA vs dense AdamW, side by side: training state, peak memory and step time on the same model and prompts.

    python benchmarks/compare.py --json out.json [--model-size small|medium] [--steps N] [--repeats R]

Each run is its own fresh process (peaks do not mix), the order alternates between repeats (adamw, logra, then
logra, adamw, ...), and both optimizers see the same prompts, sampling seeds, microbatching and rollout engine.
Per run: training state by kind (``memory_report``) and the planner's prediction of it, the process's peak RSS
during updates (and CUDA peaks on GPUs), the medians of step / rollout / train / update seconds, and the bytes
an update sends to a remote rollout engine (LoGRA: the serialized factor payload; AdamW: the changed tensors in
bf16). The first ``--warmup`` updates of each run are left out of the time medians.

By default the HF rollout engine generates with the trainer's own weights (``rollout.share_weights``), as the
training process holds no engine copy when vLLM runs on other devices (the paper's setup);
``--engine-copy`` gives the engine a private copy (then each update is synced to it: factors or full tensors).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

OPTIMIZERS = ("adamw", "logra")
TASK = {"chain_sum": {"config": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}}}


def run_worker(args: argparse.Namespace) -> None:
    """One optimizer, one process: train ``warmup + steps`` updates and write the measurements as JSON."""
    from logra_pl.callbacks.memory import peak_rss_lifetime_bytes, rss_bytes

    baseline_rss = rss_bytes()  # before any model exists (interpreter + libraries)
    import lightning.pytorch as pl

    from logra_pl.callbacks import MemoryMonitor, PolicySync
    from logra_pl.data import ReasoningGymDataModule
    from logra_pl.memory import plan
    from logra_pl.models.load import resolve_source
    from logra_pl.module import LoGRAPolicyModule, RolloutSettings
    from logra_pl.optim import AdamWConfig
    from logra_pl.sketch import LoGRAConfig

    pl.seed_everything(0, verbose=False)
    policy = f"tiny:{args.model_size}"
    module = LoGRAPolicyModule(
        policy=policy,
        optimizer=args.worker,
        logra=LoGRAConfig(rank=args.rank, update_ratio=1e-3),
        adamw=AdamWConfig(lr=1e-5),
        rollout=RolloutSettings(
            max_new_tokens=args.max_new_tokens, max_batch=args.prompts, share_weights=not args.engine_copy
        ),
        microbatch_size=args.microbatch,
        seed=0,
    )
    data = ReasoningGymDataModule(
        TASK, train_size=512, eval_size=16, prompts_per_step=args.prompts, eval_batch_size=16, seed=0
    )
    monitor = MemoryMonitor(image_every=0)
    callbacks: list[pl.Callback] = []
    if args.engine_copy:
        callbacks.append(PolicySync(mode="factors" if args.worker == "logra" else "full", verify_every=0))
    rows: list[dict[str, float]] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            row = {k: float(v) for k, v in pl_module.step_context.metrics.items()}
            row.setdefault("sync/seconds", 0.0)
            row["cycle_s"] = row["time/step_s"] + row["sync/seconds"]  # rollout + train + step + engine sync
            if args.worker == "logra":  # what a remote engine receives: the serialized factor payload
                row["wire_bytes"] = float(len(pl_module.optimizers().optimizer.last_payload.to_bytes()))
            else:  # the changed tensors in bf16
                row["wire_bytes"] = float(2 * sum(p.numel() for p in pl_module.policy.parameters() if p.requires_grad))
            rows.append(row)

    trainer = pl.Trainer(
        max_steps=args.warmup + args.steps,
        accelerator="auto",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[*callbacks, monitor, Record()],
    )
    start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    timed = rows[args.warmup :]

    def median(key: str) -> float:
        return statistics.median(r[key] for r in timed)

    last = rows[-1]
    planned = plan(resolve_source(policy).location, ranks=1, rank_r=args.rank, optimizers=[args.worker])
    result = {
        "optimizer": args.worker,
        "model": policy,
        "parameters": sum(p.numel() for p in module.policy.parameters()),
        "updates": len(rows),
        "state_bytes": last["memory/state_bytes"],
        "state_by_kind": {k.split("/")[-1]: v for k, v in last.items() if k.startswith("memory/state/")},
        "planned_state_bytes": planned[args.worker].report.total,
        "peak_rss_bytes": max(r["memory/peak_rss_bytes"] for r in rows),
        "baseline_rss_bytes": baseline_rss,
        "process_peak_rss_bytes": peak_rss_lifetime_bytes(),
        "step_seconds_median": median("cycle_s"),
        "rollout_seconds_median": median("time/rollout_s"),
        "train_seconds_median": median("time/train_s"),
        "update_seconds_median": median("time/update_s"),
        "sync_seconds_median": median("sync/seconds"),
        "sync_payload_bytes": median("wire_bytes"),
        "engine_copy": bool(args.engine_copy),
        "wall_seconds": time.perf_counter() - start,
    }
    if "memory/cuda_peak_allocated_bytes" in last:
        result["cuda_peak_allocated_bytes"] = max(r["memory/cuda_peak_allocated_bytes"] for r in rows)
        result["cuda_peak_reserved_bytes"] = max(r["memory/cuda_peak_reserved_bytes"] for r in rows)
    Path(args.result).write_text(json.dumps(result, indent=2))


def aggregate(runs: list[dict]) -> dict:
    """Median over repeats of every number; the first run's non-numeric fields."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in runs)
    out["repeats"] = len(runs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--model-size", default="medium", choices=["tiny", "small", "medium"])
    parser.add_argument("--steps", type=int, default=6, help="timed updates per run; default 6")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first updates per run; default 2")
    parser.add_argument("--repeats", type=int, default=2, help="runs per optimizer, order alternating; default 2")
    parser.add_argument("--rank", type=int, default=64, help="LoGRA sketch rank; default 64")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per update; default 16")
    parser.add_argument("--microbatch", type=int, default=2, help="responses per backward; default 2")
    parser.add_argument("--engine-copy", action="store_true", help="give the HF engine its own copy of the weights")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="response limit; default 16")
    parser.add_argument("--worker", choices=OPTIMIZERS, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return

    from logra_pl.models.load import resolve_source

    resolve_source(f"tiny:{args.model_size}")  # build and cache the model once, outside the timed runs
    shared = ["--model-size", args.model_size, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    shared += ["--rank", str(args.rank), "--prompts", str(args.prompts), "--microbatch", str(args.microbatch)]
    shared += ["--max-new-tokens", str(args.max_new_tokens)] + (["--engine-copy"] if args.engine_copy else [])
    results: dict[str, list[dict]] = {name: [] for name in OPTIMIZERS}
    order: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for name in OPTIMIZERS if i % 2 == 0 else OPTIMIZERS[::-1]:
                out = Path(tmp) / f"{name}-{i}.json"
                cmd = [sys.executable, __file__, "--worker", name, "--result", str(out), *shared]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    sys.exit(f"the {name} run failed:\n{proc.stderr[-3000:]}")
                results[name].append(json.loads(out.read_text()))
                order.append(name)
                print(f"  {name} run {i + 1}/{args.repeats}: {results[name][-1]['wall_seconds']:.0f} s", flush=True)
    runs = {name: aggregate(r) for name, r in results.items()}
    a, b = runs["adamw"], runs["logra"]
    ratios = {
        "logra_vs_adamw_state": b["state_bytes"] / a["state_bytes"],
        "logra_vs_adamw_peak": b["peak_rss_bytes"] / a["peak_rss_bytes"],
        "logra_vs_adamw_peak_above_baseline": (b["peak_rss_bytes"] - b["baseline_rss_bytes"])
        / (a["peak_rss_bytes"] - a["baseline_rss_bytes"]),
        "logra_vs_adamw_step_time": b["step_seconds_median"] / a["step_seconds_median"],
        "logra_vs_adamw_train_time": b["train_seconds_median"] / a["train_seconds_median"],
        "logra_vs_adamw_sync_bytes": b["sync_payload_bytes"] / a["sync_payload_bytes"],
    }
    if "cuda_peak_allocated_bytes" in a:
        ratios["logra_vs_adamw_cuda_peak"] = b["cuda_peak_allocated_bytes"] / a["cuda_peak_allocated_bytes"]
    report = {"runs": runs, "ratios": ratios, "order": order, "settings": vars(args) | {"worker": None}}
    print(table(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))


def table(report: dict) -> str:
    """The side-by-side table printed at the end (MiB and seconds)."""
    a, b = report["runs"]["adamw"], report["runs"]["logra"]
    mib = 2**20
    rows = [
        ("training state (MiB)", a["state_bytes"] / mib, b["state_bytes"] / mib),
        ("  planner prediction", a["planned_state_bytes"] / mib, b["planned_state_bytes"] / mib),
        ("peak RSS in updates (MiB)", a["peak_rss_bytes"] / mib, b["peak_rss_bytes"] / mib),
        ("  RSS before the model", a["baseline_rss_bytes"] / mib, b["baseline_rss_bytes"] / mib),
        ("step s (median, with sync)", a["step_seconds_median"], b["step_seconds_median"]),
        ("  rollout s", a["rollout_seconds_median"], b["rollout_seconds_median"]),
        ("  train s (fwd+bwd)", a["train_seconds_median"], b["train_seconds_median"]),
        ("  update s (optimizer step)", a["update_seconds_median"], b["update_seconds_median"]),
        ("  sync s (to the engine)", a["sync_seconds_median"], b["sync_seconds_median"]),
        ("sync bytes per update (MiB)", a["sync_payload_bytes"] / mib, b["sync_payload_bytes"] / mib),
    ]
    if "cuda_peak_allocated_bytes" in a:
        cuda = a["cuda_peak_allocated_bytes"] / mib, b["cuda_peak_allocated_bytes"] / mib
        rows.append(("CUDA peak allocated (MiB)", *cuda))
    lines = [f"\n{a['model']} ({a['parameters'] / 1e6:.1f}M parameters), order {' '.join(report['order'])}"]
    lines.append(f"{'':<30}{'adamw':>12}{'logra':>12}{'logra/adamw':>14}")
    for name, x, y in rows:
        lines.append(f"{name:<30}{x:>12.3f}{y:>12.3f}{(y / x if x else float('nan')):>14.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
