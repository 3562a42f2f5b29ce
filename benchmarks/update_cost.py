"""What LoGRA adds to one RL update, counted on the ``meta`` device at GPU shapes, against dense AdamW's update.

    python benchmarks/update_cost.py [--shapes 0.5b,1.5b] [--tokens 2048] [--rank 256] [--probe-tokens 256]
        [--no-checkpointing] [--sketch-operands float32,bfloat16] [--ops 6] [--json out.json]

No arithmetic runs: the models are built on the ``meta`` device (shapes and dtypes only, no memory), and a
``TorchDispatchMode`` sees every operator call of

- the **training phase** of one microbatch (forward and backward of a ``--tokens``-token sequence, bf16 layers as
  under ``bf16-mixed``, activation checkpointing unless ``--no-checkpointing``): LoGRA's sketch hooks
  (``logra.sketch.project``, ``logra.sketch.accumulate``) beside the model's own work, with the target matrices
  frozen (LoGRA) or trained (AdamW: their weight gradients are computed);
- LoGRA's **step**: ``logra.propose`` and ``logra.apply`` (the grouped sketch step and the exact float64 merge) on
  fp32 master weights, and its **KL probe** (``logra.kl_probe``: one forward-mode pass along the proposal);
- dense AdamW's **step** on the same 7 target matrices (fp32 weights, gradients and moments, ``foreach``, as on a GPU).

Each call is charged to the innermost ``logra.*`` range open when it runs (:func:`logra_pl.sketch.trace.listening`),
else to its phase. Per part it reports operator calls (each launches at least one kernel on a GPU), FLOPs by dtype
(``torch.utils.flop_counter``'s formulas), bytes read and written (every tensor argument and result, views at their
size), and host synchronizations (scalar reads, copies to the CPU, data-dependent shapes) — and an **expected H200
time**: per call ``max(FLOPs / rate(dtype), bytes / bandwidth) + launch``, with the rates below. The model is a
model, not a measurement: it says which part should dominate and by how much, for the GPU run to confirm.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from sketch_step import qwen2_config
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from logra_pl.sketch import trace

# Qwen2.5 shapes: hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings.
SHAPES: dict[str, tuple[int, int, int, int, int, int, bool]] = {
    "0.5b": (896, 4864, 24, 14, 2, 151936, True),
    "1.5b": (1536, 8960, 28, 12, 2, 151936, True),
}
# One H200 (SXM), sustained rather than peak: dense bf16 tensor cores ~800 of 989 TFLOP/s, fp32 without tensor cores
# ~50 of 67, fp64 tensor cores ~50 of 67, HBM3e ~4.0 of 4.8 TB/s; ~6 µs per kernel launched from eager PyTorch.
RATES = {"bf16": 800e12, "fp16": 800e12, "fp32": 50e12, "tf32": 400e12, "fp64": 50e12}
BANDWIDTH = 4.0e12
LAUNCH_S = 6e-6
SYNC_S = 20e-6  # a host read drains the stream: its own cost beyond the launch (the lost overlap is not counted)
# Calls that launch nothing (metadata: views, strides, aliases).
FREE = {
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "as_strided", "detach", "alias",
    "slice", "select", "unsqueeze", "squeeze", "split", "split_with_sizes", "chunk", "unbind", "_reshape_alias",
    "lift_fresh", "empty", "empty_like", "empty_strided", "unflatten", "flatten", "narrow", "view_as", "movedim",
    "is_same_size", "_has_same_storage_numel", "new_empty", "_record_function_enter_new", "_record_function_exit",
    "_fw_primal", "_make_dual", "_unpack_dual", "set_", "resolve_conj", "resolve_neg", "_conj", "conj", "clone_meta",
}  # fmt: skip
SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


@dataclass
class Part:
    """What one part of the update costs."""

    calls: int = 0
    launches: int = 0
    flops: dict[str, float] | None = None
    bytes: float = 0.0
    syncs: int = 0
    seconds: float = 0.0  # expected on the H200 model

    def add(self, flops: float, dtype: str, nbytes: float, launches: int, sync: bool) -> None:
        self.calls += 1
        self.launches += launches
        self.flops = self.flops or {}
        if flops:
            self.flops[dtype] = self.flops.get(dtype, 0.0) + flops
        self.bytes += nbytes
        self.syncs += int(sync)
        compute = flops / RATES.get(dtype, RATES["fp32"]) if flops else 0.0
        self.seconds += max(compute, nbytes / BANDWIDTH) * (launches > 0) + launches * LAUNCH_S + sync * SYNC_S


def _nbytes(tensors: list[Any]) -> float:
    return float(sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor)))


class CostCount(TorchDispatchMode):
    """Charges every operator call to the innermost open ``logra.*`` range, else to :attr:`phase`; answers host
    reads of meta tensors with ones (a meta tensor has no values), counting each as a synchronization."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "model"
        self.parts: dict[str, Part] = defaultdict(Part)
        self.ops: Counter[tuple[str, str, str]] = Counter()  # (part, operator, dtype): calls

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        first = next((a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)), None)
        on_device = first is not None and first.device.type == "meta"  # the GPU's stand-in (host tensors: CPU work)
        sync = False
        if on_device and func is torch.ops.aten._local_scalar_dense.default:
            out: Any = 1.0
            sync = True
        elif (
            on_device
            and func is torch.ops.aten._to_copy.default
            and torch.device(kwargs.get("device", "meta")).type == "cpu"
        ):
            out = torch.ones(first.shape, dtype=kwargs.get("dtype") or first.dtype)
            sync = True
        else:
            out = func(*args, **kwargs)
            sync = on_device and name in ("nonzero", "masked_select", "unique", "_unique2")
        ranges = [r for r in trace.open_ranges() if r.startswith("logra.")]
        part_name = ranges[-1] if ranges else self.phase
        part = self.parts[part_name]
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        outputs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        formula = flop_registry.get(func.overloadpacket)
        if formula is None and name.endswith("_") and hasattr(torch.ops.aten, name[:-1]):  # addmm_ as addmm
            formula = flop_registry.get(getattr(torch.ops.aten, name[:-1]))
        flops = 0.0
        if formula is not None:  # the registry's formulas take the call's own arguments and result
            # The formulas take neither the result buffer nor an out_dtype (mm.dtype passes it positionally).
            given = {k: v for k, v in kwargs.items() if k not in ("out", "out_dtype")}
            operands = [a for a in args if not isinstance(a, torch.dtype)]
            flops = float(formula(*operands, **given, out_val=out))
        # A product's dtype is its operands' (addmm's first argument is the sum it adds to): the last tensor given.
        operand = next((a for a in reversed(args) if isinstance(a, torch.Tensor)), first) if flops else first
        dtype = SHORT.get(operand.dtype, "fp32") if operand is not None else "fp32"
        free = name in FREE or not on_device
        self.ops[(part_name, name, dtype)] += 1
        part.add(flops, dtype, 0.0 if free else _nbytes(inputs) + _nbytes(outputs), 0 if free else 1, sync)
        return out


def qwen(shape: str, dtype: torch.dtype) -> torch.nn.Module:
    """A Qwen2 of ``shape`` on the meta device."""
    from transformers import Qwen2ForCausalLM

    config = qwen2_config(SHAPES[shape], attn_implementation="sdpa")
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config).to(dtype)
    model.requires_grad_(False)
    return model


def training_phase(model: torch.nn.Module, tokens: int, checkpointing: bool, mode: CostCount, phase: str) -> None:
    """Forward and backward of one ``tokens``-long sequence, charged to ``phase`` (and the ranges inside it)."""
    from logra_pl.runtime.checkpointing import enable_activation_checkpointing

    if checkpointing:
        enable_activation_checkpointing(model)
    model.train()
    ids = torch.zeros((1, tokens), dtype=torch.long, device="meta")
    mode.phase = phase
    with mode, trace.listening():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()


def logra_costs(
    shape: str, tokens: int, rank: int, checkpointing: bool, probe_tokens: int, operands: str = "float32"
) -> tuple[dict[str, Part], Counter]:
    """LoGRA's parts: training phase (bf16 layers, frozen targets, sketch hooks), propose, apply, the KL probe."""
    from logra_pl.sketch import LoGRAConfig, LoGRASketcher
    from logra_pl.sketch.probe import logit_tangent

    config = LoGRAConfig(rank=rank, update_ratio=1e-3, sketch_operands=operands)
    mode = CostCount()
    model = qwen(shape, torch.bfloat16)
    model.model.embed_tokens.weight.requires_grad_(False)
    with CostCount():  # not counted; answers its host reads (the bf16 operands' scales) on meta
        LoGRASketcher(model, config)  # frozen targets, hooks that sketch
    training_phase(model, tokens, checkpointing, mode, "model (LoGRA: frozen targets)")
    del model
    master = qwen(shape, torch.float32)
    with CostCount():
        sketcher = LoGRASketcher(master, config)
    mode.phase = "step (other)"
    with mode, trace.listening():
        proposal = sketcher.propose()
        assert proposal is not None, sketcher.last_skip_reason
        ids = torch.zeros((1, probe_tokens), dtype=torch.long, device="meta")
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=False):
            modules = {name: m.module for name, m in sketcher.matrices.items()}
            logit_tangent(master, modules, proposal, {"input_ids": ids}, "jvp", 1e-3, sketcher.dense)
        sketcher.apply(proposal)
    return dict(mode.parts), mode.ops


def adamw_costs(shape: str, tokens: int, checkpointing: bool, probe_tokens: int) -> tuple[dict[str, Part], Counter]:
    """Dense AdamW's parts: training phase with the 7 target matrices trained, and its ``foreach`` step on them."""
    from logra_pl.sketch import select_targets
    from logra_pl.sketch.config import DEFAULT_TARGETS

    mode = CostCount()
    model = qwen(shape, torch.bfloat16)
    targets = select_targets(model, DEFAULT_TARGETS)
    for module in targets.values():
        module.weight.requires_grad_(True)
    training_phase(model, tokens, checkpointing, mode, "model (AdamW: weight gradients)")
    params = [torch.empty(m.weight.shape, device="meta") for m in targets.values()]
    for p in params:
        p.grad = torch.empty_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-6, betas=(0.9, 0.95), foreach=True)
    optimizer.step()  # the first step creates the moments: not counted (a later update's step is)
    step = CostCount()
    step.phase = "AdamW step"
    with step:
        optimizer.step()
    del model
    from logra_pl.sketch.probe import parameter_logit_tangent

    master = qwen(shape, torch.float32)
    names = {m.weight: f"{n}.weight" for n, m in select_targets(master, DEFAULT_TARGETS).items()}
    deltas = {name: torch.empty_like(w) for w, name in names.items()}
    ids = torch.zeros((1, probe_tokens), dtype=torch.long, device="meta")
    step.phase = "KL probe (dense)"
    with step, trace.listening():
        parameter_logit_tangent(master, deltas, {"input_ids": ids}, "jvp", 1e-3)
    return dict(mode.parts) | dict(step.parts), mode.ops + step.ops


def host_seconds(shape: str, checkpointing: bool, repeats: int = 5) -> dict[str, dict[str, float]]:
    """Wall seconds of each part on this CPU for a model of ``shape``'s depth and matrices at width 64 (8 tokens):
    its arithmetic is negligible, so what is left is the host's cost of issuing the same calls — what a GPU run pays
    on the CPU side whatever its kernels take (median of ``repeats``)."""
    import statistics
    import time

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from logra_pl.runtime.checkpointing import enable_activation_checkpointing
    from logra_pl.sketch import LoGRAConfig, LoGRASketcher, select_targets
    from logra_pl.sketch.config import DEFAULT_TARGETS
    from logra_pl.sketch.probe import logit_tangent, parameter_logit_tangent

    layers = SHAPES[shape][2]
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
        dtype="float32",
    )
    ids = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(0))
    torch.set_num_threads(1)

    def timed(fn: Any) -> float:
        fn()  # warm-up
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - start)
        return statistics.median(runs)

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        built = Qwen2ForCausalLM(config).train()
        built.requires_grad_(False)
        if checkpointing:
            enable_activation_checkpointing(built)
        return built

    out: dict[str, dict[str, float]] = {"LoGRA": {}, "AdamW": {}}
    logra = model()
    sketcher = LoGRASketcher(logra, LoGRAConfig(rank=16, update_ratio=1e-3))
    out["LoGRA"]["training phase"] = timed(lambda: logra(input_ids=ids, labels=ids).loss.backward())
    proposal = sketcher.propose()
    out["LoGRA"]["logra.propose"] = timed(sketcher.propose)
    modules = {name: m.module for name, m in sketcher.matrices.items()}
    out["LoGRA"]["logra.kl_probe"] = timed(
        lambda: logit_tangent(logra, modules, proposal, {"input_ids": ids}, "jvp", 1e-3, sketcher.dense)
    )

    def propose_apply() -> None:
        sketcher.apply(sketcher.propose())

    out["LoGRA"]["logra.apply"] = max(timed(propose_apply) - out["LoGRA"]["logra.propose"], 0.0)
    dense = model()
    targets = select_targets(dense, DEFAULT_TARGETS)
    for module in targets.values():
        module.weight.requires_grad_(True)
    out["AdamW"]["training phase"] = timed(lambda: dense(input_ids=ids, labels=ids).loss.backward())
    optimizer = torch.optim.AdamW([m.weight for m in targets.values()], lr=1e-6, foreach=True)
    out["AdamW"]["AdamW step"] = timed(optimizer.step)
    deltas = {n: torch.zeros_like(p) for n, p in dense.named_parameters() if p.requires_grad}
    out["AdamW"]["KL probe (dense)"] = timed(
        lambda: parameter_logit_tangent(dense, deltas, {"input_ids": ids}, "jvp", 1e-3)
    )
    return out


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| shape | method | part | calls | kernels | GFLOP (by dtype) | GB moved | host syncs | expected H200 ms |\n"
        "| --- | --- | --- | ---: | ---: | --- | ---: | ---: | ---: |"
    )
    lines = [head]
    for r in rows:
        flops = ", ".join(f"{v / 1e9:,.0f} {k}" for k, v in sorted((r["flops"] or {}).items())) or "—"
        lines.append(
            f"| {r['shape']} | {r['method']} | {r['part']} | {r['calls']:,} | {r['launches']:,} | {flops} | "
            f"{r['bytes'] / 1e9:,.2f} | {r['syncs']} | {r['seconds'] * 1e3:,.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="0.5b,1.5b", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of the microbatch (one sequence)")
    parser.add_argument("--rank", type=int, default=256, help="LoGRA's sketch rank")
    parser.add_argument("--probe-tokens", type=int, default=256, help="tokens of the KL probe's contexts")
    parser.add_argument("--ops", type=int, default=6, help="print each part's N most called operators (0: none)")
    parser.add_argument("--no-checkpointing", action="store_true", help="no activation checkpointing")
    parser.add_argument(
        "--sketch-operands", default="float32", help="LoGRA rows for these logra.sketch_operands (comma-separated)"
    )
    parser.add_argument("--no-host", action="store_true", help="skip the host-side timing on this CPU")
    parser.add_argument("--json", type=Path, help="write every row here")
    args = parser.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            parser.error(f"unknown shape {shape!r}: choose from {', '.join(SHAPES)}")
        checkpointing = not args.no_checkpointing
        counted = [
            (
                "LoGRA" if operands == "float32" else f"LoGRA ({operands} operands)",
                logra_costs(shape, args.tokens, args.rank, checkpointing, args.probe_tokens, operands),
            )
            for operands in args.sketch_operands.split(",")
        ]
        counted.append(("AdamW", adamw_costs(shape, args.tokens, checkpointing, args.probe_tokens)))
        for method, (parts, ops) in counted:
            if args.ops:
                for name in sorted(parts):
                    top = sorted(((n, o, d) for (p, o, d), n in ops.items() if p == name), reverse=True)[: args.ops]
                    print(f"{shape} {method} {name}: " + ", ".join(f"{o}[{d}]×{n}" for n, o, d in top))
            total = Part()
            for name, part in sorted(parts.items()):
                rows.append({"shape": shape, "method": method, "part": name, **asdict(part)})
                total.calls += part.calls
                total.launches += part.launches
                total.bytes += part.bytes
                total.syncs += part.syncs
                total.seconds += part.seconds
                total.flops = {k: (total.flops or {}).get(k, 0) + v for k, v in (part.flops or {}).items()} | {
                    k: v for k, v in (total.flops or {}).items() if k not in (part.flops or {})
                }
            rows.append({"shape": shape, "method": method, "part": "**total**", **asdict(total)})
    print(table(rows))
    host: dict[str, Any] = {}
    if args.no_host:
        shapes_timed: list[str] = []
    else:
        shapes_timed = args.shapes.split(",")
        print("\n| shape | method | part | host ms (this CPU, width 64, same depth) |\n| --- | --- | --- | ---: |")
    for shape in shapes_timed:
        host[shape] = host_seconds(shape, not args.no_checkpointing)
        for method, parts in host[shape].items():
            for name, seconds in parts.items():
                print(f"| {shape} | {method} | {name} | {seconds * 1e3:,.1f} |")
    if args.json:
        args.json.write_text(json.dumps({"device": rows, "host": host}, indent=1) + "\n")


if __name__ == "__main__":
    main()
