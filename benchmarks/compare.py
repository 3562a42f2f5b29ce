"""Dense AdamW, LoRA and LoGRA, side by side: training state, peak memory and step time on the same model and prompts.

    python benchmarks/compare.py --json out.json [--model-size small|medium | --policy SOURCE] [--steps N]
        [--repeats R] [--rank R] [--lora-alpha A] [--logra-config YAML] [--optimizers adamw lora logra]
        [--mmap-threshold BYTES] [--logprob-chunk N]

Each run is its own fresh process (peaks do not mix), the order alternates between repeats (adamw, lora, logra,
then logra, lora, adamw, ...), and all optimizers see the same prompts, sampling seeds, microbatching and rollout
engine. LoRA (``LoRAMethod``: peft adapters on the same target matrices LoGRA sketches, trained by the same
AdamW settings as the dense baseline) runs at LoGRA's rank (``--rank``) with ``alpha`` = ``--lora-alpha``
(default 2 × rank). Per run: training state by kind (``memory_report``: weights, gradients, optimizer state,
adapters and the adapters' optimizer state, sketches, ...) and the planner's prediction of it, the process's
peak RSS during updates (and CUDA peaks on GPUs), the medians of step / rollout / train / update seconds, and
the bytes an update sends to a remote rollout engine (LoGRA: the serialized factor payload; AdamW: the changed
tensors in bf16; LoRA: the merged target matrices in bf16, as engines never see adapters). The first
``--warmup`` updates of each run are left out of the time medians. The JSON's ``runs`` holds the medians over
repeats, ``per_run`` every run's own numbers (in its optimizer's run order), to see the spread.
``--mmap-threshold`` starts the runs with glibc's ``MALLOC_MMAP_THRESHOLD_`` set (a fixed threshold instead of
glibc's dynamic one), to measure what the allocator's choices do to peak RSS and step time.

The table and the JSON ``ratios`` compare lora/adamw, logra/adamw and logra/lora (keys
``<a>_vs_<b>_<metric>``, e.g. ``logra_vs_adamw_state``, ``lora_vs_adamw_step_time``, ``logra_vs_lora_peak``),
for the pairs whose optimizers ran.

``--policy`` takes any policy source instead of a tiny preset (``smollm2``: SmolLM2-135M-Instruct, a pretrained model
whose state matters). LoGRA runs with ``LoGRAConfig``'s defaults (the default rule: Adam in sketch space on a fixed
projection) at ``--rank`` (and ``update_ratio`` 1e-3, which only the ratio step reads), or with
the ``model.logra`` section of ``--logra-config`` (e.g. ``configs/overlays/paper_logra.yaml`` for the paper's rule).

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

OPTIMIZERS = ("adamw", "lora", "logra")
PAIRS = (("lora", "adamw"), ("logra", "adamw"), ("logra", "lora"))  # (numerator, denominator) of the ratios
TASK = {"chain_sum": {"config": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}}}


def run_worker(args: argparse.Namespace) -> None:
    """One optimizer, one process: train ``warmup + steps`` updates and write the measurements as JSON."""
    from logra_pl.callbacks.memory import peak_rss_lifetime_bytes, rss_bytes

    baseline_rss = rss_bytes()  # before any model exists (interpreter + libraries)
    import lightning.pytorch as pl

    from logra_pl.callbacks import MemoryMonitor, PolicySync
    from logra_pl.data import ReasoningGymDataModule
    from logra_pl.methods import DenseAdamW, LoGRAMethod, LoRAMethod
    from logra_pl.methods.adamw import AdamWConfig
    from logra_pl.methods.lora import LoRAConfig, lora_layers
    from logra_pl.methods.memory_plan import plan
    from logra_pl.module import LoGRAPolicyModule, RolloutSettings
    from logra_pl.sketch import LoGRAConfig

    pl.seed_everything(0, verbose=False)
    policy = args.policy or f"tiny:{args.model_size}"
    lora = LoRAConfig(rank=args.rank, alpha=args.lora_alpha if args.lora_alpha is not None else 2.0 * args.rank)
    methods = {
        "logra": lambda: LoGRAMethod(
            LoGRAConfig(**{"update_ratio": 1e-3, **logra_section(args.logra_config), "rank": args.rank})
        ),
        "adamw": lambda: DenseAdamW(AdamWConfig(lr=1e-5)),
        "lora": lambda: LoRAMethod(lora, AdamWConfig(lr=1e-5)),
    }
    module = LoGRAPolicyModule(
        policy=policy,
        method=methods[args.worker](),
        rollout=RolloutSettings(
            max_new_tokens=args.max_new_tokens, max_batch=args.prompts, share_weights=not args.engine_copy
        ),
        microbatch_size=args.microbatch,
        logprob_chunk_tokens=args.logprob_chunk,
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
            elif args.worker == "lora":  # the merged target matrices in bf16 (engines never see adapters)
                layers = lora_layers(pl_module.policy).values()
                row["wire_bytes"] = float(2 * sum(layer.base_layer.weight.numel() for layer in layers))
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
    if args.worker == "logra":  # the method as it ran plans itself
        from logra_pl.methods.memory_plan import plan_shapes

        planned_total = module.method.plan_memory(plan_shapes(policy)).total
    else:
        planned = plan(policy, ranks=1, rank_r=args.rank, optimizers=[args.worker])
        planned_total = planned[args.worker].report.total
    result = {
        "optimizer": args.worker,
        "model": policy,
        "parameters": sum(p.numel() for n, p in module.policy.named_parameters() if ".lora_" not in n),
        "adapter_parameters": sum(p.numel() for n, p in module.policy.named_parameters() if ".lora_" in n),
        "updates": len(rows),
        "state_bytes": last["memory/state_bytes"],
        "state_by_kind": {k.split("/")[-1]: v for k, v in last.items() if k.startswith("memory/state/")},
        "planned_state_bytes": planned_total,
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
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "rank": args.rank,
        "wall_seconds": time.perf_counter() - start,
    }
    if args.worker == "lora":
        result["lora_alpha"] = module.method.lora.alpha
    if "memory/cuda_peak_allocated_bytes" in last:
        result["cuda_peak_allocated_bytes"] = max(r["memory/cuda_peak_allocated_bytes"] for r in rows)
        result["cuda_peak_reserved_bytes"] = max(r["memory/cuda_peak_reserved_bytes"] for r in rows)
    Path(args.result).write_text(json.dumps(result, indent=2))


def logra_section(path: str | None) -> dict:
    """The ``model.logra`` section of a config file (``{}`` without one): LoGRA's settings for its runs."""
    if not path:
        return {}
    import yaml

    model = (yaml.safe_load(Path(path).read_text()) or {}).get("model") or {}
    section = (model.get("method") or {}).get("init_args", {}).get("logra") or model.get("logra") or {}
    return dict(section)


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
    parser.add_argument("--policy", help="any policy source instead of tiny:<model-size> (e.g. smollm2)")
    parser.add_argument("--logra-config", help="a config whose model.logra section LoGRA runs with; default: defaults")
    parser.add_argument("--steps", type=int, default=6, help="timed updates per run; default 6")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first updates per run; default 2")
    parser.add_argument("--repeats", type=int, default=2, help="runs per optimizer, order alternating; default 2")
    parser.add_argument("--rank", type=int, default=64, help="LoGRA sketch rank and LoRA adapter rank; default 64")
    parser.add_argument("--lora-alpha", type=float, help="LoRA scale numerator (ΔW = alpha/rank·BA); default 2×rank")
    parser.add_argument(
        "--optimizers",
        nargs="+",
        choices=OPTIMIZERS,
        default=list(OPTIMIZERS),
        help="which to run (in this order on even repeats, reversed on odd ones); default adamw lora logra",
    )
    parser.add_argument("--prompts", type=int, default=16, help="prompts per update; default 16")
    parser.add_argument("--microbatch", type=int, default=2, help="responses per backward; default 2")
    parser.add_argument("--engine-copy", action="store_true", help="give the HF engine its own copy of the weights")
    parser.add_argument(
        "--logprob-chunk", type=int, help="model.logprob_chunk_tokens (chunked log-probs) in every run; default: off"
    )
    parser.add_argument("--max-new-tokens", type=int, default=16, help="response limit; default 16")
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        help="run the workers with MALLOC_MMAP_THRESHOLD_=BYTES (glibc: blocks this large are mapped on their own "
        "and unmapped when freed; fixed, where glibc's default threshold rises after each such free); default unset",
    )
    parser.add_argument("--worker", choices=OPTIMIZERS, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.lora_alpha is None:
        args.lora_alpha = 2.0 * args.rank
    if args.worker:
        run_worker(args)
        return

    from logra_pl.models.load import resolve_source

    resolve_source(args.policy or f"tiny:{args.model_size}")  # build and cache the model once, outside the timed runs
    names = [name for name in OPTIMIZERS if name in args.optimizers]  # canonical order, each once
    shared = ["--model-size", args.model_size, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    shared += ["--policy", args.policy] if args.policy else []
    shared += ["--logra-config", args.logra_config] if args.logra_config else []
    shared += ["--rank", str(args.rank), "--lora-alpha", repr(args.lora_alpha)]
    shared += ["--prompts", str(args.prompts), "--microbatch", str(args.microbatch)]
    shared += ["--max-new-tokens", str(args.max_new_tokens)] + (["--engine-copy"] if args.engine_copy else [])
    shared += ["--logprob-chunk", str(args.logprob_chunk)] if args.logprob_chunk else []
    env = dict(os.environ)
    if args.mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    results: dict[str, list[dict]] = {name: [] for name in names}
    order: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for name in names if i % 2 == 0 else names[::-1]:
                out = Path(tmp) / f"{name}-{i}.json"
                cmd = [sys.executable, __file__, "--worker", name, "--result", str(out), *shared]
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if proc.returncode != 0:
                    sys.exit(f"the {name} run failed:\n{proc.stderr[-3000:]}")
                results[name].append(json.loads(out.read_text()))
                order.append(name)
                print(f"  {name} run {i + 1}/{args.repeats}: {results[name][-1]['wall_seconds']:.0f} s", flush=True)
    runs = {name: aggregate(r) for name, r in results.items()}
    report = {"runs": runs, "ratios": ratios(runs), "order": order, "settings": vars(args) | {"worker": None}}
    report["per_run"] = results  # every run's own numbers (``runs`` holds their medians): spread, load noise
    print(table(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))


def _ratio(x: float, y: float) -> float | None:
    """``x / y``; None where ``y`` is 0 (JSON has no NaN)."""
    return x / y if y else None


def ratios(runs: dict[str, dict]) -> dict[str, float | None]:
    """``<a>_vs_<b>_<metric>`` for every pair of :data:`PAIRS` whose two optimizers ran."""
    out: dict[str, float | None] = {}
    for num, den in PAIRS:
        if num not in runs or den not in runs:
            continue
        a, b, key = runs[den], runs[num], f"{num}_vs_{den}"
        out[f"{key}_state"] = _ratio(b["state_bytes"], a["state_bytes"])
        out[f"{key}_peak"] = _ratio(b["peak_rss_bytes"], a["peak_rss_bytes"])
        out[f"{key}_peak_above_baseline"] = _ratio(
            b["peak_rss_bytes"] - b["baseline_rss_bytes"], a["peak_rss_bytes"] - a["baseline_rss_bytes"]
        )
        out[f"{key}_step_time"] = _ratio(b["step_seconds_median"], a["step_seconds_median"])
        out[f"{key}_rollout_time"] = _ratio(b["rollout_seconds_median"], a["rollout_seconds_median"])
        out[f"{key}_train_time"] = _ratio(b["train_seconds_median"], a["train_seconds_median"])
        out[f"{key}_update_time"] = _ratio(b["update_seconds_median"], a["update_seconds_median"])
        out[f"{key}_sync_bytes"] = _ratio(b["sync_payload_bytes"], a["sync_payload_bytes"])
        if "cuda_peak_allocated_bytes" in a and "cuda_peak_allocated_bytes" in b:
            out[f"{key}_cuda_peak"] = _ratio(b["cuda_peak_allocated_bytes"], a["cuda_peak_allocated_bytes"])
    return out


def table(report: dict) -> str:
    """The side-by-side table printed at the end (MiB and seconds): one column per optimizer, then the ratios."""
    runs = report["runs"]
    names = [name for name in OPTIMIZERS if name in runs]
    pairs = [(num, den) for num, den in PAIRS if num in runs and den in runs]
    mib = 2**20
    kinds: list[str] = []
    for run in runs.values():
        kinds += [k for k, v in run["state_by_kind"].items() if v and k not in kinds]

    def kind(name: str):
        return lambda r: r["state_by_kind"].get(name, 0.0) / mib

    rows = [("training state (MiB)", lambda r: r["state_bytes"] / mib)]
    rows += [(f"  {k.replace('_', ' ')}", kind(k)) for k in kinds]
    rows += [
        ("  planner prediction", lambda r: r["planned_state_bytes"] / mib),
        ("peak RSS in updates (MiB)", lambda r: r["peak_rss_bytes"] / mib),
        ("  RSS before the model", lambda r: r["baseline_rss_bytes"] / mib),
        ("step s (median, with sync)", lambda r: r["step_seconds_median"]),
        ("  rollout s", lambda r: r["rollout_seconds_median"]),
        ("  train s (fwd+bwd)", lambda r: r["train_seconds_median"]),
        ("  update s (optimizer step)", lambda r: r["update_seconds_median"]),
        ("  sync s (to the engine)", lambda r: r["sync_seconds_median"]),
        ("sync bytes per update (MiB)", lambda r: r["sync_payload_bytes"] / mib),
    ]
    if all("cuda_peak_allocated_bytes" in r for r in runs.values()):
        rows.append(("CUDA peak allocated (MiB)", lambda r: r["cuda_peak_allocated_bytes"] / mib))
    first = runs[names[0]]
    title = f"\n{first['model']} ({first['parameters'] / 1e6:.1f}M parameters"
    if "lora" in runs:
        lora = runs["lora"]
        adapters = lora["adapter_parameters"] / 1e6
        title += f"; LoRA rank {lora['rank']:g}, alpha {lora['lora_alpha']:g}: {adapters:.2f}M adapter parameters"
    lines = [title + f"), order {' '.join(report['order'])}"]
    header = f"{'':<30}" + "".join(f"{n:>12}" for n in names) + "".join(f"{f'{a}/{b}':>13}" for a, b in pairs)
    lines.append(header)
    for label, value in rows:
        cells = {n: value(runs[n]) for n in names}
        line = f"{label:<30}" + "".join(f"{cells[n]:>12.3f}" for n in names)
        for a, b in pairs:
            line += f"{cells[a] / cells[b]:>13.3f}" if cells[b] else f"{'-':>13}"
        lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
