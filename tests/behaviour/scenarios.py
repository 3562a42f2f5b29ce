"""Reference runs that pin the framework's behaviour: the same command must give the same bits, release after release.

Each scenario is one ``logra-pl fit`` of a shipped config (6 updates, short warm start, small data) in its own
process. :func:`capture` reads back what a user would compare: every logged scalar per update (wall-clock ones
excepted), the digest of every weight, and the checkpoint's contents (tensors by digest, everything else by value).
``python -m tests.behaviour.record`` writes them to ``tests/behaviour/golden/``; ``tests/test_behaviour.py``
reruns the scenarios and asserts equality bit for bit. RL runs are reproducible on one kind of CPU only (float
sums differ between kernels), so each record carries the machine's fingerprint; on another machine the test still
compares structure (tags, tensor names, shapes, dtypes) and says why the values were not compared.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden"

# 6 updates of the demo, small enough for the suite: validation and a checkpoint every 3 updates.
COMMON = [
    "--trainer.max_steps=6",
    "--trainer.val_check_interval=3",
    "--trainer.enable_progress_bar=false",
    "--model.warm_start.steps=20",
    "--data.train_size=256",
    "--data.eval_size=32",
    "--data.eval_batch_size=32",
    "--data.prompts_per_step=16",
    "--model.microbatch_size=8",
    "--checkpoint.every_n_updates=3",
]

# Scalars that measure wall-clock time or process memory: they differ between any two runs.
VOLATILE_PREFIXES = ("time/", "memory/peak", "memory/rss", "memory/cuda")
VOLATILE_SUFFIXES = ("_s", "/seconds", "step_s")


@dataclass(frozen=True)
class Scenario:
    """One reference run: a shipped config (and overlays), extra flags, and whether it needs a served engine."""

    name: str
    configs: tuple[str, ...]
    extra: tuple[str, ...] = ()
    served: bool = False
    needs_vllm: bool = False
    run_name: str = field(default="")


# The LoGRA rule the demo configs held when the records were written (the paper's RowAdam on a new projection every
# update, each matrix stepped to a share of its norm): the scenarios pin it, so the records keep their meaning.
RULE = "configs/overlays/rowadam_demo.yaml"
SCENARIOS = {
    s.name: s
    for s in (
        Scenario("logra_hf", ("configs/tiny_cpu.yaml", RULE), run_name="tiny_cpu"),
        Scenario("adamw_hf", ("configs/tiny_cpu_adamw.yaml",), run_name="tiny_cpu_adamw"),
        Scenario(
            "lora_hf",
            ("configs/tiny_cpu.yaml", "configs/ablations/lora.yaml"),
            run_name="tiny_cpu_lora",
        ),
        Scenario(
            "logra_vllm",
            ("configs/tiny_cpu_vllm.yaml", RULE),
            ("--trainer.callbacks.verify_every=3",),
            needs_vllm=True,
            run_name="tiny_cpu_vllm",
        ),
        Scenario(
            "logra_served",
            ("configs/tiny_cpu_served.yaml", RULE),
            ("--trainer.callbacks.verify_every=3", "--model.logra.update_ratio=0.005"),
            served=True,
            needs_vllm=True,
            run_name="tiny_cpu_served",
        ),
    )
}


def fingerprint() -> dict[str, str]:
    """What makes float results reproducible: the CPU model and flags, torch's version and its BLAS build."""
    cpu = ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "")
        flags = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("flags")), "")
        cpu = f"{model} | flags {hashlib.blake2b(flags.encode(), digest_size=6).hexdigest()}"
    except OSError:
        cpu = platform.processor()
    return {"cpu": cpu, "torch": torch.__version__, "threads": "1"}


def run(scenario: Scenario, save_dir: Path, url: str | None = None) -> Path:
    """Run the scenario's ``logra-pl fit`` in a child process (one thread); returns the run's version folder."""
    args = [sys.executable, "-m", "logra_pl.cli", "fit"]
    args += [f"--config={ROOT / c}" for c in scenario.configs]
    args += COMMON + list(scenario.extra)
    args += [f"--trainer.logger.init_args.save_dir={save_dir}"]
    if url is not None:
        args += [f"--model.engine.init_args.urls=[{url}]"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{scenario.name}: logra-pl fit exited {done.returncode}\n{done.stderr[-4000:]}")
    return save_dir / scenario.run_name / "version_0"


def volatile(tag: str) -> bool:
    """A scalar that measures time or process memory (not compared)."""
    return tag.startswith(VOLATILE_PREFIXES) or tag.endswith(VOLATILE_SUFFIXES)


def scalars(folder: Path) -> dict[str, dict[str, float]]:
    """Every scalar of a run's event files, by tag and step (repr of the float32 TensorBoard stores)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    out: dict[str, dict[str, float]] = {}
    for tag in sorted(acc.Tags()["scalars"]):
        if volatile(tag):
            continue
        out[tag] = {str(e.step): float(e.value) for e in acc.Scalars(tag)}
    return out


def digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes, with its dtype and shape."""
    t = t.detach().cpu().contiguous()
    flat = t.reshape(-1)
    raw = flat.view(torch.uint8) if t.dtype != torch.bool and t.numel() else flat.to(torch.uint8)
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(raw.numpy().tobytes())
    return h.hexdigest()[:32]


def plain(value: Any) -> Any:
    """A JSON image of checkpoint contents: tensors as ``{dtype, shape, sha}``, containers recursively."""
    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype), "shape": list(value.shape), "sha": digest(value)}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, float):
        return repr(value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return f"<{type(value).__name__}>"


# Checkpoint keys that record where and how a run was launched rather than what it computed.
LAUNCH_KEYS = ("hyper_parameters", "hparams_name", "pytorch-lightning_version", "datamodule_hyper_parameters")
MODULE_LAUNCH_KEYS = ("settings", "run_config", "loggers")  # loggers: each logger's run id (where it is logged)


def checkpoint_image(path: Path) -> dict[str, Any]:
    """The checkpoint's computed contents: weights, optimizer, loops, callbacks and the module's own state."""
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    for key in LAUNCH_KEYS:
        ckpt.pop(key, None)
    own = dict(ckpt.get("logra_pl") or {})
    for key in MODULE_LAUNCH_KEYS:
        own.pop(key, None)
    ckpt["logra_pl"] = own
    callbacks = {}
    for key, state in (ckpt.pop("callbacks", None) or {}).items():
        callbacks[key.split("{", 1)[0]] = state  # the state key's init-args part repeats paths of this run
    ckpt["callbacks"] = callbacks
    return plain(ckpt)


VOLATILE_KEYS = ("elapsed",)  # wall-clock seconds kept in callback state


def comparable(image: Any) -> Any:
    """A checkpoint image without wall-clock values and with this run's absolute paths made anonymous."""
    if isinstance(image, dict):
        return {k: comparable(v) for k, v in image.items() if k not in VOLATILE_KEYS}
    if isinstance(image, list):
        return [comparable(v) for v in image]
    if isinstance(image, str) and image.startswith("/"):
        return "<path>"
    return image


def capture(run_dir: Path) -> dict[str, Any]:
    """Scalars, weight digests and checkpoint contents of a finished run."""
    last = run_dir / "checkpoints" / "last.ckpt"
    ckpt = torch.load(last, map_location="cpu", weights_only=False)
    weights = {name: digest(t) for name, t in sorted(ckpt["state_dict"].items())}
    return {
        "scalars": scalars(run_dir),
        "weights": weights,
        "checkpoint": comparable(checkpoint_image(last)),
    }


def machine_id(print_: dict[str, str] | None = None) -> str:
    """A short name of a machine fingerprint (the folder its records are kept in)."""
    blob = json.dumps(print_ or fingerprint(), sort_keys=True).encode()
    return hashlib.blake2b(blob, digest_size=6).hexdigest()


def golden_path(name: str, machine: str | None = None) -> Path:
    """The record of scenario ``name``: the first one written (``golden/<name>.json``), or the one of another kind of
    machine (``golden/machines/<machine id>/<name>.json``), recorded there on the same reference code."""
    return GOLDEN / f"{name}.json" if machine is None else GOLDEN / "machines" / machine / f"{name}.json"


def load_golden(name: str) -> dict[str, Any]:
    """The record to compare with on this machine: its own kind's when one was recorded, else the first one (whose
    values are then not comparable here: only the structure is checked)."""
    mine = golden_path(name, machine_id())
    return json.loads((mine if mine.is_file() else golden_path(name)).read_text())


def diff(ref: object, mine: object, path: str = "") -> list[str]:
    """Every place where two JSON images differ (first 20)."""
    if isinstance(ref, dict) and isinstance(mine, dict):
        out = [f"{path}/{k}: missing" for k in ref if k not in mine]
        out += [f"{path}/{k}: unexpected" for k in mine if k not in ref]
        for k in ref:
            if k in mine:
                out += diff(ref[k], mine[k], f"{path}/{k}")
        return out[:20]
    if isinstance(ref, list) and isinstance(mine, list) and len(ref) == len(mine):
        return [d for r, m, k in zip(ref, mine, range(len(ref)), strict=True) for d in diff(r, m, f"{path}[{k}]")]
    return [] if ref == mine else [f"{path}: {json.dumps(ref)[:120]} != {json.dumps(mine)[:120]}"]


def structure(image: object) -> object:
    """Names, shapes and dtypes only (what must hold on any machine)."""
    if isinstance(image, dict):
        if "sha" in image:
            return {k: v for k, v in image.items() if k != "sha"}
        return {k: structure(v) for k, v in image.items()}
    if isinstance(image, list):
        return [structure(v) for v in image]
    return type(image).__name__
