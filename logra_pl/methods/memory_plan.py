"""Plan training-state memory before running: per-rank bytes of every update method, from a model's config alone.

``plan(config, ranks=4, rank_r=256)`` builds the model on the meta device (shapes only, no weights), selects the LoGRA
target matrices and asks each update method (:meth:`~logra_pl.methods.UpdateMethod.plan_memory`) to count, per rank,
what :func:`logra_pl.sketch.memory.memory_report` measures on a live run: ``weights`` (FSDP shards every parameter by
rows, padded to equal shards), ``gradients`` and ``optimizer_state`` (AdamW: ``exp_avg``, ``exp_avg_sq`` in the
parameter's dtype and a ``step`` scalar per trained parameter, sharded like it), and for LoGRA ``sketches`` (``d_out ×
r`` fp32 per matrix), ``projections`` (``r × d_in`` fp32) and ``row_statistics`` (``d_out`` fp32) — all three whole on
every rank, since each rank sketches the full matrix and the sketches are all-reduced. With a KL penalty (``loss.kl_coef
> 0``), the frozen reference policy too (``reference_policy``): every parameter and buffer in ``loss.reference_dtype``,
sharded like the weights with ``reference: same`` (``logra_fsdp`` shards it) and whole in host memory with ``reference:
cpu`` (one process only: the strategy refuses it on several ranks). Activations and the rollout engine are not training
state and not in the table; the vocabulary-sized activations of one microbatch's forward, which are the largest on
models with large vocabularies, are printed beside it (:func:`logit_activations`, ``--microbatch-tokens``).

    logra-pl plan --model Qwen/Qwen2.5-7B-Instruct --ranks 4 --rank 256     # a config.json, folder, hub id or tiny
    logra-pl plan --model Qwen/Qwen2.5-7B-Instruct --reference cpu --reference-dtype bfloat16    # with a KL penalty
    logra-pl plan --model Qwen/Qwen2.5-1.5B-Instruct --microbatch-tokens 4096 --logprob-chunk 1024   # + activations
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from logra_pl.methods import method_class
from logra_pl.methods.base import PlanSettings, PlanShapes, UpdateMethod
from logra_pl.models.load import load_config
from logra_pl.runtime.dtypes import DTYPES
from logra_pl.sketch import DEFAULT_TARGETS, select_targets
from logra_pl.sketch.config import check_rank_fits
from logra_pl.sketch.memory import MemoryReport

GiB = 1024**3
_DTYPES = DTYPES


@dataclass
class PlanRow:
    """Predicted per-rank state of one optimizer, by kind (the fields of :class:`MemoryReport`)."""

    optimizer: str
    ranks: int
    report: MemoryReport

    def as_dict(self) -> dict[str, Any]:
        """JSON-able: the kinds in bytes, the total and the persistent part."""
        out = {f.name: getattr(self.report, f.name) for f in fields(self.report)}
        out |= {"optimizer": self.optimizer, "ranks": self.ranks, "total": self.report.total}
        out["persistent"] = self.report.persistent
        return out


def plan(
    config: str | Path | PretrainedConfig | dict[str, Any],
    ranks: int = 1,
    rank_r: int = 64,
    optimizers: Sequence[str | type[UpdateMethod]] | None = None,
    weight_dtype: str = "float32",
    targets: Sequence[str] = DEFAULT_TARGETS,
    train_all: bool = False,
    reference: str | None = None,
    reference_dtype: str | None = None,
    **options: Any,
) -> dict[str, PlanRow]:
    """Predict per-rank training-state bytes for each update method (each method's own
    :meth:`~logra_pl.methods.UpdateMethod.plan_memory`, of the method its
    :meth:`~logra_pl.methods.UpdateMethod.planned` builds).

    Arguments:
        config: the model (see :func:`~logra_pl.models.load.load_config`).
        ranks: data-parallel ranks the parameters (and dense optimizer state) are sharded over.
        rank_r: LoGRA sketch rank ``r``, and the LoRA adapters' rank.
        optimizers: the methods to plan: short names (``adamw``: the dense baseline, ``sgd``: dense SGD, ``lora``:
            adapters on the targets, AdamW on them, ``logra``...), dotted class paths or classes; None: every
            registered method.
        weight_dtype: parameter dtype (``float32`` master weights by default; ``bfloat16`` for pure-bf16 runs).
        targets: matrices LoGRA sketches (and the dense baseline trains, unless ``train_all``).
        train_all: the dense baselines train every parameter (embeddings, norms...), not only the targets.
        reference: a KL penalty's reference policy (``loss.reference_device``): ``"same"`` (sharded over ``ranks``
            like the weights) or ``"cpu"`` (whole, in host memory; ``ranks`` must be 1); None: no KL penalty.
        reference_dtype: its dtype (``loss.reference_dtype``); None: ``weight_dtype``.
        options: the planned methods' own options (:meth:`~logra_pl.methods.UpdateMethod.plan_options`): LoGRA's
            ``logra_rule``, ``logra_moments``, ``moment_dtype``; SGD's ``sgd_momentum``; an option no planned method
            knows is refused.
    """
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    chosen = planned_methods(optimizers)
    known = {action.dest for action in option_parser(chosen.values())._actions} - {"help"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown plan options {unknown} for {', '.join(chosen)}: the methods take {sorted(known)}")
    shapes, model = _shapes(config, ranks, weight_dtype, targets)
    check_rank_fits(rank_r, {n: m.in_features for n, m in shapes.matrices.items()}, clip=False)
    reference_bytes = _reference_bytes(model, shapes.params, shapes, reference, reference_dtype or weight_dtype)
    settings = PlanSettings(rank=rank_r, targets=tuple(targets), train_all=train_all, options=options)
    out: dict[str, PlanRow] = {}
    for name, method in chosen.items():
        report = method.planned(settings).plan_memory(shapes)
        report.reference_policy = reference_bytes
        out[name] = PlanRow(name, ranks, report)
    return out


def planned_methods(names: Sequence[str | type[UpdateMethod]] | None = None) -> dict[str, type[UpdateMethod]]:
    """The method classes to plan, by the name their row gets: every registered method (its first short name) when
    ``names`` is None; else each short name, dotted class path or class given."""
    registered = UpdateMethod.registry.names
    if names is None:
        out: dict[str, type[UpdateMethod]] = {}
        for name, cls in registered.items():
            if isinstance(cls, type) and cls not in out.values():
                out[name] = cls
        return out
    chosen = {}
    for name in names:
        cls = name if isinstance(name, type) else method_class(name)
        if cls is None:
            raise ValueError(
                f"unknown method {name!r}: plan a registered one ({', '.join(map(repr, registered))}) or an "
                "UpdateMethod subclass by its dotted class path"
            )
        chosen[name if isinstance(name, str) else cls.name] = cls
    return chosen


def option_parser(methods: Iterable[type[UpdateMethod]], parser: argparse.ArgumentParser | None = None) -> Any:
    """``parser`` (or a new one) with the options of every method in ``methods``, each class once."""
    parser = parser or argparse.ArgumentParser(add_help=False)
    for cls in dict.fromkeys(methods):
        cls.plan_options(parser)
    return parser


def plan_shapes(
    config: str | Path | PretrainedConfig | dict[str, Any],
    ranks: int = 1,
    weight_dtype: str = "float32",
    targets: Sequence[str] = DEFAULT_TARGETS,
) -> PlanShapes:
    """What a method's :meth:`~logra_pl.methods.UpdateMethod.plan_memory` reads for a model: built on the meta
    device, its target matrices, parameters and weight bytes per rank (for a method built with its own settings)."""
    return _shapes(config, ranks, weight_dtype, targets)[0]


def _shapes(
    config: str | Path | PretrainedConfig | dict[str, Any], ranks: int, weight_dtype: str, targets: Sequence[str]
) -> tuple[PlanShapes, nn.Module]:
    cfg = load_config(config)
    dtype = _DTYPES[weight_dtype]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    matrices = select_targets(model, targets)
    if not matrices:
        raise ValueError(f"no target matrices {list(targets)} in this {type(model).__name__}")
    params = list({id(p): p for p in model.parameters()}.values())  # tied weights once
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    shapes = PlanShapes(matrices, params, 0, ranks, dtype)
    shapes.weights = sum(shapes.shard_bytes(p) for p in params) + buffers
    return shapes, model


def _reference_bytes(
    model: nn.Module, params: list[torch.Tensor], shapes: PlanShapes, reference: str | None, dtype_name: str
) -> int:
    """Per-rank bytes of a KL penalty's reference policy: every parameter (in ``dtype_name``) and buffer, sharded
    by rows over ``ranks`` when it sits with the policy (``same``), whole in host memory (``cpu``); 0 without one."""
    if reference is None:
        return 0
    if reference not in ("same", "cpu"):
        raise ValueError(f"unknown reference {reference!r}: plan 'same' (the policy's device) or 'cpu'")
    if dtype_name not in _DTYPES:
        raise ValueError(f"unknown reference dtype {dtype_name!r}: use one of {sorted(_DTYPES)}")
    if reference == "cpu" and shapes.ranks > 1:
        raise ValueError(
            "reference 'cpu' keeps a whole copy in every process; logra_fsdp refuses it on several ranks: plan "
            "reference 'same' (sharded like the policy)"
        )
    dtype = _DTYPES[dtype_name]
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return sum(shapes.shard_bytes(p, dtype) for p in params) + buffers


def logit_activations(
    config: str | Path | PretrainedConfig | dict[str, Any],
    tokens: int,
    response_tokens: int | None = None,
    chunk: int | None = None,
    weight_dtype: str = "float32",
) -> dict[str, int]:
    """Bytes of the vocabulary-sized activations of one training forward over ``tokens`` (prompt + response) of which
    ``response_tokens`` (default: all) are scored, with ``V`` the vocabulary:

    - ``full`` (``model.logprob_chunk_tokens: null``): the logits of every position, ``tokens × V`` in the weights'
      dtype, and the float32 log-softmax of the response positions, ``response_tokens × V × 4``, which the backward
      keeps (the gathered logits and their float32 copy are transient);
    - ``chunked``: three float32 ``chunk × V`` tensors at a time (a chunk's logits, probabilities and their
      gradient, in the backward) and one float per scored token (:mod:`logra_pl.train.chunked_logprobs`); None when
      ``chunk`` is not given.
    """
    cfg = load_config(config)
    vocab = int(cfg.vocab_size)
    scored = tokens if response_tokens is None else response_tokens
    width = _DTYPES[weight_dtype].itemsize
    out = {"vocab": vocab, "full": tokens * vocab * width + scored * vocab * 4}
    if chunk is not None:
        out["chunked"] = 3 * min(chunk, scored) * vocab * 4 + scored * 4
    return out


def format_plan(rows: dict[str, PlanRow], title: str = "") -> str:
    """A table in GiB, one column per optimizer, and the LoGRA/AdamW ratio of the totals."""
    kinds = [
        "weights",
        "gradients",
        "optimizer_state",
        "adapters",
        "adapter_optimizer_state",
        "sketches",
        "projections",
        "row_statistics",
        "sketch_moments",
        "reference_policy",
    ]
    names = list(rows)
    lines = [title] if title else []
    lines.append(f"{'per rank (GiB)':<25}" + "".join(f"{n:>12}" for n in names))
    for kind in kinds:
        lines.append(f"{kind:<25}" + "".join(f"{getattr(rows[n].report, kind) / GiB:>12.3f}" for n in names))
    lines.append(f"{'total':<25}" + "".join(f"{rows[n].report.total / GiB:>12.3f}" for n in names))
    for name in names:
        if "adamw" in rows and name != "adamw":
            lines.append(f"{name} / adamw total: {rows[name].report.total / rows['adamw'].report.total:.3f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """``logra-pl plan``: print the predicted per-rank state of every registered update method (or of those named by
    ``--method``), each with its own options, and optionally write it as JSON."""
    parser = argparse.ArgumentParser(prog="logra-pl plan", description=__doc__.split("\n\n")[0])
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--method", action="append")
    try:  # the methods first: their own options join the parser
        chosen = planned_methods(early.parse_known_args(argv)[0].method)
    except ValueError as err:
        parser.error(str(err))
    parser.add_argument("--model", required=True, help="config.json, save_pretrained folder, hub id or tiny[:preset]")
    parser.add_argument(
        "--method",
        action="append",
        help="a method to plan: a short name or an UpdateMethod's dotted class path (repeat it); default: every "
        f"registered one ({', '.join(planned_methods())})",
    )
    parser.add_argument("--ranks", type=int, default=1, help="data-parallel ranks (FSDP shards); default 1")
    parser.add_argument("--rank", type=int, default=64, help="LoGRA sketch rank r (and LoRA's); default 64")
    parser.add_argument("--weight-dtype", default="float32", choices=sorted(_DTYPES), help="default float32")
    parser.add_argument("--train-all", action="store_true", help="dense baselines train every parameter")
    option_parser(chosen.values(), parser.add_argument_group("the methods' own options"))  # type: ignore[arg-type]
    parser.add_argument(
        "--reference",
        choices=["same", "cpu"],
        help="a KL penalty's reference policy (loss.reference_device): same (sharded like the weights) or cpu",
    )
    parser.add_argument(
        "--reference-dtype", choices=sorted(_DTYPES), help="its dtype (loss.reference_dtype); default: --weight-dtype"
    )
    parser.add_argument(
        "--microbatch-tokens", type=int, help="also print the vocabulary-sized activations of a microbatch this long"
    )
    parser.add_argument("--response-tokens", type=int, help="of which scored (response) tokens; default: all")
    parser.add_argument("--logprob-chunk", type=int, help="model.logprob_chunk_tokens to compare with; default: none")
    parser.add_argument("--json", help="write the plan here too")
    args = parser.parse_args(argv)
    shared = {"model", "method", "ranks", "rank", "weight_dtype", "train_all", "reference", "reference_dtype"}
    shared |= {"microbatch_tokens", "response_tokens", "logprob_chunk", "json"}
    options = {k: v for k, v in vars(args).items() if k not in shared}
    try:
        rows = plan(
            args.model,
            args.ranks,
            args.rank,
            optimizers=list(chosen),
            weight_dtype=args.weight_dtype,
            train_all=args.train_all,
            reference=args.reference,
            reference_dtype=args.reference_dtype,
            **options,
        )
    except ValueError as err:
        parser.error(str(err))
    title = f"{args.model}: {args.ranks} rank(s), r={args.rank}, {args.weight_dtype} weights"
    if args.reference:
        title += f", KL reference on {args.reference} in {args.reference_dtype or args.weight_dtype}"
    print(format_plan(rows, title))
    saved: dict[str, Any] = {k: v.as_dict() for k, v in rows.items()}
    if args.microbatch_tokens:
        acts = logit_activations(
            args.model, args.microbatch_tokens, args.response_tokens, args.logprob_chunk, args.weight_dtype
        )
        scored = args.response_tokens or args.microbatch_tokens
        print(
            f"activations of one microbatch's forward, {args.microbatch_tokens} tokens ({scored} scored), vocabulary "
            f"{acts['vocab']:,}: logits and log-softmax {acts['full'] / GiB:.3f} GiB"
            + (
                f"; with logprob_chunk_tokens {args.logprob_chunk}: {acts['chunked'] / GiB:.3f} GiB"
                if "chunked" in acts
                else " (model.logprob_chunk_tokens: --logprob-chunk N to compare)"
            )
        )
        saved["activations"] = acts
    if args.json:
        Path(args.json).write_text(json.dumps(saved, indent=2))


if __name__ == "__main__":
    main()
