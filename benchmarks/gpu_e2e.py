"""``logra-pl fit`` end to end on CUDA: bf16-mixed, KL control, checkpoints, a ``kill -9`` and a bitwise resume.

What it runs. A random-init Qwen2 shaped like Qwen2.5-0.5B (or ``--size 1.5b``): every decoder matrix of the real
model and its padded 151,936-row vocabulary, with logra-pl's offline byte-level BPE tokenizer (the ``tiny:medium``
preset's, ``logra_pl/models/tokenizer.py``). It is built here, taught the answer format for a few dozen AdamW steps on
the device (answer tokens then ``<|im_end|>``, so that responses end with EOS and ``RolloutMismatch`` has
EOS-terminated responses to measure), and saved as a policy folder. Then, for three scenarios,

- ``logra``: LoGRA (rank 256), one process;
- ``adamw``: dense AdamW on the same matrices, one process;
- ``logra_fsdp``: LoGRA under ``--trainer.strategy logra_fsdp`` (FSDP2) with one rank,

it runs ``logra-pl fit`` as child processes with the HF rollout engine, ``--trainer.precision bf16-mixed`` over fp32
master weights, activation checkpointing, ``PredictedKLControl`` (a constant 1e-4 budget, ``calibrate: true``),
``RolloutMismatch``, ``MemoryMonitor`` and ``RolloutLog``, a checkpoint every 3 updates:

1. an uninterrupted run of 6 updates;
2. a run killed with SIGKILL after update 4 (``tests/helpers/kill.py``'s ``KillAt``: no cleanup of any kind), whose
   last checkpoint is update 3;
3. its resume, ``--ckpt_path last``, to update 6.

Checks (one PASS/FAIL line each; exit status 1 on any FAIL): the kill and its checkpoint; the resumed run's weights
and optimizer state equal the uninterrupted run's bit for bit; its logged rewards (``train/reward_mean``, every step)
and every other deterministic scalar (all but ``time/*`` and ``memory/*``) equal the uninterrupted run's; its sampled
responses and their rewards (``RolloutLog``) too; the KL calibration of every update, ``|kl/realized −
kl/predicted_scaled| / kl/realized < 0.10`` (the bound of the CPU test of this setup,
``tests/models/test_large_model_path.py::test_bf16_mixed_keeps_fp32_master_and_sketches``); ``MemoryMonitor``'s CUDA
peaks (``memory/cuda_peak_allocated_bytes``, ``memory/cuda_peak_reserved_bytes``; on a CPU ``memory/peak_rss_bytes``)
logged for every update; ``RolloutMismatch``'s ``mismatch/ema`` logged for every update. It prints seconds per update
split into rollout / train (forwards and backwards) / optimizer step (``time/rollout_s``, ``time/train_s``,
``time/update_s``, medians over the uninterrupted run's updates after the first), the CUDA peaks and the KL
calibration, and writes every number to ``--json``.

Why eager attention. Bitwise equality across processes needs kernels that give the same bits on every run. SDPA's
fused backward kernels (memory-efficient and flash attention) accumulate the query gradient with atomic adds, whose
order varies from run to run; the eager path (matmul, softmax) has no such reduction, and neither has anything else on
this path (the gathers of sampled-token log-probs touch one element per row). ``--attn sdpa`` runs the fused kernels.

On a GPU machine without network (torch, transformers, lightning, peft, tensorboard installed; docs/benchmarks.md "On a
GPU"), from the checkout's root::

    python benchmarks/gpu_wheels.py --out .whl    # HERE, with network: the wheels of what that image lacks (~12 MiB)
    # THERE (one command; the device tool's `carry: [".whl"]`, output into $OUT):
    python3 -m pip install -q --no-index --no-deps --no-compile --no-build-isolation --find-links .whl \\
        --target /tmp/site -r .whl/requirements.txt && \\
    PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 benchmarks/gpu_e2e.py --out /tmp/e2e --json $OUT/gpu_e2e.json

(pycosat, which reasoning-gym imports, is published as source only: it is built at install time, which needs the
image's C compiler and Python headers; the H200 image compiled it in seconds.) Measured on one H200 (2026-12-04):
the policy is built in 17 s and each child process takes 80-86 s (imports, loading 0.5B weights, 6 updates), so the
three uninterrupted runs take about 250 s and the whole script 8-9 minutes, more than a 7-minute slot: give such a
slot one ``--only`` scenario or two. ``--timeout`` bounds each child process; ``--json`` is rewritten after every
run's checks, so a script cut short leaves what it measured. On a CPU, the same checks on the tiny model take a few
minutes (a slow test runs them)::

    python benchmarks/gpu_e2e.py --cpu [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the policy is built here with logra_pl, installed or not (a GPU image has it not)
    sys.path.insert(0, str(ROOT))
GiB = 1024**3
CHAIN_SUM = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}
KL_BUDGET = 1e-4
KL_BOUND = 0.10  # tests/models/test_large_model_path.py: bf16-mixed calibration bound on the CPU
NONDETERMINISTIC = ("time/", "memory/")  # wall-clock seconds and process memory differ between any two runs


def deterministic(tag: str) -> bool:
    """Whether a logged scalar must repeat bit for bit: not a time (``time/*``, ``*_s`` such as ``logra/merge_s``) nor
    a memory reading (``memory/*``)."""
    return not tag.startswith(NONDETERMINISTIC) and not tag.endswith("_s")


# ------------------------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class Shape:
    """A Qwen2 decoder (random init, built here) and the knobs of its runs.

    Arguments:
        label: what it is shaped like.
        hidden, intermediate, layers, heads, kv_heads, head_dim: the decoder's shape.
        vocab: the model's vocabulary, padded past the tokenizer's as Qwen2.5 pads its 151,665 tokens to 151,936
            rows (the tiny shape pads 512 to 1,024, so that the CPU mode runs the padded path too).
        tokenizer: the tiny-model preset (``logra_pl/models/tiny.py``) whose offline BPE tokenizer the policy uses.
        rank: LoGRA's sketch rank.
        prompts, responses, new_tokens, microbatch: prompts per update, responses per prompt, the response limit and
            responses per backward pass.
        teach_steps, teach_lr: AdamW steps (batch 32) that teach the answer format before the runs, and their rate.
    """

    label: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tokenizer: str
    rank: int
    prompts: int
    responses: int
    new_tokens: int
    microbatch: int
    teach_steps: int
    teach_lr: float


SHAPES: dict[str, Shape] = {
    "0.5b": Shape("Qwen2.5-0.5B", 896, 4864, 24, 14, 2, 64, 151936, "medium", 256, 32, 2, 32, 16, 40, 3e-4),
    "1.5b": Shape("Qwen2.5-1.5B", 1536, 8960, 28, 12, 2, 128, 151936, "medium", 256, 32, 2, 32, 16, 40, 2e-4),
    "tiny": Shape("tiny", 128, 512, 2, 2, 2, 64, 1024, "tiny", 64, 8, 2, 8, 8, 40, 2e-3),
}


@dataclass(frozen=True)
class Scenario:
    """One way of training: its ``logra-pl fit`` flags on top of the shared config."""

    name: str
    flags: tuple[str, ...]
    what: str


SCENARIOS = (
    Scenario("logra", ("--model.optimizer=logra",), "LoGRA, one process"),
    Scenario(
        "adamw",
        ("--model.optimizer=adamw", "--model.adamw.lr=1e-4", "--model.adamw.warmup_steps=0"),
        "dense AdamW on the same matrices, one process",
    ),
    Scenario(
        "logra_fsdp", ("--model.optimizer=logra", "--trainer.strategy=logra_fsdp"), "LoGRA under logra_fsdp, 1 rank"
    ),
)
# Run only when named with --only: LoGRA with the sketch's matmuls on bf16 operands (logra.sketch_operands), the
# tensor cores' path, against the default's fp32 ones.
OPTIONAL_SCENARIOS = (
    Scenario(
        "logra_bf16ops",
        ("--model.optimizer=logra", "--model.logra.sketch_operands=bfloat16"),
        "LoGRA, the sketch's matmuls on bf16 operands, one process",
    ),
)


@dataclass
class Settings:
    """One invocation's choices."""

    cpu: bool
    shape: Shape
    out: Path
    updates: int = 6
    checkpoint_every: int = 3
    kill_at: int = 4
    attn: str = "eager"
    jobs: int = 3
    timeout: float = 600.0
    scenarios: tuple[Scenario, ...] = SCENARIOS

    @property
    def device(self) -> str:
        return "cpu" if self.cpu else "cuda"


# ------------------------------------------------------------------------------------------------ the policy
def build_policy(settings: Settings) -> Path:
    """A random-init Qwen2 of ``settings.shape`` with the offline tokenizer, taught the answer format; its folder.

    Built once per output folder (a complete folder is reused). The model is initialised on the device (seed 0), then
    ``teach_steps`` AdamW steps of supervised answers (``logra_pl.train.warm_start.answer_batch``: loss on the answer
    and ``<|im_end|>`` only), bf16 autocast on CUDA.
    """
    import reasoning_gym
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from logra_pl.models.tiny import TinyModelSpec, build_tiny_model
    from logra_pl.runs.export import policy_folder_complete, save_policy_folder
    from logra_pl.train.warm_start import answer_batch

    shape = settings.shape
    folder = settings.out / f"policy-{shape.label.replace(' ', '-')}"
    if policy_folder_complete(folder):
        return folder
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(shape.tokenizer))  # built once, cached
    spec = TinyModelSpec(
        hidden_size=shape.hidden,
        num_layers=shape.layers,
        num_heads=shape.heads,
        num_kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate,
        max_position_embeddings=4096,
    )
    config = spec.qwen2_config(shape.vocab, tokenizer.pad_token_id, tokenizer.eos_token_id)
    torch.manual_seed(0)
    with torch.device(settings.device):
        model = Qwen2ForCausalLM(config)
    items = list(reasoning_gym.create_dataset("chain_sum", size=32 * shape.teach_steps, seed=1234, **CHAIN_SUM))
    optimizer = torch.optim.AdamW(model.parameters(), lr=shape.teach_lr)
    model.train()
    for step in range(shape.teach_steps):
        ids, mask, labels = (t.to(settings.device) for t in answer_batch(tokenizer, items[32 * step : 32 * step + 32]))
        with torch.autocast(settings.device, dtype=torch.bfloat16, enabled=not settings.cpu):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        if not torch.isfinite(loss):
            raise RuntimeError(f"the format lessons diverged at step {step}: lower Shape.teach_lr ({shape.teach_lr})")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    for key, value in (("eos_token_id", tokenizer.eos_token_id), ("pad_token_id", tokenizer.pad_token_id)):
        setattr(model.generation_config, key, value)
    model.generation_config.bos_token_id = None
    params = sum(p.numel() for p in model.parameters())
    save_policy_folder(
        model.cpu(), tokenizer, folder, provenance={"built_by": "benchmarks/gpu_e2e.py", "shape": shape.label}
    )
    print(
        f"policy: a Qwen2 shaped like {shape.label}, {params / 1e6:.1f}M parameters, vocabulary {config.vocab_size} "
        f"(tokenizer {len(tokenizer)}), format loss {float(loss.detach()):.3f} after {shape.teach_steps} steps, "
        f"built in {time.perf_counter() - start:.0f} s -> {folder}",
        flush=True,
    )
    return folder


# --------------------------------------------------------------------------------------------------- config
def run_config(settings: Settings, policy: Path) -> dict[str, Any]:
    """The resolved settings every run shares (written as ``config.yaml``; scenarios add their flags)."""
    shape = settings.shape
    callbacks = [
        {"class_path": "logra_pl.callbacks.MemoryMonitor", "init_args": {"image_every": 0}},
        {
            "class_path": "logra_pl.callbacks.PredictedKLControl",
            "init_args": {
                "schedule": {"kind": "constant", "delta_max": KL_BUDGET},
                "alpha_max": 3.0,
                "probe_responses": 2,
                "probe": "jvp",
                "calibrate": True,
            },
        },
        {"class_path": "logra_pl.callbacks.RolloutMismatch", "init_args": {"ema": 0.3, "floor": 0.5}},
        {"class_path": "logra_pl.callbacks.RolloutLog"},
    ]
    return {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu" if settings.cpu else "gpu",
            "devices": 1,
            "precision": "bf16-mixed",
            "max_steps": settings.updates,
            "max_epochs": -1,
            "limit_val_batches": 0,
            "num_sanity_val_steps": 0,
            "log_every_n_steps": 1,
            "enable_progress_bar": False,
            "callbacks": callbacks,
            "logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": str(settings.out / "runs"), "name": "run"},
            },
        },
        "checkpoint": {"every_n_updates": settings.checkpoint_every, "save_last": True, "save_top_k": 0},
        "model": {
            "policy": str(policy),
            "warm_start": None,
            "logra": {"rank": shape.rank, "update_ratio": 0.01, "ratio_scope": "matrix"},
            "rollout": {
                "responses_per_prompt": shape.responses,
                "temperature": 1.0,
                "top_p": 1.0,
                "max_new_tokens": shape.new_tokens,
            },
            "microbatch_size": shape.microbatch,
            "activation_checkpointing": True,
            "attn_implementation": settings.attn,
            "answer_format": "plain",
            "dtype": "float32",
            "seed": 0,
        },
        "data": {
            "tasks": {"chain_sum": {"weight": 1.0, "config": CHAIN_SUM}},
            "train_size": 8 * shape.prompts * settings.updates,
            "eval_size": 16,
            "prompts_per_step": shape.prompts,
            "seed": 0,
        },
    }


# ---------------------------------------------------------------------------------------------------- runs
@dataclass
class Run:
    """One ``logra-pl fit`` process: its command's outcome and where it logged."""

    name: str
    returncode: int
    seconds: float
    log: Path
    folder: Path
    saved_at: int | None = None  # the update of the last checkpoint this run left

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


def child_env(settings: Settings) -> dict[str, str]:
    """The children's environment: this checkout first on the import path, no network, deterministic cuBLAS."""
    path = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # cuBLAS's documented setting for reproducible results
    env["LOGRA_PL_CACHE"] = str(settings.out / "cache")
    if settings.cpu:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def fit(
    settings: Settings, scenario: Scenario, name: str, *extra: str, kill_at: int | None = None, tag: str = ""
) -> Run:
    """``python -m logra_pl.cli fit --config <out>/config.yaml <scenario flags> <extra>`` in run folder ``name``,
    logged to ``logs/<name><tag>.log``; ``kill_at``: ``KillAt`` ends the process with SIGKILL after that update."""
    cmd = [sys.executable, "-m", "logra_pl.cli", "fit", f"--config={settings.out / 'config.yaml'}"]
    cmd += [*scenario.flags, f"--trainer.logger.init_args.name={name}", *extra]
    if kill_at is not None:
        cmd += ["--trainer.callbacks+=tests.helpers.kill.KillAt", f"--trainer.callbacks.update={kill_at}"]
    log = settings.out / "logs" / f"{name}{tag}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with log.open("wb") as out:
        try:
            env = child_env(settings)
            proc = subprocess.run(
                cmd, cwd=settings.out, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=settings.timeout
            )
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = 124
    return Run(name, code, time.perf_counter() - start, log, settings.out / "runs" / name / "version_0")


def chain(settings: Settings, scenario: Scenario) -> tuple[Run, Run]:
    """The killed run and its resume (``--ckpt_path last``), in one run folder; the killed run's ``saved_at`` is the
    update of the checkpoint it left (read before the resume overwrites it)."""
    name = f"{scenario.name}-resumed"
    killed = fit(settings, scenario, name, kill_at=settings.kill_at, tag="-1-killed")
    last = killed.folder / "checkpoints" / "last.ckpt"
    killed.saved_at = checkpoint(killed.folder).get("global_step") if last.is_file() else None
    resumed = fit(settings, scenario, name, "--ckpt_path=last", tag="-2-resume")
    return killed, resumed


# ------------------------------------------------------------------------------------------------ reading
def scalars(folder: Path) -> dict[str, dict[int, float]]:
    """Every scalar of a run folder as TensorBoard reads it (the steps a resume purged are dropped)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def checkpoint(folder: Path) -> dict[str, Any]:
    import torch

    # Memory-mapped: an AdamW checkpoint of the 0.5B shape holds ~5 GB, read here tensor by tensor.
    return torch.load(folder / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False, mmap=True)


def tensors(tree: Any, prefix: str = "") -> Iterable[tuple[str, Any]]:
    """Every tensor in a nested checkpoint structure, with its path."""
    import torch

    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for key in sorted(tree, key=str):
            yield from tensors(tree[key], f"{prefix}/{key}")
    elif isinstance(tree, list | tuple):
        for i, value in enumerate(tree):
            yield from tensors(value, f"{prefix}/{i}")


def differing(a: Any, b: Any) -> list[str]:
    """Paths of the tensors that are not bit-identical (or present in one tree only)."""
    import torch

    left, right = dict(tensors(a)), dict(tensors(b))
    bad = sorted(set(left) ^ set(right))
    return bad + [k for k in left.keys() & right.keys() if not torch.equal(left[k], right[k])]


def rollout_rows(folder: Path) -> list[tuple[Any, ...]]:
    from logra_pl.callbacks import read_rollouts

    rows = read_rollouts(folder / "rollouts")
    return sorted((r["update"], r["prompt_ids"], r["response_ids"], r["reward"]) for r in rows)


# ------------------------------------------------------------------------------------------------- checks
@dataclass
class Report:
    """PASS/FAIL lines and every number, for the console and the JSON."""

    checks: list[dict[str, Any]] = field(default_factory=list)
    numbers: dict[str, Any] = field(default_factory=dict)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append({"check": name, "pass": bool(ok), "detail": detail})
        print(f"{'PASS' if ok else 'FAIL'}  {name}{f'  ({detail})' if detail else ''}", flush=True)
        return bool(ok)

    @property
    def passed(self) -> bool:
        return all(c["pass"] for c in self.checks)


def median_after_first(values: dict[int, float]) -> float:
    """Median over the updates after the first (which pays CUDA's and the allocator's warm-up)."""
    steps = sorted(values)
    rest = [values[s] for s in steps[1:]] or [values[s] for s in steps]
    return statistics.median(rest) if rest else math.nan


def check_straight(report: Report, settings: Settings, scenario: Scenario, straight: Run) -> bool:
    """The uninterrupted run's checks and numbers (into ``report.numbers[scenario.name]``), as soon as it ends."""
    s = scenario.name
    numbers: dict[str, Any] = {"what": scenario.what, "seconds": {"straight": straight.seconds}}
    report.numbers[s] = numbers
    if not report.check(
        f"{s}: uninterrupted run of {settings.updates} updates", straight.returncode == 0, _failed(straight)
    ):
        return False
    ref = scalars(straight.folder)
    numbers["per_update"] = {tag: ref[tag] for tag in sorted(ref)}
    _report_numbers(report, settings, s, ref, numbers)
    return True


def check_resume(
    report: Report, settings: Settings, scenario: Scenario, straight: Run, killed: Run, resumed: Run
) -> None:
    """The kill/resume chain's checks against the uninterrupted run (which passed :func:`check_straight`)."""
    s = scenario.name
    numbers = report.numbers[s]
    n = settings.updates
    ref = scalars(straight.folder)
    at = killed.saved_at
    report.check(
        f"{s}: SIGKILL after update {settings.kill_at}, last checkpoint at update {settings.checkpoint_every}",
        killed.returncode == -signal.SIGKILL and at == settings.checkpoint_every,
        f"exit {killed.returncode}, checkpoint at update {at}",
    )
    numbers["seconds"] |= {"killed": killed.seconds, "resumed": resumed.seconds}
    if not report.check(f"{s}: resumed with --ckpt_path last to update {n}", resumed.returncode == 0, _failed(resumed)):
        return
    mine, theirs = checkpoint(resumed.folder), checkpoint(straight.folder)
    report.check(
        f"{s}: global step {n} in both final checkpoints",
        mine["global_step"] == theirs["global_step"] == n,
        f"{mine['global_step']} vs {theirs['global_step']}",
    )
    bad = differing(mine["state_dict"], theirs["state_dict"])
    report.check(
        f"{s}: weights after the resume == uninterrupted, bit for bit",
        not bad,
        f"{len(mine['state_dict'])} tensors" + (f"; differ: {bad[:4]}" if bad else ""),
    )
    bad = differing(mine["optimizer_states"], theirs["optimizer_states"])
    report.check(
        f"{s}: optimizer state after the resume == uninterrupted, bit for bit",
        not bad,
        f"{len(dict(tensors(mine['optimizer_states'])))} tensors" + (f"; differ: {bad[:4]}" if bad else ""),
    )
    got = scalars(resumed.folder)
    rewards = got.get("train/reward_mean", {})
    report.check(
        f"{s}: logged rewards == uninterrupted (train/reward_mean, every step)",
        rewards == ref.get("train/reward_mean") and sorted(rewards) == list(range(n)),
        f"steps {sorted(rewards)}",
    )
    tags = sorted(t for t in ref if deterministic(t))
    unequal = [t for t in tags if got.get(t) != ref[t]]
    report.check(
        f"{s}: every deterministic scalar == uninterrupted",
        not unequal,
        f"{len(tags)} tags compared (times and memory excluded)" + (f"; differ: {unequal[:5]}" if unequal else ""),
    )
    mine_rows, ref_rows = rollout_rows(resumed.folder), rollout_rows(straight.folder)
    report.check(
        f"{s}: sampled responses and their rewards == uninterrupted (RolloutLog)",
        mine_rows == ref_rows and len(ref_rows) > 0,
        f"{len(ref_rows)} responses",
    )


def _failed(run: Run) -> str:
    if run.returncode == 0:
        return f"{run.seconds:.0f} s"
    return f"exit {run.returncode} after {run.seconds:.0f} s; log {run.log}:\n{run.tail()}"


def _report_numbers(report: Report, settings: Settings, s: str, ref: dict[str, dict[int, float]], numbers: dict):
    """Timings, memory peaks, KL calibration and the mismatch EMA of the uninterrupted run (with their checks)."""
    n = settings.updates
    every = list(range(n))
    numbers["median_s"] = {
        key: median_after_first(ref.get(f"time/{key}_s", {})) for key in ("rollout", "train", "update", "step")
    }
    peaks = (
        ["memory/peak_rss_bytes"]
        if settings.cpu
        else [f"memory/cuda_peak_{k}_bytes" for k in ("allocated", "reserved")]
    )
    numbers["peaks_gib"] = {p: max(ref.get(p, {0: math.nan}).values()) / GiB for p in peaks}
    report.check(
        f"{s}: MemoryMonitor logged {', '.join(peaks)} for every update",
        all(sorted(ref.get(p, {})) == every and min(ref[p].values()) > 0 for p in peaks),
        ", ".join(f"max {numbers['peaks_gib'][p]:.2f} GiB" for p in peaks),
    )
    timed = [f"time/{k}_s" for k in ("rollout", "train", "update")]
    report.check(f"{s}: timings logged for every update", all(sorted(ref.get(t, {})) == every for t in timed))
    realized, predicted = ref.get("kl/realized", {}), ref.get("kl/predicted_scaled", {})
    errors = {
        step: abs(realized[step] - predicted[step]) / realized[step]
        for step in sorted(realized)
        if step in predicted and realized[step] > 0
    }
    numbers["kl"] = {
        "budget": KL_BUDGET,
        "realized": realized,
        "predicted_scaled": predicted,
        "alpha": ref.get("kl/alpha", {}),
        "rel_error": errors,
    }
    worst = max(errors.values(), default=math.nan)
    report.check(
        f"{s}: KL calibration |realized - alpha^2 pred| / realized < {KL_BOUND} on every update",
        sorted(errors) == every and worst < KL_BOUND,
        f"max {worst:.2%}, median {statistics.median(errors.values()) if errors else math.nan:.2%}; "
        f"mean realized {statistics.fmean(realized.values()) if realized else math.nan:.3g} vs budget {KL_BUDGET}",
    )
    ema, observed = ref.get("mismatch/ema", {}), ref.get("mismatch/observed", {})
    numbers["mismatch"] = {"ema": ema, "observed": observed, "truncation_rate": ref.get("train/truncation_rate", {})}
    report.check(
        f"{s}: RolloutMismatch logged mismatch/ema for every update",
        sorted(ema) == every,
        f"observed on {len(observed)} of {n} updates (EOS-terminated responses)",
    )


# -------------------------------------------------------------------------------------------------- console
def print_table(report: Report, settings: Settings) -> None:
    """Seconds per update and memory peaks side by side."""
    peak = "peak RSS GiB" if settings.cpu else "CUDA peak alloc / reserved GiB"
    print(f"\n{'scenario':<12} {'rollout s':>10} {'train s':>9} {'optimizer s':>12} {'step s':>8}  {peak}")
    for scenario in settings.scenarios:
        numbers = report.numbers.get(scenario.name, {})
        med, peaks = numbers.get("median_s"), numbers.get("peaks_gib")
        if not med:
            print(f"{scenario.name:<12} (no run)")
            continue
        mem = " / ".join(f"{v:.2f}" for v in peaks.values())
        cells = f"{med['rollout']:>10.3f} {med['train']:>9.3f} {med['update']:>12.3f} {med['step']:>8.3f}"
        print(f"{scenario.name:<12} {cells}  {mem}")
    print("(medians over updates 2..N of the uninterrupted run; optimizer s = time/update_s)\n")


def environment() -> dict[str, Any]:
    import lightning
    import torch
    import transformers

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__}
    info["lightning"] = lightning.__version__
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info


def preflight(settings: Settings) -> str | None:
    """Import what the children import, in a child with their environment; the error text, or None."""
    code = "import logra_pl.cli, tests.helpers.kill, tensorboard, torch; "
    code += "assert torch.cuda.is_available(), 'no CUDA device'" if not settings.cpu else "pass"
    got = subprocess.run([sys.executable, "-c", code], env=child_env(settings), capture_output=True, text=True)
    return None if got.returncode == 0 else got.stderr.strip().splitlines()[-1]


# ----------------------------------------------------------------------------------------------------- main
def say(text: str) -> None:
    print(text, flush=True)


def run(
    settings: Settings, log: Callable[[str], None] = say, saved: Callable[[Report], None] = lambda report: None
) -> Report:
    """Build the policy, run every scenario (uninterrupted runs one at a time, then the kill/resume chains of those
    that passed, in parallel), check and report; ``saved`` is called with the report after each run's checks, so
    that a run cut short by the machine's time limit still leaves its numbers."""
    import yaml

    settings.out.mkdir(parents=True, exist_ok=True)
    for stale in ("runs", "logs"):  # an earlier invocation's runs would be resumed from and counted as versions
        shutil.rmtree(settings.out / stale, ignore_errors=True)
    report = Report()
    report.numbers["settings"] = {
        "device": settings.device,
        "shape": settings.shape.label,
        "updates": settings.updates,
        "checkpoint_every": settings.checkpoint_every,
        "kill_at": settings.kill_at,
        "attn": settings.attn,
    }
    problem = preflight(settings)
    if problem is not None:
        report.check("imports in the children's environment", False, f"{problem} (see the install command above)")
        return report
    report.numbers["environment"] = environment()
    policy = build_policy(settings)
    (settings.out / "config.yaml").write_text(yaml.safe_dump(run_config(settings, policy), sort_keys=False))
    straight, passed = {}, []
    for scenario in settings.scenarios:  # one at a time: their seconds per update are the timings
        straight[scenario.name] = done = fit(settings, scenario, f"{scenario.name}-straight")
        log(f"{scenario.name}: uninterrupted run, exit {done.returncode}, {done.seconds:.0f} s")
        if check_straight(report, settings, scenario, done):
            passed.append(scenario)
        saved(report)
    with ThreadPoolExecutor(max_workers=settings.jobs) as pool:  # the kill/resume chains, in parallel
        results = list(pool.map(lambda s: chain(settings, s), passed))
    for scenario, (killed, resumed) in zip(passed, results, strict=True):
        log(f"{scenario.name}: killed run exit {killed.returncode}, resumed run exit {resumed.returncode}")
        check_resume(report, settings, scenario, straight[scenario.name], killed, resumed)
        saved(report)
    return report


def parse_args(argv: list[str] | None = None) -> tuple[Settings, str | None]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the tiny model on the CPU (what the tests run)")
    parser.add_argument("--size", choices=["0.5b", "1.5b"], default="0.5b", help="model shape on CUDA (default 0.5b)")
    parser.add_argument("--out", default=None, help="working folder (default runs/gpu_e2e or runs/gpu_e2e_cpu)")
    parser.add_argument("--json", default=None, help="write every number and check here")
    parser.add_argument("--attn", choices=["eager", "sdpa"], default="eager", help="attention kernel (default eager)")
    parser.add_argument(
        "--jobs", type=int, default=None, help="kill/resume chains at once (default 3; on the CPU at most its cores)"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per child process (default 600)")
    parser.add_argument(
        "--only", default=None, help="comma-separated scenarios (default logra,adamw,logra_fsdp; also logra_bf16ops)"
    )
    args = parser.parse_args(argv)
    shape = SHAPES["tiny" if args.cpu else args.size]
    out = Path(args.out or (ROOT / "runs" / ("gpu_e2e_cpu" if args.cpu else "gpu_e2e"))).resolve()
    chosen = SCENARIOS
    if args.only:
        names = args.only.split(",")
        known = SCENARIOS + OPTIONAL_SCENARIOS
        unknown = sorted(set(names) - {s.name for s in known})
        if unknown:
            parser.error(f"unknown scenario(s) {unknown}: choose from {[s.name for s in known]}")
        chosen = tuple(s for s in known if s.name in names)
    # On the CPU every child runs one thread (main), so chains at once use the cores the machine has.
    jobs = args.jobs or (min(3, os.cpu_count() or 1) if args.cpu else 3)
    settings = Settings(args.cpu, shape, out, attn=args.attn, jobs=jobs, timeout=args.timeout, scenarios=chosen)
    return settings, args.json


def main(argv: list[str] | None = None) -> int:
    settings, json_path = parse_args(argv)
    if settings.cpu:  # before torch is imported: two threads per process on a busy machine were 20x slower
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()

    def saved(report: Report) -> None:
        report.numbers["wall_s"] = time.perf_counter() - start
        if json_path:
            Path(json_path).parent.mkdir(parents=True, exist_ok=True)
            Path(json_path).write_text(json.dumps({"checks": report.checks, **report.numbers}, indent=1, default=str))

    report = run(settings, saved=saved)
    saved(report)
    if report.numbers.get("environment"):
        print_table(report, settings)
    passed = sum(c["pass"] for c in report.checks)
    print(f"{passed}/{len(report.checks)} checks passed in {report.numbers['wall_s']:.0f} s", flush=True)
    return 0 if report.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
