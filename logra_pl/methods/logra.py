"""``LoGRAMethod`` and its optimizer: full-weight updates through low-rank gradient sketches (algorithm.md §1-5).

Backward fills ``S = G Pᵀ`` per target matrix; ``optimizer.step()`` forms the proposal (RowAdam, step size), lets
``on_before_optimizer_step`` callbacks scale or veto it, has the divergence guard judge it, and merges
``W ← W − α U P``. Engines receive the same bf16 factors and a seed (:attr:`ships_factors`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from logra_pl.config import as_settings, register
from logra_pl.errors import ConfigError
from logra_pl.methods.base import (
    AllReduceSum,
    DataParallelRanks,
    PlanSettings,
    PlanShapes,
    StepResult,
    UpdateMethod,
    bytes_text,
    count_text,
)
from logra_pl.methods.guard import DivergenceGuard
from logra_pl.sketch import LoGRAConfig, LoGRASketcher, Payload, Proposal, select_targets
from logra_pl.sketch.config import (
    DEFAULT_TARGETS,
    MOMENT_DTYPES,
    PROJECTION_STORAGES,
    SKETCH_OPERAND_DTYPES,
    SKETCH_SIDES,
    check_rank_fits,
    matrix_rank,
)
from logra_pl.sketch.memory import MemoryReport, memory_report
from logra_pl.sketch.merge import full_tensor
from logra_pl.sketch.probe import ProbeMode, logit_tangent, moved_logits
from logra_pl.sketch.projection import packed_bytes


def reduce_sketches(optimizer: LoGRAOptimizer, ranks: DataParallelRanks) -> None:
    """All-reduce (sum) every sketch, one call per group of same-shaped matrices (each group's sketches are one
    stacked buffer, :meth:`~logra_pl.sketch.LoGRASketcher.sketch_stacks`); the bytes and seconds go to the ranks'
    ``stats``."""
    start = time.perf_counter()
    stacks = optimizer.sketcher.sketch_stacks()
    nbytes = sum(s.numel() * s.element_size() for s in stacks)
    if ranks.world_size > 1:
        for stack in stacks:
            torch.distributed.all_reduce(stack, op=torch.distributed.ReduceOp.SUM)
    ranks.stats["logra/sketch_allreduce_bytes"] = float(nbytes if ranks.world_size > 1 else 0)
    ranks.stats["logra/sketch_allreduce_s"] = time.perf_counter() - start


def summed_weight_sq_norms(optimizer: LoGRAOptimizer, ranks: DataParallelRanks) -> dict[str, float]:
    """``‖W_i‖²`` of whole matrices: each rank's shard sums, summed over ``ranks``."""
    local = optimizer.sketcher.weight_sq_norms()
    if ranks.world_size <= 1:
        return local
    names = list(local)
    t = torch.tensor([local[n] for n in names], dtype=torch.float64, device=ranks.root_device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
    return {n: float(v) for n, v in zip(names, t.tolist(), strict=True)}


class LoGRAOptimizer(torch.optim.Optimizer):
    """One LoGRA update per ``step()``: propose → closure (hooks) → merge, or skip.

    Arguments:
        sketcher: the model's :class:`LoGRASketcher` (hooks attached, sketches filled by backward).
        max_relative_update: the divergence guard's bound: an update larger than this fraction of the weights is
            rejected before it merges (None: no bound).

    After ``step()``: :attr:`last_payload` is the merged payload (``None`` if skipped) — what a rollout engine
    must apply — and :attr:`last_proposal` the proposal it came from, while something else still holds it (a step
    controller does, until it has calibrated the update). ``grad_scale`` multiplies the sketches before RowAdam (e.g.
    ``1/world_size`` after a sum all-reduce).
    """

    def __init__(self, sketcher: LoGRASketcher, max_relative_update: float | None = None) -> None:
        params = [m.module.weight for m in sketcher.matrices.values()]
        super().__init__(params, defaults={})
        self.sketcher = sketcher
        self.proposal: Proposal | None = None
        self._last_proposal: weakref.ref[Proposal] | None = None
        self.last_payload: Payload | None = None
        self.grad_scale = 1.0
        self.last_merge_s = 0.0
        self.max_relative_update = max_relative_update
        # Set by wire_ranks under data parallelism: all-reduce the sketches, and sum ‖W_i‖² over row shards.
        self.before_propose: Callable[[LoGRAOptimizer], None] | None = None
        self.weight_sq_norms: Callable[[LoGRAOptimizer], dict[str, float]] | None = None

    def wire_ranks(self, ranks: DataParallelRanks) -> None:
        """Data parallelism (:class:`~logra_pl.methods.base.ReplicatedStateOptimizer`): before each proposal the
        sketches are summed over ``ranks`` (:func:`reduce_sketches`) and ``‖W_i‖²`` over the row shards
        (:func:`summed_weight_sq_norms`); each matrix merges at the first global row its rank holds."""
        sketcher = self.sketcher
        sketcher.row_offsets = {n: ranks.row_offset(m.module.weight) for n, m in sketcher.matrices.items()}
        self.before_propose = functools.partial(reduce_sketches, ranks=ranks)
        self.weight_sq_norms = functools.partial(summed_weight_sq_norms, ranks=ranks)

    @property
    def last_proposal(self) -> Proposal | None:
        """The proposal the last ``step()`` came from, or None once nothing else holds it.

        The optimizer keeps no reference of its own, as ``ProposingAdamW`` releases its previewed deltas: a merged
        proposal holds the update's directions and the projections it was made with (the sketcher has drawn the
        next ones), and keeping them into the next step's forward and backward raised LoGRA's peak RSS on
        ``tiny:medium`` by 34 MiB (957.6 → 923.2 MiB, ``benchmarks/compare.py``'s LoGRA run).
        """
        return self._last_proposal() if self._last_proposal is not None else None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Propose, run ``closure`` (Lightning's hooks), then merge the (possibly rescaled) proposal."""
        if self.before_propose is not None:
            self.before_propose(self)
        norms = self.weight_sq_norms(self) if self.weight_sq_norms is not None else None
        self.proposal = self.sketcher.propose(grad_scale=self.grad_scale, weight_sq_norms=norms)
        result = None
        if closure is not None:
            with torch.enable_grad():
                result = closure()
        proposal, self.proposal = self.proposal, None
        self._last_proposal = weakref.ref(proposal) if proposal is not None else None
        self.last_payload = None
        if proposal is None:
            return result
        start = time.perf_counter()
        self.last_payload = self.sketcher.apply(proposal, max_relative_update=self.max_relative_update)
        self.last_merge_s = time.perf_counter() - start
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Sketches are reset after every update; nothing else holds gradients."""

    def state_dict(self) -> dict[str, Any]:
        """All LoGRA state (row statistics, update index, counters, config)."""
        return {"logra": self.sketcher.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (refuses a mismatched LoGRA config)."""
        self.sketcher.load_state_dict(state_dict["logra"])


# The LoGRA rules `logra-pl plan` knows by name: the default (LoGRAConfig's own) and the paper's.
PLAN_RULES = {"default": LoGRAConfig, "paper": LoGRAConfig.paper}


@register("logra")
class LoGRAMethod(UpdateMethod):
    """LoGRA: the paper's method.

    Arguments:
        logra: every LoGRA knob (:class:`~logra_pl.sketch.LoGRAConfig`; kept as :attr:`config`); its ``targets``
            are set from the module's ``targets``, which every method trains (a differing ``logra.targets`` is the
            module's targets when it names none).
    """

    name = "logra"
    ships_factors = True
    makes_proposals = True
    keeps_sketches = True

    def __init__(self, logra: LoGRAConfig | None = None) -> None:
        self.config = as_settings(LoGRAConfig, logra, "logra")
        self._sketcher: LoGRASketcher | None = None
        self.optimizer: LoGRAOptimizer | None = None
        self._gain = 0.0
        self._keep_step = False
        self._next_gain: float | None = None

    @property
    def logra(self) -> LoGRAConfig:
        """The LoGRA knobs this method was built with (its init argument; :attr:`config`)."""
        return self.config

    @property
    @override
    def targets(self) -> tuple[str, ...] | None:
        mine = tuple(self.config.targets)
        return None if mine == tuple(DEFAULT_TARGETS) else mine

    @classmethod
    @override
    def plan_options(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--logra-rule",
            default="default",
            choices=sorted(PLAN_RULES),
            help="LoGRA's rule: default (Adam in sketch space, two bf16 moments) or paper (RowAdam); default: default",
        )
        parser.add_argument(
            "--logra-moments",
            nargs="?",
            const="float32",
            choices=sorted(MOMENT_DTYPES),
            help="with --logra-rule paper: a first moment (logra.beta1 > 0), stored as this dtype (default float32)",
        )
        parser.add_argument(
            "--moment-dtype",
            choices=sorted(MOMENT_DTYPES),
            help="storage of LoGRA's moments (logra.moment_dtype); default: the rule's own (default bf16, paper fp32)",
        )
        parser.add_argument(
            "--sketch-operands",
            choices=sorted(SKETCH_OPERAND_DTYPES),
            help="the sketch matmuls' operands (logra.sketch_operands; bfloat16 keeps P's signs too); default float32",
        )
        parser.add_argument(
            "--sketch-side",
            choices=sorted(SKETCH_SIDES),
            help="the side the projection mixes (logra.sketch_side: d_in × r sketches on the outputs'); default inputs",
        )
        parser.add_argument(
            "--projection-storage",
            choices=sorted(PROJECTION_STORAGES),
            help="how projections are held (logra.projection_storage: packed keeps their draws, 1/32); default dense",
        )

    @classmethod
    @override
    def planned(cls, settings: PlanSettings) -> LoGRAMethod:
        """Options: ``logra_rule`` (``"default"``: Adam in sketch space, a first and a per-entry second moment,
        ``d_out × r`` each per matrix, bf16; ``"paper"``: RowAdam, ``d_out`` row statistics only), ``logra_moments``
        (the paper's rule with a first moment, ``logra.beta1 > 0``; a dtype name also sets its storage),
        ``moment_dtype`` (the moments' storage, ``logra.moment_dtype``; None: the rule's own), ``sketch_operands``
        (``logra.sketch_operands``; None: float32), ``sketch_side`` (``logra.sketch_side``; None: inputs) and
        ``projection_storage`` (``logra.projection_storage``; None: dense)."""
        options = settings.options
        rule, moments = options.get("logra_rule") or "default", options.get("logra_moments")
        dtype = options.get("moment_dtype") or (moments if isinstance(moments, str) else None)
        if rule not in PLAN_RULES:
            raise ValueError(f"unknown logra_rule {rule!r}: use one of {sorted(PLAN_RULES)}")
        if dtype is not None and dtype not in MOMENT_DTYPES:
            raise ValueError(f"unknown moment_dtype {dtype!r}: use one of {sorted(MOMENT_DTYPES)}")
        knobs: dict[str, Any] = {"rank": settings.rank, "targets": tuple(settings.targets)}
        if moments:
            knobs["beta1"] = 0.9
        if dtype is not None:
            knobs["moment_dtype"] = dtype
        if options.get("sketch_operands"):
            knobs["sketch_operands"] = options["sketch_operands"]
        if options.get("sketch_side"):
            knobs["sketch_side"] = options["sketch_side"]
        if options.get("projection_storage"):
            knobs["projection_storage"] = options["projection_storage"]
        return cls(PLAN_RULES[rule](**knobs))

    def with_targets(self, targets: Sequence[str]) -> LoGRAConfig:
        """The config with the module's targets (a differing, explicitly set ``logra.targets`` is refused)."""
        mine = tuple(self.config.targets)
        if mine != tuple(targets) and mine != tuple(DEFAULT_TARGETS):
            raise ConfigError(
                f"logra.targets={list(mine)} differs from model.targets={list(targets)}: the trained matrices are "
                "model.targets (every method trains them); set them there and drop logra.targets"
            )
        return dataclasses.replace(self.config, targets=tuple(targets)) if mine != tuple(targets) else self.config

    @property
    @override
    def step_knob(self) -> str:
        return "lr" if self.config.step_mode in ("lr", "adam") else "update_ratio"

    @property
    @override
    def sketcher(self) -> LoGRASketcher | None:
        return self._sketcher

    @override
    def check_fits(self, source: str, targets: Sequence[str]) -> None:
        """``rank ≤ d_in`` for every target matrix (unless ``clip_rank``), read from the model's config on the meta
        device."""
        from transformers import AutoModelForCausalLM

        from logra_pl.models.load import load_config, resolve_source

        resolve_source(source)  # a source that cannot exist gets its clear PolicyLoadError here
        config = load_config(source)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        widths = {
            n: self.config.sketch_dims(m.out_features, m.in_features)[1]
            for n, m in select_targets(skeleton, targets).items()
        }
        check_rank_fits(self.config.rank, widths, self.config.clip_rank, f" in policy {source!r}")

    @override
    def configure_optimizers(self, policy: nn.Module, targets: Sequence[str], guard: DivergenceGuard) -> Any:
        self.config = self.with_targets(targets)  # what trained_tensors and changed_numel read from now on
        self._sketcher = LoGRASketcher(policy, self.config)
        self._sketcher.keep_step = self._keep_step
        bound = guard.max_update_ratio if guard.enabled else None
        self.optimizer = LoGRAOptimizer(self._sketcher, max_relative_update=bound)
        return self.optimizer

    @override
    def step(self, optimizer: Any, scheduler: Any, all_reduce_sum: AllReduceSum) -> StepResult:
        optimizer.step()
        inner, sketcher = optimizer.optimizer, self._sketcher
        rejected = sketcher.last_skip_reason if inner.last_payload is None else None
        norm = 0.0 if rejected else math.sqrt(sketcher.last_update_sq_norm)
        self._gain, self._next_gain, dense_next = sketcher.last_gain, sketcher.next_gain, 0.0
        if sketcher.dense:  # the dense parameters' parts are over this process's shards: summed over ranks
            parts = torch.tensor([sketcher.last_dense_gain, sketcher.next_dense_gain], dtype=torch.float64)
            dense_gain, dense_next = all_reduce_sum(parts).tolist()
            self._gain += dense_gain
        if self._next_gain is not None:
            self._next_gain += dense_next
        return StepResult(rejected, norm, inner.last_payload)

    @property
    @override
    def last_gain(self) -> float | None:
        """``α·⟨S, U⟩`` summed over the sketched matrices (``= ⟨G, α·U P⟩`` exactly, ``S`` the all-reduced sketch of
        the update's loss and ``U`` the proposal's factor; the merged ``F = bf16(α·U)`` differs by its rounding), plus
        the dense parameters' ``−⟨g, α·Δ⟩``."""
        return self._gain

    @override
    def keep_last_step(self) -> bool:
        """Keep each merged update's factors (and dense steps) for the next update's measure, which its sketches
        give exactly while the basis persists (next_gain.py); a basis drawn anew every update (``refresh_every: 1``)
        or rescaled every update (``input_scaling: rms``) never persists, so then this method cannot."""
        if self.config.refresh_every == 1 or self.config.input_scaling == "rms":
            return False
        self._keep_step = True
        if self._sketcher is not None:
            self._sketcher.keep_step = True
        return True

    @property
    @override
    def next_batch_gain(self) -> float | None:
        """``⟨S', F⟩`` summed over the sketched matrices (``= −⟨G', ΔW⟩`` exactly: ``F`` the merged factors of the
        kept update, ``S'`` this update's all-reduced sketches on the same basis), plus the dense parameters'
        ``−⟨g', α·Δ⟩``."""
        return self._next_gain

    # ------------------------------------------------------------------------------------ step control
    @property
    @override
    def applied_updates(self) -> int:
        return self._sketcher.num_applied if self._sketcher is not None else 0

    @override
    def applied(self, proposal: Any) -> bool:
        opt = self.optimizer
        return opt is not None and opt.last_proposal is proposal and opt.last_payload is not None

    @override
    def logit_tangent(
        self,
        policy: nn.Module,
        proposal: Any,
        model_inputs: Mapping[str, torch.Tensor],
        mode: ProbeMode = "jvp",
        fd_step: float = 1e-3,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hooks on the sketched layers add ``−(X Pᵀ) Uᵀ`` to their outputs' tangents; ``logra.dense_params`` add
        theirs by a central difference (:func:`~logra_pl.sketch.probe.logit_tangent`)."""
        sketcher = self._sketcher
        modules = {name: m.module for name, m in sketcher.matrices.items()}
        return logit_tangent(policy, modules, proposal, model_inputs, mode, fd_step, sketcher.dense)

    @override
    def logits_at(
        self, policy: nn.Module, proposal: Any, model_inputs: Mapping[str, torch.Tensor], alpha: float
    ) -> torch.Tensor:
        """Hooks on the sketched layers add ``−α (X Pᵀ) Uᵀ`` to their outputs; ``logra.dense_params`` move by
        ``α·delta`` for the forward (:func:`~logra_pl.sketch.probe.moved_logits`)."""
        sketcher = self._sketcher
        modules = {name: m.module for name, m in sketcher.matrices.items()}
        return moved_logits(policy, modules, proposal, model_inputs, alpha, sketcher.dense)

    @override
    def trained_tensors(self, policy: nn.Module) -> dict[str, torch.Tensor]:
        params = {f"{n}.weight": m.weight for n, m in select_targets(policy, self.config.targets).items()}
        params.update(self._sketcher.dense if self._sketcher is not None else {})
        return {n: full_tensor(p).detach() for n, p in params.items()}

    @override
    def changed_numel(self, policy: nn.Module) -> int:
        return sum(m.weight.numel() for m in select_targets(policy, self.config.targets).values())

    @override
    def metrics(self) -> dict[str, float]:
        sketcher = self._sketcher
        out = {
            "guard/relative_update": sketcher.last_relative_update,
            "logra/skipped_updates": float(sketcher.num_skipped),
            "logra/merge_s": self.optimizer.last_merge_s,
            "train/update_gain": self._gain,
        }
        if sketcher.config.moment_reference_kl is not None:  # the moment's horizon in KL: its decay this update
            out["logra/moment_decay"] = sketcher.last_moment_decay
        return out

    @override
    def memory(self, policy: nn.Module) -> MemoryReport:
        return memory_report(policy, sketcher=self._sketcher)

    @override
    def plan_memory(self, shapes: PlanShapes) -> MemoryReport:
        """Per matrix: a ``d_out × r`` fp32 sketch, an ``r × d_in`` fp32 projection and ``d_out`` fp32 row
        statistics (and its ``r × d_in`` bf16 signs with ``logra.sketch_operands: bfloat16``), whole on every rank
        (each rank sketches the full matrix; the sketches are all-reduced), with
        ``logra.beta1 > 0`` a ``d_out × r`` first moment in ``logra.moment_dtype``, and with ``update_rule: adam`` a
        ``d_out × r`` second moment in the same dtype, and with ``input_scaling: rms`` three ``d_in`` fp32 vectors
        (the update's sums of squared inputs, their EMA, the scales) and a token count; no gradients, no optimizer
        state. On the outputs' side (``logra.sketch_side: outputs``) ``d_out`` and ``d_in`` trade places in each of
        these (a ``d_in × r`` sketch, an ``r × d_out`` projection)."""
        report = MemoryReport(weights=shapes.weights)
        cfg = self.config
        widths = {n: cfg.sketch_dims(m.out_features, m.in_features)[1] for n, m in shapes.matrices.items()}
        check_rank_fits(cfg.rank, widths, cfg.clip_rank)  # on the outputs' side, r ≤ d_out
        moment = MOMENT_DTYPES[cfg.moment_dtype].itemsize
        for linear in shapes.matrices.values():
            rows, width = cfg.sketch_dims(linear.out_features, linear.in_features)
            r = matrix_rank(cfg.rank, width, cfg.clip_rank)
            report.sketches += rows * r * 4
            if cfg.input_precondition == "gram":  # the update's r × r Gram and its token count
                report.sketches += r * r * 4 + 4
            if cfg.projection_storage == "packed":  # the draws P is built from (signs too, at each read)
                report.projections += packed_bytes(r, width, cfg.distribution)
            else:
                report.projections += r * width * 4
                if cfg.sketch_operands == "bfloat16":  # P's signs in bf16 beside it, the sketch matmuls' operand
                    report.projections += r * width * 2
            report.row_statistics += rows * 4
            if cfg.input_scaling == "rms":  # the update's Σx² and token count; the EMA and the scales s
                report.sketches += linear.in_features * 4 + 4
                report.row_statistics += 2 * linear.in_features * 4
            if cfg.beta1 > 0:
                report.sketch_moments += rows * r * moment
            if cfg.update_rule == "adam":  # the per-entry second moment, in the same dtype
                report.sketch_moments += rows * r * moment
            report.dense_gradient_equivalent += linear.out_features * linear.in_features * 4
        return report

    @override
    def trained_parameter_count(self, policy: nn.Module) -> int:
        if self._sketcher is None:
            return 0
        return sum(m.module.weight.numel() for m in self._sketcher.matrices.values())

    @override
    def report(self, policy: nn.Module, targets: Sequence[str]) -> str:
        cfg, sketcher = self.config, self._sketcher
        if sketcher is None:
            return ""
        mats = sketcher.matrices.values()
        sketch = sum(m.sketch.numel() * m.sketch.element_size() for m in mats)
        proj = sum(m.stored_projection.numel() * m.stored_projection.element_size() for m in mats)
        rows = sum(v.numel() * v.element_size() for v in sketcher.row_stats.values())
        dense = sum(m.module.weight.numel() * 4 for m in mats)
        every = cfg.refresh_every
        basis = (
            "fixed" if every == 0 else "refreshed every update" if every == 1 else f"refreshed every {every} updates"
        )
        kept = [*sketcher.moments.values(), *sketcher.second_moments.values()]
        moments = sum(t.numel() * t.element_size() for t in kept)
        moment_text = f" + {bytes_text(moments)} of sketch-space moments" if moments else ""
        return (
            f"LoGRA trains {count_text(self.trained_parameter_count(policy))} parameters in {len(sketcher.matrices)} "
            f"matrices ({', '.join(targets)}) through rank-{cfg.rank} sketches of their {cfg.sketch_side} "
            f"({cfg.distribution} projections{', packed' if cfg.projection_storage == 'packed' else ''}, "
            f"{basis}; {cfg.update_rule} rule); everything else is frozen. Its state: {bytes_text(sketch)} of "
            f"sketches + {bytes_text(proj)} of projections + {bytes_text(rows)} of row statistics{moment_text}, in "
            f"place of {bytes_text(dense)} of fp32 dense gradients (+ {bytes_text(2 * dense)} of Adam moments)"
        )
