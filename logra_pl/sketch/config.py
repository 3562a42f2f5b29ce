"""The LoGRA hyper-parameters (algorithm.md §1-5) as one validated, serialisable dataclass."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from logra_pl.errors import ConfigError, check_int, check_range
from logra_pl.runtime.dtypes import dtypes_of
from logra_pl.sketch.side import sketch_dims

DEFAULT_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

Distribution = Literal["rademacher", "gaussian", "hadamard"]
DISTRIBUTIONS: tuple[str, ...] = ("rademacher", "gaussian", "hadamard")  # every value of Distribution, in order
UpdateRule = Literal["rowadam", "sgd", "adam"]
UPDATE_RULES: tuple[str, ...] = ("rowadam", "sgd", "adam")
StepMode = Literal["ratio", "lr", "adam"]
MomentTransfer = Literal["project", "reset"]
InputPreconditioner = Literal["none", "gram"]
InputScaling = Literal["none", "rms"]
SketchSide = Literal["inputs", "outputs"]
ProjectionStorage = Literal["dense", "packed"]
PROJECTION_STORAGES = ("dense", "packed")
SKETCH_SIDES: tuple[str, ...] = ("inputs", "outputs")
RatioScope = Literal["global", "matrix"]

_FACTOR_DTYPES = dtypes_of("bfloat16", "float16", "float32")
# How the sketch-space first moment may be stored (it is always computed in fp32); the planner reads it too.
MOMENT_DTYPES = dtypes_of("float32", "bfloat16")
# The operands of the sketch's matmuls (accumulated and kept in fp32 either way).
SKETCH_OPERAND_DTYPES = dtypes_of("float32", "bfloat16")

# Keys that change what the saved LoGRA state means: a checkpoint written with one value cannot be resumed
# under another (row statistics of another rank/target set, projections from another seed or distribution).
STRUCTURAL_KEYS: tuple[str, ...] = (
    "targets",
    "rank",
    "distribution",
    "refresh_every",  # what `refresh` meant: an old config's `refresh` is read as its refresh_every (0 or 1)
    "base_seed",
    "update_rule",
    "beta2",
    "beta1",
    "dense_params",
    "clip_rank",
    "input_scaling",  # the saved activation statistics exist only under "rms"
    "sketch_side",  # the saved moments are d_out × r (inputs) or d_in × r (outputs)
)
# What a checkpoint written before a structural key existed meant by it.
_STRUCTURAL_DEFAULTS: dict[str, Any] = {
    "dense_params": [],
    "beta1": 0.0,
    "clip_rank": False,
    "input_scaling": "none",
    "sketch_side": "inputs",
}


def matrix_rank(rank: int, d_in: int, clip: bool) -> int:
    """The sketch rank of one ``(d_out, d_in)`` matrix: ``rank``, or with ``clip_rank`` ``min(rank, d_in)`` (a rank
    at or above every ``d_in`` gives every matrix a full-rank sketch). Trainer, planner and receivers all use it."""
    return min(rank, d_in) if clip else rank


class LoGRAConfigError(ConfigError):
    """A LoGRA setting or input that cannot work; the message names the value and how to fix it."""


def check_rank_fits(rank: int, in_features: Mapping[str, int], clip: bool, where: str = "") -> None:
    """Refuse a sketch rank above the ``d_in`` of a target matrix (``in_features``: ``d_in`` by matrix name) unless
    ``clip`` (``logra.clip_rank``): a sketch cannot have more columns than its matrix. The one check of it, for the
    live sketcher, the check before any weights load and the memory plan (``where``: e.g. the policy's name)."""
    if clip or not in_features:
        return
    name, smallest = min(in_features.items(), key=lambda item: item[1])
    if rank > smallest:
        raise LoGRAConfigError(
            f"logra.rank={rank} exceeds d_in={smallest} of {name!r}{where}: a sketch cannot have more columns than "
            f"its matrix; use rank <= {smallest} (or logra.clip_rank: true, which gives such matrices rank d_in)"
        )


def check_distribution(distribution: object) -> None:
    """Refuse a projection distribution that is not one of :data:`DISTRIBUTIONS`, naming the ones there are."""
    if distribution not in DISTRIBUTIONS:
        names = ", ".join(repr(d) for d in DISTRIBUTIONS)
        raise LoGRAConfigError(f"unknown projection distribution {distribution!r}: use one of {names}")


def resolve_refresh_every(refresh: bool | None, refresh_every: int | None) -> int:
    """The projection period ``N`` (algorithm.md §2) from its two spellings: ``refresh_every`` or the old ``refresh``.

    ``refresh_every`` wins when given: ``N ≥ 1`` draws a new projection every ``N`` updates, ``0`` keeps one fixed
    basis. ``refresh`` alone is the old flag: ``True`` means ``N = 1`` (the paper: a new ``P`` every update),
    ``False`` means ``N = 0``. Neither given: ``N = 0``, one basis for the whole run (the project's default since the
    KL-matched grid: a first moment survives on a basis that persists; the paper's ``N = 1`` is ``refresh: true``).
    Both given, they must agree on whether the basis is refreshed at all: ``refresh: false`` with
    ``refresh_every ≥ 1``, or ``refresh: true`` with ``refresh_every: 0``, is an error naming both (``refresh: true``
    with any ``N ≥ 1`` is consistent: it says the basis is refreshed, ``refresh_every`` says how often).
    """
    if refresh is not None and not isinstance(refresh, bool):
        raise LoGRAConfigError(f"logra.refresh must be true or false, got {refresh!r}")
    if refresh_every is None:
        return 1 if refresh is True else 0
    if isinstance(refresh_every, bool) or not isinstance(refresh_every, int) or refresh_every < 0:
        raise LoGRAConfigError(
            f"logra.refresh_every must be a non-negative integer (N >= 1: a new projection every N updates; "
            f"0: one fixed basis), got {refresh_every!r}"
        )
    if refresh is not None and refresh != (refresh_every != 0):
        raise LoGRAConfigError(
            f"logra.refresh={refresh} contradicts logra.refresh_every={refresh_every}: refresh is the old spelling "
            "(false = refresh_every 0, true = refresh_every >= 1); drop refresh, or make the two agree"
        )
    return refresh_every


@dataclass
class LoGRAConfig:
    """Every knob of the LoGRA sketch core, with the defaults of algorithm.md §1-5.

    The defaults are the project's rule for new runs, chosen by the KL-matched grid (docs/benchmarks.md): Adam on the
    sketch's coordinates (``update_rule: adam``) with a first moment (``beta1`` 0.9), both kept in bf16, on one
    projection for the whole run (``refresh_every`` 0), stepped by ``lr`` (``step_mode: adam``). The paper's rule
    (RowAdam, no first moment, a new projection every update, the ratio step) is :meth:`paper`, or
    ``configs/overlays/paper_logra.yaml`` in a config.

    Arguments:
        targets: last name parts of the ``nn.Linear`` modules whose weights are trained through sketches.
        rank: sketch rank ``r``; the sketch of a ``(d_out, d_in)`` weight is ``(d_out, r)``.
        clip_rank: a matrix whose ``d_in`` is below ``rank`` gets rank ``d_in`` (:func:`matrix_rank`) instead of the
            error ``rank > d_in``; with ``rank`` at or above every ``d_in`` and a Hadamard projection every sketch is
            full-rank and orthogonal (``P Pᵀ = I``: the sketch step is the dense step in a rotated basis).
        distribution: projection entries, ``"rademacher"`` (``±1/sqrt(r)``), ``"gaussian"`` (``N(0, 1/r)``) or
            ``"hadamard"`` (``r`` random rows of a signed, permuted Hadamard matrix: orthogonal rows, entries ``0`` or
            ``±sqrt(m/r)`` with ``m`` the odd part of ``d_in``; algorithm.md §2).
        refresh: the older spelling of ``refresh_every``: ``True`` = a new projection every update (the paper's),
            ``False`` = one fixed basis. ``None`` (default): not given. After construction it holds
            ``refresh_every != 0``.
        refresh_every: ``N``: a new projection every ``N`` updates (projection index ``(u // N)·N``); ``0``: one
            fixed basis. ``None`` (default): from ``refresh``, else ``0`` (one basis for the run; the paper's refresh
            at every update is ``refresh: true`` or ``refresh_every: 1``). Both given, they must agree
            (:func:`resolve_refresh_every`).
        base_seed: mixed with the update index and the module name into each projection's seed.
        update_rule: ``"rowadam"`` (per-row second moment, algorithm.md §4), ``"sgd"`` (``D = S``) or ``"adam"``
            (a per-entry second moment of the ``d_out × r`` sketch, ``D = N / sqrt(V̂)``: Adam in sketch space, with
            ``d_out × r`` more state per matrix, stored as ``moment_dtype``).
        beta2: the EMA factor of the second moment (RowAdam's row statistic, or ``adam``'s per-entry one).
        beta1: EMA factor of a first moment in sketch space (``d_out × r`` per matrix), carried across
            projection changes; ``0`` (default, the paper's rule): no first moment, ``D`` is formed from ``S``.
        moment_reference_kl: the first moment's horizon as a distance in policy space: each update decays ``m`` by
            ``β1^√(κ/κ_ref)``, ``κ`` the KL the previous merged update moved the policy as the step controller priced
            it, so ``β1`` is the decay per update of KL ``moment_reference_kl`` (a ``4×`` larger update decays by
            ``β1²``; algorithm.md §4). ``None`` (default): ``β1`` per update, whatever the update's size. Needs
            ``beta1 > 0`` and a step controller that prices each update (PredictedKLControl).
        momentum_transfer: what the sketch-space moments do when a matrix's projection changes: ``"project"``
            carries them to the new basis (``m ← m C`` with ``C = (P_old P_oldᵀ)⁻¹ P_old P_newᵀ``; ``adam``'s ``V ← V
            (C ∘ C)``), ``"reset"`` zeroes them (and their bias corrections restart).
        moment_dtype: how the sketch-space moments are stored between updates: ``"float32"`` (default) or
            ``"bfloat16"`` (half the bytes; each update computes ``β1·m + (1−β1)·S`` (``β2·V + (1−β2)·S²``) and its
            step in fp32 from the stored value, then rounds the new moment to bf16 to keep it). Not structural: a
            resume under another dtype casts.
        eps: RowAdam's denominator floor, relative to the mean row root.
        input_precondition: ``"none"`` (default) or ``"gram"``: right-multiply the direction's numerator (``S`` or
            ``m̂``) by ``(Γ/n + λ·tr(Γ/n)/r·I)⁻¹``, with ``Γ = Σ z zᵀ`` the ``r × r`` Gram of the update's projected
            inputs ``z = P x`` over the ``n`` tokens whose output gradient is non-zero: the natural-gradient step for
            the layer's input side inside the sketch (K-FAC's ``A⁻¹`` restricted to ``P``'s row space), which damps
            the input directions that carry most of the activations' energy. ``update_rule`` ``rowadam`` or ``sgd``.
        gram_damping: ``λ`` of ``input_precondition: gram``, relative to the Gram's mean eigenvalue.
        input_scaling: ``"none"`` (default) or ``"rms"``: sketch and step in input coordinates scaled per channel,
            ``Q = P·diag(s)`` in place of ``P`` (algorithm.md §3a): ``S = G Qᵀ``, ``ΔW = U Q``, with
            ``s_j ∝ (rms x_j + ε)^(-1/2)`` from an EMA of the layer inputs' mean squares. Half of Adam's per-channel
            normalization sits on each factor, so a few loud input channels no longer carry most of the step's
            output change. The first update runs unscaled (no statistics yet); the sketch-space moments restart
            when the first scale is set. Needs a fixed projection (``refresh_every: 0``). One ``d_in`` vector per
            matrix ships with every payload; three are kept.
        input_scale_beta: EMA factor of ``input_scaling: rms``'s per-channel mean squares, one step per merged
            update (bias-corrected).
        sketch_side: which side of each matrix the projection mixes (algorithm.md §3b). ``"inputs"`` (default, the
            paper's): ``S = G Pᵀ`` (``d_out × r``, ``P`` is ``r × d_in``), ``ΔW = −α·U P``; the forward keeps
            ``X Pᵀ`` (tokens × r) for the backward. ``"outputs"``: ``T = R G`` (``r × d_in``, ``R`` is ``r × d_out``),
            stored transposed as ``Tᵀ = Gᵀ Rᵀ`` (``d_in × r``), ``ΔW = −α·Rᵀ Uᵀ``: the update rule's per-entry
            normalization then sees each input channel as it is, as dense Adam's does (docs/benchmarks.md). The forward
            keeps the layer input ``X`` (tokens × d_in, what a dense weight gradient keeps) for the backward. Not
            with ``input_scaling`` or ``input_precondition``, which act on the inputs' mixing.
        projection_storage: how the projections are held between their uses. ``"dense"`` (default): each ``P`` in
            fp32 (``4·r·d_in`` bytes per matrix, as many as its sketch). ``"packed"``: as their draws (Rademacher:
            ``r·d_in`` bits, 1/32 of the fp32 ``P``; Hadamard: ``r + 2·d_in`` integers), and each reader (the
            backward's sketch, the merge, the step control's probe) builds its ``P`` bit for bit when it reads it
            and lets it go. The same arithmetic, so the same run; what it costs is the building, once per
            microbatch per matrix in the backward. Not structural: a run resumes under either.
        step_mode: ``"ratio"`` scales the step to ``update_ratio`` of the weight norm; ``"lr"`` uses ``U = lr·D``;
            ``"adam"`` uses ``U = lr·N/den``: row-wise Adam in sketch space (no norm restore), steps of dense Adam's
            size for the same ``lr``.
        update_ratio: relative nominal step size ``‖ΔW‖/‖W‖`` (ratio mode).
        ratio_scope: ``"global"`` (algorithm.md §4: one scale over all selected matrices together) or ``"matrix"`` (each
            matrix gets ``‖ΔW_i‖ = update_ratio·‖W_i‖``, a layer-wise trust ratio; it learns markedly faster on
            the tiny CPU models, where a global scale starves the layers with small gradients).
        lr: learning rate (``lr`` and ``adam`` modes).
        lr_warmup_steps: updates of linear warmup of ``lr`` (``lr``/``adam`` modes; counted in merged updates).
        lr_decay_steps: updates (after warmup) of its cosine decay to ``lr_min_ratio·lr``; ``0``: no decay, ``lr``
            is ``lr_min_ratio·lr`` from the end of the warmup on (one step down, dense AdamW's reading of 0).
        lr_min_ratio: final ``lr`` as a fraction of ``lr``; ``1`` (default) with no warmup: a constant ``lr``.
        factor_dtype: dtype the factors ``U·α`` are rounded to before merging and shipping.
        sketch_operands: the operands of the sketch's two matmuls (``Z = X Pᵀ`` in the forward hook, ``S += dYᵀ Z``
            in the backward; algorithm.md §3), always accumulated and kept in fp32. ``"float32"`` (default): ``X`` and
            ``dY`` as they come, upcast. ``"bfloat16"``: the bf16 tensor cores' path — ``X`` and ``dY`` in bf16 (what
            a layer under ``bf16-mixed`` multiplies and returns: exact there), ``P`` as its signs times one scale
            (exact: ``rademacher`` and ``hadamard`` entries are ``0`` or ``±c``), ``Z`` carried into the backward as
            two bf16 terms (``Z ≈ Z_hi + Z_lo``, within ``2⁻¹⁶`` of ``Z``): ``S`` within ``~2⁻¹⁵`` of the fp32
            sketch of the same bf16 inputs. On a GPU the products run on tensor cores with fp32 results
            (``torch.mm(..., out_dtype=float32)``); elsewhere the same products in fp32. Keeps ``r × d_in`` bf16 signs
            per matrix beside ``P`` (counted as projections). Not structural.
        merge_chunk_rows: rows merged per chunk, bounding the temporary float64 ``rows × d_in`` delta. ``None``
            (default): as many rows as fit 64 MiB on a GPU, 4 MiB on a CPU
            (:func:`~logra_pl.sketch.merge.merge_chunk_rows`). The merged weights are the same bits either way.
        dense_params: opt-in (algorithm.md §1): glob patterns of parameter names (``"*norm.weight"``,
            ``"model.embed_tokens.weight"``) trained beside the sketches by a small dense Adam — their step joins
            the proposal, is scaled by the same α and probed by the KL controller, and ships to engines as new
            values. Empty (default): everything but the targets stays frozen.
        dense_lr: the dense Adam's learning rate.
        dense_betas: its ``(β1, β2)``.
        dense_eps: its ``eps``.
    """

    targets: tuple[str, ...] = DEFAULT_TARGETS
    rank: int = 64
    clip_rank: bool = False
    distribution: Distribution = "rademacher"
    refresh: bool | None = None
    refresh_every: int | None = None
    base_seed: int = 0
    update_rule: UpdateRule = "adam"
    beta2: float = 0.95
    beta1: float = 0.9
    moment_reference_kl: float | None = None
    momentum_transfer: MomentTransfer = "project"
    moment_dtype: str = "bfloat16"
    eps: float = 1e-8
    input_precondition: InputPreconditioner = "none"
    gram_damping: float = 0.1
    input_scaling: InputScaling = "none"
    input_scale_beta: float = 0.9
    sketch_side: SketchSide = "inputs"
    projection_storage: ProjectionStorage = "dense"
    step_mode: StepMode = "adam"
    update_ratio: float = 6e-5
    ratio_scope: RatioScope = "global"
    lr: float = 1e-4
    lr_warmup_steps: int = 0
    lr_decay_steps: int = 0
    lr_min_ratio: float = 1.0
    factor_dtype: str = "bfloat16"
    sketch_operands: str = "float32"
    merge_chunk_rows: int | None = None
    dense_params: tuple[str, ...] = ()
    dense_lr: float = 1e-5
    dense_betas: tuple[float, float] = (0.9, 0.999)
    dense_eps: float = 1e-8

    def __post_init__(self) -> None:
        self.targets = tuple(self.targets)
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise LoGRAConfigError(f"targets must be a non-empty list of module name parts, got {self.targets!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise LoGRAConfigError(f"logra.rank must be a positive integer, got {self.rank!r}")
        if not isinstance(self.clip_rank, bool):
            raise LoGRAConfigError(f"logra.clip_rank must be true or false, got {self.clip_rank!r}")
        check_distribution(self.distribution)
        if self.sketch_operands not in SKETCH_OPERAND_DTYPES:
            raise LoGRAConfigError(
                f"unknown logra.sketch_operands {self.sketch_operands!r}: use one of {sorted(SKETCH_OPERAND_DTYPES)}"
            )
        if self.sketch_operands == "bfloat16" and self.distribution == "gaussian":
            raise LoGRAConfigError(
                "logra.sketch_operands: bfloat16 multiplies by P's signs, exact only for projections whose entries "
                "are 0 or ±c: use distribution rademacher or hadamard, or sketch_operands float32"
            )
        self.refresh_every = resolve_refresh_every(self.refresh, self.refresh_every)
        self.refresh = self.refresh_every != 0
        if self.update_rule not in UPDATE_RULES:
            raise LoGRAConfigError(f"unknown update_rule {self.update_rule!r}: use 'rowadam', 'sgd' or 'adam'")
        if self.step_mode not in ("ratio", "lr", "adam"):
            raise LoGRAConfigError(f"unknown step_mode {self.step_mode!r}: use 'ratio', 'lr' or 'adam'")
        if self.step_mode == "adam" and self.update_rule == "sgd":
            raise LoGRAConfigError(
                "step_mode 'adam' divides by a second moment: use update_rule 'rowadam' or 'adam' (or step_mode 'lr')"
            )
        if self.input_precondition not in ("none", "gram"):
            raise LoGRAConfigError(f"unknown input_precondition {self.input_precondition!r}: use 'none' or 'gram'")
        if self.input_precondition == "gram" and self.update_rule == "adam":
            raise LoGRAConfigError(
                "input_precondition 'gram' whitens the sketch's columns, which update_rule 'adam' normalizes entry by "
                "entry again: use update_rule 'rowadam' or 'sgd' with it"
            )
        if self.input_scaling not in ("none", "rms"):
            raise LoGRAConfigError(f"unknown input_scaling {self.input_scaling!r}: use 'none' or 'rms'")
        if self.input_scaling == "rms" and self.refresh_every != 0:
            raise LoGRAConfigError(
                "input_scaling 'rms' scales a fixed projection's columns; a refreshed projection would carry its "
                f"moments across two changing bases: set logra.refresh_every: 0 (got {self.refresh_every})"
            )
        if self.input_scaling == "rms" and self.input_precondition == "gram":
            raise LoGRAConfigError(
                "input_scaling 'rms' and input_precondition 'gram' both rescale the input side: pick one"
            )
        if self.sketch_side not in SKETCH_SIDES:
            raise LoGRAConfigError(f"unknown logra.sketch_side {self.sketch_side!r}: use 'inputs' or 'outputs'")
        if self.projection_storage not in PROJECTION_STORAGES:
            raise LoGRAConfigError(
                f"unknown logra.projection_storage {self.projection_storage!r}: use 'dense' or 'packed'"
            )
        if self.projection_storage == "packed" and self.distribution == "gaussian":
            raise LoGRAConfigError(
                "logra.projection_storage: packed keeps each P as the integers it is built from, and a Gaussian P "
                "is its own draw (fp32 entries): use distribution rademacher or hadamard, or projection_storage dense"
            )
        if self.sketch_side == "outputs" and (self.input_scaling != "none" or self.input_precondition != "none"):
            raise LoGRAConfigError(
                "logra.sketch_side 'outputs' leaves the inputs unmixed, so input_scaling and input_precondition, "
                "which act on the inputs' mixing, have nothing to act on: set them to 'none', or sketch_side 'inputs'"
            )
        if self.moment_reference_kl is not None and self.beta1 == 0:
            raise LoGRAConfigError(
                "logra.moment_reference_kl sets the first moment's horizon, and logra.beta1 = 0 keeps no first "
                "moment: set beta1 > 0 (e.g. 0.95), or moment_reference_kl: null"
            )
        if self.momentum_transfer not in ("project", "reset"):
            raise LoGRAConfigError(f"unknown momentum_transfer {self.momentum_transfer!r}: use 'project' or 'reset'")
        if self.ratio_scope not in ("global", "matrix"):
            raise LoGRAConfigError(f"unknown ratio_scope {self.ratio_scope!r}: use 'global' or 'matrix'")
        try:  # finite numbers in range: NaN fails every comparison and would otherwise slip through
            check_range("logra.beta2", self.beta2, 0.0, 1.0, high_open=True)
            check_range("logra.beta1", self.beta1, 0.0, 1.0, high_open=True, hint="0 = no first moment")
            if self.moment_reference_kl is not None:
                check_range("logra.moment_reference_kl", self.moment_reference_kl, 0.0, low_open=True, hint="a KL")
            check_range("logra.lr_min_ratio", self.lr_min_ratio, 0.0, 1.0)
            check_int("logra.lr_warmup_steps", self.lr_warmup_steps, 0)
            check_int("logra.lr_decay_steps", self.lr_decay_steps, 0)
            check_range("logra.eps", self.eps, 0.0)
            check_range("logra.input_scale_beta", self.input_scale_beta, 0.0, 1.0, high_open=True)
            check_range("logra.gram_damping", self.gram_damping, 0.0, low_open=True, hint="relative damping λ")
            check_range("logra.update_ratio", self.update_ratio, 0.0, low_open=True, hint="‖ΔW‖/‖W‖ per update")
            check_range("logra.lr", self.lr, 0.0, low_open=True)
        except ConfigError as err:
            raise LoGRAConfigError(str(err)) from None
        if self.factor_dtype not in _FACTOR_DTYPES:
            raise LoGRAConfigError(f"unknown factor_dtype {self.factor_dtype!r}: use one of {sorted(_FACTOR_DTYPES)}")
        if self.moment_dtype not in MOMENT_DTYPES:
            raise LoGRAConfigError(
                f"unknown moment_dtype {self.moment_dtype!r}: use one of {sorted(MOMENT_DTYPES)} (the first moment's "
                "storage; it is computed in float32 either way)"
            )
        if self.merge_chunk_rows is not None and self.merge_chunk_rows <= 0:
            raise LoGRAConfigError(f"merge_chunk_rows must be > 0 (or null: automatic), got {self.merge_chunk_rows!r}")
        self.dense_params = tuple(self.dense_params)
        self.dense_betas = (float(self.dense_betas[0]), float(self.dense_betas[1]))
        try:
            check_range("logra.dense_lr", self.dense_lr, 0.0, low_open=True)
            check_range("logra.dense_betas[0]", self.dense_betas[0], 0.0, 1.0, high_open=True)
            check_range("logra.dense_betas[1]", self.dense_betas[1], 0.0, 1.0, high_open=True)
            check_range("logra.dense_eps", self.dense_eps, 0.0)
        except ConfigError as err:
            raise LoGRAConfigError(str(err)) from None
        if not isinstance(self.base_seed, int) or self.base_seed < 0:
            raise LoGRAConfigError(f"base_seed must be a non-negative integer, got {self.base_seed!r}")

    @classmethod
    def paper(cls, **overrides: Any) -> LoGRAConfig:
        """The paper's rule (algorithm.md §4, §10): RowAdam with no first moment on a new Rademacher projection every
        update, the step a global ratio of the weights' norm; ``overrides`` set any other key (``rank``,
        ``update_ratio``, ...)."""
        rule: dict[str, Any] = dict(
            update_rule="rowadam", beta1=0.0, moment_dtype="float32", step_mode="ratio", ratio_scope="global"
        )  # fmt: skip
        if "refresh" not in overrides and "refresh_every" not in overrides:
            rule["refresh_every"] = 1  # either spelling given wins, whole
        return cls(**{**rule, **overrides})

    def sketch_dims(self, d_out: int, d_in: int) -> tuple[int, int]:
        """``(rows, width)`` of a ``d_out × d_in`` matrix's sketch: it holds ``rows × r`` entries and its projection
        is ``r × width`` — ``(d_out, d_in)`` on the inputs' side, ``(d_in, d_out)`` on the outputs'
        (:attr:`sketch_side`)."""
        return sketch_dims(d_out, d_in, self.sketch_side)

    @property
    def factor_torch_dtype(self) -> torch.dtype:
        """The torch dtype of shipped/merged factors."""
        return _FACTOR_DTYPES[self.factor_dtype]

    @property
    def sketch_operand_torch_dtype(self) -> torch.dtype:
        """The torch dtype of the sketch matmuls' operands (:attr:`sketch_operands`)."""
        return SKETCH_OPERAND_DTYPES[self.sketch_operands]

    @property
    def moment_torch_dtype(self) -> torch.dtype:
        """The torch dtype the sketch-space first moment is stored in."""
        return MOMENT_DTYPES[self.moment_dtype]

    def to_dict(self) -> dict[str, Any]:
        """Plain-Python form (lists, not tuples) for checkpoints and payloads.

        ``refresh_every`` is written only when ``refresh`` cannot say it (``N ≥ 2``): a config at ``N`` = 0 or 1
        writes the same dict as before the setting existed, so its checkpoints are unchanged; so do ``clip_rank`` and
        ``moment_reference_kl``, written only when set.
        """
        out = dataclasses.asdict(self)
        if self.refresh_every in (0, 1):
            del out["refresh_every"]
        if not self.clip_rank:  # as before the setting existed
            del out["clip_rank"]
        if self.moment_reference_kl is None:  # likewise
            del out["moment_reference_kl"]
        if self.input_precondition == "none":  # likewise
            del out["input_precondition"], out["gram_damping"]
        if self.input_scaling == "none":  # likewise
            del out["input_scaling"], out["input_scale_beta"]
        if self.sketch_operands == "float32":  # likewise
            del out["sketch_operands"]
        if self.sketch_side == "inputs":  # likewise
            del out["sketch_side"]
        if self.projection_storage == "dense":  # likewise
            del out["projection_storage"]
        out["targets"] = list(self.targets)
        out["dense_params"] = list(self.dense_params)
        out["dense_betas"] = list(self.dense_betas)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoGRAConfig:
        """Inverse of :meth:`to_dict`; unknown keys are an error that names them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise LoGRAConfigError(f"unknown LoGRA config keys {unknown}; known keys are {sorted(known)}")
        return cls(**data)

    def structural_mismatch(self, other: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
        """Keys of :data:`STRUCTURAL_KEYS` whose value differs between ``self`` and a saved config dict."""
        mine = {
            **self.to_dict(),
            "refresh_every": self.refresh_every,
            "clip_rank": self.clip_rank,
            "input_scaling": self.input_scaling,
            "sketch_side": self.sketch_side,
        }
        diff: dict[str, tuple[Any, Any]] = {}
        for key in STRUCTURAL_KEYS:
            theirs = other.get(key, _STRUCTURAL_DEFAULTS.get(key))  # older checkpoints: what they meant
            if key == "refresh_every":  # a dict at N = 0 or 1 (and every older one) says it with `refresh` only
                try:
                    theirs = resolve_refresh_every(other.get("refresh"), other.get("refresh_every"))
                except LoGRAConfigError:
                    theirs = (other.get("refresh"), other.get("refresh_every"))
            if key in ("targets", "dense_params") and theirs is not None:
                theirs = list(theirs)
            if theirs != mine[key]:
                diff[key] = (theirs, mine[key])
        return diff
