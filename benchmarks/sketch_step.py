"""One LoGRA sketch step (``propose()`` + ``apply()``): the per-matrix reference vs the grouped step, side by side.

    python benchmarks/sketch_step.py [--json out.json] [--shapes medium,1.5b,7b] [--rank 64] [--big-rank 256]
        [--repeats 5] [--rounds 3] [--distribution rademacher]

What it measures, per model shape and path (``per-matrix``: :class:`~logra_pl.sketch.reference.PerMatrixSketcher`,
the step one matrix at a time as it ran before it was grouped; ``grouped``: :class:`~logra_pl.sketch.LoGRASketcher`):

- ``aten (profiler)``: every ``aten::`` event ``torch.profiler`` records during one ``propose()`` + ``apply()``,
  nested calls included (``aten::to`` → ``aten::_to_copy`` → ``aten::copy_`` counts 3): how the 21,420 calls of
  issue 26 were counted.
- ``aten (dispatch)``: the operator calls that reach a ``TorchDispatchMode`` (top-level calls after autograd, nested
  ones not repeated). On a GPU each of them launches at least one kernel.
- ``seconds``: wall time of ``propose()`` + ``apply()`` (after one untimed update), on the CPU or on CUDA
  (``torch.cuda.synchronize()`` on both ends): the minimum and the median over ``--repeats`` updates in each of
  ``--rounds`` fresh processes per path, the two paths alternating (per-matrix, grouped, then grouped, per-matrix,
  ...), so that a machine whose speed drifts (a shared host) favours neither.
- ``RSS rise``: on the CPU, how far one ``propose()`` + ``apply()`` lifts the process's peak RSS above its RSS
  before it (``VmHWM`` reset through ``/proc/self/clear_refs``), measured on the second update (median of the
  rounds).

Shapes: ``medium`` is ``tiny:medium`` (10 layers × 7 matrices, ~50M parameters) on the CPU with real sketches from
one backward pass. ``1.5b`` and ``7b`` are Qwen2.5-1.5B and -7B (28 layers × 7 matrices) at ``--big-rank``: on the
meta device (shapes only, no arithmetic, no memory) for the operator counts, where a dispatch mode answers the
host reads (``tolist()``, ``float()``) with 1.0; and, when CUDA is available, on the GPU with random weights and
sketches, for counts and time. Every measurement runs in a fresh process.

The table prints each path's numbers and the ratio grouped / per-matrix. ``--json`` writes them all.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

PATHS = ("per-matrix", "grouped")
# Qwen2.5 architectures (hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings).
BIG_SHAPES: dict[str, tuple[int, int, int, int, int, int, bool]] = {
    "1.5b": (1536, 8960, 28, 12, 2, 151936, True),
    "7b": (3584, 18944, 28, 28, 4, 152064, False),
}
LABELS = {"medium": "tiny:medium", "1.5b": "Qwen2.5-1.5B", "7b": "Qwen2.5-7B"}


class DispatchCount(TorchDispatchMode):
    """Counts the operator calls that reach the Python dispatch key; answers host reads of meta tensors with 1.0.

    On the meta device a tensor has no values, so ``tolist()`` (a copy to the CPU) and ``float()`` (a scalar read)
    cannot run: they get ones, which the sketch step reads as finite values and unit norms.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self.calls[str(func.overloadpacket.__name__)] += 1
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and first.device.type == "meta":
            if func is torch.ops.aten._local_scalar_dense.default:
                return 1.0
            if func is torch.ops.aten._to_copy.default and torch.device(kwargs.get("device", "meta")).type == "cpu":
                return torch.ones(first.shape, dtype=kwargs.get("dtype") or first.dtype)
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.calls.values())


def profiler_count(step: Any, meta: bool) -> int:
    """``aten::`` events ``torch.profiler`` records during ``step()`` (nested calls included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        if meta:
            with DispatchCount():  # host reads answered; its own ``ones`` add a handful of events
                step()
        else:
            step()
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def dispatch_count(step: Any) -> tuple[int, dict[str, int]]:
    """Operator calls of ``step()`` at the dispatch mode, and the ten most frequent."""
    mode = DispatchCount()
    with mode:
        step()
    return mode.total, dict(mode.calls.most_common(10))


def vm_kib(key: str) -> int:
    """A ``/proc/self/status`` line in KiB (``VmHWM``, ``VmRSS``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def qwen2_config(dims: tuple[int, int, int, int, int, int, bool], **extra: Any) -> Any:
    """The ``Qwen2Config`` of ``(hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings)`` (fp32)."""
    from transformers import Qwen2Config

    hidden, inter, layers, heads, kv, vocab, tied = dims
    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        tie_word_embeddings=tied,
        dtype="float32",
        **extra,
    )


# --------------------------------------------------------------------------------------------------- workers
def build(shape: str, device: str, rank: int, distribution: str, path: str) -> tuple[Any, Any, Any]:
    """``(model, sketcher, fill)``: ``fill()`` puts one update's sketches in place (a backward pass, or random)."""
    from transformers import AutoModelForCausalLM, Qwen2ForCausalLM

    from logra_pl.sketch import LoGRAConfig, LoGRASketcher
    from logra_pl.sketch.reference import PerMatrixSketcher

    cls = PerMatrixSketcher if path == "per-matrix" else LoGRASketcher
    config = LoGRAConfig(rank=rank, distribution=distribution, update_ratio=1e-3)
    if shape == "medium":
        from logra_pl.models.tiny import build_tiny_model

        model = AutoModelForCausalLM.from_pretrained(build_tiny_model("medium"), dtype=torch.float32)
        sketcher = cls(model, config)
        ids = torch.randint(0, model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))

        def fill() -> None:
            model(input_ids=ids, labels=ids).loss.backward()

        return model, sketcher, fill
    with torch.device(device):
        model = Qwen2ForCausalLM(qwen2_config(BIG_SHAPES[shape]))
    sketcher = cls(model, config)
    gen = torch.Generator(device=device) if device != "meta" else None

    def fill() -> None:
        for stack in sketcher.sketch_stacks():
            if gen is not None:
                stack.normal_(generator=gen)

    return model, sketcher, fill


def worker(shape: str, device: str, path: str, rank: int, distribution: str, repeats: int) -> dict[str, Any]:
    """One path on one shape, in this (fresh) process: counts, times and (CPU) the peak RSS rise."""
    torch.manual_seed(0)
    _, sketcher, fill = build(shape, device, rank, distribution, path)
    meta = device == "meta"

    def step() -> None:
        proposal = sketcher.propose()
        assert proposal is not None, sketcher.last_skip_reason
        assert sketcher.apply(proposal) is not None, sketcher.last_skip_reason

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    out: dict[str, Any] = {"shape": shape, "path": path, "device": device, "matrices": len(sketcher.matrices)}
    out["groups"] = len(sketcher.groups)
    if meta:
        fill()
        out["aten_profiler"] = profiler_count(step, meta=True)
        fill()
        out["aten_dispatch"], out["top_calls"] = dispatch_count(step)
        return out
    fill()
    step()  # warm-up: first calls allocate and initialise
    sync()
    if device == "cpu":
        fill()
        Path("/proc/self/clear_refs").write_text("5")
        before = vm_kib("VmRSS")
        step()
        out["rss_rise_mib"] = (vm_kib("VmHWM") - before) / 1024
    fill()
    out["aten_profiler"] = profiler_count(step, meta=False)
    fill()
    out["aten_dispatch"], out["top_calls"] = dispatch_count(step)
    seconds = []
    for _ in range(repeats):
        fill()
        sync()
        start = time.perf_counter()
        step()
        sync()
        seconds.append(time.perf_counter() - start)
    out["seconds"] = seconds
    out["seconds_min"] = min(seconds)
    out["seconds_median"] = statistics.median(seconds)
    return out


# ------------------------------------------------------------------------------------------------------ main
def run_worker(shape: str, device: str, path: str, args: argparse.Namespace) -> dict[str, Any]:
    rank = args.rank if shape == "medium" else args.big_rank
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", path, "--shape", shape, "--device", device]
    cmd += ["--rank", str(rank), "--distribution", args.distribution, "--repeats", str(args.repeats)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{shape}/{device}/{path} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def pooled(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One path's rounds as one row: the counts of the first (they do not vary), the minimum and the median of every
    timed update of every round, and the median peak-RSS rise."""
    row = dict(results[0])
    if "seconds" in row:
        seconds = [t for r in results for t in r["seconds"]]
        row |= {"seconds": seconds, "seconds_min": min(seconds), "seconds_median": statistics.median(seconds)}
        row["rounds"] = len(results)
    if "rss_rise_mib" in row:
        row["rss_rise_mib"] = statistics.median(r["rss_rise_mib"] for r in results)
    return row


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.{digits}f}"


def table(rows: list[dict[str, Any]]) -> str:
    """One line per (shape, device, metric): per-matrix, grouped, and their ratio."""
    metrics = [
        ("aten_profiler", "aten calls (profiler)"),
        ("aten_dispatch", "aten calls (dispatch)"),
        ("seconds_min", "seconds (min)"),
        ("seconds_median", "seconds (median)"),
        ("rss_rise_mib", "peak RSS rise (MiB)"),
    ]
    lines = [
        "| shape | device | matrices | metric | per-matrix | grouped | grouped / per-matrix |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: |",
    ]
    keyed: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for row in rows:
        keyed.setdefault((row["shape"], row["device"]), {})[row["path"]] = row
    for (shape, device), paths in keyed.items():
        old, new = paths.get("per-matrix", {}), paths.get("grouped", {})
        for key, label in metrics:
            a, b = old.get(key), new.get(key)
            if a is None and b is None:
                continue
            ratio = fmt(b / a) if a and b is not None else "—"
            matrices = new.get("matrices", old.get("matrices"))
            lines.append(f"| {LABELS[shape]} | {device} | {matrices} | {label} | {fmt(a)} | {fmt(b)} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write every measurement here")
    parser.add_argument("--shapes", default="medium,1.5b,7b", help="comma-separated: medium, 1.5b, 7b")
    parser.add_argument("--rank", type=int, default=64, help="sketch rank r of tiny:medium (default 64)")
    parser.add_argument("--big-rank", type=int, default=256, help="sketch rank r of the 1.5B/7B shapes (the paper's)")
    parser.add_argument("--repeats", type=int, default=5, help="timed updates per path and round (default 5)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="fresh processes per path on a timed device, the paths alternating (A B, B A, ...); default 3",
    )
    parser.add_argument("--distribution", default="rademacher", choices=["rademacher", "gaussian", "hadamard"])
    parser.add_argument("--worker", choices=PATHS, help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--device", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = worker(args.shape, args.device, args.worker, args.rank, args.distribution, args.repeats)
        print(json.dumps(result))
        return
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s != "medium" and s not in BIG_SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}: choose from medium, {', '.join(BIG_SHAPES)}")
    rows = []
    for shape in shapes:
        devices = ["cpu"] if shape == "medium" else ["meta"] + (["cuda"] if torch.cuda.is_available() else [])
        for device in devices:
            rounds = 1 if device == "meta" else args.rounds
            runs: dict[str, list[dict[str, Any]]] = {path: [] for path in PATHS}
            for index in range(rounds):
                for path in PATHS if index % 2 == 0 else tuple(reversed(PATHS)):
                    runs[path].append(run_worker(shape, device, path, args))
                    print(f"  {LABELS[shape]} on {device}, {path} ({index + 1}/{rounds}): done", file=sys.stderr)
            rows.extend(pooled(results) for results in runs.values())
    print(table(rows))
    if not torch.cuda.is_available():
        print("(no CUDA device here: the 1.5B/7B shapes are counted on the meta device only, not timed)")
    if args.json:
        args.json.write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
