"""The parity protocol of ``benchmarks/ablate.py --grid parity``: LoGRA against a tuned dense AdamW, fairly.

    python benchmarks/ablate.py --grid parity [--model tiny|tiny:small] [--stage tune|report|all|levers]
        [--updates N] [--values K] [--methods NAME ...] [--jobs 2] [--out DIR] [--figures DIR] [--dry-run]

Why: a comparison of update rules is only as fair as the tuning of each. Every method gets the same budget of
tuning (its one step knob over log-spaced values, on the same seeds), is chosen on problems it is then not scored
on, and is reported on fresh seeds. The protocol, on ``configs/tiny_cpu.yaml``:

1. **Evaluation split.** The 256 held-out problems are split by ``--data.eval_tune_fraction=0.5``: every second
   problem (2nd, 4th, ...) is a *tuning* problem, the others *report* problems (fixed, the same in every run:
   :func:`logra_pl.data.loaders.tag_eval_subsets`). Validation logs ``val/tune/pass@1`` and ``val/report/pass@1``
   beside ``val/pass@1`` (all 256), 4 times per run (the last at the final update).
2. **Methods and knobs** (:data:`METHODS`): ``paper_logra`` (``configs/overlays/paper_logra.yaml``: the paper's
   LoGRA) and ``logra_best`` (plus ``configs/overlays/logra_levers.yaml``: the chosen levers), both tuned by the
   KL budget's scale (δmax and δmin times one factor: with the controller active the budget, not update_ratio,
   sizes the step); ``adamw`` (``configs/overlays/adamw.yaml``) and ``lora`` r = 64 (``configs/ablations/lora.yaml``),
   tuned by lr. Each knob has 4 to 6 log-spaced values (:data:`METHODS`; the paper's KL scale 5, its grid extended
   one step down when its best was at the lower edge; logra_best's 6, one more step up when its best was at the
   upper edge), run on seeds 0-1. A choice at the smallest or largest value tried is followed outward (the
   widening rule, :func:`widen`; ``--no-widen`` turns it off): the next value of the full grid, then one step beyond
   it (:attr:`Knob.beyond`), two more tuning runs per step, until the choice is interior or that last step is
   tried; a KL budget whose α sat at its cap is not widened upward. The chosen value is the
   argmax over values of the tuning-split pass@1, each run's score being the **mean of its last two validations**
   (less evaluation noise than the final one alone, still the end of training), averaged over the seeds. Ties
   (equal to 1e-9) go to the higher mean reward gain, then to the smaller knob value (the more conservative
   step); a value with a failed run (e.g. the divergence guard stopped it) is never chosen.
3. **Report.** The chosen value runs on 5 fresh seeds (2-6); the table gives mean ± std over them of the reward
   gain (``grid.summarize_run``: the last 10% of updates' mean train reward minus the first 10%'s), the final
   report-split pass@1, the realized KL per update (the mean of ``kl/realized`` over updates), the training state
   (bytes held for training besides the weights, counted by MemoryMonitor before each optimizer step: gradients,
   optimizer moments, adapters and theirs, sketches, projections, row statistics; the peak over updates) and the
   wall time per run, with the ratios to tuned AdamW and the goal line (MET/MISSED, with the numbers).
4. **KL for every method.** LoGRA runs carry their KL controller with ``calibrate: true``; AdamW and LoRA runs get
   :class:`~logra_pl.callbacks.PredictedKLControl` in measure-only mode (``callbacks/kl_measure.yaml``:
   ``schedule.kind: none``, ``calibrate: true``; no control, α = 1, the weights those of a run without it). A run
   that logged no ``kl/realized`` gets "—" in the report, which says so.
5. **Levers** (``--stage levers``, or ``--grid levers``): each lever of :data:`LEVERS` alone on top of
   ``paper_logra`` at its tuned budget, seeds 0-1, scored like the tuning stage against paper_logra's own tuning
   runs at that budget (same seeds); the winners go into ``configs/overlays/logra_levers.yaml`` by hand.

Every method anneals over the run: the KL budget's horizon and AdamW/LoRA's lr decay are set to the run's length
(600 updates: the configs' own values). Runs are one ``logra-pl fit`` process each, ``--jobs`` at a time, and
resumable as in ``ablate.py`` (``result.json`` and the settings key: the arguments and the parsed content of the
YAML files they name, so an edited overlay reruns what it changes); the choice is recomputed from finished runs
every time, so the report stage starts once the tuning stage is complete, in the same command (``--stage all``).
An overlay whose ``model.logra`` keys or values LoGRAConfig does not know (the levers' until their branch is
merged) stops the harness before any run, naming them (``--methods`` runs the others meanwhile).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import os
import shutil
import statistics
import time
import typing
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from grid import (
    BASE,
    BASELINE_EXTRA,
    COSTS,
    ROOT,
    VALIDATIONS,
    aggregate,
    logra_pl_command,
    read_scalars,
    recorded_args,
    rolling_mean,
    run_one,
    short_method_form,
    summarize_run,
    training_state_bytes,
)
from grid import pm as grid_pm
from grid import settings_key as args_key

PAPER_OVERLAY = "configs/overlays/paper_logra.yaml"
LEVERS_OVERLAY = "configs/overlays/logra_levers.yaml"
TUNE_FRACTION = 0.5  # every second evaluation problem is a tuning problem
TUNE_SEEDS = (0, 1)
REPORT_SEEDS = (2, 3, 4, 5, 6)
# The full protocol per model: updates per run and knob values per method (what results.md compares a run with).
PROTOCOL = {"updates": 600, "values": 6}
MODEL_DEFAULTS = {"tiny": {"updates": 600, "values": 6}, "tiny:small": {"updates": 300, "values": 3}}
# Settings a model needs beyond configs/tiny_cpu.yaml, in every run and in the baseline validation (they are no cut:
# every method gets them). tiny:small: the demo's warm-start lr (2e-3) stalls its 4.2M-parameter model at answer
# loss ~1.1-1.3 (1500 steps: final 1.11, start pass@1 0.055); at 5e-4 the loss keeps falling (0.70 after 300 steps,
# where 2e-3 sat at 1.26 and 1e-3 at 1.08; one seed, 64 problems per step).
MODEL_ARGS: dict[str, tuple[str, ...]] = {"tiny:small": ("--model.warm_start.lr=0.0005",)}
# Seconds per update of the measure-only KL probe on AdamW/LoRA runs (one forward-mode pass and one forward on 2
# responses). An estimate, not a measurement: LoGRA's COSTS entry already includes its probe.
KL_MEASURE_COST = 0.06
# Per-update (and per-validation) cost relative to `tiny`, whose COSTS the harness measured. tiny:small: 4.5x, the
# measured ratio of a bare forward+backward and of an 8-token generation of 64 prompts (4.7x, 4.4x; one thread,
# 0.59M vs 4.2M parameters), not of whole harness runs: its first runs' wall times tell.
MODEL_COST = {"tiny": 1.0, "tiny:small": 4.5}
STARTUP_COST = {"tiny": 1.0, "tiny:small": 1.5}
# PredictedKLControl in measure-only mode, appended to the runs of methods without KL control.
MEASURE_KL = ("--trainer.callbacks+=callbacks/kl_measure.yaml",)
GOAL = {"gain": 1.0, "state": 0.35}
GOAL_TEXT = (
    "tuned LoGRA's reward gain ≥ 100% of tuned AdamW's, report-split pass@1 within one seed std, at ≤ 0.35× "
    "AdamW's training state"
)


# ------------------------------------------------------------------------------------------------ methods
@dataclass(frozen=True)
class Knob:
    """The one setting a method is tuned by.

    Arguments:
        name: ``kl_scale`` (δmax and δmin of the method's PredictedKLControl times the value) or ``lr``
            (``model.adamw.lr``, AdamW's and LoRA's).
        values: the log-spaced grid, ascending.
        default: the value a cut grid centres on (``--values K`` keeps the K values nearest to it): where the
            method's full tuning on ``tiny`` chose, so a 3-value grid on ``tiny:small`` brackets that choice.
        beyond: one value below and one above ``values`` (same log step): where the widening rule
            (:func:`widen`) steps when a choice sits at the edge of the full grid. The rule goes no further.
    """

    name: str
    values: tuple[float, ...]
    default: float
    beyond: tuple[float, float]

    def args(self, value: float, overlays: Sequence[str]) -> list[str]:
        """The ``logra-pl`` overrides that set the knob to ``value``."""
        if self.name == "lr":
            return [f"--model.adamw.lr={fmt(value)}"]
        low, high = kl_budget(tuple(overlays))
        return [
            f"--trainer.callbacks.init_args.schedule.delta_max={fmt(high * value)}",
            f"--trainer.callbacks.init_args.schedule.delta_min={fmt(low * value)}",
        ]

    def next_value(self, tried: Sequence[float], chosen: float) -> float | None:
        """The untried value next to ``chosen`` on its outer side, when ``chosen`` is the smallest or largest of
        ``tried``: the neighbouring grid value, else the one step beyond the grid; None when there is none."""
        ladder = (self.beyond[0], *self.values, self.beyond[1])
        if chosen not in ladder or len(tried) < 2 or chosen not in (min(tried), max(tried)):
            return None
        i = ladder.index(chosen)
        j = i - 1 if chosen == min(tried) else i + 1
        return ladder[j] if 0 <= j < len(ladder) and ladder[j] not in tried else None

    def keep(self, count: int | None) -> tuple[float, ...]:
        """The ``count`` values nearest to the default (log distance; ties: the smaller), ascending; all for None."""
        if count is None or count >= len(self.values):
            return self.values
        if count < 1:
            raise SystemExit(f"--values must be at least 1, got {count}")
        near = sorted(self.values, key=lambda v: (abs(math.log(v / self.default)), v))
        return tuple(sorted(near[:count]))


@dataclass(frozen=True)
class Method:
    """One method of the protocol.

    Arguments:
        name: folder and table name.
        label: how tables and plots name it.
        overlays: YAML files applied after ``configs/tiny_cpu.yaml``, in order.
        optimizer: ``logra`` | ``adamw`` | ``lora`` (per-update cost; LoGRA runs get a projection seed).
        knob: what it is tuned by.
        measure_kl: append PredictedKLControl in measure-only mode (methods without KL control).
    """

    name: str
    label: str
    overlays: tuple[str, ...]
    optimizer: str
    knob: Knob
    measure_kl: bool = False


# The grids: factor-2 steps of the KL budget around paper_logra.yaml's own (δmax 1e-2 → δmin 1e-3); half-decade
# steps of lr around the configs' (AdamW 3e-4, LoRA 1e-3). The KL grid has a fifth value, 0.25: on `tiny`
# paper_logra's best tuning score was at 0.5, the grid's edge, so the grid was extended one step down.
KL_KNOB = Knob("kl_scale", (0.25, 0.5, 1.0, 2.0, 4.0), 0.5, (0.125, 8.0))
# logra_best's grid goes one step further up: on `tiny` its best tuning score was at 4, the edge of the paper's grid
# (its first moment and Adam-style step take larger budgets without the collapse the paper's rule shows at 2 and 4).
# At 8 (tiny's choice) α sat at its cap 3 on 84% of updates: the budget no longer sizes the step, so the grid stops.
# Each default is tiny's choice, so a 3-value cut (tiny:small) keeps 0.25, 0.5, 1 (paper), 2, 4, 8 (logra_best),
# 1e-4, 3e-4, 1e-3 (AdamW), 3e-4, 1e-3, 3e-3 (LoRA).
LEVERS_KL_KNOB = Knob("kl_scale", (0.25, 0.5, 1.0, 2.0, 4.0, 8.0), 4.0, (0.125, 16.0))
ADAMW_KNOB = Knob("lr", (1e-4, 3e-4, 1e-3, 3e-3), 3e-4, (3e-5, 1e-2))
LORA_KNOB = Knob("lr", (3e-4, 1e-3, 3e-3, 1e-2), 1e-3, (1e-4, 3e-2))
METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("paper_logra", "LoGRA, paper (r = 64)", (PAPER_OVERLAY,), "logra", KL_KNOB),
        Method("logra_best", "LoGRA, best levers (r = 64)", (PAPER_OVERLAY, LEVERS_OVERLAY), "logra", LEVERS_KL_KNOB),
        Method("adamw", "dense AdamW", ("configs/overlays/adamw.yaml",), "adamw", ADAMW_KNOB, measure_kl=True),
        Method("lora", "LoRA (r = 64)", ("configs/ablations/lora.yaml",), "lora", LORA_KNOB, measure_kl=True),
    )
}
LOGRA_METHODS = ("paper_logra", "logra_best")
# Each lever alone on top of paper_logra (model.logra keys; the lever branch's names). A first moment needs a basis
# policy to be judged, so its remedies (slower refresh, orthogonal rows) are cells of their own.
LEVERS: dict[str, dict[str, Any]] = {
    "scope_matrix": {"ratio_scope": "matrix"},
    "hadamard": {"distribution": "hadamard"},
    "beta1_project": {"beta1": 0.9, "momentum_transfer": "project"},
    "beta1_reset": {"beta1": 0.9, "momentum_transfer": "reset"},
    "beta1_refresh10": {"beta1": 0.9, "momentum_transfer": "project", "refresh_every": 10},
    "beta1_hadamard": {"beta1": 0.9, "momentum_transfer": "project", "distribution": "hadamard"},
    "step_adam": {"step_mode": "adam", "lr": 1e-3, "lr_warmup_steps": 9, "lr_min_ratio": 0.1},
}


def fmt(value: Any) -> str:
    """A CLI / folder spelling of a value: compact floats (``0.0003``, ``4``), ``true``/``false``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


@functools.cache
def _yaml(path: str) -> dict:
    return yaml.safe_load((ROOT / path).read_text()) or {}


def _kl_control(overlays: tuple[str, ...]) -> dict[str, Any] | None:
    """``init_args`` of the PredictedKLControl in the last of base + ``overlays`` that lists one (None: none)."""
    found = None
    for path in (BASE, *overlays):
        for cb in (_yaml(path).get("trainer") or {}).get("callbacks") or []:
            if str(cb.get("class_path", "")).endswith("PredictedKLControl"):
                found = cb.get("init_args") or {}
    return found


@functools.cache
def kl_budget(overlays: tuple[str, ...]) -> tuple[float, float]:
    """(δmin, δmax) of the PredictedKLControl in the last of base + ``overlays`` that lists one."""
    control = _kl_control(overlays)
    if control is None or "schedule" not in control:
        raise SystemExit(f"no PredictedKLControl schedule in {BASE} + {list(overlays)}: the kl_scale knob needs one")
    return float(control["schedule"]["delta_min"]), float(control["schedule"]["delta_max"])


@functools.cache
def alpha_cap(overlays: tuple[str, ...]) -> float:
    """``alpha_max`` of that PredictedKLControl (the class's default, 3, where it is not set)."""
    return float((_kl_control(overlays) or {}).get("alpha_max", 3.0))


# A KL budget that binds on fewer updates than this no longer sizes the step: α sits at its cap on the rest.
CAP_BOUND_FRACTION = 0.75


def cap_binding(runs: Sequence[dict], alpha_max: float) -> dict[str, float] | None:
    """How often α sat at its cap in ``runs`` (their ``kl/alpha`` curves): the fraction of updates with
    α ≥ α_max·(1 − 1e-6) and the mean α over α_max. None when no run logged α. When the fraction is high, a
    larger KL budget cannot grow the step much: it is sized by the step rule times α_max, not by the budget."""
    alphas = [v for r in runs for _, v in (r.get("curves") or {}).get("kl/alpha", [])]
    if not alphas:
        return None
    at_cap = sum(a >= alpha_max * (1 - 1e-6) for a in alphas)
    return {"fraction": at_cap / len(alphas), "mean_alpha": statistics.fmean(alphas), "alpha_max": alpha_max}


def merged_logra(method: Method, lever: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``model.logra`` of base + the method's overlays (mappings merge key by key, ``null`` drops) + ``lever``."""
    out: dict[str, Any] = {}
    for path in (BASE, *method.overlays):
        model = short_method_form(_yaml(path).get("model"), base=path == BASE)
        if "logra" in model:
            out = {} if model["logra"] is None else {**out, **model["logra"]}
    return {**out, **(lever or {})}


def logra_problems(settings: Mapping[str, Any]) -> list[str]:
    """What LoGRAConfig on this checkout refuses in ``settings``: unknown keys, values outside a Literal, then
    (when both are fine) its own validation. Empty when the settings can run."""
    from logra_pl.sketch import LoGRAConfig

    hints = typing.get_type_hints(LoGRAConfig)
    names = {f.name for f in dataclasses.fields(LoGRAConfig)}
    problems = [f"unknown key {key!r}" for key in settings if key not in names]
    for key, value in settings.items():
        choices = typing.get_args(hints.get(key)) if typing.get_origin(hints.get(key)) is typing.Literal else ()
        if choices and value not in choices:
            problems.append(f"{key}={value!r} is not one of {list(choices)}")
    if not problems:
        try:
            LoGRAConfig(**dict(settings))
        except Exception as err:  # any refusal is reported, with its message
            problems.append(str(err))
    return problems


def preflight(method: Method, lever: tuple[str, Mapping[str, Any]] | None = None) -> str | None:
    """None when ``method`` (with ``lever``) can run on this checkout, else the reason, naming the keys."""
    if method.optimizer != "logra":
        return None
    problems = logra_problems(merged_logra(method, lever[1] if lever else None))
    if not problems:
        return None
    what = f"lever {lever[0]!r}" if lever else f"method {method.name!r} ({', '.join(method.overlays)})"
    return (
        f"{what} cannot run on this checkout: model.logra {'; '.join(problems)} (LoGRAConfig does not have the "
        "update-rule levers yet: merge their branch, or edit configs/overlays/logra_levers.yaml / LEVERS)"
    )


# ------------------------------------------------------------------------------------------------ planning
@dataclass
class RunSpec:
    """One planned ``logra-pl fit`` run."""

    stage: str  # tune | report | levers
    method: str
    cell: str  # folder under <out>: <method>/<knob>=<value> or levers/<lever>
    seed: int
    value: float | None
    args: list[str]
    optimizer: str
    lever: str | None = None
    key: str = field(init=False)

    def __post_init__(self) -> None:
        self.key = settings_key(self.args)

    def folder(self, out: Path) -> Path:
        return out / self.cell / f"seed{self.seed}"


# Keys added to the configs after runs were committed, with the value that changes nothing (the code's default, at
# which a run is bit for bit the run before the key existed): a config that holds one of them at that value hashes
# as it did without it, so a new option does not rerun finished runs. Any other value is a new setting and reruns.
ADDED_AT_DEFAULT: dict[str, dict[str, Any]] = {
    "model.rollout": {
        "max_staleness": 0,  # asynchronous rollouts (51221aa)
        "max_stale_kl": None,
        "dynamic_sampling": False,  # batch shaping (issue 25)
        "max_sampling_rounds": 3,
        "overlong_buffer": 0,
        "overlong_penalty": 1.0,
    },
    "model.loss.init_args": {  # the settings every loss shares (issue 25: aggregation, mask_truncated, KL penalty)
        "aggregation": "token_mean",
        "aggregation_length": None,
        "mask_truncated": False,
        "kl_coef": 0.0,
        "kl_estimator": "k3",
        "reference_device": "cpu",
        "reference_dtype": None,
    },
    # correctness and the verifier failure policy (issue 25)
    "model.scoring": {"correct_threshold": 1.0, "max_failure_rate": 0.5, "max_failed_updates": 2},
    # a callback recipe's own arguments (callbacks/kl_measure.yaml): PredictedKLControl's line search, off
    "init_args": {"max_overshoot": None, "max_backtracks": 3, "search_responses": None},
}
# Keys a file gained when LoGRA's defaults became Adam in sketch space, written out at the old defaults (what their
# absence meant then): keyed as absent, in that file only.
WRITTEN_OUT = {"configs/overlays/paper_logra.yaml": {"beta1": 0.0, "moment_dtype": "float32"}}
# The LoGRA rule the base config held while the protocol was measured (configs/overlays/rowadam_demo.yaml, less the
# keys it adds at the old defaults): every method of the protocol either writes its whole rule (paper_logra.yaml) or
# does not run LoGRA, so the base's rule is keyed as this one and a change of the demo's rule reruns nothing.
PROTOCOL_BASE_RULE = "configs/overlays/rowadam_demo.yaml"
_RULE_KEYS_ADDED = ("moment_dtype", "lr", "lr_warmup_steps", "lr_decay_steps", "lr_min_ratio")


def _keyed_content(path: str) -> Any:
    """The parsed YAML file ``path`` as the settings key reads it (the base with the protocol's rule)."""
    config = yaml.safe_load((ROOT / path).read_text())
    if isinstance(config, dict) and isinstance(config.get("model"), dict):  # as the keys were first written
        config["model"] = short_method_form(config["model"], base=Path(path) == Path(BASE))
    if Path(path) == Path(BASE) and isinstance(config, dict):
        rule = short_method_form(yaml.safe_load((ROOT / PROTOCOL_BASE_RULE).read_text())["model"])["logra"]
        config["model"]["logra"] = {k: v for k, v in rule.items() if k not in _RULE_KEYS_ADDED}
    written = WRITTEN_OUT.get(Path(path).as_posix().removeprefix("./"), {})
    logra = (config.get("model") or {}).get("logra") if isinstance(config, dict) else None
    if written and isinstance(logra, dict):
        for name, value in written.items():
            if logra.get(name) == value:
                del logra[name]
    return _without_added_defaults(config)


def _without_added_defaults(config: Any) -> Any:
    """``config`` (a parsed YAML file) without the :data:`ADDED_AT_DEFAULT` keys that hold their default."""
    if not isinstance(config, dict):
        return config
    config = json.loads(json.dumps(config))  # a deep copy; never edit the caller's mapping
    for dotted, defaults in ADDED_AT_DEFAULT.items():
        section: Any = config
        for part in dotted.split("."):
            section = section.get(part) if isinstance(section, dict) else None
        if isinstance(section, dict):
            for name, value in defaults.items():
                if name in section and section[name] == value:
                    del section[name]
    return config


def settings_key(args: Sequence[str]) -> str:
    """What a finished run is matched on: its arguments (``grid.settings_key``) and the parsed content of every
    YAML file they name, so that editing an overlay (logra_levers.yaml, once the levers are chosen) reruns the runs
    it changes, while a comment edit, or a key added later at its default (:data:`ADDED_AT_DEFAULT`), does not."""
    files = sorted(
        {a.split("=", 1)[-1] for a in args if a.endswith(".yaml")}
        | {b for a, b in itertools.pairwise(args) if a == "--config"}
    )
    content = [f"{f}:{json.dumps(_keyed_content(f), sort_keys=True)}" for f in files if (ROOT / f).is_file()]
    return args_key([*args, *content])


def _slug(model: str) -> str:
    return model.replace(":", "_").replace("/", "_")


def run_args(
    method: Method,
    value: float,
    seed: int,
    updates: int,
    folder: Path,
    model: str,
    lever: Mapping[str, Any] | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The ``logra-pl fit`` arguments of one parity run (after the program name); ``extra`` goes last.

    The order matters: ``--trainer.callbacks.init_args.*`` reaches the list's last callback, which is LoGRA's
    PredictedKLControl (paper_logra.yaml puts it last) until the measure-only one is appended for AdamW/LoRA.
    """
    args = ["fit"] + [a for c in (BASE, *method.overlays) for a in ("--config", c)]
    args += [f"--seed_everything={seed}", f"--model.seed={seed}"]
    if method.optimizer == "logra":
        args.append(f"--model.logra.base_seed={seed}")
    args += [f"--trainer.max_steps={updates}", f"--trainer.val_check_interval={max(1, updates // VALIDATIONS)}"]
    args += [
        f"--trainer.logger.init_args.save_dir={folder}",
        "--trainer.logger.init_args.name=tb",
        "--trainer.logger.init_args.version=0",
        "--trainer.enable_progress_bar=false",
        "--checkpoint.every_n_updates=0",
        "--checkpoint.save_last=false",
        "--checkpoint.at_end=false",
        f"--model.policy={model}",
        *MODEL_ARGS.get(model, ()),
        f"--data.eval_tune_fraction={fmt(TUNE_FRACTION)}",
    ]
    if method.optimizer == "logra":  # the anneal spans the run (600 updates: the configs' own horizon)
        args.append(f"--trainer.callbacks.init_args.schedule.horizon={updates}")
        args += [f"--model.logra.{k}={fmt(v)}" for k, v in (lever or {}).items()]
        if merged_logra(method, lever).get("step_mode") == "adam":
            args.append(f"--model.logra.lr_decay_steps={updates}")
    else:
        args.append(f"--model.adamw.decay_steps={updates}")
    args += method.knob.args(value, method.overlays)
    if method.measure_kl:
        args += MEASURE_KL
    return args + [a for a in extra if method.optimizer == "logra" or not a.startswith("--model.logra.")]


@dataclass
class Plan:
    """What one invocation runs: the settings shared by every run, and how each run's arguments are made."""

    model: str
    updates: int
    values: int | None
    methods: tuple[str, ...]
    out: Path
    tune_seeds: tuple[int, ...] = TUNE_SEEDS
    report_seeds: tuple[int, ...] = REPORT_SEEDS
    extra: tuple[str, ...] = ()
    widened: Mapping[str, tuple[float, ...]] = field(default_factory=dict)  # values added by :func:`widen`

    def values_of(self, method: str) -> tuple[float, ...]:
        """The method's tuning values: the kept grid plus what the widening rule added, ascending."""
        return tuple(sorted({*METHODS[method].knob.keep(self.values), *self.widened.get(method, ())}))

    def spec(
        self, stage: str, method: str, value: float, seed: int, lever: tuple[str, dict[str, Any]] | None = None
    ) -> RunSpec:
        m = METHODS[method]
        cell = f"levers/{lever[0]}" if lever else f"{method}/{m.knob.name}={fmt(value)}"
        folder = self.out / cell / f"seed{seed}"
        args = run_args(m, value, seed, self.updates, folder, self.model, lever[1] if lever else None, self.extra)
        return RunSpec(stage, method, cell, seed, value, args, m.optimizer, lever[0] if lever else None)

    def tune_runs(self) -> list[RunSpec]:
        return [
            self.spec("tune", name, value, seed)
            for name in self.methods
            for value in self.values_of(name)
            for seed in self.tune_seeds
        ]

    def report_runs(self, choices: Mapping[str, Choice]) -> list[RunSpec]:
        return [
            self.spec("report", name, choices[name].value, seed)
            for name in self.methods
            if choices.get(name) is not None and choices[name].value is not None
            for seed in self.report_seeds
        ]

    def lever_runs(self, paper: Choice | None, levers: Sequence[str]) -> list[RunSpec]:
        if paper is None or paper.value is None:
            return []
        return [
            self.spec("levers", "paper_logra", paper.value, seed, (name, LEVERS[name]))
            for name in levers
            for seed in self.tune_seeds
        ]


# ------------------------------------------------------------------------------------------------ results
def load_result(spec: RunSpec, out: Path) -> dict | None:
    """The finished run's ``result.json`` when its settings key matches ``spec``'s, else None."""
    done = spec.folder(out) / "result.json"
    if not done.exists():
        return None
    result = json.loads(done.read_text())
    return result if result.get("key") == spec.key else None


def tune_score(scalars: Mapping[str, list[tuple[int, float]]]) -> float:
    """A run's tuning score: the mean of its last two validations' tuning-split pass@1 (the one when only one)."""
    points = [v for _, v in scalars.get("val/tune/pass@1", [])]
    return statistics.fmean(points[-2:]) if points else float("nan")


def _last(scalars: Mapping[str, list[tuple[int, float]]], tag: str) -> float | None:
    points = scalars.get(tag, [])
    return points[-1][1] if points else None


def summarize(scalars: dict[str, list[tuple[int, float]]], val0: Mapping[str, float], wall_s: float) -> dict:
    """One parity run's numbers: ``grid.summarize_run``'s, the per-split pass@1, the tuning score, the state."""
    out = summarize_run(scalars, val0.get("all", float("nan")), wall_s)
    out.update(
        tune_score=tune_score(scalars),
        tune_final=_last(scalars, "val/tune/pass@1"),
        report_final=_last(scalars, "val/report/pass@1"),
        report_start=val0.get("report"),
        training_state_bytes=training_state_bytes(scalars),
        persistent_state_bytes=_last(scalars, "memory/persistent_state_bytes"),
        kl_realized=out["kl_realized"] if scalars.get("kl/realized") else None,
        kl_updates=len(scalars.get("kl/realized", [])),
        failed=False,
    )
    return out


def failed_result(spec: RunSpec, error: str, wall_s: float) -> dict:
    """What a failed run leaves: counted as finished (so a diverging setting is not retried every session), never
    chosen, shown as failed; ``--retry-failed`` runs it again."""
    nan = float("nan")
    return {
        "key": spec.key,
        "cell": spec.cell,
        "seed": spec.seed,
        "args": recorded_args(spec.args),
        "failed": True,
        "error": error[-2000:],
        "wall_s": wall_s,
        "tune_score": nan,
        "reward_gain": nan,
        "updates": 0,
        "curves": {},
    }


@dataclass
class Choice:
    """A method's tuned knob value (None when it cannot be chosen yet), with why."""

    method: str
    value: float | None
    scores: dict[float, dict[str, float]]  # value -> {"tune_score", "reward_gain", "failed", "n"}
    missing: int = 0  # tuning runs not finished
    reason: str = ""

    @property
    def at_edge(self) -> bool:
        """The chosen value is the smallest or largest tried: the grid may not hold the optimum."""
        return self.value is not None and len(self.scores) > 1 and self.value in (min(self.scores), max(self.scores))


def _finite(x: float | None) -> float:
    return x if x is not None and math.isfinite(x) else -math.inf


def _mean_kl(runs: Sequence[dict]) -> float | None:
    """The runs' mean realized KL per update; None unless every run logged one."""
    kls = [r.get("kl_realized") for r in runs]
    return statistics.fmean(kls) if kls and all(k is not None and math.isfinite(k) for k in kls) else None


def choose(method: str, results: Mapping[float, Sequence[dict | None]]) -> Choice:
    """The tuning stage's choice for ``method`` from its tuning runs (``value -> one result per tuning seed, None
    where unfinished``): the argmax of the seeds' mean tuning score; ties (1e-9) go to the higher mean reward gain,
    then the smaller value; a value with a failed run is never chosen. None until every run has finished."""
    scores: dict[float, dict[str, float]] = {}
    missing = 0
    for value, runs in results.items():
        done = [r for r in runs if r is not None]
        missing += len(runs) - len(done)
        failed = sum(bool(r.get("failed")) for r in done)
        ok = [r for r in done if not r.get("failed")]
        scores[value] = {
            "tune_score": statistics.fmean(r["tune_score"] for r in ok) if ok else float("nan"),
            "reward_gain": statistics.fmean(r["reward_gain"] for r in ok) if ok else float("nan"),
            "kl_realized": _mean_kl(ok),
            "failed": float(failed),
            "n": float(len(done)),
        }
    if missing:
        return Choice(method, None, scores, missing, f"{missing} tuning run(s) not finished")
    eligible = [v for v, s in scores.items() if not s["failed"] and math.isfinite(s["tune_score"])]
    if not eligible:
        return Choice(method, None, scores, 0, "every tuning value failed or logged no val/tune/pass@1")

    def rank(v: float) -> tuple[float, float, float]:
        s = scores[v]
        return (round(s["tune_score"], 9), round(_finite(s["reward_gain"]), 9), -v)

    return Choice(method, max(eligible, key=rank), scores)


def choices(plan: Plan, out: Path, methods: Sequence[str] | None = None) -> dict[str, Choice]:
    """Every method's choice, recomputed from the finished tuning runs under ``out``."""
    found: dict[str, Choice] = {}
    for name in methods or plan.methods:
        results = {
            value: [load_result(plan.spec("tune", name, value, seed), out) for seed in plan.tune_seeds]
            for value in plan.values_of(name)
        }
        found[name] = choose(name, results)
    return found


def widening_step(plan: Plan, out: Path, name: str, choice: Choice) -> float | None:
    """The value the widening rule adds to ``name``'s tuning next, or None.

    A choice at the smallest or largest value tried may have its optimum outside them, so the rule tries the next
    value outward (:meth:`Knob.next_value`: the full grid's neighbour, then one step beyond it), once per call.
    Not upward in a KL budget whose α already sat at its cap on ≥ CAP_BOUND_FRACTION of the choice's updates: the
    budget no longer sizes the step there, so a larger one is the same run.
    """
    method = METHODS[name]
    if choice.value is None:
        return None
    tried = plan.values_of(name)
    step = method.knob.next_value(tried, choice.value)
    if step is None or method.knob.name != "kl_scale" or step < choice.value:
        return step
    runs = [load_result(plan.spec("tune", name, choice.value, s), out) for s in plan.tune_seeds]
    cap = cap_binding([r for r in runs if r and not r.get("failed")], alpha_cap(method.overlays))
    return None if cap is not None and cap["fraction"] >= CAP_BOUND_FRACTION else step


def widen(plan: Plan, out: Path, run: typing.Callable[[list[RunSpec]], None] | None = None) -> Plan:
    """``plan`` with each method's tuning grid followed outward while its choice sits at an edge
    (:func:`widening_step`). With ``run`` (the tuning stage) the added values' tuning runs are run, round after
    round; without it (other stages, the report) only values whose tuning runs have all finished are added, so every
    invocation recomputes the same grids from what is on disk."""
    while True:
        found = choices(plan, out)
        grow: dict[str, float] = {}
        for name in plan.methods:
            step = widening_step(plan, out, name, found[name])
            if step is None:
                continue
            specs = [plan.spec("tune", name, step, s) for s in plan.tune_seeds]
            if run is not None or all(load_result(s, out) is not None for s in specs):
                grow[name] = step
        if not grow:
            return plan
        plan = dataclasses.replace(
            plan, widened={**plan.widened, **{n: (*plan.widened.get(n, ()), v) for n, v in grow.items()}}
        )
        if run is not None:
            print(f"  widening: {', '.join(f'{n} adds {fmt(v)}' for n, v in grow.items())} (choice at an edge)")
            run([plan.spec("tune", n, v, s) for n, v in grow.items() for s in plan.tune_seeds])


# ------------------------------------------------------------------------------------------------ running
def estimate_s(runs: Sequence[RunSpec], model: str, updates: int, jobs: int) -> float:
    """Estimated wall seconds of ``runs``, ``jobs`` at a time (``grid.COSTS``, scaled for the model)."""
    scale = MODEL_COST.get(model, max(MODEL_COST.values()))
    total = 0.0
    for spec in runs:
        per_update = COSTS[spec.optimizer] + (KL_MEASURE_COST if METHODS[spec.method].measure_kl else 0.0)
        total += COSTS["startup"] * STARTUP_COST.get(model, 1.5) + VALIDATIONS * COSTS["validation"] * scale
        total += updates * per_update * scale
    return total / max(1, jobs)


def parity_baseline(plan: Plan, out: Path, threads: int) -> dict[str, float]:
    """Greedy pass@1 of the warm-started policy before any update, on all / tuning / report problems, once per
    model; cached in ``<out>/baseline.json``. Also fills the warm-start cache before runs start in parallel."""
    args = ["validate", "--config", BASE, f"--model.policy={plan.model}", *MODEL_ARGS.get(plan.model, ())]
    args.append(f"--data.eval_tune_fraction={TUNE_FRACTION}")
    args += [f"--trainer.logger.init_args.save_dir={out / 'baseline'}", "--trainer.logger.init_args.name=tb"]
    args += ["--trainer.logger.init_args.version=0", "--trainer.enable_progress_bar=false"]
    args += [a for a in plan.extra if a.startswith(BASELINE_EXTRA)]
    key = settings_key(args)
    cached = out / "baseline.json"
    if cached.exists() and json.loads(cached.read_text()).get("key") == key:
        return json.loads(cached.read_text())["val"]
    shutil.rmtree(out / "baseline", ignore_errors=True)
    run_one([*logra_pl_command(), *args], out / "baseline", threads)
    scalars = read_scalars(out / "baseline")
    val = {
        name: points[-1][1]
        for name, tag in (("all", "val/pass@1"), ("tune", "val/tune/pass@1"), ("report", "val/report/pass@1"))
        if (points := scalars.get(tag))
    }
    if "report" not in val:
        raise RuntimeError(f"the baseline validation in {out / 'baseline'} logged no val/report/pass@1")
    out.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps({"key": key, "val": val}))
    return val


def needs_rerun(spec: RunSpec, done: dict, retry_failed: bool = False, rerun_without_kl: bool = False) -> bool:
    """Whether a finished run is run again: a failed one with ``retry_failed``; with ``rerun_without_kl``, one of a
    method with measure-only KL that logged no ``kl/realized`` (finished before PredictedKLControl measured dense
    and LoRA steps: the settings key cannot tell code versions apart)."""
    if done.get("failed"):
        return retry_failed
    return rerun_without_kl and METHODS[spec.method].measure_kl and not done.get("kl_updates")


def execute(
    runs: Sequence[RunSpec],
    out: Path,
    jobs: int,
    val0: Mapping[str, float],
    retry_failed: bool = False,
    rerun_without_kl: bool = False,
) -> None:
    """Run every spec that has no matching finished result (or whose result :func:`needs_rerun`)."""
    threads = max(1, (os.cpu_count() or 2) // jobs)
    todo = []
    for spec in runs:
        done = load_result(spec, out)
        if done is not None and not needs_rerun(spec, done, retry_failed, rerun_without_kl):
            print(f"  {spec.cell} seed {spec.seed}: finished earlier, reused", flush=True)
            continue
        todo.append(spec)

    def work(spec: RunSpec) -> None:
        folder = spec.folder(out)
        shutil.rmtree(folder, ignore_errors=True)  # an unfinished run starts over
        start = time.perf_counter()
        try:
            wall = run_one([*logra_pl_command(), *spec.args], folder, threads)
        except RuntimeError as err:
            (folder / "result.json").write_text(json.dumps(failed_result(spec, str(err), time.perf_counter() - start)))
            print(f"  {spec.cell} seed {spec.seed}: FAILED (kept as failed; --retry-failed reruns it)\n{err}")
            return
        result = {"key": spec.key, "cell": spec.cell, "seed": spec.seed, "args": recorded_args(spec.args)}
        result.update(summarize(read_scalars(folder / "tb"), val0, wall))
        (folder / "result.json").write_text(json.dumps(result))
        final = math.nan if result["report_final"] is None else result["report_final"]
        print(
            f"  {spec.cell} seed {spec.seed}: {result['updates']} updates in {wall:.0f} s, reward gain "
            f"{result['reward_gain']:+.3f}, tuning score {result['tune_score']:.3f}, report pass@1 "
            f"{val0.get('report', math.nan):.3f} -> {final:.3f}",
            flush=True,
        )

    print(f"{len(todo)} runs to do, {len(runs) - len(todo)} reused; {jobs} at a time, {threads} thread(s) each")
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(work, todo))


# ------------------------------------------------------------------------------------------------ reporting
SUMMARY_KEYS = (
    "reward_gain",
    "report_final",
    "tune_final",
    "val_final",
    "kl_realized",
    "training_state_bytes",
    "wall_s",
    "updates",
)


def collect(plan: Plan, out: Path, found: Mapping[str, Choice], levers: Sequence[str]) -> dict:
    """Everything finished so far, as results.json holds it: tuning scores, choices, report runs and summaries,
    lever runs."""
    report: dict[str, Any] = {"grid": "parity", "model": plan.model, "updates": plan.updates, "methods": {}}
    report.update(tune_seeds=list(plan.tune_seeds), report_seeds=list(plan.report_seeds), levers={})
    for name in plan.methods:
        method, choice = METHODS[name], found.get(name)
        entry: dict[str, Any] = {
            "label": method.label,
            "overlays": list(method.overlays),
            "knob": method.knob.name,
            "values": list(plan.values_of(name)),
            "tuning": {fmt(v): s for v, s in (choice.scores.items() if choice else [])},
            "choice": None if choice is None else choice.value,
            "choice_reason": "" if choice is None else choice.reason,
            "choice_at_edge": bool(choice and choice.at_edge),
            "cap_binding": None,
            "runs": {},
            "summary": None,
        }
        if choice is not None and method.knob.name == "kl_scale":
            for value in plan.values_of(name):
                tuned = [load_result(plan.spec("tune", name, value, s), out) for s in plan.tune_seeds]
                cap = cap_binding([r for r in tuned if r and not r.get("failed")], alpha_cap(method.overlays))
                if fmt(value) in entry["tuning"] and cap is not None:
                    entry["tuning"][fmt(value)]["alpha_at_cap"] = cap["fraction"]
                if value == choice.value:
                    entry["cap_binding"] = cap
        if choice is not None and choice.value is not None:
            runs = [load_result(plan.spec("report", name, choice.value, s), out) for s in plan.report_seeds]
            done = [r for r in runs if r is not None]
            entry["runs"] = {str(r["seed"]): r for r in done}
            entry["missing"] = len(runs) - len(done)
            ok = [r for r in done if not r.get("failed")]
            entry["failed"] = len(done) - len(ok)
            if ok and len(done) == len(runs):
                entry["summary"] = aggregate(ok, SUMMARY_KEYS)
        report["methods"][name] = entry
    paper = found.get("paper_logra")
    for spec in plan.lever_runs(paper, levers):
        result = load_result(spec, out)
        lever = report["levers"].setdefault(spec.lever, {"settings": LEVERS[spec.lever], "runs": {}})
        if result is not None:
            lever["runs"][str(spec.seed)] = result
    for lever in report["levers"].values():
        ok = [r for r in lever["runs"].values() if not r.get("failed")]
        complete = len(lever["runs"]) == len(plan.tune_seeds) and len(ok) == len(plan.tune_seeds)
        lever["summary"] = aggregate(ok, (*SUMMARY_KEYS, "tune_score")) if complete else None
        lever["failed"] = len(lever["runs"]) - len(ok)
    return report


def _stat(entry: Mapping[str, Any] | None, key: str) -> dict | None:
    summary = (entry or {}).get("summary") or {}
    return summary.get(key)


def _mean_of(entry: Mapping[str, Any] | None, key: str) -> float | None:
    stat = _stat(entry, key)
    return None if stat is None else stat["mean"]


def _bytes(stat: dict | None) -> str:
    if stat is None:
        return "—"
    return f"{stat['mean'] / 2**20:.2f} ± {stat['std'] / 2**20:.2f} MiB"


def _pm(stat: dict | None, digits: int = 3, signed: bool = False, sci: bool = False) -> str:
    if stat is None:
        return "—"
    if sci:
        return f"{stat['mean']:.2e} ± {stat['std']:.1e}"
    return grid_pm(stat, digits, signed)


def report_table(report: dict) -> str:
    """The report table (docs/benchmarks.md): per method at its chosen setting, mean ± std over the report seeds."""
    methods = report["methods"]
    adamw = methods.get("adamw")
    g_a, s_a = _mean_of(adamw, "reward_gain"), _mean_of(adamw, "training_state_bytes")
    start = report.get("val_start", {}).get("report")
    start_text = f" (start {start:.3f})" if start is not None else ""
    lines = [
        f"| method | tuned knob | reward gain | gain vs AdamW | report-split pass@1{start_text} | realized KL per "
        "update | training state | state vs AdamW | wall s per run |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for entry in methods.values():
        chosen = "—" if entry["choice"] is None else f"{entry['knob']} = {fmt(entry['choice'])}"
        if entry["summary"] is None:
            why = entry["choice_reason"] or (
                f"{entry.get('missing', 0)} report run(s) not finished" if entry.get("missing") else ""
            )
            if entry.get("failed"):
                why = f"{entry['failed']} report run(s) failed"
            lines.append(f"| {entry['label']} | {chosen} | not measured: {why or 'no runs'} |  |  |  |  |  |  |")
            continue
        g, s = _mean_of(entry, "reward_gain"), _mean_of(entry, "training_state_bytes")
        gain_ratio = f"{g / g_a:.0%}" if g is not None and g_a else "—"
        state_ratio = f"{s / s_a:.2f}×" if s is not None and s_a else "—"
        lines.append(
            f"| {entry['label']} | {chosen} | {_pm(_stat(entry, 'reward_gain'), signed=True)} | {gain_ratio} | "
            f"{_pm(_stat(entry, 'report_final'))} | {_pm(_stat(entry, 'kl_realized'), sci=True)} | "
            f"{_bytes(_stat(entry, 'training_state_bytes'))} | {state_ratio} | {_pm(_stat(entry, 'wall_s'), 0)} |"
        )
    seeds = ", ".join(map(str, report["report_seeds"]))
    lines += [
        "",
        f"mean ± std over the report seeds ({seeds}) at each method's tuned setting, {report['updates']} updates per "
        "run; reward gain: mean train reward of the last 10% of updates minus the first 10%; report-split pass@1: "
        "greedy, final validation, on the problems tuning never saw; realized KL: mean of kl/realized over "
        "updates; training state: bytes held for training besides the weights (peak over updates).",
    ]
    return "\n".join(lines)


def tuning_table(report: dict) -> str:
    """Every knob value's tuning-split score (mean over the tuning seeds), the chosen one marked ★."""
    seeds = ", ".join(map(str, report["tune_seeds"]))
    lines = [
        f"| method | knob | tuning-split pass@1 (mean of the last two validations, seeds {seeds}) · reward gain · "
        "realized KL per update (· share of updates with α at its cap) |",
        "| --- | --- | --- |",
    ]
    for entry in report["methods"].values():
        cells = []
        for value in entry["values"]:
            s = entry["tuning"].get(fmt(value))
            mark = " ★" if entry["choice"] is not None and fmt(entry["choice"]) == fmt(value) else ""
            if s is None or s["n"] < len(report["tune_seeds"]):
                done = 0 if s is None else int(s["n"])
                cells.append(f"{fmt(value)}: ({done}/{len(report['tune_seeds'])} runs)")
            elif s["failed"]:
                cells.append(f"{fmt(value)}: failed ({int(s['failed'])} run(s))")
            else:
                kl = "" if s.get("kl_realized") is None else f" · {s['kl_realized']:.1e}"
                cap = "" if s.get("alpha_at_cap") is None else f" · {s['alpha_at_cap']:.0%}"
                cells.append(f"{fmt(value)}: {s['tune_score']:.3f} · {s['reward_gain']:+.3f}{kl}{cap}{mark}")
        lines.append(f"| {entry['label']} | {entry['knob']} | {'; '.join(cells)} |")
    return "\n".join(lines)


def levers_table(report: dict) -> str | None:
    """Each lever alone on paper_logra at its tuned budget, against paper_logra's tuning runs there."""
    if not report["levers"]:
        return None
    paper = report["methods"].get("paper_logra") or {}
    ref = paper.get("tuning", {}).get(fmt(paper.get("choice"))) if paper.get("choice") is not None else None
    lines = [
        f"Reference: paper_logra at kl_scale = {fmt(paper.get('choice'))}, seeds "
        f"{', '.join(map(str, report['tune_seeds']))}: tuning score {ref['tune_score']:.3f}, reward gain "
        f"{ref['reward_gain']:+.3f}."
        if ref
        else "Reference: paper_logra's tuning is not complete.",
        "",
        "| lever | model.logra | tuning score | Δ vs paper | reward gain | Δ vs paper | realized KL | training state |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, lever in report["levers"].items():
        settings = ", ".join(f"{k}: {fmt(v)}" for k, v in lever["settings"].items())
        s = lever["summary"]
        if s is None:
            state = f"{lever['failed']} run(s) failed" if lever["failed"] else f"{len(lever['runs'])} run(s) finished"
            lines.append(f"| `{name}` | {settings} | not measured: {state} |  |  |  |  |  |")
            continue
        d_t = f"{s['tune_score']['mean'] - ref['tune_score']:+.3f}" if ref else "—"
        d_g = f"{s['reward_gain']['mean'] - ref['reward_gain']:+.3f}" if ref else "—"
        lines.append(
            f"| `{name}` | {settings} | {_pm(s['tune_score'])} | {d_t} | {_pm(s['reward_gain'], signed=True)} | "
            f"{d_g} | {_pm(s.get('kl_realized'), sci=True)} | {_bytes(s.get('training_state_bytes'))} |"
        )
    return "\n".join(lines)


def goal_lines(report: dict) -> list[str]:
    """The goal, MET or MISSED with the numbers, for each LoGRA method against tuned AdamW."""
    methods = report["methods"]
    adamw = methods.get("adamw")
    out = []
    for name in LOGRA_METHODS:
        entry = methods.get(name)
        if entry is None:
            continue
        needed = {"reward_gain", "report_final", "training_state_bytes"}
        if adamw is None or entry["summary"] is None or adamw["summary"] is None:
            missing = [n for n, e in ((name, entry), ("adamw", adamw)) if e is None or e["summary"] is None]
            out.append(f"Goal ({GOAL_TEXT}) for {name}: NOT MEASURED yet (no report summary for {', '.join(missing)}).")
            continue
        if any(_stat(e, k) is None for e in (entry, adamw) for k in needed):
            out.append(f"Goal for {name}: NOT MEASURED (a run logged no {sorted(needed)}).")
            continue
        g, g_a = _mean_of(entry, "reward_gain"), _mean_of(adamw, "reward_gain")
        p, p_a, sd = _mean_of(entry, "report_final"), _mean_of(adamw, "report_final"), _stat(adamw, "report_final")
        s, s_a = _mean_of(entry, "training_state_bytes"), _mean_of(adamw, "training_state_bytes")
        gain_ok = g_a > 0 and g / g_a >= GOAL["gain"]
        pass_ok = p >= p_a - sd["std"]
        state_ok = s / s_a <= GOAL["state"]
        verdict = "MET" if gain_ok and pass_ok and state_ok else "MISSED"
        out.append(
            f"Goal ({GOAL_TEXT}) for {name}: **{verdict}** — reward gain {g:+.3f} vs AdamW's {g_a:+.3f} "
            f"({g / g_a if g_a else float('nan'):.0%}, {'≥' if gain_ok else '<'} 100%); report-split pass@1 {p:.3f} "
            f"vs {p_a:.3f} ± {sd['std']:.3f} ({p - p_a:+.3f}: {'within' if pass_ok else 'below'} one AdamW seed "
            f"std); training state {s / 2**20:.2f} vs {s_a / 2**20:.2f} MiB ({s / s_a:.2f}×, "
            f"{'≤' if state_ok else '>'} 0.35×)."
        )
    return out


def cuts(plan: Plan) -> list[str]:
    """How this invocation departs from the full protocol (updates, values, seeds), for results.md."""
    out = []
    if plan.updates != PROTOCOL["updates"]:
        out.append(f"{plan.updates} updates per run (full protocol: {PROTOCOL['updates']})")
    for name in plan.methods:
        kept, full = METHODS[name].knob.keep(plan.values), METHODS[name].knob.values
        if kept != full:
            out.append(f"{name}: {len(kept)} knob values {list(map(fmt, kept))} of {list(map(fmt, full))}")
        if plan.widened.get(name):
            added = list(map(fmt, sorted(plan.widened[name])))
            out.append(f"{name}: widened by {added} (its choice sat at an edge; the widening rule)")
    if plan.tune_seeds != TUNE_SEEDS:
        out.append(f"tuning seeds {list(plan.tune_seeds)} (full: {list(TUNE_SEEDS)})")
    if plan.report_seeds != REPORT_SEEDS:
        out.append(f"report seeds {list(plan.report_seeds)} (full: {list(REPORT_SEEDS)})")
    missing = sorted(set(METHODS) - set(plan.methods))
    if missing:
        out.append(f"methods left out: {missing}")
    return out


def findings(report: dict) -> list[str]:
    """What the numbers say beyond the goal line: edge choices, failures, the missing KL measurements."""
    out = goal_lines(report)
    no_kl = [
        name
        for name, entry in report["methods"].items()
        if entry["summary"] is not None and entry["summary"].get("kl_realized") is None
    ]
    if no_kl:
        out.append(
            f"Realized KL per update: — for {', '.join(no_kl)}: their runs logged no kl/realized (runs finished "
            "before PredictedKLControl measured dense and LoRA steps: rerun them with --rerun-without-kl)."
        )
    for name, entry in report["methods"].items():
        cap = entry.get("cap_binding")
        saturated = (
            cap is not None and cap["fraction"] >= CAP_BOUND_FRACTION and entry["choice"] == max(entry["values"])
        )
        if saturated:
            out.append(
                f"{name}: the chosen {entry['knob']} = {fmt(entry['choice'])} is the grid's largest, and the budget "
                f"has stopped sizing the step there: α sat at its cap {fmt(cap['alpha_max'])} on "
                f"{cap['fraction']:.0%} of the tuning runs' updates (mean α {cap['mean_alpha']:.2f}), so a larger "
                f"budget can grow the step by at most {cap['alpha_max'] / cap['mean_alpha'] - 1:.0%}; the step is "
                "the update rule's times α_max (tune its lr, or α_max, to go further)."
            )
        elif entry["choice_at_edge"]:
            out.append(
                f"{name}: the chosen {entry['knob']} = {fmt(entry['choice'])} is at the edge of its grid "
                f"{list(map(fmt, entry['values']))}: the optimum may lie outside it (the widening rule, on unless "
                "--no-widen, steps outward to one value beyond the full grid; finished runs are reused)."
            )
        failed = [v for v, s in entry["tuning"].items() if s["failed"]]
        if failed:
            out.append(f"{name}: tuning runs failed at {entry['knob']} = {', '.join(failed)} (never chosen).")
    paper = report["methods"].get("paper_logra") or {}
    ref = paper.get("tuning", {}).get(fmt(paper["choice"])) if paper.get("choice") is not None else None
    better = [
        name
        for name, lever in report["levers"].items()
        if lever["summary"] is not None
        and ref is not None
        and lever["summary"]["tune_score"]["mean"] > ref["tune_score"]
        and lever["summary"]["reward_gain"]["mean"] > ref["reward_gain"]
    ]
    if report["levers"]:
        out.append(
            "Levers that raise both the tuning score and the reward gain over paper_logra (candidates for "
            f"configs/overlays/logra_levers.yaml): {', '.join(better) if better else 'none yet'}."
        )
    return out


def _series(runs: Mapping[str, dict], tag: str) -> tuple[list[int], list[float], list[float]] | None:
    series = [r["curves"].get(tag, []) for r in runs.values() if not r.get("failed")]
    series = [s for s in series if s]
    if not series:
        return None
    length = min(len(s) for s in series)
    smooth = [rolling_mean([v for _, v in s[:length]], max(1, length // 25)) for s in series]
    steps = [st for st, _ in series[0][:length]]
    mean = [statistics.fmean(col) for col in zip(*smooth, strict=True)]
    std = [statistics.pstdev(col) for col in zip(*smooth, strict=True)]
    return steps, mean, std


def plots(report: dict, out: Path) -> list[Path]:
    """reward vs update and realized KL per update (report seeds, seed bands), tuning score vs knob value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=80)
        plt.close(fig)
        written.append(out / name)

    methods = {n: e for n, e in report["methods"].items() if e["runs"]}
    n_seeds = len(report["report_seeds"])
    for tag, name, ylabel, log in (
        ("train/reward_mean", "parity_reward_curves.png", "train reward (rolling mean)", False),
        ("kl/realized", "parity_kl_realized.png", "realized KL per update (rolling mean)", True),
    ):
        drawn = False
        fig, ax = plt.subplots(figsize=(5.5, 3.4))
        for entry in methods.values():
            found = _series(entry["runs"], tag)
            if found is None:
                continue
            steps, mean, std = found
            label = f"{entry['label']} ({entry['knob']} = {fmt(entry['choice'])})"
            ax.plot(steps, mean, label=label)
            lo = [max(a - b, 1e-12) if log else a - b for a, b in zip(mean, std, strict=True)]
            ax.fill_between(steps, lo, [a + b for a, b in zip(mean, std, strict=True)], alpha=0.25)
            drawn = True
        if not drawn:
            plt.close(fig)
            continue
        absent = [e["label"] for e in methods.values() if _series(e["runs"], tag) is None]
        if absent:  # say which methods logged nothing, rather than leave them silently out
            ax.text(0.01, 0.01, f"not logged: {', '.join(absent)}", transform=ax.transAxes, fontsize=6, va="bottom")
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("update")
        ax.set_ylabel(ylabel)
        ax.set_title(f"tuned settings; band: ± std over {n_seeds} report seeds", fontsize=8)
        ax.legend(fontsize=6)
        save(fig, name)
    knobs = sorted({e["knob"] for e in report["methods"].values() if e["tuning"]})
    if knobs:
        fig, axes = plt.subplots(1, len(knobs), figsize=(4.2 * len(knobs), 3.2), squeeze=False)
        for ax, knob in zip(axes[0], knobs, strict=True):
            for entry in report["methods"].values():
                pts = [
                    (float(v), s["tune_score"])
                    for v, s in entry["tuning"].items()
                    if entry["knob"] == knob and math.isfinite(s["tune_score"])
                ]
                if pts:
                    pts.sort()
                    ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=entry["label"])
                    if entry["choice"] is not None:
                        chosen = entry["tuning"][fmt(entry["choice"])]["tune_score"]
                        ax.scatter([entry["choice"]], [chosen], marker="*", s=120, color="black", zorder=3)
            ax.set_xscale("log")
            ax.set_xlabel(knob)
            ax.set_ylabel("tuning-split pass@1")
            ax.legend(fontsize=6)
        save(fig, "parity_tuning.png")
    return written


def write_report(report: dict, out: Path, figures: Path | None, plan: Plan) -> None:
    """``results.json``, ``results.md`` and the plots under ``out``; the plots also to ``figures`` when given."""
    out.mkdir(parents=True, exist_ok=True)
    # Without the runs' curves: each run's result.json holds them, and results.json stays small enough to commit.
    slim = json.loads(json.dumps(report))
    for group in (*slim["methods"].values(), *slim["levers"].values()):
        for run in group["runs"].values():
            run.pop("curves", None)
    (out / "results.json").write_text(json.dumps(slim, indent=1))
    pngs = plots(report, out)
    lines = [f"# Parity protocol on `{report['model']}` (`benchmarks/ablate.py --grid parity`)", ""]
    lines += [
        f"Each method tuned by its step knob on seeds {', '.join(map(str, report['tune_seeds']))} by the tuning-split "
        "pass@1 (every second held-out problem; the mean of each run's last two validations), then run at the "
        f"chosen value on seeds {', '.join(map(str, report['report_seeds']))} and scored on the report split "
        f"(the other problems); {report['updates']} updates per run. Cut from the full protocol: "
        + ("; ".join(cuts(plan)) or "nothing")
        + "."
        + (
            f" The model's own settings, in every run and the baseline: `{' '.join(MODEL_ARGS[plan.model])}`."
            if MODEL_ARGS.get(plan.model)
            else ""
        ),
        "",
        "## Report",
        "",
        report_table(report),
        "",
        "## Tuning",
        "",
        tuning_table(report),
        "",
    ]
    levers = levers_table(report)
    if levers:
        lines += ["## Levers (each alone on paper_logra at its tuned budget)", "", levers, ""]
    lines += ["## Findings", ""] + [f"- {f}" for f in findings(report)]
    lines += ["", f"Wall time of this invocation: {report.get('wall_s', 0.0) / 60:.1f} min.", ""]
    lines += [f"![{p.stem}]({p.name})" for p in pngs]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    if figures is not None:
        figures.mkdir(parents=True, exist_ok=True)
        for p in pngs:
            shutil.copy(p, figures / f"{_slug(report['model'])}_{p.name}")


# ------------------------------------------------------------------------------------------------ main
def make_plan(args: argparse.Namespace) -> tuple[Plan, str, tuple[str, ...]]:
    """The plan, the stage and the levers of an ``ablate.py --grid parity|levers`` command line."""
    defaults = MODEL_DEFAULTS.get(args.model, MODEL_DEFAULTS["tiny:small"])
    stage = "levers" if args.grid == "levers" else args.stage
    methods = tuple(args.methods or METHODS)
    levers = tuple(args.levers or LEVERS)
    for what, names, known in (("methods", methods, METHODS), ("levers", levers, LEVERS)):
        unknown = sorted(set(names) - set(known))
        if unknown:
            raise SystemExit(f"unknown {what} {unknown}: choose from {list(known)}")
    if stage == "levers":  # the levers need paper_logra's tuned budget (its tuning runs first, or is reused)
        methods = ("paper_logra",)
    plan = Plan(
        model=args.model,
        updates=args.updates or defaults["updates"],
        values=args.values if args.values is not None else defaults["values"],
        methods=methods,
        out=(args.out or ROOT / "results" / "parity" / _slug(args.model)).resolve(),
        tune_seeds=tuple(args.tune_seeds or TUNE_SEEDS),
        report_seeds=tuple(args.report_seeds or REPORT_SEEDS),
        extra=tuple(args.extra),
    )
    if plan.updates < 2 * VALIDATIONS:
        raise SystemExit(f"--updates {plan.updates}: at least {2 * VALIDATIONS} (two per validation)")
    return plan, stage, levers


def describe(plan: Plan, stage: str, levers: Sequence[str], tune: Sequence[RunSpec], jobs: int) -> str:
    """The plan as printed before anything runs: runs per stage and their estimated wall time."""
    n_report = len(plan.methods) * len(plan.report_seeds) if stage in ("report", "all") else 0
    n_levers = len(levers) * len(plan.tune_seeds) if stage == "levers" else 0

    def one_run(name: str) -> float:
        return estimate_s([plan.spec("tune", name, METHODS[name].knob.default, 0)], plan.model, plan.updates, 1)

    est_tune = estimate_s(tune, plan.model, plan.updates, jobs)
    est_report = sum(one_run(n) for n in plan.methods) * len(plan.report_seeds) / jobs if n_report else 0.0
    est_levers = n_levers * one_run("paper_logra") / jobs
    values = ", ".join(f"{n}: {len(plan.values_of(n))} values" for n in plan.methods)
    lines = [
        f"grid parity, model {plan.model}, stage {stage}: methods {list(plan.methods)}, {plan.updates} updates per "
        f"run, {VALIDATIONS} validations, {jobs} at a time -> {plan.out}",
        f"  tune: {len(tune)} runs ({values} x seeds {list(plan.tune_seeds)}), estimated {est_tune / 60:.0f} min",
    ]
    if n_report:
        lines.append(
            f"  report: {n_report} runs ({len(plan.methods)} methods x seeds {list(plan.report_seeds)} at the tuned "
            f"value), estimated {est_report / 60:.0f} min"
        )
    if n_levers:
        lines.append(
            f"  levers: {n_levers} runs ({len(levers)} levers x seeds {list(plan.tune_seeds)} at paper_logra's tuned "
            f"budget), estimated {est_levers / 60:.0f} min"
        )
    scale = MODEL_COST.get(plan.model, max(MODEL_COST.values()))
    lines.append(
        f"  total estimated {(est_tune + est_report + est_levers) / 60:.0f} min, finished runs included (grid.COSTS,"
        f" measured on tiny; x{scale} per update for {plan.model}; the KL measurement of AdamW/LoRA runs estimated)"
    )
    lines.append(
        "  then the widening rule: a choice at a grid edge adds the next value outward (2 runs per step, not in the "
        "estimate; --no-widen: off)"
    )
    cut = cuts(dataclasses.replace(plan, methods=tuple(METHODS)))  # a stage's own subset of methods is no cut
    if cut:
        lines.append(f"  cut from the full protocol: {'; '.join(cut)}")
    if MODEL_ARGS.get(plan.model):
        lines.append(f"  {plan.model}'s own settings (every run and the baseline): {' '.join(MODEL_ARGS[plan.model])}")
    return "\n".join(lines)


def dry_run(
    plan: Plan, stage: str, levers: Sequence[str], tune: Sequence[RunSpec], found: Mapping[str, Choice]
) -> None:
    """Every command the stage would run; a stage waiting for a tuning shows its command with the knob open."""
    runs = [*tune]
    if stage in ("report", "all"):
        runs += plan.report_runs(found)
    if stage == "levers":
        runs += plan.lever_runs(found.get("paper_logra"), levers)
    for spec in runs:
        print(f"[{spec.stage}] {spec.cell} seed {spec.seed}: logra-pl " + " ".join(spec.args))
    for name in [n for n in plan.methods if found[n].value is None]:
        m = METHODS[name]
        if stage in ("report", "all"):
            example = plan.spec("report", name, m.knob.default, plan.report_seeds[0])
        elif stage == "levers":
            lever = next(iter(levers))
            example = plan.spec("levers", name, m.knob.default, plan.tune_seeds[0], (lever, LEVERS[lever]))
        else:
            continue
        text = " ".join(example.args).replace(
            " ".join(m.knob.args(m.knob.default, m.overlays)), f"<tuned {m.knob.name}>"
        )
        text = text.replace(f"/{m.knob.name}={fmt(m.knob.default)}/", f"/{m.knob.name}=<tuned>/")
        where = example.cell.split("/")[0]
        print(f"[{example.stage}] {where}: waits for {name}'s tuning ({found[name].reason}); e.g. logra-pl {text}")


def main(argv: Sequence[str] | None = None) -> None:
    """``python benchmarks/parity.py`` (or ``ablate.py --grid parity|levers``): plan, print the estimate, run the
    stages, write the report."""
    args = parser().parse_args(argv)
    plan, stage, levers = make_plan(args)
    out = plan.out
    if args.widen:  # the grids as far as finished runs already widened them
        plan = widen(plan, out)
    # Methods (and levers) this checkout cannot run: refused before anything starts, named.
    problems = [p for name in plan.methods if (p := preflight(METHODS[name]))]
    if stage == "levers":
        problems += [p for name in levers if (p := preflight(METHODS["paper_logra"], (name, LEVERS[name])))]
    tune = plan.tune_runs() if stage in ("tune", "all", "levers") else []
    found = choices(plan, out)
    print(describe(plan, stage, levers, tune, args.jobs), flush=True)
    for p in problems:
        print(f"  CANNOT RUN: {p}", flush=True)
    if args.dry_run:
        dry_run(plan, stage, levers, tune, found)
        return
    if problems:
        hint = "(the other methods run with --methods, e.g. --methods paper_logra adamw lora)"
        raise SystemExit("\n".join(problems) + "\n" + hint)
    start = time.perf_counter()
    val0 = parity_baseline(plan, out, max(1, (os.cpu_count() or 2) // args.jobs))
    if tune:
        execute(tune, out, args.jobs, val0, args.retry_failed, args.rerun_without_kl)
    if args.widen:
        runner = functools.partial(
            execute,
            out=out,
            jobs=args.jobs,
            val0=val0,
            retry_failed=args.retry_failed,
            rerun_without_kl=args.rerun_without_kl,
        )
        plan = widen(plan, out, runner if tune else None)
    found = choices(plan, out)
    if stage in ("report", "all"):
        for name, choice in found.items():
            if choice.value is None:
                print(f"  report stage of {name} waits: {choice.reason} (run --stage tune first)", flush=True)
        execute(plan.report_runs(found), out, args.jobs, val0, args.retry_failed, args.rerun_without_kl)
    if stage == "levers":
        if found["paper_logra"].value is None:
            raise SystemExit(f"the levers need paper_logra's tuned budget: {found['paper_logra'].reason}")
        execute(
            plan.lever_runs(found["paper_logra"], levers),
            out,
            args.jobs,
            val0,
            args.retry_failed,
            args.rerun_without_kl,
        )
    # The report holds every method's finished runs, whichever this invocation ran (results.md is one file).
    everything = dataclasses.replace(plan, methods=tuple(METHODS))
    if args.widen:
        everything = widen(everything, out)
    shown = levers if stage == "levers" else tuple(n for n in LEVERS if (out / "levers" / n).exists())
    report = collect(everything, out, choices(everything, out), shown)
    report.update(val_start=val0, wall_s=time.perf_counter() - start, cuts=cuts(everything))
    write_report(report, out, args.figures, everything)
    print((out / "results.md").read_text())


def parser() -> argparse.ArgumentParser:
    """The parity grid's options (``ablate.py --grid parity`` passes every argument on)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--grid", choices=("parity", "levers"), default="parity", help="levers = --stage levers")
    parser.add_argument("--updates", type=int, default=None, help="updates per run (default: the model's protocol)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, each with cpu_count/jobs threads")
    parser.add_argument("--out", type=Path, default=None, help="default: results/parity/<model>")
    parser.add_argument("--figures", type=Path, default=None, help="also copy the plots here")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the commands, run nothing")
    parser.add_argument("--model", default="tiny", help="model.policy of every run: tiny (default) | tiny:small")
    parser.add_argument("--stage", choices=("tune", "report", "all", "levers"), default="all")
    parser.add_argument("--methods", nargs="+", default=None, help=f"only these of {list(METHODS)}")
    parser.add_argument("--levers", nargs="+", default=None, help=f"only these of {list(LEVERS)} (--stage levers)")
    parser.add_argument("--values", type=int, default=None, help="knob values per method (nearest the default)")
    parser.add_argument("--tune-seeds", type=int, nargs="+", default=None, help="default: 0 1")
    parser.add_argument("--report-seeds", type=int, nargs="+", default=None, help="default: 2 3 4 5 6")
    parser.add_argument(
        "--no-widen",
        dest="widen",
        action="store_false",
        help="keep each tuning grid as planned (default: follow a choice at a grid edge outward, widening())",
    )
    parser.add_argument("--retry-failed", action="store_true", help="rerun runs that failed (kept as failed)")
    parser.add_argument(
        "--rerun-without-kl",
        action="store_true",
        help="rerun AdamW/LoRA runs that logged no kl/realized (finished before dense KL measurement existed)",
    )
    parser.add_argument(
        "--extra",
        nargs=argparse.REMAINDER,
        default=[],
        help="logra-pl arguments added to every run (last on the command line, so they win)",
    )
    return parser


if __name__ == "__main__":
    main()
