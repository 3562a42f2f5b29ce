"""What the grid harnesses share — ``ablate.py`` (the paper's ablations) and ``parity.py`` (the fair LoGRA vs tuned
AdamW protocol) — with no import between the two: where the repository is, the base config, the cost model, how a
run is launched (``logra-pl`` in a child process, its threads and log), how a finished run is recognised when a grid
resumes (its settings key; committed ``result.json`` files keep arguments relative to the checkout), how its
TensorBoard scalars are read back and summarised, and how seeds are aggregated (mean ± std).
"""

from __future__ import annotations

import hashlib
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
BASE = "configs/tiny_cpu.yaml"
# The grids' settings keys were first written from configs in the short form of an update method (model.optimizer
# with the model.logra / adamw / lora sections): the grids read the configs in that form, so a finished run keeps its
# key, and write it into their runs' configs (the CLI translates it to model.method).
SHORT_FORM_OF = {
    "logra_pl.methods.LoGRAMethod": "logra",
    "logra_pl.methods.DenseAdamW": "adamw",
    "logra_pl.methods.LoRAMethod": "lora",
}


def short_method_form(model: Mapping[str, Any] | None, base: bool = False) -> dict[str, Any]:
    """A config's ``model`` mapping with a built-in ``model.method`` (LoGRA, AdamW, LoRA) written in the short form
    the grids' keys were made from, as the configs said it: the sections of ``init_args``; ``optimizer`` in the base
    config (``base``) and in the overlays of another method, which also dropped the base's LoGRA section
    (``logra: null``); an overlay of LoGRA's gave its section alone. Anything else is returned as it is."""
    out = dict(model or {})
    method = out.get("method")
    if not isinstance(method, Mapping) or method.get("class_path") not in SHORT_FORM_OF:
        return out
    kind = SHORT_FORM_OF[method["class_path"]]
    del out["method"]
    head: dict[str, Any] = {"optimizer": kind} if base or kind != "logra" else {}
    head |= {"logra": None} if kind != "logra" else {}
    return out | head | dict(method.get("init_args") or {})


SCALARS = (
    "train/reward_mean",
    "val/pass@1",
    "val/tune/pass@1",
    "val/report/pass@1",
    "kl/realized",
    "kl/predicted_scaled",
    "kl/effective_budget",
    "kl/alpha",
    "logra/recon_cosine",
    "logra/captured_energy",
)


VALIDATIONS = 4  # validations per run (the last one at the final update)
# Seconds on this project's 2-core CPU with one thread per run and two runs at a time (measured with this harness):
# process start-up and model build, one validation of 256 problems, and one update per optimizer (64 prompts).
COSTS = {"startup": 25.0, "validation": 6.0, "logra": 0.32, "adamw": 0.22, "lora": 0.26}


# ------------------------------------------------------------------------------------------------ runs
def settings_key(args: Sequence[str]) -> str:
    """What a finished run is matched on when resuming: its arguments, minus where it writes."""
    kept = [a for a in args if not a.startswith("--trainer.logger.init_args.save_dir")]
    return hashlib.sha256("\0".join(kept).encode()).hexdigest()[:16]


def recorded_args(args: Sequence[str]) -> list[str]:
    """A run's arguments as its ``result.json`` keeps them: paths under the checkout relative to it (``./results/…``),
    so committed results name no machine's folders (the settings key ignores where a run writes)."""
    root = str(ROOT)
    return [a.replace(f"={root}/", "=./").replace(root, ".") for a in args]


def logra_pl_command() -> list[str]:
    """The ``logra-pl`` command of this interpreter (the checkout's package, whatever is on PATH)."""
    return [sys.executable, "-c", "from logra_pl.cli import main; main()"]


def run_one(cmd: list[str], folder: Path, threads: int, log_name: str = "run.log") -> float:
    """Run ``cmd`` in the checkout with ``threads`` BLAS threads, its output in ``folder/log_name``; its wall seconds
    (a failure raises with the log's last lines)."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(folder / log_name, "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        tail = (folder / log_name).read_text().splitlines()[-15:]
        raise RuntimeError(f"run in {folder} failed (exit {proc.returncode}); last lines:\n" + "\n".join(tail))
    return wall


# ``--extra`` overrides that change what the baseline validation sees (the policy before any update, the problems).
BASELINE_EXTRA = ("--model.policy", "--model.warm_start", "--model.rollout.val", "--model.answer_format", "--data.")


# ------------------------------------------------------------------------------------------------ reading runs
def read_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the TensorBoard event files under ``folder``, as ``tag -> [(step, value)]`` sorted by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found: dict[str, dict[int, float]] = {}
    for events in sorted(folder.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0, "images": 1, "tensors": 1})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            for ev in acc.Scalars(tag):
                found.setdefault(tag, {})[int(ev.step)] = float(ev.value)
    return {tag: sorted(points.items()) for tag, points in found.items()}


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def summarize_run(scalars: dict[str, list[tuple[int, float]]], val0: float, wall_s: float) -> dict:
    """One run's numbers: final val pass@1 and its change from the start, reward gain, recon cosine, KL."""
    rewards = [v for _, v in scalars.get("train/reward_mean", [])]
    n = len(rewards)
    window = max(10, n // 10) if n >= 20 else max(1, n // 2)  # short (smoke) runs: halves
    gain = mean(rewards[-window:]) - mean(rewards[:window]) if n >= 2 * window else float("nan")
    val = scalars.get("val/pass@1", [])
    realized = [v for _, v in scalars.get("kl/realized", [])]
    budget = dict(scalars.get("kl/effective_budget", []))
    realized_steps = dict(scalars.get("kl/realized", []))
    paired = [(realized_steps[s], budget[s]) for s in realized_steps if s in budget]
    recon = [v for _, v in scalars.get("logra/recon_cosine", [])]
    energy = [v for _, v in scalars.get("logra/captured_energy", [])]
    return {
        "updates": n,
        "wall_s": wall_s,
        "reward_first": mean(rewards[:window]),
        "reward_last": mean(rewards[-window:]),
        "reward_gain": gain,
        "reward_window": window,
        "val_start": val0,
        "val_final": val[-1][1] if val else float("nan"),
        "val_gain": (val[-1][1] - val0) if val else float("nan"),
        "recon_cosine": mean(recon),
        "captured_energy": mean(energy),
        "kl_realized": mean(realized),
        "kl_realized_over_budget": (mean([r for r, _ in paired]) / mean([b for _, b in paired])) if paired else None,
        "curves": {tag: scalars[tag] for tag in SCALARS if tag in scalars},
    }


def training_state_bytes(scalars: Mapping[str, list[tuple[int, float]]]) -> float | None:
    """Peak over updates of the bytes held for training besides the weights (MemoryMonitor's state by kind, counted
    before each optimizer step: AdamW's gradients and LoGRA's filled sketches both exist then)."""
    total = dict(scalars.get("memory/state_bytes", []))
    weights = dict(scalars.get("memory/state/weights", []))
    held = [total[s] - weights[s] for s in total if s in weights]
    return max(held) if held else None


AGGREGATED = (
    "updates",
    "wall_s",
    "reward_first",
    "reward_last",
    "reward_gain",
    "val_start",
    "val_final",
    "val_gain",
    "recon_cosine",
    "captured_energy",
    "kl_realized",
    "kl_realized_over_budget",
)


def aggregate(runs: Sequence[dict], keys: Sequence[str] = AGGREGATED) -> dict:
    """Mean and sample std over seeds of each number of ``keys`` (None where no run has a finite one)."""
    out = {}
    for key in keys:
        values = [r[key] for r in runs if r.get(key) is not None and math.isfinite(r[key])]
        if not values:
            out[key] = None
            continue
        out[key] = {
            "mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values),
            "max": max(values),
            "n": len(values),
        }
    return out


def pm(stat: dict | None, digits: int = 3, signed: bool = False) -> str:
    """``mean ± std`` of an aggregated number (``–`` when there is none)."""
    if stat is None:
        return "–"
    sign = "+" if signed else ""
    return f"{stat['mean']:{sign}.{digits}f} ± {stat['std']:.{digits}f}"


def rolling_mean(values: list[float], width: int) -> list[float]:
    """The mean of the last ``width`` values at each position (fewer at the start), for smoothed curves."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= width:
            acc -= values[i - width]
        out.append(acc / min(i + 1, width))
    return out


def delegate(script: str, argv: Sequence[str]) -> int:
    """Run another harness of this folder with ``argv`` in a child process (``ablate.py --grid parity`` runs
    ``parity.py``): its exit status."""
    return subprocess.run([sys.executable, str(Path(__file__).with_name(script)), *argv], cwd=ROOT).returncode
