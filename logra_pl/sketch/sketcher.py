"""``LoGRASketcher``: attaches sketches to a model and turns them into merged, shippable updates.

One update, in order (algorithm.md §3-5):

1. forward/backward over the microbatches — the hooks fill each ``S = G Pᵀ``;
2. (data-parallel callers all-reduce :meth:`LoGRASketcher.sketch_stacks` here);
3. :meth:`propose` — non-finite guard, RowAdam/SGD directions, the global ``update_ratio`` scale → a
   :class:`~logra_pl.sketch.payload.Proposal` (``alpha`` may now be set by a step controller);
4. :meth:`apply` — ``proposal → payload`` (bf16 ``U·α``), merged with
   :func:`~logra_pl.sketch.merge.merge_stack_`, the merge every rollout engine runs; row statistics are
   committed; the next update's projections are drawn. Or :meth:`skip` — nothing merged, the event counted.

Every step runs on groups of same-shaped matrices (:mod:`logra_pl.sketch.groups`): one batched formula per group
instead of one per matrix, each matrix getting the bits it gets alone (algorithm.md §4-5). The per-matrix
reference, kept for tests and benchmarks, is :class:`~logra_pl.sketch.reference.PerMatrixSketcher`.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from logra_pl.sketch.accumulate import MatrixSketch
from logra_pl.sketch.config import LoGRAConfig, LoGRAConfigError, check_rank_fits
from logra_pl.sketch.groups import (
    MatrixGroup,
    group_matrices,
    stack_grams,
    stack_lifted_sq_norms,
    stack_transfer,
    stack_weight_norms,
)
from logra_pl.sketch.guard import rejection_reason, relative_update
from logra_pl.sketch.host import host_values
from logra_pl.sketch.input_scale import ema_mean_squares, input_scales, scaled_signs
from logra_pl.sketch.merge import full_tensor, local_tensor, merge_stack_
from logra_pl.sketch.next_gain import KeptStep
from logra_pl.sketch.payload import (
    DenseProposal,
    FactorStack,
    MatrixProposal,
    Payload,
    Proposal,
    named_tensors,
    stacked_factors,
)
from logra_pl.sketch.projection import (
    PackedProjections,
    make_projections,
    projection_index,
    projection_seed,
    sign_scale,
)
from logra_pl.sketch.side import merge_span, oriented
from logra_pl.sketch.targets import select_targets
from logra_pl.sketch.trace import traced_call
from logra_pl.sketch.update import (
    adam_direction,
    bias_corrected,
    entry_adam_direction,
    factor_gain,
    first_moment,
    gram_preconditioned,
    horizon_decay,
    lr_factor,
    moment_mass,
    ratio_scale,
    rowadam_direction,
    sgd_direction,
)

# What one group's update rule produced: the directions D (k, d_out, r), and the row statistics, first moments and
# per-entry second moments
# to commit if the update merges (None when the rule keeps none).
GroupStep = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]

STATE_FORMAT = "logra-pl/sketcher/v1"

# ``update_rule: adam`` runs on slices of a group holding at most 1/RULE_SLICES of the model's sketch entries (but
# never fewer than RULE_MIN_ENTRIES: small groups, whose temporaries cost nothing, run whole), at least one matrix
# each (see LoGRASketcher._group_direction). RowAdam and SGD form one or two stack-sized temporaries and run whole.
RULE_SLICES = 4
RULE_MIN_ENTRIES = 1 << 16


class LoGRASketcher:
    """The LoGRA state of one model: per-matrix sketches and projections, RowAdam row statistics, counters.

    Arguments:
        model: the policy; its selected ``nn.Linear`` weights get ``requires_grad=False`` and a sketch hook.
        config: the LoGRA hyper-parameters.
        freeze_rest: also set ``requires_grad=False`` on every other parameter (algorithm.md §1 default).
    """

    def __init__(self, model: nn.Module, config: LoGRAConfig | None = None, *, freeze_rest: bool = True) -> None:
        self.model = model
        self.config = config or LoGRAConfig()
        self.update_index = 0
        self.num_applied = 0
        self.num_skipped = 0
        self.num_rejected = 0
        self.last_skip_reason: str | None = None
        self.last_update_sq_norm = 0.0  # ‖ΔW‖² of the last merged (or rejected) update, summed over matrices
        self.last_relative_update = 0.0  # its ‖ΔW‖/‖W‖
        # The first-order gain of the last merged update (0 when skipped or rejected): α·⟨S, U⟩ over the sketched
        # matrices (the same on every rank: S is all-reduced, U whole), and −⟨g, α·Δ⟩ over this process's shards of
        # the dense parameters (a data-parallel caller sums that part over ranks).
        self.last_gain = 0.0
        self.last_dense_gain = 0.0
        self._grad_scale = 1.0
        self._unit_gains: list[torch.Tensor] = []  # per group, ⟨S_i, U_i⟩ of the current proposal
        # With keep_step: the last merged update (KeptStep) and its gain on this update's loss, grad_scale applied:
        # next_gain over the sketched matrices (the same on every rank), next_dense_gain over this process's shards
        # of the dense parameters (a data-parallel caller sums that part). None: not measured for this update.
        self.keep_step = False
        self._kept: KeptStep | None = None
        self._next_parts: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self.next_gain: float | None = None
        self.next_dense_gain = 0.0
        self.row_offsets: dict[str, int] = {}
        targets = select_targets(model, self.config.targets)
        widths = {n: self.config.sketch_dims(m.out_features, m.in_features)[1] for n, m in targets.items()}
        check_rank_fits(self.config.rank, widths, self.config.clip_rank)
        if freeze_rest:
            for p in model.parameters():
                p.requires_grad_(False)
        beta1 = self.config.beta1 > 0
        entry = self.config.update_rule == "adam"
        # Same-shaped matrices share stacked buffers; each matrix's tensors below are views of its row.
        self.groups: list[MatrixGroup] = group_matrices(
            targets,
            self.config.rank,
            self.config.moment_torch_dtype if beta1 else None,
            clip_rank=self.config.clip_rank,
            second_moment_dtype=self.config.moment_torch_dtype if entry else None,
            grams=self.config.input_precondition == "gram",
            input_stats=self.config.input_scaling == "rms",
            side=self.config.sketch_side,
        )
        built: dict[str, MatrixSketch] = {}
        for group in self.groups:
            for i, (name, linear) in enumerate(zip(group.names, group.linears, strict=True)):
                gram = (group.grams[i], group.gram_tokens[i : i + 1]) if group.grams is not None else (None, None)
                stats = {}
                if group.input_sq is not None and group.input_tokens is not None:
                    stats = {"input_sq": group.input_sq[i], "input_tokens": group.input_tokens[i : i + 1]}
                operands = self.config.sketch_operand_torch_dtype
                built[name] = MatrixSketch(
                    name, linear, group.rank, group.sketch[i], *gram, operands=operands, side=group.side, **stats
                )
        self.matrices: dict[str, MatrixSketch] = {}
        for name, linear in targets.items():
            linear.weight.requires_grad_(False)
            matrix = built[name]
            matrix.handle = linear.register_forward_hook(matrix.hook)
            self.matrices[name] = matrix
        views = {n: (g, i) for g in self.groups for i, n in enumerate(g.names)}
        self.row_stats: dict[str, torch.Tensor] = {n: views[n][0].row_stats[views[n][1]] for n in self.matrices}
        # The sketch-space first moment (``logra.beta1 > 0``): d_out × r per matrix (stored as ``moment_dtype``), in
        # the basis of the current projection; ``moment_age`` counts the merged updates it has averaged since it
        # started (bias correction).
        self.moments: dict[str, torch.Tensor] = (
            {n: views[n][0].moments[views[n][1]] for n in self.matrices} if beta1 else {}  # type: ignore[index]
        )
        self.moment_age = 0
        # ``logra.moment_reference_kl``: the moment's total weight ``c`` (``m / c`` is its bias-corrected value,
        # :func:`moment_mass`) and the KL the last merged update moved the policy, as its step controller priced it.
        self.moment_mass = 0.0
        self.moved_kl: float | None = None
        self.last_moment_decay = self.config.beta1  # the decay the last merged update's moment took (a diagnostic)
        # ``update_rule: adam``'s per-entry second moment (d_out × r per matrix, ``moment_dtype``), in the same basis;
        # ``second_age`` counts the merged updates it has averaged (bias correction).
        self.second_moments: dict[str, torch.Tensor] = (
            {n: views[n][0].second_moments[views[n][1]] for n in self.matrices} if entry else {}  # type: ignore[index]
        )
        self.second_age = 0
        # ``input_scaling: rms``: the EMA steps of input statistics taken so far (0: the scales are still ones).
        self.input_age = 0
        # The matrices in group order: how per-group values (k per group) line up with names.
        self._grouped_names = [n for g in self.groups for n in g.names]
        # What the proposal of this update will commit if merged: per group, (row statistics, first moments, second
        # moments).
        self._pending: list[tuple[torch.Tensor | None, ...]] | None = None
        # ``{group index: P Pᵀ}`` (float64, (k, r, r)) for the current update: propose and the guard in apply both
        # measure ``‖· P‖``.
        self._grams: dict[int, torch.Tensor] = {}
        # ``{group index: (‖W_i‖, the weights' (data pointer, version) pairs)}``: the norms the last merge left, when
        # it held the merged float64 values anyway (merge_stack_(norms=True)); reused while no weight has changed.
        self._merged_norms: dict[int, tuple[torch.Tensor, list[tuple[int, int]]]] = {}
        # The most sketch entries one slice of the update rule reads (see _group_direction).
        slices = RULE_SLICES if self.config.update_rule == "adam" else 1
        self._rule_entries = max(RULE_MIN_ENTRIES, sum(g.sketch.numel() for g in self.groups) // slices)
        self.dense = select_dense(model, self.config.dense_params, set(self.matrices))
        for p in self.dense.values():
            p.requires_grad_(True)
        # The dense Adam's moments (fp32, the local shard under FSDP) and its step count (= applied updates).
        self.dense_state: dict[str, dict[str, torch.Tensor]] = {
            n: {
                "exp_avg": torch.zeros_like(local_tensor(p).detach(), dtype=torch.float32),
                "exp_avg_sq": torch.zeros_like(local_tensor(p).detach(), dtype=torch.float32),
            }
            for n, p in self.dense.items()
        }
        self._install_projections()

    # ----------------------------------------------------------------------------------------------- hooks
    def detach(self) -> None:
        """Remove every sketch hook (weights stay frozen)."""
        for m in self.matrices.values():
            if m.handle is not None:
                m.handle.remove()
                m.handle = None

    def seed_for(self, name: str) -> int:
        """Projection seed of matrix ``name`` at the current update: that of ``(u // N)·N``, ``N = refresh_every``."""
        index = projection_index(self.update_index, self.config.refresh_every)
        return projection_seed(self.config.base_seed, index, name)

    def _install_projections(self, carry: bool = True) -> None:
        """Draw the projections of the current update where their seed changed, a group at a time; with ``carry``,
        the first moment follows each change (``momentum_transfer``: carried into the new basis, or reset)."""
        changed = False
        for group in self.groups:
            matrices = [self.matrices[n] for n in group.names]
            seeds = [self.seed_for(n) for n in group.names]
            fresh = [i for i, (seed, m) in enumerate(zip(seeds, matrices, strict=True)) if seed != m.seed]
            if not fresh:
                continue
            drawn = self._draw(group, [seeds[i] for i in fresh])
            packed = isinstance(drawn, PackedProjections)
            new: torch.Tensor | PackedProjections
            if len(fresh) == group.size:
                new = drawn
            elif isinstance(drawn, PackedProjections):  # a partial change (not produced by the seed rule today)
                assert group.packed is not None
                new = group.packed.replace_rows(fresh, drawn)
            else:  # likewise: keep the other rows' P
                assert group.projection is not None
                new = group.projection.clone()
                new[fresh] = drawn
            carried = [i for i in fresh if matrices[i].seed != -1]
            dense_pair: tuple[torch.Tensor, torch.Tensor] | None = None  # (old, new) P, built once if carried
            for kept, squared in ((group.moments, False), (group.second_moments, True)):
                if not carry or kept is None or not carried:
                    continue
                if self.config.momentum_transfer == "project":
                    if dense_pair is None:
                        dense_pair = (group.projections(), new.expand() if isinstance(new, PackedProjections) else new)
                    self._transfer(group, carried, *dense_pair, squared)
                elif len(carried) == group.size:
                    kept.zero_()
                else:
                    kept[carried] = 0
                changed = True
            del dense_pair
            if isinstance(new, PackedProjections):
                group.packed, group.projection = new, None
                fresh = list(range(group.size))  # every row reads the new packed stack
            else:
                group.projection = new
            bf16 = self.config.sketch_operands == "bfloat16"  # P = scale·signs: rademacher and hadamard (config)
            if bf16 and not packed:
                group.signs = self._signs(group)
                group.scales = new.abs().amax(dim=(1, 2)).tolist()  # one read per new basis (fixed: once a run)
                fresh = list(range(group.size))  # every row's signs view the new stack
            scale = sign_scale(self.config.distribution, group.rank, group.d_in) if bf16 and packed else None
            for i in fresh:
                if isinstance(new, PackedProjections):  # signs, if any, built from the draws at each read
                    matrices[i].set_packed_projection(new, i, seeds[i], scale)
                else:
                    matrices[i].set_stacked_projection(new, i, seeds[i], group.signs, group.scales)
                if group.input_scale is not None:
                    matrices[i].input_scale = group.input_scale[i]
        if changed and self.config.momentum_transfer == "reset":
            self._restart_moments()

    def _restart_moments(self) -> None:
        """The sketch-space moments start over (zeroed by the caller, or in a new basis): their bias corrections
        restart from the next update."""
        self.moment_age = self.second_age = 0
        self.moment_mass = 0.0

    def _horizon_step(self) -> tuple[float, float]:
        """``(decay, weight)`` of this update's first-moment step ``m ← decay·m + weight·S`` under
        ``logra.moment_reference_kl``: the decay over the distance the last merged update moved the policy
        (:func:`horizon_decay`) and the new sketch's weight ``1−β1`` (the moment's mass ``c`` normalizes it)."""
        cfg = self.config
        assert cfg.moment_reference_kl is not None
        return horizon_decay(cfg.beta1, self.moved_kl, cfg.moment_reference_kl), 1.0 - cfg.beta1

    @staticmethod
    def _signs(group: MatrixGroup) -> torch.Tensor:
        """The bf16 operand of the tensor-core sketch path: ``sign(P)``, or ``sign(P)·s`` with input scaling."""
        if group.input_scale is None:
            return group.projections().sign().to(torch.bfloat16)
        return scaled_signs(group.projections(), group.input_scale)

    def _fold_input_stats(self) -> None:
        """``input_scaling: rms``, after a merged update: its input statistics (summed over ranks with the sketches)
        join each matrix's EMA, and the next update's scales ``s`` are installed. When the first scales are set the
        sketch-space moments, formed in the unscaled basis, restart. Nothing is read to the host."""
        if self.config.input_scaling != "rms":
            return
        beta = self.config.input_scale_beta
        for group in self.groups:
            assert group.input_ema is not None and group.input_sq is not None and group.input_tokens is not None
            new = ema_mean_squares(group.input_ema, group.input_sq, group.input_tokens, beta)
            # A matrix whose statistics are not finite keeps its EMA (decided on the device: no host sync).
            finite = torch.isfinite(new).all(dim=-1, keepdim=True)
            group.input_ema.copy_(torch.where(finite, new, group.input_ema))
        self.input_age += 1
        self._install_input_scales()
        if self.input_age == 1:
            for group in self.groups:
                for kept in (group.moments, group.second_moments):
                    if kept is not None:
                        kept.zero_()
            self._restart_moments()

    def _install_input_scales(self) -> None:
        """Form every group's ``s`` from its EMA (a new tensor: a proposal keeps the scales it was made with) and
        point the hooks (and the bf16 path's signs) at it."""
        for group in self.groups:
            assert group.input_ema is not None
            if self.input_age == 0:  # no statistics yet: unscaled
                group.input_scale = torch.ones_like(group.input_ema)
            else:
                group.input_scale = input_scales(group.input_ema, self.input_age, self.config.input_scale_beta)
            if group.signs is not None:
                group.signs = self._signs(group)
            for i, name in enumerate(group.names):
                m = self.matrices[name]
                m.input_scale = group.input_scale[i]
                if group.signs is not None:
                    m.signs = group.signs[i]

    def _draw(self, group: MatrixGroup, seeds: list[int]) -> torch.Tensor | PackedProjections:
        """The projections of ``seeds`` at the group's shape, stacked ``(k, r, d_in)`` on its device (packed:
        their draws, ``logra.projection_storage``)."""
        cfg = self.config
        if cfg.projection_storage == "packed":
            return PackedProjections.draw(seeds, group.rank, group.d_in, cfg.distribution, device=group.device)
        return make_projections(seeds, group.rank, group.d_in, cfg.distribution, device=group.device)

    def _transfer(
        self, group: MatrixGroup, rows: list[int], old: torch.Tensor, new: torch.Tensor, squared: bool = False
    ) -> None:
        """Carry the first moments (``squared``: the per-entry second moments) of ``rows`` of the group from the
        projections ``old`` to ``new`` (in place)."""
        kept = group.second_moments if squared else group.moments
        assert kept is not None
        if len(rows) == group.size:
            kept.copy_(stack_transfer(kept, old, new, squared))
        else:
            kept[rows] = stack_transfer(kept[rows], old[rows], new[rows], squared)

    def sketches(self) -> dict[str, torch.Tensor]:
        """``{name: S}`` (views of the groups' stacks) — every matrix's sketch, in the model's order."""
        return {name: m.sketch for name, m in self.matrices.items()}

    def sketch_stacks(self) -> list[torch.Tensor]:
        """The sketches as stored: one ``(k, d_out, r)`` buffer per group, the buffers a data-parallel strategy
        all-reduces before :meth:`propose` (one call each). Together they hold every matrix's ``S`` once; with
        ``input_precondition: gram`` they are followed by each group's Grams ``(k, r, r)`` and token counts ``(k,)``,
        and with ``input_scaling: rms`` by each group's sums of squared inputs ``(k, d_in)`` and token counts
        ``(k,)``, summed over ranks alike."""
        stacks = [group.sketch for group in self.groups]
        for group in self.groups:
            if group.grams is not None:
                stacks += [group.grams, group.gram_tokens]
        for group in self.groups:
            if group.input_sq is not None and group.input_tokens is not None:
                stacks += [group.input_sq, group.input_tokens]
        return stacks

    def zero_sketches(self) -> None:
        """Reset every ``S`` to zero (start of an update), and the dense parameters' gradients."""
        for group in self.groups:
            group.sketch.zero_()
            if group.grams is not None:
                group.grams.zero_()
                group.gram_tokens.zero_()
            if group.input_sq is not None and group.input_tokens is not None:
                group.input_sq.zero_()
                group.input_tokens.zero_()
        for p in self.dense.values():
            p.grad = None

    # ------------------------------------------------------------------------------------------- proposal
    def weight_norms(self) -> list[torch.Tensor]:
        """``‖W_i‖`` over the local rows, one ``(k,)`` float64 tensor per group (on the device; group order).

        A group's norms from its last merge are reused while its weights are the ones merged: same storage, and no
        in-place write through the parameters since (their version counters, which ``load_state_dict`` and any
        ``copy_`` advance). Otherwise they are computed from the weights (:func:`stack_weight_norms`), the same bits.
        """
        out = []
        for index, group in enumerate(self.groups):
            weights = [local_tensor(linear.weight) for linear in group.linears]
            cached = self._merged_norms.get(index)
            if cached is not None and cached[1] == weight_versions(weights):
                out.append(cached[0])
            else:  # in the merge's layout (Wᵀ on the outputs' side): the float64 sums of its norms, in its order
                out.append(stack_weight_norms([oriented(w.detach(), group.side) for w in weights]))
        return out

    def weight_sq_norms(self) -> dict[str, float]:
        """``‖W_i‖²`` of every selected matrix, over the rows this process holds (local shards when sharded)."""
        (norms,) = host_values(self.weight_norms())
        by_name = dict(zip(self._grouped_names, norms, strict=True))
        return {name: by_name[name] ** 2 for name in self.matrices}

    def _gram(self, index: int) -> torch.Tensor:
        """``P Pᵀ`` (float64, ``(k, r, r)``) of group ``index``'s projections, formed once per update and reused."""
        gram = self._grams.get(index)
        if gram is None:
            exact = self.config.distribution != "gaussian"
            group = self.groups[index]
            projections = group.projections()
            gram = self._grams[index] = stack_grams(projections, exact=exact, col_scales=group.input_scale)
        return gram

    def _lifted_sq_norms(self, stacks: list[torch.Tensor]) -> list[torch.Tensor]:
        """``‖D_i P_i‖²`` of a stack of factors per group (any float dtype), one ``(k,)`` float64 tensor each."""
        return [stack_lifted_sq_norms(d, self._gram(k)) for k, d in enumerate(stacks)]

    def _sketch_finite(self) -> list[torch.Tensor]:
        """Whether every entry of each ``S`` is finite: one ``(k,)`` bool tensor per group."""
        return [torch.isfinite(group.sketch).all(dim=(1, 2)) for group in self.groups]

    def _by_name(self, values: list[float]) -> dict[str, float]:
        """Per-matrix values in group order (as read from the groups' tensors) → ``{name: value}`` in model order."""
        by_name = dict(zip(self._grouped_names, values, strict=True))
        return {name: by_name[name] for name in self.matrices}

    @traced_call("logra.propose")
    def propose(self, grad_scale: float = 1.0, weight_sq_norms: Mapping[str, float] | None = None) -> Proposal | None:
        """Form the proposal from the accumulated sketches, or skip the update and return ``None``.

        Arguments:
            grad_scale: multiplies every ``S`` first (e.g. ``1 / tokens`` for token-mean normalisation).
            weight_sq_norms: ``{name: ‖W_i‖²}`` summed over ranks when weights are sharded; default: local.
        """
        cfg = self.config
        step = self.num_applied + 1
        self._grad_scale = grad_scale
        self._next_parts = self._kept_gains()
        steps = self._directions(step, grad_scale)
        grads = {n: p.grad for n, p in self.dense.items() if p.grad is not None}
        # Everything Python decides on below, read from the device in one transfer (see logra_pl.sketch.host).
        finite, lifted_values, norms = host_values(
            self._sketch_finite() + [torch.isfinite(local_tensor(g)).all() for g in grads.values()],
            self._lifted_sq_norms([step[0] for step in steps]),
            self.weight_norms() if weight_sq_norms is None else [],
        )
        ok = self._by_name(finite[: len(self.matrices)]) | dict(zip(grads, finite[len(self.matrices) :], strict=True))
        bad = [name for name, fine in ok.items() if not fine]
        if bad:
            self.skip(f"non-finite sketch or gradient in {len(bad)} tensors, e.g. {bad[0]!r}")
            return None
        lifted = self._by_name(lifted_values)
        if weight_sq_norms is None:
            w_sq = {name: norm**2 for name, norm in self._by_name(norms).items()}
        else:
            w_sq = dict(weight_sq_norms)
        if cfg.step_mode in ("lr", "adam"):
            lr = cfg.lr * lr_factor(self.num_applied, cfg.lr_warmup_steps, cfg.lr_decay_steps, cfg.lr_min_ratio)
            scales = dict.fromkeys(self.matrices, lr)
        elif cfg.ratio_scope == "global":
            scales = dict.fromkeys(
                self.matrices, ratio_scale(sum(w_sq.values()), sum(lifted.values()), cfg.update_ratio)
            )
        else:
            scales = {n: ratio_scale(w_sq[n], lifted[n], cfg.update_ratio) for n in self.matrices}
        if not all(math.isfinite(c) for c in scales.values()) or not all(math.isfinite(v) for v in lifted.values()):
            self.skip(f"non-finite update scale (Σ‖DP‖²={sum(lifted.values())})")
            return None
        stacks = [
            FactorStack(tuple(group.names), scaled_(d, [scales[n] for n in group.names]))
            for group, (d, *_) in zip(self.groups, steps, strict=True)
        ]
        rows = {name: (st, g, i) for st, g in zip(stacks, self.groups, strict=True) for i, name in enumerate(st.names)}
        matrices = {
            name: MatrixProposal(
                seed=m.seed,
                stack=rows[name][0],
                row=rows[name][2],
                projections=rows[name][1].basis,
                input_scales=rows[name][1].input_scale,
            )
            for name, m in self.matrices.items()
        }
        self._pending = [tuple(step[1:]) for step in steps]
        # The proposal's first-order gain at α = 1, per matrix (read with apply's other values: no sync here).
        self._unit_gains = [factor_gain(g.sketch, st.tensor) for g, st in zip(self.groups, stacks, strict=True)]
        scale = next(iter(scales.values())) if len(set(scales.values())) == 1 else float("nan")
        return Proposal(
            matrices=matrices,
            update_index=self.update_index,
            base_seed=cfg.base_seed,
            rank=cfg.rank,
            clip_rank=cfg.clip_rank,
            distribution=cfg.distribution,
            refresh=cfg.refresh,
            refresh_every=cfg.refresh_every,
            factor_dtype=cfg.factor_torch_dtype,
            scale=scale,
            stats={"weight_sq_norm": sum(w_sq.values()), "direction_sq_norm": sum(lifted.values())},
            weight_sq_norms=w_sq,
            dense=self._dense_proposals(step, grad_scale),
            stacks=stacks,
            sketch_side=cfg.sketch_side,
        )

    def _directions(self, step: int, grad_scale: float) -> list[GroupStep]:
        """Per group ``(D, v_new, m_new)``: the direction of every ``grad_scale · S`` of the stack, on the device.

        RowAdam, Adam-style (``step_mode: adam``) or SGD, from ``S`` or, with ``beta1 > 0``, from the bias-corrected
        first moment, each formula once on the group's stack (algorithm.md §4). Nothing is committed: the new row
        statistics and moments wait until the update is merged.
        """
        return [self._group_direction(group, step, grad_scale) for group in self.groups]

    def _group_direction(self, group: MatrixGroup, step: int, grad_scale: float) -> GroupStep:
        """``(D, v_new, m_new, V_new)`` of one group, by slices of whole matrices with ``update_rule: adam``.

        Every formula of a rule reads one matrix at a time (row statistics, per-matrix means and norms), so a slice
        gives its matrices' values bit for bit as the whole stack would. Per-entry Adam forms about six stack-sized
        fp32 temporaries (the scaled sketch, the new moments, ``m̂``, the quotient); on a slice of at most
        ``1/RULE_SLICES`` of the model's sketch entries (at least one matrix, at least ``RULE_MIN_ENTRIES``) they stay
        a small part of the state instead of adding several times a group's sketch to the update's peak. Each extra
        slice costs its own operator calls (about 90), so slices are few and only the rule that needs them has them.
        """
        k = group.size
        per = max(1, self._rule_entries // max(1, group.sketch.shape[1:].numel()))
        if per >= k:
            grams = (group.grams, group.gram_tokens) if group.grams is not None else None
            return self._rule(
                group.sketch, group.row_stats, group.moments, step, grad_scale, group.second_moments, grams
            )
        out: list[torch.Tensor | None] | None = None
        for lo in range(0, k, per):
            part = self._rule_slice(group, slice(lo, min(k, lo + per)), step, grad_scale)
            if out is None:  # the results' dtypes are the rule's: allocated once its first slice has run
                out = [None if t is None else t.new_empty((k, *t.shape[1:])) for t in part]
            for whole, t in zip(out, part, strict=True):
                if whole is not None:
                    whole[lo : lo + len(t)].copy_(t)  # type: ignore[arg-type]
        assert out is not None
        return out[0], out[1], out[2], out[3]

    def _rule_slice(self, group: MatrixGroup, rows: slice, step: int, grad_scale: float) -> GroupStep:
        """:meth:`_rule` on the matrices ``rows`` of ``group`` (views of its stacks: nothing copied)."""
        grams = (group.grams[rows], group.gram_tokens[rows]) if group.grams is not None else None
        return self._rule(
            group.sketch[rows],
            group.row_stats[rows],
            None if group.moments is None else group.moments[rows],
            step,
            grad_scale,
            None if group.second_moments is None else group.second_moments[rows],
            grams,
        )

    def _rule(
        self,
        sketch: torch.Tensor,
        row_stats: torch.Tensor,
        moments: torch.Tensor | None,
        step: int,
        grad_scale: float,
        second_moments: torch.Tensor | None = None,
        grams: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> GroupStep:
        """The update rule on ``S`` (one matrix or a stack): ``(D, v_new, m_new, V_new)``. ``grams``: the projected
        inputs' Grams and token counts (``input_precondition: gram``), which right-multiply the numerator."""
        cfg = self.config
        s = sketch * grad_scale if grad_scale != 1.0 else sketch
        numerator = moment = None
        if moments is not None and cfg.moment_reference_kl is not None:
            decay, weight = self._horizon_step()
            moment = first_moment(s, moments, decay, weight)
            numerator = moment / moment_mass(self.moment_mass, decay, weight)
        elif moments is not None:
            moment = first_moment(s, moments, cfg.beta1)
            numerator = bias_corrected(moment, cfg.beta1, self.moment_age + 1)
        if grams is not None:
            numerator = gram_preconditioned(s if numerator is None else numerator, *grams, cfg.gram_damping)
        if moment is not None and moments is not None:
            # Held until the merge commits it, in the dtype it is stored in (the commit rounds to it anyway): a bf16
            # moment waits at half the bytes of its fp32 value.
            moment = moment.to(moments.dtype)
        if cfg.update_rule == "adam":
            assert second_moments is not None
            d, second = entry_adam_direction(s, second_moments, self.second_age + 1, cfg.beta2, cfg.eps, numerator)
            return d, None, moment, second.to(second_moments.dtype)  # likewise
        if cfg.step_mode == "adam":
            d, v = adam_direction(s, row_stats, step, cfg.beta2, cfg.eps, numerator)
            return d, v, moment, None
        if cfg.update_rule == "rowadam":
            d, v = rowadam_direction(s, row_stats, step, cfg.beta2, cfg.eps, numerator)
            return d, v, moment, None
        return (sgd_direction(s) if numerator is None else numerator), None, moment, None

    def _dense_proposals(self, step: int, grad_scale: float) -> dict[str, DenseProposal]:
        """Adam steps of the dense parameters at α = 1 (torch's AdamW without weight decay, step ``step``)."""
        cfg = self.config
        beta1, beta2 = cfg.dense_betas
        out: dict[str, DenseProposal] = {}
        for name, p in self.dense.items():
            if p.grad is None:
                continue
            g = local_tensor(p.grad).detach().to(torch.float32) * grad_scale
            st = self.dense_state[name]
            m = st["exp_avg"] * beta1 + g * (1 - beta1)
            v = st["exp_avg_sq"] * beta2 + g.square() * (1 - beta2)
            denom = (v.sqrt() / math.sqrt(1 - beta2**step)).add_(cfg.dense_eps)
            delta = (m / denom) * (-cfg.dense_lr / (1 - beta1**step))
            out[name] = DenseProposal(delta=delta, exp_avg=m, exp_avg_sq=v)
        return out

    @traced_call("logra.apply")
    def apply(
        self, proposal: Proposal, alpha: float | None = None, max_relative_update: float | None = None
    ) -> Payload | None:
        """Merge ``proposal`` at multiplier ``alpha`` (default ``proposal.alpha``) and advance to the next update.

        Returns the merged payload (what a rollout engine must receive), or ``None`` when nothing was merged:
        the factors are not finite (a counted skip), or the divergence guard rejects the update — it is larger
        than ``max_relative_update`` of the weights, or could make them non-finite (a counted rejection; see
        :mod:`logra_pl.sketch.guard`). Either way the weights are untouched.
        """
        if proposal.update_index != self.update_index:
            raise ValueError(
                f"proposal for update {proposal.update_index} applied at update {self.update_index}: "
                "form a new proposal with propose()"
            )
        if proposal.veto is not None:
            self.skip(proposal.veto)
            return None
        if self.config.moment_reference_kl is not None and proposal.priced_kl is None:
            raise LoGRAConfigError(
                "logra.moment_reference_kl decays the first moment by the KL each update moves the policy, and this "
                "update was not priced: add a step controller that prices every update (PredictedKLControl), or set "
                "logra.moment_reference_kl: null"
            )
        payload = proposal.to_payload(alpha)
        if not math.isfinite(payload.alpha):
            self.skip(f"non-finite factors at alpha={payload.alpha}")
            return None
        new_dense = {
            n: (local_tensor(self.dense[n]).detach().float() + payload.alpha * d.delta).to(self.dense[n].dtype)
            for n, d in proposal.dense.items()
        }
        factor_stacks = [stacked_factors(payload, group.names) for group in self.groups]
        # The three checks below and the update's first-order gain, read from the device in one transfer (see
        # logra_pl.sketch.host).
        factors_finite, update_values, dense_finite, norms, gains, next_sketched, next_dense = host_values(
            [torch.isfinite(f).all(dim=(1, 2)) for f in factor_stacks],
            self._lifted_sq_norms(factor_stacks),
            [torch.isfinite(v).all() for v in new_dense.values()],
            [] if proposal.weight_sq_norms else self.weight_norms(),
            self._unit_gains + self._dense_gains(proposal, payload.alpha),
            *(self._next_parts or ([], [])),
        )
        if not all(factors_finite):
            self.skip(f"non-finite factors at alpha={payload.alpha}")
            return None
        update_by_name = self._by_name(update_values)
        update_sq = {name: update_by_name[name] for name in payload.factors}
        w_sq = proposal.weight_sq_norms or {name: norm**2 for name, norm in self._by_name(norms).items()}
        self.last_update_sq_norm = sum(update_sq.values())
        self.last_relative_update = relative_update(w_sq, update_sq)
        dtype = next(iter(self.matrices.values())).module.weight.dtype
        reason = rejection_reason(w_sq, update_sq, max_relative_update, dtype)
        if reason is not None:
            self.reject(reason)
            return None
        if not all(dense_finite):
            self.reject("the dense parameters' step would make them non-finite")
            return None
        # The merge reuses the projections drawn for this update (each P is drawn once per update).
        for group, factors in zip(self.groups, factor_stacks, strict=True):
            self._merge(group, factors)
        with torch.no_grad():
            for n, value in new_dense.items():
                local_tensor(self.dense[n]).copy_(value)
                self.dense_state[n]["exp_avg"].copy_(proposal.dense[n].exp_avg)
                self.dense_state[n]["exp_avg_sq"].copy_(proposal.dense[n].exp_avg_sq)
        # Engines receive the new values whole (FSDP shards gathered: a collective, on every rank).
        payload.dense = {n: full_tensor(self.dense[n]).detach().clone() for n in new_dense}
        if self._pending is not None:
            for group, (v, moment, second) in zip(self.groups, self._pending, strict=True):
                if v is not None:
                    group.row_stats.copy_(v)
                if moment is not None:
                    group.moments.copy_(moment)  # type: ignore[union-attr]  # rounded to the storage dtype here
                if second is not None:
                    group.second_moments.copy_(second)  # type: ignore[union-attr]  # likewise
            if self.moments:
                self.moment_age += 1
                if self.config.moment_reference_kl is not None:
                    decay, weight = self._horizon_step()
                    self.moment_mass = moment_mass(self.moment_mass, decay, weight)
                    self.last_moment_decay = decay
            if self.second_moments:
                self.second_age += 1
        sketched = len(self.matrices)
        self.last_gain = self._grad_scale * payload.alpha * sum(gains[:sketched])
        self.last_dense_gain = sum(gains[sketched:])
        self._settle_next_gain(next_sketched, next_dense)
        if self.keep_step:  # on the basis just merged on (a fold or refresh below replaces it, never overwrites it)
            self._kept = KeptStep(
                factor_stacks,
                [group.basis for group in self.groups],
                [group.input_scale for group in self.groups],
                {n: payload.alpha * d.delta for n, d in proposal.dense.items()},
            )
        self.num_applied += 1
        self.moved_kl = proposal.priced_kl  # the next moment's decay reads it (logra.moment_reference_kl)
        self._fold_input_stats()
        self._advance()
        return payload

    def _dense_gains(self, proposal: Proposal, alpha: float) -> list[torch.Tensor]:
        """The dense parameters' part of the update's first-order gain: ``−⟨g, α·Δ⟩`` of each one's local shard (0-dim
        float64 tensors, ``grad_scale`` applied)."""
        out = []
        for name, step in proposal.dense.items():
            grad = self.dense[name].grad
            if grad is not None:
                g = local_tensor(grad).detach().reshape(-1).to(torch.float64)
                out.append(-self._grad_scale * alpha * torch.dot(g, step.delta.reshape(-1).to(torch.float64)))
        return out

    def _merge(self, group: MatrixGroup, factors: torch.Tensor) -> None:
        """``W ← W − F P`` on the local rows of the group's matrices (``factors``: the payload's ``(k, d_out, r)``);
        on the outputs' side ``Wᵀ ← Wᵀ − F R`` (:mod:`~logra_pl.sketch.side`). Keeps the merged weights' norms when
        the merge gives them (see :meth:`weight_norms`)."""
        index = self.groups.index(group)
        self._merged_norms.pop(index, None)
        params = [local_tensor(linear.weight) for linear in group.linears]
        weights = [oriented(p.data, group.side) for p in params]
        held = params[0].shape[0]  # the rows of W this process holds (a dim-0 shard under FSDP)
        offsets = [int(self.row_offsets.get(name, 0)) for name in group.names]
        projections = group.projections()  # packed: built for this merge only
        if len(set(offsets)) == 1:  # one offset per group under FSDP (same shape, same mesh)
            norms = merge_stack_(
                weights,
                factors,
                projections,
                self.config.distribution,
                **merge_span((offsets[0], offsets[0] + held), None, group.side),
                chunk_rows=self.config.merge_chunk_rows,
                norms=True,
                col_scales=group.input_scale,
            )
            if norms is not None:
                self._merged_norms[index] = (norms, weight_versions(params))
            return
        for offset in dict.fromkeys(offsets):
            rows = [i for i, o in enumerate(offsets) if o == offset]
            merge_stack_(
                [weights[i] for i in rows],
                factors[rows],
                projections[rows],
                self.config.distribution,
                **merge_span((offset, offset + held), None, group.side),
                chunk_rows=self.config.merge_chunk_rows,
                col_scales=None if group.input_scale is None else group.input_scale[rows],
            )

    def step(self, grad_scale: float = 1.0, alpha: float | None = None) -> Payload | None:
        """:meth:`propose` then :meth:`apply`; ``None`` when the update was skipped."""
        proposal = self.propose(grad_scale)
        return None if proposal is None else self.apply(proposal, alpha)

    def skip(self, reason: str) -> None:
        """Drop this update: nothing merged, row statistics unchanged, the event counted, next projections drawn."""
        self.num_skipped += 1
        self.last_skip_reason = reason
        self.last_gain = self.last_dense_gain = 0.0
        self._settle_next_gain()
        self._advance()

    def reject(self, reason: str) -> None:
        """The divergence guard refused this update: like :meth:`skip`, but counted in ``num_rejected``."""
        self.num_rejected += 1
        self.last_skip_reason = reason
        self.last_gain = self.last_dense_gain = 0.0
        self._settle_next_gain()
        self._advance()

    def _kept_gains(self) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """The kept step's gain on this update's raw sketches and dense gradients (on the device, no sync), or None
        when no step is kept or the basis changed since it was merged (next_gain.py)."""
        kept = self._kept
        if kept is None or not kept.same_basis([g.basis for g in self.groups], [g.input_scale for g in self.groups]):
            return None
        grads = {n: None if p.grad is None else local_tensor(p.grad).detach() for n, p in self.dense.items()}
        return kept.sketched_gains([g.sketch for g in self.groups]), kept.dense_gains(grads)

    def _settle_next_gain(self, sketched: list[float] | None = None, dense: list[float] | None = None) -> None:
        """Set :attr:`next_gain` and :attr:`next_dense_gain` from this update's measure (read here when the caller
        did not read it with its own values): ``grad_scale`` applied; None when not measured or not finite."""
        parts, self._next_parts = self._next_parts, None
        self.next_gain, self.next_dense_gain = None, 0.0
        if parts is None:
            return
        if sketched is None or dense is None:
            sketched, dense = host_values(*parts)
        if all(math.isfinite(v) for v in (*sketched, *dense)):
            self.next_gain = self._grad_scale * sum(sketched)
            self.next_dense_gain = self._grad_scale * sum(dense)

    def _advance(self) -> None:
        self._pending = None
        self._unit_gains = []
        self._grams.clear()
        self.update_index += 1
        self.zero_sketches()
        self._install_projections()

    # ------------------------------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """All LoGRA state: config (base seed included), update index, counters and row statistics."""
        return {
            "format": STATE_FORMAT,
            "config": self.config.to_dict(),
            "update_index": self.update_index,
            "num_applied": self.num_applied,
            "num_skipped": self.num_skipped,
            "num_rejected": self.num_rejected,
            "row_stats": {name: v.detach().cpu().clone() for name, v in self.row_stats.items()},
            "dense_state": {
                n: {k: v.detach().cpu().clone() for k, v in st.items()} for n, st in self.dense_state.items()
            },
            "moments": {name: m.detach().cpu().clone() for name, m in self.moments.items()},
            "moment_age": self.moment_age,
            "second_moments": {name: v.detach().cpu().clone() for name, v in self.second_moments.items()},
            "second_age": self.second_age,
            **self._input_state(),
            **self._horizon_state(),
        }

    def _horizon_state(self) -> dict[str, Any]:
        """``logra.moment_reference_kl``'s state (nothing otherwise: other checkpoints keep their keys): the moment's
        mass and the last merged update's price, from which the next decay and bias correction follow bit for bit."""
        if self.config.moment_reference_kl is None:
            return {}
        return {"moment_mass": self.moment_mass, "moved_kl": self.moved_kl}

    def _input_state(self) -> dict[str, Any]:
        """``input_scaling: rms``'s state (nothing otherwise: other checkpoints keep their keys): each matrix's EMA
        of input mean squares and the EMA's age; the scales are recomputed from them, bit for bit."""
        if self.config.input_scaling != "rms":
            return {}
        ema = {n: g.input_ema[i].detach().cpu().clone() for g in self.groups for i, n in enumerate(g.names)}  # type: ignore[index]
        return {"input_ema": ema, "input_age": self.input_age}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; refuses a checkpoint whose structural config or matrices differ."""
        if state.get("format") != STATE_FORMAT:
            raise LoGRAConfigError(f"not a LoGRA sketcher state (format {state.get('format')!r})")
        diff = self.config.structural_mismatch(state["config"])
        if diff:
            detail = "; ".join(f"{k}: checkpoint {a!r} vs current {b!r}" for k, (a, b) in diff.items())
            raise LoGRAConfigError(
                f"LoGRA checkpoint was written with a different config ({detail}): resume with the checkpoint's "
                "values or start a fresh run"
            )
        saved = state["row_stats"]
        if set(saved) != set(self.row_stats):
            extra, absent = sorted(set(saved) - set(self.row_stats)), sorted(set(self.row_stats) - set(saved))
            raise LoGRAConfigError(
                f"LoGRA checkpoint matrices differ from this model's: only in checkpoint {extra[:3]}, "
                f"only in model {absent[:3]}"
            )
        for name, v in saved.items():
            if tuple(v.shape) != tuple(self.row_stats[name].shape):
                raise LoGRAConfigError(
                    f"row statistic of {name!r} has shape {tuple(v.shape)} in the checkpoint but "
                    f"{tuple(self.row_stats[name].shape)} here: another model?"
                )
        for name, v in saved.items():
            self.row_stats[name].copy_(v)
        dense = state.get("dense_state", {})
        if set(dense) != set(self.dense_state):
            raise LoGRAConfigError(
                f"LoGRA checkpoint's dense parameters {sorted(dense)[:3]} differ from this run's "
                f"{sorted(self.dense_state)[:3]}: resume with the checkpoint's logra.dense_params"
            )
        for name, st in dense.items():
            for key, v in st.items():
                self.dense_state[name][key].copy_(v)
        self.update_index = int(state["update_index"])
        self.num_applied = int(state["num_applied"])
        self.num_skipped = int(state["num_skipped"])
        self.num_rejected = int(state.get("num_rejected", 0))
        self._pending = None
        self._grams.clear()
        self._merged_norms.clear()
        self.zero_sketches()
        self._install_projections(carry=False)  # the saved moments are already in this update's basis
        moments = state.get("moments", {})
        if set(moments) != set(self.moments):
            raise LoGRAConfigError(
                f"LoGRA checkpoint holds first moments for {len(moments)} matrices, this run needs "
                f"{len(self.moments)} (logra.beta1 = {self.config.beta1}): resume with the checkpoint's logra.beta1"
            )
        for name, moment in moments.items():
            self.moments[name].copy_(moment)
        self.moment_age = int(state.get("moment_age", 0))
        # A checkpoint from before the horizon in KL: the constant-β1 mass 1 − β1^a it implied, no KL recorded.
        self.moment_mass = float(state.get("moment_mass", 1.0 - self.config.beta1**self.moment_age))
        moved = state.get("moved_kl")
        self.moved_kl = None if moved is None else float(moved)
        second = state.get("second_moments", {})
        if set(second) != set(self.second_moments):
            raise LoGRAConfigError(
                f"LoGRA checkpoint holds per-entry second moments for {len(second)} matrices, this run needs "
                f"{len(self.second_moments)} (logra.update_rule = {self.config.update_rule!r}): resume with the "
                "checkpoint's logra.update_rule"
            )
        for name, value in second.items():
            self.second_moments[name].copy_(value)
        self.second_age = int(state.get("second_age", 0))
        if self.config.input_scaling == "rms":
            ema = state.get("input_ema", {})
            if set(ema) != set(self.matrices):
                raise LoGRAConfigError(
                    f"LoGRA checkpoint holds input statistics for {len(ema)} matrices, this run needs "
                    f"{len(self.matrices)} (logra.input_scaling: rms)"
                )
            for group in self.groups:
                assert group.input_ema is not None
                for i, name in enumerate(group.names):
                    group.input_ema[i].copy_(ema[name])
            self.input_age = int(state["input_age"])
            self._install_input_scales()


def weight_versions(weights: list[torch.Tensor]) -> list[tuple[int, int]]:
    """``(data pointer, version counter)`` of each weight: both stay the same while nothing writes the weight in
    place through it (writes through ``.data`` are not counted: the sketcher's merge is the only one)."""
    return [(w.data_ptr(), w._version) for w in weights]


def scaled_(directions: torch.Tensor, scales: list[float]) -> torch.Tensor:
    """``D_i ← c_i · D_i`` in place on a stack (or one matrix with one scale); returns it.

    One scale for all multiplies by the Python float, as one matrix's ``D.mul_(c)`` does (torch rounds ``c`` to
    float32 for a float32 tensor); several multiply by their float32 values, the same products entry for entry.
    """
    if len(set(scales)) == 1:
        return directions.mul_(scales[0])
    factor = torch.tensor(scales, dtype=torch.float32, device=directions.device)
    return directions.mul_(factor.view(-1, *([1] * (directions.dim() - 1))))


def select_dense(model: nn.Module, patterns: tuple[str, ...], targets: set[str]) -> dict[str, nn.Parameter]:
    """``{canonical name: parameter}`` matching any glob in ``patterns`` (never a target matrix's weight).

    A pattern that matches nothing is an error naming it, so a typo does not silently train nothing.
    """
    if not patterns:
        return {}
    named = named_tensors(model)
    out: dict[str, nn.Parameter] = {}
    for pattern in patterns:
        hits = [n for n in named if fnmatch.fnmatchcase(n, pattern) and n.removesuffix(".weight") not in targets]
        if not hits:
            raise LoGRAConfigError(
                f"logra.dense_params pattern {pattern!r} matches no parameter outside the sketched matrices; "
                f"names look like {sorted(named)[:3]}"
            )
        out.update({n: named[n] for n in hits})
    return out
