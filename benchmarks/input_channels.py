"""Where each update rule's first step puts its mass across a layer's input channels, on a real gradient.

    python benchmarks/input_channels.py [--model smollm2] [--prompts 16] [--rank 64] [--top 0.01] [--out DIR]

Why: at a KL budget of 4e-3 per update the default LoGRA rule (Adam on the sketch's d_out × r coordinates) takes off
later than dense AdamW, and the full-rank rotated rules do no better (docs/benchmarks.md). A pretrained model's
layer inputs are far from isotropic: a few input channels carry most of ``E[x²]``. Dense Adam normalizes every entry
of ``G`` (``d_out × d_in``) on its own, so each input channel gets a step of its own size; a rule that normalizes
in a projected or rotated input basis sees coordinates that all mix the loud channels, and its step, mapped back,
follows them. This script measures that, one gradient, no training:

- ``G`` of every LoGRA target matrix: the gradient of the mean negative log-likelihood of the reference answers of
  ``--prompts`` problems of the model's ``kl_matched`` task (the direction RL reinforces when those answers are
  rewarded), prompt and answer teacher-forced, in fp32;
- ``e_j = E[x_j²]`` of each matrix's input over the same tokens, and the loud channels: the top ``--top`` share of
  them by ``e_j`` (at least one);
- the first step of each rule, where Adam's first step is ``m̂/√v̂ = sign(g)`` in its own coordinates:

  ========================  =========================================================================
  dense SGD                 ``G``
  dense AdamW               ``sign(G)``
  LoGRA default rule        ``sign(G Pᵀ) P``, ``P`` the rule's ``r × d_in`` Hadamard projection
  rotated Adam, full rank   ``sign(G Hᵀ) H``, ``H`` the same projection at ``r = d_in`` (orthogonal)
  input-scaled rule         ``sign(G D⁻¹ Pᵀ) P``, ``D = diag(√e)``: the sketch of ``G D⁻¹``, whose columns no
                            longer favour the loud channels (a candidate, not a built rule)
  input-scaled, both sides  ``sign(G Qᵀ) Q``, ``Q = P D⁻¹``: the same sketch, the step on the same ``Q``, so that
                            ``⟨G, ΔW⟩ = ⟨S, U⟩`` stays exact (``D⁻²`` on the input side, as a diagonal K-FAC)
  input-scaled, √ each side ``sign(G Qᵀ) Q``, ``Q = P D^-½``: ``D⁻¹`` in all, as the input-scaled rule and dense
                            Adam's per-entry scale (``√v_ij ≈ rms(dY_i)·rms(x_j)``), with ``⟨G, ΔW⟩ = ⟨S, U⟩``
  input_scaling: rms        the rule as built (algorithm.md §3a): √ each side with ``s`` from
                            :func:`~logra_pl.sketch.input_scale.input_scales` (floor, mean-square 1, bf16)
  ========================  =========================================================================

Per rule and matrix kind (median over layers): the share of ``‖ΔW‖²`` on the loud channels' columns, the share of
the output change ``‖ΔW X‖²`` that the loud channels alone make (``‖ΔW[:, L] X[L]‖² / ‖ΔW X‖²``), and the cosine of
the step with dense AdamW's. Writes ``results.json`` and ``results.md`` into ``--out``
(default ``results/input_channels/<model>``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from kl_matched import MODELS

from logra_pl.data import ReasoningGymDataModule
from logra_pl.models.load import load_policy
from logra_pl.sketch.input_scale import input_scales
from logra_pl.sketch.projection import make_projection
from logra_pl.train.batching import encode_prompts

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RULES = (
    "dense SGD",
    "dense AdamW",
    "LoGRA default rule",
    "rotated Adam, full rank",
    "input-scaled rule",
    "input-scaled, both sides",
    "input-scaled, √ each side",
    "input_scaling: rms",
)


def gradients_and_inputs(
    model: torch.nn.Module, tokenizer: Any, items: list[dict[str, Any]]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``{matrix: G}`` of the answers' mean NLL and ``{matrix: X}`` (tokens × d_in) of every target matrix's input."""
    modules = {n: m for n, m in model.named_modules() if n.split(".")[-1] in TARGETS}
    for p in model.parameters():
        p.requires_grad_(False)
    for m in modules.values():
        m.weight.requires_grad_(True)
    inputs: dict[str, list[torch.Tensor]] = {n: [] for n in modules}

    def hook_for(name: str):
        def hook(module, args, output):
            inputs[name].append(args[0].detach().reshape(-1, args[0].shape[-1]))

        return hook

    handles = [m.register_forward_hook(hook_for(n)) for n, m in modules.items()]
    prompts = encode_prompts(tokenizer, items)
    answers = [
        [*tokenizer(str(it["answer"]), add_special_tokens=False).input_ids, tokenizer.eos_token_id] for it in items
    ]
    total = sum(len(a) for a in answers)
    try:
        for prompt, answer in zip(prompts, answers, strict=True):
            ids = torch.tensor([prompt + answer])
            logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1]
            nll = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(answer), reduction="sum")
            (nll / total).backward()
    finally:
        for h in handles:
            h.remove()
    grads = {n: m.weight.grad.detach().double() for n, m in modules.items()}
    return grads, {n: torch.cat(xs).double() for n, xs in inputs.items()}


def steps(grad: torch.Tensor, x: torch.Tensor, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """Each rule's first step for one matrix (see the module docstring), in weight space."""
    d_in = grad.shape[1]
    p = make_projection(seed, min(rank, d_in), d_in, "hadamard").double()
    h = make_projection(seed, d_in, d_in, "hadamard").double()
    scale = x.pow(2).mean(0).sqrt().clamp_min(1e-12)
    built = input_scales(x.pow(2).mean(0, keepdim=True), age=1, beta=0.0)[0].double()
    return {
        "dense SGD": grad,
        "dense AdamW": grad.sign(),
        "LoGRA default rule": (grad @ p.T).sign() @ p,
        "rotated Adam, full rank": (grad @ h.T).sign() @ h,
        "input-scaled rule": ((grad / scale) @ p.T).sign() @ p,
        "input-scaled, both sides": ((grad / scale) @ p.T).sign() @ (p / scale),
        "input-scaled, √ each side": ((grad / scale.sqrt()) @ p.T).sign() @ (p / scale.sqrt()),
        # The rule as built (logra.input_scaling: rms): √ each side, with its floor, normalization and bf16 rounding.
        "input_scaling: rms": ((grad * built) @ p.T).sign() @ (p * built),
    }


def measure(grads: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor], rank: int, top: float) -> dict:
    """Per matrix kind and rule, the medians over layers of the three shares (module docstring)."""
    rows: dict[str, dict[str, dict[str, list[float]]]] = {}
    energy: dict[str, list[float]] = {}
    for i, (name, grad) in enumerate(sorted(grads.items())):
        kind = name.split(".")[-1]
        x = inputs[name]
        e = x.pow(2).mean(0)
        loud = e.argsort(descending=True)[: max(1, round(top * e.numel()))]
        energy.setdefault(kind, []).append(float(e[loud].sum() / e.sum()))
        adam = grad.sign()
        for rule, dw in steps(grad, x, rank, seed=i).items():
            out_all = (x @ dw.T).pow(2).sum()
            out_loud = (x[:, loud] @ dw[:, loud].T).pow(2).sum()
            cell = rows.setdefault(kind, {}).setdefault(rule, {"weight": [], "output": [], "cos_adamw": []})
            cell["weight"].append(float(dw[:, loud].pow(2).sum() / dw.pow(2).sum()))
            cell["output"].append(float(out_loud / out_all))
            cell["cos_adamw"].append(float((dw * adam).sum() / (dw.norm() * adam.norm())))
    return {
        kind: {
            "loud_share_of_input_energy": statistics.median(energy[kind]),
            "layers": len(energy[kind]),
            "rules": {r: {k: statistics.median(v) for k, v in cells.items()} for r, cells in by_rule.items()},
        }
        for kind, by_rule in rows.items()
    }


def report(result: dict[str, Any]) -> str:
    """The markdown table of :func:`measure`'s medians."""
    lines = [
        f"# Input channels on `{result['model']}` (`benchmarks/input_channels.py`)",
        "",
        f"One gradient: the mean NLL of the reference answers of {result['prompts']} `chain_sum` problems. Loud "
        f"channels: the top {result['top']:.0%} of a matrix's input channels by E[x²]. Each rule's first step "
        f"(Adam's: sign(g) in its own coordinates; r = {result['rank']}). Medians over layers.",
        "",
        "| matrix | loud channels' share of E[x²] | rule | share of ‖ΔW‖² on them | share of ‖ΔW X‖² they make | "
        "cos with AdamW's step |",
        "| --- | ---: | --- | ---: | ---: | ---: |",
    ]
    for kind in TARGETS:
        if kind not in result["kinds"]:
            continue
        row = result["kinds"][kind]
        for j, rule in enumerate(RULES):
            cell = row["rules"][rule]
            head = f"{kind} ({row['layers']})" if j == 0 else ""
            share = f"{row['loud_share_of_input_energy']:.2f}" if j == 0 else ""
            lines.append(
                f"| {head} | {share} | {rule} | {cell['weight']:.3f} | {cell['output']:.3f} | {cell['cos_adamw']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2", choices=sorted(MODELS))
    parser.add_argument("--prompts", type=int, default=16, help="problems whose answers give the gradient")
    parser.add_argument("--rank", type=int, default=64, help="the sketch rank of the projected rules")
    parser.add_argument("--top", type=float, default=0.01, help="share of input channels counted as loud")
    parser.add_argument("--out", type=Path, help="default: results/input_channels/<model>")
    args = parser.parse_args()
    torch.manual_seed(0)
    setup = MODELS[args.model]
    task, config = setup.task
    data = ReasoningGymDataModule(
        {task: {"config": config}},
        train_size=max(64, args.prompts),
        eval_size=16,
        prompts_per_step=args.prompts,
        seed=0,
    )
    data.setup("fit")
    items = next(iter(data.train_dataloader()))
    model, tokenizer = load_policy(args.model)
    grads, inputs = gradients_and_inputs(model, tokenizer, items)
    result = {
        "model": args.model,
        "prompts": args.prompts,
        "rank": args.rank,
        "top": args.top,
        "kinds": measure(grads, inputs, args.rank, args.top),
    }
    out = args.out or Path("results/input_channels") / args.model.replace(":", "_")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    text = report(result)
    (out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
