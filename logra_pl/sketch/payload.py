"""The proposal and its compact payload (algorithm.md §5, §9): one object that is probed, merged and shipped.

A :class:`Proposal` holds, per selected matrix, the fp32 update factor ``U`` (d_out × r) and the seed of its
projection, plus the step multiplier ``alpha`` (nominally 1; the KL controller may change it). Turning it into
a :class:`Payload` rounds ``U·α`` to ``factor_dtype`` (bf16): that payload is what the trainer merges *and*
what the rollout engine receives, through the same :func:`apply_payload`, so both hold identical weights.
The payload is ``O(d_out·r)`` per matrix plus a few integers, instead of ``d_out·d_in``.

On the outputs' side (``logra.sketch_side: outputs``, :mod:`~logra_pl.sketch.side`) every ``U`` is ``d_in × r``, every
projection ``R`` is ``r × d_out`` and the merge is ``Wᵀ ← Wᵀ − F R``: the payload's header says so, and every receiver
merges through the same functions.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import nn

from logra_pl.sketch.config import matrix_rank, resolve_refresh_every
from logra_pl.sketch.merge import local_tensor, merge_stack_
from logra_pl.sketch.projection import PackedProjections, make_projections, projection_index, projection_seed
from logra_pl.sketch.side import INPUTS, OUTPUTS, merge_span, oriented, sketch_dims
from logra_pl.sketch.targets import canonical_name

PAYLOAD_FORMAT = "logra-pl/payload/v1"
DENSE_PREFIX = "dense::"  # safetensors names of dense parameter values in a serialized payload
SCALE_PREFIX = "scale::"  # safetensors names of per-column input scales (logra.input_scaling: rms)


@dataclass
class FactorStack:
    """Factors of same-shaped matrices stacked along a first dimension: ``tensor[i]`` belongs to ``names[i]``.

    The sketcher forms its factors one group of matrices at a time (:mod:`logra_pl.sketch.groups`); a stack lets
    the rounding to the payload dtype and the merge run once per group. Each matrix's own factor (in
    :attr:`Proposal.matrices` or :attr:`Payload.factors`) is a view of its row.
    """

    names: tuple[str, ...]
    tensor: torch.Tensor

    def views(self) -> dict[str, torch.Tensor]:
        """``{name: its row of the stack}`` (views, no copy)."""
        return dict(zip(self.names, self.tensor.unbind(0), strict=True))

    def holds(self, factors: Mapping[str, torch.Tensor]) -> bool:
        """Whether every ``factors[name]`` of the stack is still its row (not replaced since the stack was made)."""
        t = self.tensor
        step = t.stride(0) * t.element_size()
        return all(
            name in factors
            and factors[name].data_ptr() == t.data_ptr() + i * step
            and factors[name].shape == t.shape[1:]
            and factors[name].dtype == t.dtype
            for i, name in enumerate(self.names)
        )


class StackedFactors(MutableMapping[str, torch.Tensor]):
    """``{name: factor}`` whose factors are rows of :class:`FactorStack` s, each row viewed when first read.

    A payload of the grouped sketch step holds its factors this way: iterating names, checking membership and
    handing a whole stack to the merge (:func:`stacked_factors`) take no per-matrix view. Setting a name stores that
    tensor instead (it is then no longer its stack's row).

    Arguments:
        stacks: the stacks; their names, in order, are the mapping's keys.
        extra: further ``{name: factor}`` not in a stack.
        order: the keys in this order (e.g. the model's); default: the stacks' names, then ``extra``'s.
    """

    def __init__(
        self,
        stacks: list[FactorStack],
        extra: Mapping[str, torch.Tensor] | None = None,
        order: list[str] | None = None,
    ) -> None:
        self._rows: dict[str, tuple[FactorStack, int]] = {
            name: (st, i) for st in stacks for i, name in enumerate(st.names)
        }
        extra = dict(extra or {})
        keys = order if order is not None else [*self._rows, *extra]
        if sorted(keys) != sorted([*self._rows, *extra]):
            raise ValueError("StackedFactors: order must list every stacked and extra name once")
        self._tensors: dict[str, torch.Tensor | None] = {name: extra.get(name) for name in keys}

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._tensors[name]
        if tensor is None:
            st, row = self._rows[name]
            tensor = self._tensors[name] = st.tensor[row]
        return tensor

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        self._rows.pop(name, None)
        self._tensors[name] = value

    def __delitem__(self, name: str) -> None:
        self._rows.pop(name, None)
        del self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def stack_of(self, names: list[str]) -> torch.Tensor | None:
        """The stack whose rows are exactly the factors of ``names``, in this order, or ``None``."""
        rows = [self._rows.get(name) for name in names]
        if not rows or rows[0] is None:
            return None
        st = rows[0][0]
        same = all(r is not None and r[0] is st and r[1] == i for i, r in enumerate(rows))
        return st.tensor if same and len(st.names) == len(names) else None

    def __repr__(self) -> str:
        return f"StackedFactors({list(self._tensors)})"


class MatrixProposal:
    """The proposed update of one matrix: ``ΔW = −α · U P`` with ``P`` rebuilt from ``seed`` (``−α · U P diag(s)``
    with input scaling).

    Arguments:
        factor: ``U``, fp32, ``(d_out, r)``. Or leave it out and pass ``stack`` and ``row``: ``U`` is then row
            ``row`` of a group's stacked factors, viewed when first read (the sketcher's own steps read the stack).
        seed: the seed of ``P``.
        projection: ``P``, fp32, ``(r, d_in)``: kept for probing; never serialised. Or ``projections``: the group's
            ``(k, r, d_in)`` stack, of which ``P`` is row ``row``, viewed when first read (or the group's
            :class:`~logra_pl.sketch.projection.PackedProjections`, whose row is built at each read).
        input_scales: the group's ``(k, d_in)`` per-column scales ``s`` (``logra.input_scaling: rms``), of which
            this matrix's is row ``row``; ``None``: unscaled.
    """

    def __init__(
        self,
        factor: torch.Tensor | None = None,
        seed: int = -1,
        projection: torch.Tensor | None = None,
        *,
        stack: FactorStack | None = None,
        row: int = 0,
        projections: torch.Tensor | PackedProjections | None = None,
        input_scales: torch.Tensor | None = None,
    ) -> None:
        if factor is None and stack is None:
            raise ValueError("a MatrixProposal needs its factor, or the stack and row that hold it")
        self._factor = factor
        self.stack = None if factor is not None else stack
        self.row = row
        self.seed = seed
        self._projection = projection if projection is not None or projections is not None else torch.empty(0)
        self._projections = None if projection is not None else projections
        self._input_scales = input_scales

    @property
    def input_scale(self) -> torch.Tensor | None:
        """``s`` (fp32, bf16-valued, ``(d_in,)``) of ``ΔW = −α·U P diag(s)``, or ``None`` (unscaled)."""
        return None if self._input_scales is None else self._input_scales[self.row]

    @property
    def factor(self) -> torch.Tensor:
        """``U`` (fp32, ``(d_out, r)``)."""
        if self._factor is None:
            assert self.stack is not None
            self._factor = self.stack.tensor[self.row]
        return self._factor

    @factor.setter
    def factor(self, value: torch.Tensor) -> None:
        self._factor, self.stack = value, None  # no longer the stack's row

    @property
    def projection(self) -> torch.Tensor:
        """``P`` (fp32, ``(r, d_in)``): a view of its stack's row, or, for packed projections, built from the draws
        at each read and not kept (the proposal would otherwise hold every matrix's ``P`` again)."""
        if self._projection is None:
            assert self._projections is not None
            if isinstance(self._projections, PackedProjections):
                return self._projections[self.row]
            self._projection = self._projections[self.row]
        return self._projection

    @projection.setter
    def projection(self, value: torch.Tensor) -> None:
        self._projection, self._projections = value, None

    def __repr__(self) -> str:
        return f"MatrixProposal(seed={self.seed}, factor={tuple(self.factor.shape)})"


@dataclass
class DenseProposal:
    """The proposed step of one densely trained parameter (``logra.dense_params``): ``p ← p + α·delta``.

    ``delta`` is the dense Adam step at α = 1 (fp32, the local shard under FSDP); ``exp_avg``/``exp_avg_sq`` are the
    moments to commit if the update is applied.
    """

    delta: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


@dataclass
class Proposal:
    """All matrices' update factors at one update index, and the step multiplier ``alpha``.

    Arguments:
        matrices: ``{canonical module name: MatrixProposal}``.
        update_index: the update these projections belong to.
        base_seed, rank, distribution, refresh, refresh_every: what a receiver needs to rebuild every ``P``
            (``refresh_every`` ``None``: from ``refresh``, as :class:`Payload` reads it).
        clip_rank: each matrix's rank is ``min(rank, d_in)`` (``logra.clip_rank``).
        factor_dtype: dtype ``U·α`` is rounded to in the payload.
        alpha: step multiplier; 1 is the nominal step (algorithm.md §6 sets it from the predicted KL).
        scale: the global scale ``c`` already folded into each ``U`` (NaN when scales differ per matrix).
        stats: norms that went into ``scale`` (diagnostics).
        veto: set by :meth:`skip`: the update is then skipped and counted instead of merged.
        weight_sq_norms: ``{name: ‖W_i‖²}`` the scale was formed from (whole matrices, summed over shards); the
            divergence guard compares the update with them before merging.
        dense: ``{parameter name: DenseProposal}`` of ``logra.dense_params`` (empty by default).
        stacks: the factors ``U`` stacked by group (:class:`FactorStack`; each ``matrices[name].factor`` is a view of
            one): :meth:`to_payload` rounds a stack at once. Matrices in no stack are rounded one by one.
        sketch_side: ``"inputs"`` (``ΔW = −α·U P``) or ``"outputs"`` (``ΔW = −α·(U R)ᵀ``, ``U`` ``d_in × r``).
        priced_kl: the KL a step controller priced the update at, at its ``alpha`` (``None``: not priced); the
            sketcher keeps the merged update's for the next first moment's decay (``logra.moment_reference_kl``).
    """

    matrices: dict[str, MatrixProposal]
    update_index: int
    base_seed: int
    rank: int
    distribution: str
    refresh: bool
    factor_dtype: torch.dtype = torch.bfloat16
    alpha: float = 1.0
    scale: float = 1.0
    stats: dict[str, float] = field(default_factory=dict)
    veto: str | None = None
    weight_sq_norms: dict[str, float] = field(default_factory=dict)
    dense: dict[str, DenseProposal] = field(default_factory=dict)
    refresh_every: int | None = None
    stacks: list[FactorStack] = field(default_factory=list)
    clip_rank: bool = False
    sketch_side: str = INPUTS
    priced_kl: float | None = None

    def skip(self, reason: str) -> None:
        """Ask the optimizer not to merge this proposal (e.g. a step controller's NaN prediction)."""
        self.veto = reason

    def to_payload(self, alpha: float | None = None) -> Payload:
        """Round ``U·α`` (``alpha`` defaults to ``self.alpha``) to ``factor_dtype``: the exact merged update."""
        a = self.alpha if alpha is None else float(alpha)
        # Elementwise, so a stack rounds to the bits its matrices would round to one by one.
        stacks = [
            FactorStack(st.names, (st.tensor * a).to(self.factor_dtype))
            for st in self.stacks
            if all(
                name in self.matrices and self.matrices[name].stack is st and self.matrices[name].row == i
                for i, name in enumerate(st.names)
            )
        ]
        stacked = {name for st in stacks for name in st.names}
        factors = StackedFactors(
            stacks,
            {name: (m.factor * a).to(self.factor_dtype) for name, m in self.matrices.items() if name not in stacked},
            order=list(self.matrices),
        )
        return Payload(
            factors=factors,
            update_index=self.update_index,
            base_seed=self.base_seed,
            rank=self.rank,
            distribution=self.distribution,
            refresh=self.refresh,
            alpha=a,
            refresh_every=self.refresh_every,
            stacks=stacks,
            clip_rank=self.clip_rank,
            input_scales=self._input_scales(),
            sketch_side=self.sketch_side,
        )

    def _input_scales(self) -> dict[str, torch.Tensor]:
        """``{name: s}`` of the matrices' input scales (``logra.input_scaling: rms``; views of the sketcher's stacks,
        which are replaced, never overwritten, when the next scales are formed): every matrix has one, or none."""
        out = {name: m.input_scale for name, m in self.matrices.items() if m.input_scale is not None}
        if out and len(out) != len(self.matrices):
            bare = sorted(set(self.matrices) - set(out))
            raise ValueError(f"input scales for some matrices but none for {bare[:3]}: a payload scales all or none")
        return out


@dataclass
class Payload:
    """What is merged and shipped for one update: bf16 ``U·α`` per matrix plus the seeds' ingredients.

    A receiver rebuilds each ``P`` from ``(base_seed, projection index, name)`` and applies ``W ← W − F P``; the
    projection index is ``(update_index // N)·N`` with ``N = refresh_every`` (``0`` for a fixed basis).
    ``dense`` holds the new values of densely trained parameters (``logra.dense_params``), copied as they are.
    ``input_scales`` (``logra.input_scaling: rms``): each matrix's per-column scale ``s`` (``(d_in,)``, bf16-valued,
    shipped as bf16: exact), and the merge is ``W ← W − F P diag(s)``; empty: unscaled.
    ``stacks`` (not serialised) are the factors as the trainer's groups hold them (:class:`FactorStack`), so its
    own merge needs no re-stacking; a receiver stacks them itself. ``sketch_side: outputs``: each factor is
    ``d_in × r``, each projection ``r × d_out`` (drawn at width ``d_out``), and the merge is ``Wᵀ ← Wᵀ − F R``.

    ``refresh`` is the older spelling of ``refresh_every`` (:func:`~logra_pl.sketch.config.resolve_refresh_every`):
    a payload written before ``refresh_every`` existed carries ``refresh`` only and means ``N = 1`` or ``0``. After
    construction both are set and agree; a contradiction between them is a ``ValueError``.
    """

    factors: MutableMapping[str, torch.Tensor]  # a dict, or StackedFactors (rows of ``stacks``)
    update_index: int
    base_seed: int
    rank: int
    distribution: str
    refresh: bool | None = None
    alpha: float = 1.0
    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    refresh_every: int | None = None
    stacks: list[FactorStack] = field(default_factory=list)
    clip_rank: bool = False
    input_scales: dict[str, torch.Tensor] = field(default_factory=dict)
    sketch_side: str = INPUTS

    def __post_init__(self) -> None:
        self.refresh_every = resolve_refresh_every(self.refresh, self.refresh_every)
        self.refresh = self.refresh_every != 0
        if self.sketch_side not in (INPUTS, OUTPUTS):
            raise ValueError(f"payload sketch_side {self.sketch_side!r} is neither {INPUTS!r} nor {OUTPUTS!r}")

    def matrix_rank(self, d_in: int) -> int:
        """The rank of a matrix whose projection is ``d_in`` wide (its ``d_out`` on the outputs' side): ``rank``, or
        ``min(rank, d_in)`` with ``clip_rank``."""
        return matrix_rank(self.rank, d_in, self.clip_rank)

    def seed(self, name: str) -> int:
        """Seed of matrix ``name``'s projection: that of update ``(update_index // N)·N`` (``0`` when ``N = 0``)."""
        return projection_seed(self.base_seed, projection_index(self.update_index, self.refresh_every), name)

    @property
    def nbytes(self) -> int:
        """Bytes of factor data and dense parameter values (the parts that scale with model size)."""
        tensors = [*self.factors.values(), *self.dense.values()]
        scales = sum(t.numel() * 2 for t in self.input_scales.values())  # shipped as bf16
        return sum(t.numel() * t.element_size() for t in tensors) + scales

    def header(self) -> dict[str, Any]:
        """The scalar fields, as JSON-able metadata.

        ``refresh_every`` is written only when ``refresh`` cannot say it (``N ≥ 2``): at ``N`` = 0 or 1 the bytes
        are those of a payload from before the setting, which every receiver reads alike. A receiver too old to
        know ``refresh_every`` refuses a payload that has it, rather than rebuilding other projections.
        """
        header = {
            "format": PAYLOAD_FORMAT,
            "update_index": self.update_index,
            "base_seed": self.base_seed,
            "rank": self.rank,
            "distribution": self.distribution,
            "refresh": self.refresh,
            "alpha": self.alpha,
        }
        if self.refresh_every not in (0, 1):
            header["refresh_every"] = self.refresh_every
        if self.clip_rank:  # written only when set: the bytes of every other payload are as before
            header["clip_rank"] = True
        if self.sketch_side != INPUTS:  # likewise; a receiver too old to know it refuses the payload
            header["sketch_side"] = self.sketch_side
        return header

    def to_bytes(self) -> bytes:
        """Serialise as safetensors (factors as tensors, scalars as JSON metadata)."""
        # Copies: factors are rows of one stack, and safetensors refuses tensors that share memory.
        tensors = {name: f.detach().to("cpu", copy=True).contiguous() for name, f in self.factors.items()}
        tensors.update(
            {DENSE_PREFIX + name: v.detach().to("cpu", copy=True).contiguous() for name, v in self.dense.items()}
        )
        tensors.update(  # bf16-valued: bf16 is exact and half the bytes
            {SCALE_PREFIX + n: s.detach().to("cpu", torch.bfloat16).contiguous() for n, s in self.input_scales.items()}
        )
        return st_save(tensors, metadata={"logra": json.dumps(self.header())})

    @classmethod
    def from_bytes(cls, data: bytes) -> Payload:
        """Inverse of :meth:`to_bytes`; refuses bytes that are not a logra-pl payload."""
        try:
            tensors = st_load(data)
            header_len = int.from_bytes(data[:8], "little")
            meta = json.loads(data[8 : 8 + header_len]).get("__metadata__") or {}
        except Exception as err:
            raise ValueError(f"not a readable logra-pl payload (expected safetensors bytes): {err}") from err
        header = json.loads(meta.get("logra", "{}"))
        if header.get("format") != PAYLOAD_FORMAT:
            raise ValueError(f"not a logra-pl payload (format {header.get('format')!r}, expected {PAYLOAD_FORMAT!r})")
        header.pop("format")
        factors = {k: v for k, v in tensors.items() if not k.startswith((DENSE_PREFIX, SCALE_PREFIX))}
        dense = {k[len(DENSE_PREFIX) :]: v for k, v in tensors.items() if k.startswith(DENSE_PREFIX)}
        scales = {k[len(SCALE_PREFIX) :]: v.float() for k, v in tensors.items() if k.startswith(SCALE_PREFIX)}
        if scales and set(scales) != set(factors):
            raise ValueError("payload's input scales do not cover exactly its matrices: the bytes are damaged")
        return cls(factors=factors, dense=dense, input_scales=scales, **header)


def weight_tensors(target: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{canonical module name: weight tensor}`` of a module's parameters or of a state dict's ``*.weight`` keys."""
    items = target.named_parameters() if isinstance(target, nn.Module) else target.items()
    out: dict[str, torch.Tensor] = {}
    for key, tensor in items:
        if key.endswith(".weight"):
            out[canonical_name(key[: -len(".weight")])] = tensor
    return out


def apply_payload(
    payload: Payload,
    target: nn.Module | Mapping[str, torch.Tensor],
    *,
    row_offsets: Mapping[str, int] | None = None,
    chunk_rows: int | None = None,
    projections: Mapping[str, tuple[int, torch.Tensor]] | None = None,
) -> list[str]:
    """Apply ``W ← W − F P`` for every matrix of ``payload`` to ``target``, in place; return the names merged.

    This is the one merge used by the trainer and by every receiver. ``target`` is a module or a state dict
    (keys ``<module>.weight``, wrapper prefixes ignored). When ``target`` holds dim-0 shards, ``row_offsets``
    gives each one's global first row. A matrix of the payload missing from ``target`` is an error.
    ``chunk_rows`` is the merge's row chunk (default: :func:`~logra_pl.sketch.merge.merge_chunk_rows`, as many
    rows as a bounded float64 temporary holds).

    On the outputs' side each ``Wᵀ`` (a view) is merged with ``R`` drawn at ``W``'s full ``d_out``: a dim-0 shard is
    then a column range of ``Wᵀ``, and its target must give the full shape (a DTensor, as FSDP holds it).

    Matrices of one shape (and weight dtype, device and row offset) merge together: their projections are drawn in
    one go (:func:`~logra_pl.sketch.projection.make_projections`) and merged by
    :func:`~logra_pl.sketch.merge.merge_stack_`, which gives every matrix the bits of its own merge.
    ``projections`` (``{name: (seed, P)}``, optional) are projections already drawn: a group whose every seed
    matches reuses them instead of drawing again (the result is bit-identical).
    """
    weights = weight_tensors(target)
    missing = [name for name in payload.factors if name not in weights]
    if missing:
        raise KeyError(
            f"payload matrices {missing[:5]}{'...' if len(missing) > 5 else ''} are not in the target; "
            "was the payload made for another model?"
        )
    offsets = {name: 0 if row_offsets is None else int(row_offsets.get(name, 0)) for name in payload.factors}
    side = payload.sketch_side
    held = {name: local_tensor(weights[name]).shape[0] for name in payload.factors}  # the rows of W held here
    if side != INPUTS and any(offsets[n] and not hasattr(weights[n], "to_local") for n in payload.factors):
        raise ValueError(
            "an outputs-side payload merges a dim-0 shard as columns of Wᵀ and draws R at W's full d_out: pass "
            "the sharded weights themselves (DTensors), not their local rows"
        )
    locals_ = {name: oriented(local_tensor(weights[name]).data, side) for name in payload.factors}
    groups: dict[tuple[Any, ...], list[str]] = {}
    for name, factor in payload.factors.items():
        w = locals_[name]
        key = (tuple(factor.shape), tuple(w.shape), tuple(weights[name].shape), w.dtype, w.device, offsets[name])
        groups.setdefault(key, []).append(name)
    for names in groups.values():
        d_in = sketch_dims(*weights[names[0]].shape, side)[1]  # the projection's width
        seeds = [payload.seed(name) for name in names]
        cached = [(projections or {}).get(name, (None, None)) for name in names]
        if all(c_seed == seed for (c_seed, _), seed in zip(cached, seeds, strict=True)):
            drawn = torch.stack([p.to(locals_[names[0]].device) for _, p in cached])
        else:
            rank, device = payload.matrix_rank(d_in), locals_[names[0]].device
            drawn = make_projections(seeds, rank, d_in, payload.distribution, device=device)
        merge_stack_(
            [locals_[name] for name in names],
            stacked_factors(payload, names),
            drawn,
            payload.distribution,
            **merge_span((offsets[names[0]], offsets[names[0]] + held[names[0]]), None, side),
            chunk_rows=chunk_rows,
            col_scales=stacked_scales(payload, names, device=locals_[names[0]].device),
        )
    if payload.dense:
        named = named_tensors(target)
        absent = [n for n in payload.dense if n not in named]
        if absent:
            raise KeyError(f"payload dense parameters {absent[:5]} are not in the target")
        with torch.no_grad():
            for name, value in payload.dense.items():
                local = local_tensor(named[name])
                offset = 0 if row_offsets is None else int(row_offsets.get(name, 0))
                local.data.copy_(value[offset : offset + local.shape[0]] if local.dim() else value)
    return [*payload.factors, *payload.dense]


def stacked_factors(payload: Payload, names: list[str]) -> torch.Tensor:
    """The factors of ``names`` as one ``(k, d_out, r)`` tensor: the payload's own stack when it holds exactly these
    matrices, in this order, and still backs their factors; else stacked here (a copy of ``O(d_out·r)`` per matrix)."""
    if isinstance(payload.factors, StackedFactors):
        stack = payload.factors.stack_of(names)
        if stack is not None:
            return stack
    for st in payload.stacks:
        if list(st.names) == names and st.holds(payload.factors):
            return st.tensor
    return torch.stack([payload.factors[name] for name in names])


def stacked_scales(payload: Payload, names: list[str], device: torch.device | str) -> torch.Tensor | None:
    """The input scales of ``names`` as one ``(k, d_in)`` fp32 tensor on ``device`` (``None`` for an unscaled payload);
    a payload that scales some matrices but not these is an error, not a silent unscaled merge."""
    if not payload.input_scales:
        return None
    missing = [n for n in names if n not in payload.input_scales]
    if missing:
        raise KeyError(f"payload has input scales but none for {missing[:3]}: the payload is incomplete")
    return torch.stack([payload.input_scales[n].to(device=device, dtype=torch.float32) for n in names])


def named_tensors(target: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{canonical parameter name: tensor}`` of a module's parameters or a state dict (wrapper prefixes gone)."""
    items = target.named_parameters() if isinstance(target, nn.Module) else target.items()
    out: dict[str, torch.Tensor] = {}
    for key, tensor in items:
        module, _, leaf = key.rpartition(".")
        out[f"{canonical_name(module)}.{leaf}" if module else key] = tensor
    return out
