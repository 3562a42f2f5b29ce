"""GPU memory and speed of one RL update: dense AdamW vs LoRA vs LoGRA on Qwen2.5-1.5B- and 7B-shaped models.

What it measures. For each model shape and optimizer, a few policy-gradient updates (after one untimed warm-up)
on random weights, with the paper's compute setup: fp32 master weights, bf16 autocast compute, activation
checkpointing (non-reentrant), sdpa attention, microbatch 1, 2,048-token sequences (256 random prompt tokens + a
1,792-token synthetic response), a synthetic ±1 advantage and the REINFORCE loss ``−A·mean(log p(response))``.
Per update (``torch.cuda.reset_peak_memory_stats()`` at its start): peak allocated and peak reserved bytes,
``torch.cuda.memory_allocated()`` sampled after the forward, after the backward and after the optimizer step
(the paper's "average memory" is the mean of such samples), and the wall seconds (``torch.cuda.synchronize()``
on both ends). Gradients are released (``zero_grad(set_to_none=True)``) after the "after step" sample, at the
end of the update. Also the training state by kind (``logra_pl.sketch.memory_report``: weights, gradients,
optimizer state, sketches, projections, row statistics), taken right after the last step, gradients included.

The optimizers:
- ``adamw``: dense ``torch.optim.AdamW`` (lr 1e-6, betas 0.9/0.95, eps 1e-8, wd 0) on the 7 target matrices
  (q, k, v, o, gate, up, down of every layer), everything else frozen — the same weights LoGRA trains;
- ``lora``: peft LoRA r=256, alpha=512, dropout 0 on the same 7 matrices, AdamW on the adapters;
- ``logra``: ``LoGRASketcher`` with ``LoGRAConfig(rank=256)`` (LoGRA's default rule; the first H200 runs, before
  it, used the paper's: refreshed Rademacher projections, RowAdam), frozen base weights, ``propose()`` +
  ``apply()`` after the backward; ``--sketch-operands bfloat16`` runs the sketch's matmuls on bf16 operands
  (``logra.sketch_operands``).

Run it on a GPU machine (about 1 minute on one H200, measured; docs/benchmarks.md "On a GPU" has the numbers)::

    python benchmarks/gpu_check.py [--json out.json] [--updates 3] [--adamw-all] [--models 1.5b,7b] [--profile DIR]

(``--profile DIR``: one more update per configuration under ``torch.profiler``, untimed: its operator table in
``DIR/<model>_<optimizer>.txt``, and the totals of the named ranges — this script's forward, backward and step,
logra-pl's ``logra.*`` ranges, :mod:`logra_pl.sketch.trace` — in the JSON.)

and on a CPU, in seconds, with a tiny Qwen2 (training-state bytes and wall seconds instead of CUDA statistics)::

    python benchmarks/gpu_check.py --tiny [--json out.json]

The paper's numbers (average memory per GPU, 4-GPU FSDP training + 4 vLLM engines, BF16, activation
checkpointing, rank 256, microbatch 1): AdamW 9.18 GiB → LoGRA 7.18 GiB at 1.5B (ratio 0.782), 31.82 → 17.29
GiB at 7B (0.543); dense Adam runs out of memory at 27B, where LoGRA needs 51.54 GiB. FSDP divides weights,
gradients and optimizer state by the 4 GPUs but not the activations, so the single-GPU ratios printed here are
not the same quantity. The paper's dense baseline trains all parameters (``--adamw-all``); the default here
trains only the 7 target matrices, so that the rows compare the update rules on the same weights.

Configurations that run out of GPU memory print ``OOM`` in their row; any other failure prints ``error`` (with
the traceback on stderr) and makes the exit status 1 once the table is printed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from torch.profiler import record_function
from transformers import Qwen2Config, Qwen2ForCausalLM

# Import the sketch core from this checkout, installed or not; ``logra_pl.sketch`` needs only torch (no vLLM,
# reasoning-gym or datasets), so the script runs on a bare GPU machine with torch, transformers and peft.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from logra_pl.sketch import DEFAULT_TARGETS, LoGRAConfig, LoGRASketcher, memory_report  # noqa: E402
from logra_pl.train.chunked_logprobs import chunked_response_scores  # noqa: E402  (pure torch, like the sketch)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

GiB = 1024**3
MiB = 1024**2
OPTIMIZERS = ("adamw", "lora", "logra")
# Dense baseline of the paper (SPEC §10): AdamW lr 1e-6, betas (0.9, 0.95), eps 1e-8, weight decay 0.
ADAMW_LR, ADAMW_BETAS, ADAMW_EPS, ADAMW_WD = 1e-6, (0.9, 0.95), 1e-8, 0.0
# The paper's per-GPU average memory (GiB): AdamW, LoGRA.
PAPER_GIB: dict[str, tuple[float, float]] = {"1.5b": (9.18, 7.18), "7b": (31.82, 17.29)}


@dataclass(frozen=True)
class Shape:
    """A Qwen2 architecture (random weights, built locally)."""

    label: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    rope_theta: float = 1_000_000.0

    def config(self) -> Qwen2Config:
        """The transformers config: fp32 weights, sdpa attention, no KV cache."""
        return Qwen2Config(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=32768,
            rope_theta=self.rope_theta,
            rms_norm_eps=1e-6,
            tie_word_embeddings=self.tied,
            use_cache=False,
            attn_implementation="sdpa",
            dtype="float32",
        )


SHAPES: dict[str, Shape] = {
    "1.5b": Shape("Qwen2.5-1.5B", 1536, 8960, 28, 12, 2, 151936, tied=True),
    "7b": Shape("Qwen2.5-7B", 3584, 18944, 28, 28, 4, 152064, tied=False),
    "tiny": Shape("tiny Qwen2", 64, 128, 2, 4, 2, 512, tied=True),
}


@dataclass
class Settings:
    """One run's knobs (the defaults are the paper's)."""

    device: torch.device
    models: list[str]
    optimizers: list[str]
    updates: int = 3
    warmup: int = 1
    prompt_len: int = 256
    response_len: int = 1792
    rank: int = 256
    adamw_all: bool = False
    adamw_impl: str = "default"
    autocast: bool = True
    seed: int = 0
    logprob_chunk: int | None = None  # tokens per chunk of the chunked log-probs; None: the full log-softmax
    sketch_operands: str = "float32"  # logra.sketch_operands: the sketch matmuls' operands (bfloat16: tensor cores)
    profile: str | None = None  # folder for one extra, untimed update's profile per configuration; None: no profile

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


# ----------------------------------------------------------------------------------------------- optimizers
class Method:
    """One optimizer on one model: ``step()`` after the backward, ``release()`` at the end of the update."""

    name = ""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def step(self) -> None:
        raise NotImplementedError

    def release(self) -> None:
        """Drop what only lives within an update (dense gradients)."""

    def state(self) -> dict[str, int]:
        raise NotImplementedError

    def trainable(self) -> int:
        raise NotImplementedError


def make_adamw(params: list[nn.Parameter], impl: str) -> torch.optim.AdamW:
    """AdamW with the paper's dense-baseline hyper-parameters; ``impl`` picks torch's foreach/fused/for-loop path."""
    kwargs: dict[str, Any] = {}
    if impl == "fused":
        kwargs["fused"] = True
    elif impl == "foreach":
        kwargs["foreach"] = True
    elif impl == "for-loop":
        kwargs["foreach"] = False
    return torch.optim.AdamW(params, lr=ADAMW_LR, betas=ADAMW_BETAS, eps=ADAMW_EPS, weight_decay=ADAMW_WD, **kwargs)


def target_weights(model: nn.Module) -> list[nn.Parameter]:
    """Weights of the 7 target matrices of every layer (q, k, v, o, gate, up, down)."""
    return [
        m.weight
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.split(".")[-1] in DEFAULT_TARGETS
    ]


class DenseAdamW(Method):
    """Dense AdamW on the 7 target matrices (``all_params``: on every parameter, as the paper's baseline)."""

    def __init__(self, model: nn.Module, settings: Settings) -> None:
        super().__init__(model)
        self.name = "adamw (all params)" if settings.adamw_all else "adamw"
        if settings.adamw_all:
            params = [p for p in model.parameters() if p.requires_grad]
        else:
            model.requires_grad_(False)
            params = target_weights(model)
            for p in params:
                p.requires_grad_(True)
        self.params = params
        self.optimizer = make_adamw(params, settings.adamw_impl)

    def step(self) -> None:
        self.optimizer.step()

    def release(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state(self) -> dict[str, int]:
        return _state_by_kind(memory_report(self.model, self.optimizer))

    def trainable(self) -> int:
        return sum(p.numel() for p in self.params)


class LoRA(Method):
    """peft LoRA (r = rank, alpha = 2·rank, dropout 0) on the 7 target matrices, AdamW on the adapters."""

    name = "lora"

    def __init__(self, model: nn.Module, settings: Settings) -> None:
        from peft import LoraConfig, get_peft_model  # the only peft use: a missing peft fails this row alone

        config = LoraConfig(
            r=settings.rank,
            lora_alpha=2 * settings.rank,
            lora_dropout=0.0,
            target_modules=list(DEFAULT_TARGETS),
            bias="none",
        )
        super().__init__(get_peft_model(model, config))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = make_adamw(self.params, settings.adamw_impl)

    def step(self) -> None:
        self.optimizer.step()

    def release(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state(self) -> dict[str, int]:
        return _state_by_kind(memory_report(self.model, self.optimizer))

    def trainable(self) -> int:
        return sum(p.numel() for p in self.params)


class LoGRA(Method):
    """``LoGRASketcher`` (LoGRA's default rule at ``rank``, with ``sketch_operands``), frozen base weights;
    propose + apply per update."""

    name = "logra"

    def __init__(self, model: nn.Module, settings: Settings) -> None:
        super().__init__(model)
        self.sketcher = LoGRASketcher(model, LoGRAConfig(rank=settings.rank, sketch_operands=settings.sketch_operands))

    def step(self) -> None:
        proposal = self.sketcher.propose()
        if proposal is not None:
            self.sketcher.apply(proposal)

    def state(self) -> dict[str, int]:
        return _state_by_kind(memory_report(self.model, None, self.sketcher))

    def trainable(self) -> int:
        return sum(m.d_out * m.d_in for m in self.sketcher.matrices.values())

    def counters(self) -> dict[str, int]:
        s = self.sketcher
        return {"applied": s.num_applied, "skipped": s.num_skipped, "rejected": s.num_rejected}


METHODS: dict[str, Callable[[nn.Module, Settings], Method]] = {"adamw": DenseAdamW, "lora": LoRA, "logra": LoGRA}


def _state_by_kind(report: Any) -> dict[str, int]:
    kinds = ("weights", "gradients", "optimizer_state", "sketches", "projections", "row_statistics")
    out = {k: int(getattr(report, k)) for k in kinds}
    out["total"] = int(report.total)
    return out


# --------------------------------------------------------------------------------------------------- running
def build_model(shape: Shape, settings: Settings) -> Qwen2ForCausalLM:
    """Random fp32 weights straight on the device, activation checkpointing on, in training mode."""
    torch.manual_seed(settings.seed)
    with torch.device(settings.device):
        model = Qwen2ForCausalLM(shape.config())
    model.to(torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def make_batches(shape: Shape, settings: Settings) -> list[tuple[torch.Tensor, float]]:
    """Token ids (prompt + synthetic response) and a ±1 advantage for every update, warm-up included."""
    gen = torch.Generator().manual_seed(settings.seed)
    seq = settings.prompt_len + settings.response_len
    batches = []
    for _ in range(settings.warmup + settings.updates):
        ids = torch.randint(0, shape.vocab, (1, seq), generator=gen)
        advantage = 1.0 if torch.rand((), generator=gen) < 0.5 else -1.0
        batches.append((ids, advantage))
    return batches


class OneRow:
    """One unpadded prompt+response row as the chunked log-probs read a packed batch
    (:class:`logra_pl.train.packed.PackedResponses`): the response is everything after ``prompt_len``."""

    def __init__(self, ids: torch.Tensor, prompt_len: int) -> None:
        seq = ids.shape[1]
        self.input_ids = ids
        self.attention_mask = torch.ones_like(ids)
        self.position_ids = torch.arange(seq, device=ids.device).unsqueeze(0)
        self.targets = ids[:, prompt_len:]
        self.response_mask = torch.ones_like(self.targets)
        self.starts = torch.full((1,), prompt_len - 1, device=ids.device)


def sync(settings: Settings) -> None:
    if settings.cuda:
        torch.cuda.synchronize(settings.device)


def one_update(
    model: nn.Module, method: Method, ids: torch.Tensor, advantage: float, s: Settings, record_state: bool = False
) -> dict[str, Any]:
    """Forward, backward, optimizer step; memory samples and wall seconds of the whole update.

    ``record_state``: also take the training state by kind right after the step, before gradients are released
    (outside the timed span).
    """
    ids = ids.to(s.device)
    samples: dict[str, int] = {}

    def sample(point: str) -> None:
        if s.cuda:
            samples[point] = torch.cuda.memory_allocated(s.device)

    sync(s)
    if s.cuda:
        torch.cuda.reset_peak_memory_stats(s.device)
    start = time.perf_counter()
    with record_function("update.forward"), torch.autocast(s.device.type, dtype=torch.bfloat16, enabled=s.autocast):
        if s.logprob_chunk is None:
            # Logits only where they predict a response token: positions prompt_len - 1 .. seq - 2.
            logits = model(input_ids=ids, logits_to_keep=s.response_len + 1, use_cache=False).logits[:, :-1]
            logp = torch.log_softmax(logits.float(), dim=-1)
            token_logp = logp.gather(-1, ids[:, s.prompt_len :, None]).squeeze(-1)
            del logits, logp
        else:  # the output projection and log-softmax chunk by chunk: no (R, V) tensor is kept
            token_logp = chunked_response_scores(model, OneRow(ids, s.prompt_len), 1.0, s.logprob_chunk)[0]
        loss = -advantage * token_logp.mean()
    sample("after_forward")
    with record_function("update.backward"):
        loss.backward()
    del token_logp
    sample("after_backward")
    with record_function("update.step"):
        method.step()
    sample("after_step")
    sync(s)
    seconds = time.perf_counter() - start
    state = method.state() if record_state else None
    start = time.perf_counter()
    method.release()
    sync(s)
    row: dict[str, Any] = {"seconds": seconds + time.perf_counter() - start, "loss": float(loss.detach())}
    if state is not None:
        row["state"] = state
    if s.cuda:
        row["samples"] = samples
        row["mean_allocated_bytes"] = sum(samples.values()) / len(samples)
        row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(s.device)
        row["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(s.device)
    return row


def profile_update(method: Method, batch: tuple[torch.Tensor, float], s: Settings, out: Path) -> dict[str, Any]:
    """One more update, untimed, under ``torch.profiler``: where its time goes.

    Writes ``out``, the operators and ranges sorted by their own device time (CPU time on a CPU),
    and returns the totals of the named ranges: this script's phases (``update.forward``, ``update.backward``,
    ``update.step``) and logra-pl's own (``logra.sketch.project``, ``logra.sketch.accumulate``, ``logra.propose``,
    ``logra.apply``; :mod:`logra_pl.sketch.trace`), each with its call count, CPU milliseconds and, on CUDA, the
    milliseconds of the kernels it launched.
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if s.cuda else [])
    with profile(activities=activities) as prof:
        one_update(method.model, method, batch[0], batch[1], s)
    events = prof.key_averages()
    sort = "self_device_time_total" if s.cuda else "self_cpu_time_total"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(events.table(sort_by=sort, row_limit=40, max_name_column_width=60))
    ranges: dict[str, Any] = {}
    for e in events:
        if e.key.startswith(("update.", "logra.")):
            ranges[e.key] = {
                "count": e.count,
                "cpu_ms": e.cpu_time_total / 1e3,
                "device_ms": getattr(e, "device_time_total", 0.0) / 1e3 if s.cuda else None,
            }
    return ranges


def run_config(key: str, optimizer: str, s: Settings) -> dict[str, Any]:
    """Build the model, attach the optimizer, run warm-up + timed updates; everything is freed on return."""
    shape = SHAPES[key]
    start = time.perf_counter()
    model = build_model(shape, s)
    parameters = sum(p.numel() for p in model.parameters())
    method = METHODS[optimizer](model, s)
    sync(s)
    build_s = time.perf_counter() - start
    batches = make_batches(shape, s)
    last = len(batches) - 1
    updates = [one_update(method.model, method, ids, adv, s, i == last) for i, (ids, adv) in enumerate(batches)]
    timed = updates[s.warmup :]
    state = updates[-1].pop("state")
    profiled = None
    if s.profile is not None:
        profiled = profile_update(method, batches[-1], s, Path(s.profile) / f"{key}_{optimizer}.txt")
    result: dict[str, Any] = {
        "parameters": parameters,
        "trainable_parameters": method.trainable(),
        "optimizer_label": method.name,
        "build_seconds": build_s,
        "state_bytes": state["total"],
        "state_by_kind": state,
        "seconds_per_update": sum(u["seconds"] for u in timed) / len(timed),
        "warmup_seconds": sum(u["seconds"] for u in updates[: s.warmup]),
        "updates": timed,
    }
    if profiled is not None:
        result["profile"] = profiled
    if isinstance(method, LoGRA):
        result["logra_counters"] = method.counters()
    if s.cuda:
        result["mean_allocated_bytes"] = sum(u["mean_allocated_bytes"] for u in timed) / len(timed)
        result["peak_allocated_bytes"] = max(u["peak_allocated_bytes"] for u in timed)
        result["peak_reserved_bytes"] = max(u["peak_reserved_bytes"] for u in timed)
    return result


def free_memory(s: Settings) -> None:
    gc.collect()
    if s.cuda:
        torch.cuda.synchronize(s.device)
        torch.cuda.empty_cache()


def run_all(s: Settings, on_row: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    """Every (model, optimizer) in its own scope; OOM and other failures become rows, not crashes."""
    rows: list[dict[str, Any]] = []
    for key in s.models:
        for optimizer in s.optimizers:
            free_memory(s)
            row: dict[str, Any] = {"model": key, "model_name": SHAPES[key].label, "optimizer": optimizer}
            if s.cuda:
                row["allocated_before_bytes"] = torch.cuda.memory_allocated(s.device)
            began = time.perf_counter()
            try:
                row.update(run_config(key, optimizer, s), status="ok")
            except torch.cuda.OutOfMemoryError as err:
                row.update(status="oom", error=str(err).splitlines()[0])
            except Exception as err:  # one broken configuration must not cost the rest of a GPU run
                traceback.print_exc()
                row.update(status="error", error=f"{type(err).__name__}: {err}")
            # The exception (and the frames holding the model) is gone here, so the memory can be returned.
            free_memory(s)
            row["wall_seconds"] = time.perf_counter() - began
            rows.append(row)
            add_ratios(rows)
            print(f"  {key} {optimizer}: {row['status']} in {row['wall_seconds']:.1f} s", file=sys.stderr, flush=True)
            on_row(rows)
    return rows


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """``ratios``: each row's state / mean / peak bytes over the same model's adamw row (``None`` if n/a)."""
    for row in rows:
        base = next((r for r in rows if r["model"] == row["model"] and r["optimizer"] == "adamw"), None)
        row["ratios"] = {}
        for key, field in (
            ("state", "state_bytes"),
            ("mean", "mean_allocated_bytes"),
            ("peak", "peak_allocated_bytes"),
        ):
            ok = base is not None and row.get(field) is not None and base.get(field)
            row["ratios"][key] = row[field] / base[field] if ok else None


# --------------------------------------------------------------------------------------------------- report
def table(rows: list[dict[str, Any]], s: Settings) -> str:
    """The markdown table and its footnotes."""
    unit, div = ("GiB", GiB) if s.cuda and s.models != ["tiny"] else ("MiB", MiB)
    head = [
        "model",
        "optimizer",
        f"state {unit}",
        f"mean allocated {unit}",
        f"peak allocated {unit}",
        f"peak reserved {unit}",
        "s/update",
        "state / adamw",
        "mean / adamw",
        "peak / adamw",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|"]

    def num(value: float | None, scale: float = 1.0, digits: int = 3) -> str:
        return "n/a" if value is None else f"{value / scale:.{digits}f}"

    for r in rows:
        cells = [r["model_name"], r.get("optimizer_label", r["optimizer"])]
        if r["status"] != "ok":
            cells += ["OOM" if r["status"] == "oom" else "error"] + ["—"] * (len(head) - 3)
        else:
            cells += [num(r.get(k), div) for k in ("state_bytes", "mean_allocated_bytes", "peak_allocated_bytes")]
            cells += [num(r.get("peak_reserved_bytes"), div), num(r["seconds_per_update"], digits=2)]
            cells += [num(r["ratios"][k]) for k in ("state", "mean", "peak")]
        lines.append("| " + " | ".join(cells) + " |")
    seq = s.prompt_len + s.response_len
    notes = [
        "",
        f"{s.updates} timed updates after {s.warmup} warm-up; microbatch 1, {seq} tokens ({s.prompt_len} prompt + "
        f"{s.response_len} response), rank {s.rank}, {'bf16 autocast' if s.autocast else 'fp32'} on {s.device}, "
        + (f"log-probs in chunks of {s.logprob_chunk} tokens, " if s.logprob_chunk else "full log-softmax, ")
        + "fp32 master weights, activation checkpointing. state = weights + gradients + optimizer state + sketches + "
        "projections + row statistics (memory_report, right after the last step); mean allocated = mean of "
        "memory_allocated() after forward, backward and step; peaks per update, max over updates.",
        "Paper, per GPU (average memory, LoGRA/AdamW): 0.782 at 1.5B (7.18 / 9.18 GiB), 0.543 at 7B "
        "(17.29 / 31.82 GiB). It measured 4-GPU FSDP training, where weights, gradients and optimizer state are "
        "sharded 4 ways and activations are not, so a single-GPU ratio is not the same quantity.",
    ]
    if not s.cuda:
        notes.append("No CUDA device: the allocated/reserved columns are n/a; compare the training state.")
    if not s.adamw_all:
        notes.append("adamw trains only the 7 target matrices; the paper's dense baseline trains all parameters.")
    return "\n".join(lines + notes)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the numbers here (rewritten after every configuration)")
    parser.add_argument("--tiny", action="store_true", help="a tiny Qwen2, 64-token sequences, rank 8 (CPU, seconds)")
    parser.add_argument("--device", help="default: cpu with --tiny, else cuda if available")
    parser.add_argument("--models", help="comma-separated: 1.5b,7b (default) or tiny")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated; default all three")
    parser.add_argument("--updates", type=int, default=3, help="timed updates per configuration; default 3")
    parser.add_argument("--warmup", type=int, default=1, help="untimed updates first; default 1")
    parser.add_argument("--rank", type=int, help="LoGRA and LoRA rank; default 256 (8 with --tiny)")
    parser.add_argument("--prompt-len", type=int, help="default 256 (8 with --tiny)")
    parser.add_argument("--response-len", type=int, help="default 1792 (56 with --tiny)")
    parser.add_argument("--adamw-all", action="store_true", help="dense AdamW on all parameters (the paper's)")
    parser.add_argument(
        "--adamw-impl",
        default="default",
        choices=["default", "foreach", "fused", "for-loop"],
        help="torch AdamW implementation (default: torch's choice, foreach on CUDA)",
    )
    parser.add_argument(
        "--sketch-operands",
        default="float32",
        choices=["float32", "bfloat16"],
        help="LoGRA's logra.sketch_operands (bfloat16: the sketch matmuls on tensor cores); default float32",
    )
    parser.add_argument("--no-autocast", action="store_true", help="fp32 compute instead of bf16 autocast")
    parser.add_argument(
        "--logprob-chunk",
        type=int,
        default=None,
        help="log-probs through the chunked path, this many tokens per chunk (default: the full log-softmax)",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="after the timed updates, profile one more (untimed) per configuration: DIR/<model>_<optimizer>.txt, "
        "and the named ranges' totals in --json",
    )
    parser.add_argument(
        "--expandable-segments", action="store_true", help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    )
    args = parser.parse_args(argv)
    if args.updates < 1 or args.warmup < 0:
        parser.error("--updates must be >= 1 and --warmup >= 0")
    return args


def settings_from(args: argparse.Namespace) -> Settings:
    tiny = args.tiny
    device = torch.device(args.device or ("cpu" if tiny or not torch.cuda.is_available() else "cuda"))
    models = args.models.split(",") if args.models else (["tiny"] if tiny else ["1.5b", "7b"])
    unknown = [m for m in models if m not in SHAPES] + [o for o in args.optimizers.split(",") if o not in METHODS]
    if unknown:
        sys.exit(f"unknown model or optimizer {unknown}: models {sorted(SHAPES)}, optimizers {list(METHODS)}")
    if device.type != "cuda" and any(m != "tiny" for m in models):
        sys.exit("the 1.5B/7B shapes need a CUDA device; use --tiny on a CPU")
    return Settings(
        device=device,
        models=models,
        optimizers=args.optimizers.split(","),
        updates=args.updates,
        warmup=args.warmup,
        prompt_len=args.prompt_len or (8 if tiny else 256),
        response_len=args.response_len or (56 if tiny else 1792),
        rank=args.rank or (8 if tiny else 256),
        adamw_all=args.adamw_all,
        adamw_impl=args.adamw_impl,
        autocast=not args.no_autocast,
        logprob_chunk=args.logprob_chunk,
        profile=args.profile,
        sketch_operands=args.sketch_operands,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.expandable_segments:  # read when CUDA initialises, which has not happened yet
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    s = settings_from(args)
    started = time.perf_counter()
    meta = {
        "settings": {k: (str(v) if isinstance(v, torch.device) else v) for k, v in vars(s).items()},
        "device_name": torch.cuda.get_device_name(s.device) if s.cuda else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "paper_per_gpu_gib": {k: {"adamw": a, "logra": b, "ratio": round(b / a, 3)} for k, (a, b) in PAPER_GIB.items()},
    }

    def write(rows: list[dict[str, Any]]) -> None:
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            doc = {**meta, "rows": rows, "wall_seconds": time.perf_counter() - started}
            Path(args.json).write_text(json.dumps(doc, indent=2))

    rows = run_all(s, write)
    write(rows)
    print(table(rows, s))
    return 1 if any(r["status"] == "error" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
