"""Asynchronous rollouts against synchronous ones: updates per minute and reward per wall-clock minute, side by side.

    PYTHONPATH=. python benchmarks/async_speed.py [--policy tiny:small] [--staleness 0 1 2] [--seeds 0 1 2]
        [--updates 60] [--max-new-tokens 48] [--out runs/async_speed]

The paper's topology on one machine: a real ``logra-pl serve`` engine in its own process (one thread) and a
``logra-pl fit`` trainer (``configs/tiny_cpu_served.yaml``, one thread) reaching it over HTTP, so generation and
training can overlap only when rollouts are sampled ahead. Each (staleness, seed) run trains ``--updates`` updates
with ``--model.rollout.max_staleness`` set; every other setting is the same. Per run, from its TensorBoard events:
updates per minute over the updates after the first ``--skip`` (startup and the first full sync left out), the
reward gain, reward per minute, the last validation's pass@1, the mean ``async/trainer_wait_s``, and where an
update's seconds go (``time/rollout_s``: the trainer's rollout phase, waiting included; ``time/train_s``;
``time/update_s``; ``async/engine_idle_s``: generation capacity that overlap left unused).

Finished runs are reused (``<out>/k<k>/seed<s>/result.json``); ``<out>/results.json`` holds every run and the
mean ± std per staleness, ``<out>/async_speed.png`` the reward against wall time. Run it alone: the two processes
need the two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from parity import MODEL_ARGS

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny_cpu_served.yaml"


def scalars(run: Path) -> dict[str, list[tuple[float, int, float]]]:
    """``tag -> [(wall time, step, value)]`` over a run folder's event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[float, int, float]]] = {}
    for events in sorted(run.glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.wall_time, e.step, e.value) for e in acc.Scalars(tag))
    return {tag: sorted(v, key=lambda x: x[1]) for tag, v in out.items()}


def summarize(run: Path, skip: int) -> dict[str, float]:
    """The numbers of one run (see the module docstring)."""
    s = scalars(run)
    reward = s["train/reward_mean"]
    timed = reward[skip:]
    minutes = (timed[-1][0] - timed[0][0]) / 60.0
    updates_per_min = (len(timed) - 1) / minutes if minutes > 0 else float("nan")
    k = max(1, len(reward) // 5)  # reward gain: the last fifth's mean over the first fifth's
    gain = statistics.fmean(v for _, _, v in reward[-k:]) - statistics.fmean(v for _, _, v in reward[:k])
    wall_min = (reward[-1][0] - reward[0][0]) / 60.0
    out = {
        "updates": float(len(reward)),
        "updates_per_min": updates_per_min,
        "reward_gain": gain,
        "reward_gain_per_min": gain / wall_min if wall_min > 0 else float("nan"),
        "wall_min": wall_min,
        "trainer_wait_s": statistics.fmean(v for _, _, v in s.get("async/trainer_wait_s", [(0, 0, 0.0)])),
    }
    # Where an update's seconds go (means over the timed updates): the rollout phase as the trainer sees it (waiting
    # for responses, scoring them, its own log-probs of them), the loss and backward, the optimizer step, and the
    # engine's idle seconds per update (asynchronous runs only: how much generation capacity overlap left unused).
    for key, tag in (("rollout_s", "time/rollout_s"), ("train_s", "time/train_s"), ("update_s", "time/update_s")):
        if tag in s:
            out[key] = statistics.fmean(v for _, _, v in s[tag][skip:])
    if "async/engine_idle_s" in s:
        out["engine_idle_s"] = statistics.fmean(v for _, _, v in s["async/engine_idle_s"][skip:])
    if "val/pass@1" in s:
        out["val_pass@1"] = s["val/pass@1"][-1][2]
    out["curve"] = [(t - reward[0][0], v) for t, _, v in reward]  # type: ignore[assignment]
    return out


def fit(url: str, folder: Path, k: int, seed: int, args: argparse.Namespace) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "logra_pl.cli", "fit", f"--config={CONFIG}", f"--model.policy={args.policy}"]
    cmd += [f"--model.engine.init_args.urls=[{url}]", f"--trainer.max_steps={args.updates}"]
    cmd += [f"--trainer.val_check_interval={args.updates}", f"--model.rollout.max_staleness={k}"]
    cmd += [f"--model.rollout.max_new_tokens={args.max_new_tokens}", f"--seed_everything={seed}"]
    cmd += [f"--model.seed={seed}", f"--model.logra.base_seed={seed}", "--trainer.enable_progress_bar=false"]
    cmd += [f"--trainer.logger.init_args.save_dir={folder}", "--trainer.logger.init_args.name=tb"]
    cmd += ["--trainer.logger.init_args.version=0", "--checkpoint.every_n_updates=0", "--checkpoint.at_end=false"]
    # The parity protocol's warm start (configs/tiny_cpu.yaml's 1500 steps, and the model's own settings): cached
    # once, the same policy every run starts from.
    cmd += ["--model.warm_start.steps=1500", *MODEL_ARGS.get(args.policy, ()), *args.extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.setdefault("LOGRA_PL_API_KEY", "async-speed")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)


def _mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample std over seeds (std 0 for one seed)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _cell(summary: dict, key: str, digits: int = 3) -> str:
    mean, std = summary.get(key, (float("nan"), float("nan")))
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def table(results: dict) -> str:
    rows = [
        "| staleness | updates / min | reward gain | gain / min | val pass@1 | trainer wait s | rollout s "
        "| train s | engine idle s | vs k=0 |"
    ]
    rows.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    base = results["summary"].get("0", {}).get("updates_per_min", [None])[0]
    for k, m in sorted(results["summary"].items()):
        ratio = f"{m['updates_per_min'][0] / base:.2f}×" if base else "-"
        cells = [_cell(m, "updates_per_min", 2), _cell(m, "reward_gain"), _cell(m, "reward_gain_per_min")]
        cells += [_cell(m, "val_pass@1"), _cell(m, "trainer_wait_s", 2), _cell(m, "rollout_s", 2)]
        cells += [_cell(m, "train_s", 2), _cell(m, "engine_idle_s", 2) if "engine_idle_s" in m else "-", ratio]
        rows.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (k, runs) in enumerate(sorted(results["runs"].items())):
        for j, run in enumerate(runs.values()):
            t, v = zip(*run["curve"], strict=True)
            ax.plot([x / 60 for x in t], v, color=f"C{i}", alpha=0.6, label=f"max_staleness {k}" if j == 0 else None)
    ax.set_xlabel("wall minutes")
    ax.set_ylabel("train/reward_mean")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="tiny:small")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--updates", type=int, default=60)
    parser.add_argument("--skip", type=int, default=3, help="first updates left out of updates/min; default 3")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--out", default=str(ROOT / "runs" / "async_speed"))
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more logra-pl fit arguments")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.serve import Server  # a real `logra-pl serve` in its own process group

    os.environ.setdefault("LOGRA_PL_API_KEY", "async-speed")
    server = Server(out, "--model", args.policy, "--api-key", os.environ["LOGRA_PL_API_KEY"])
    results: dict = {"settings": {k: v for k, v in vars(args).items() if k != "out"}, "runs": {}, "summary": {}}
    started = False
    try:
        for seed in args.seeds:
            for k in args.staleness:  # interleaved: machine drift hits every staleness alike
                folder = out / f"k{k}" / f"seed{seed}"
                done = folder / "result.json"
                if not done.is_file():
                    if not started:
                        server.start()
                        started = True
                    t0 = time.perf_counter()
                    proc = fit(server.url, folder, k, seed, args)
                    if proc.returncode != 0:
                        sys.exit(f"k={k} seed {seed} failed:\n{proc.stderr[-3000:]}")
                    result = summarize(folder / "tb" / "version_0", args.skip) | {"run_s": time.perf_counter() - t0}
                    done.write_text(json.dumps(result))
                    print(f"k={k} seed {seed}: {result['updates_per_min']:.2f} updates/min", flush=True)
                results["runs"].setdefault(str(k), {})[str(seed)] = json.loads(done.read_text())
    finally:
        server.kill()
    for k, runs in results["runs"].items():
        keys = [key for key in next(iter(runs.values())) if key != "curve"]
        results["summary"][k] = {
            key: _mean_std([r[key] for r in runs.values()]) for key in keys if all(key in r for r in runs.values())
        }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "async_speed.png")
    print(table(results))


if __name__ == "__main__":
    main()
