"""Forming the update from the sketches (algorithm.md §4): RowAdam or SGD directions, then the step's scale.

Each function is one formula of the spec, on plain tensors: ``S`` is a (d_out × r) sketch, ``v`` the
(d_out × 1) RowAdam row statistic, ``m`` the (d_out × r) sketch-space first moment, ``P`` the (r × d_in)
projection. Every one also takes a stack of matrices of one shape (a leading dimension: ``(k, d_out, r)``,
``(k, d_out, 1)``, ``(k, r, d_in)``), the unit of the grouped sketch step: what is summed or averaged "over the
matrix" is summed over its last two dimensions, so each matrix of a stack gets the value it gets alone
(algorithm.md §4 says which reductions keep their bits and when).
"""

from __future__ import annotations

import math

import torch

TINY = torch.finfo(torch.float32).tiny


def _float32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 (itself when it already is: no operator call)."""
    return t if t.dtype == torch.float32 else t.to(torch.float32)


# Entries one partial sum of :func:`matrix_sum` adds: torch's CPU grain size, the most one reduction adds on one
# thread (a longer single sum is split between threads).
SUM_BLOCK = 32768


def matrix_sum(x: torch.Tensor) -> torch.Tensor:
    """``Σ_ij x_ij`` of a matrix (0-dim) or of each matrix of a stack (``(k,)``), in blocks of :data:`SUM_BLOCK`
    consecutive entries, then over the blocks' sums.

    Why blocks: a CPU sum splits its work between threads by the size of the whole call, so one matrix summed alone
    and the same matrix summed in a stack of 6 differed in the last bits (tiny:medium's 640 × 64 factors, float64).
    A block is always one thread's, added in the same order, and so is the short sum over the blocks: every matrix
    gets the same bits alone, in any stack and with any number of threads. A matrix of at most one block (the tiny
    model's, at r = 64) is summed as one call sums it, so its bits are what they were before the blocks.
    """
    n = x.shape[-2] * x.shape[-1]
    flat = x.reshape(*x.shape[:-2], n)
    blocks = n // SUM_BLOCK
    if blocks == 0:
        return flat.sum(dim=-1)
    parts = flat[..., : blocks * SUM_BLOCK].reshape(*x.shape[:-2], blocks, SUM_BLOCK).sum(dim=-1)
    if n > blocks * SUM_BLOCK:
        parts = torch.cat([parts, flat[..., blocks * SUM_BLOCK :].sum(dim=-1, keepdim=True)], dim=-1)
    return parts.sum(dim=-1)


def row_denominator(row_stat: torch.Tensor, step: int, beta2: float, eps: float) -> torch.Tensor:
    """``den = sqrt(v / (1 − β2^t)) + max(ε·mean(root), tiny)``: RowAdam's per-row denominator (d_out × 1), the mean
    over the matrix's rows."""
    root = torch.sqrt(row_stat / (1.0 - beta2**step))
    return root + torch.clamp(eps * root.mean(dim=(-2, -1), keepdim=True), min=TINY)


def rowadam_direction(
    sketch: torch.Tensor,
    row_stat: torch.Tensor,
    step: int,
    beta2: float = 0.95,
    eps: float = 1e-8,
    numerator: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One RowAdam step on one matrix; returns ``(D, v_new)`` and leaves the inputs untouched.

    ::

        v    ← β2·v + (1−β2)·mean_j(S_ij²)
        root = sqrt(v / (1 − β2^t))
        den  = root + max(ε·mean(root), tiny)
        s    = min(den) / den ;  s ← s / sqrt(mean(s²))
        D    = s ⊙ N ;  D ← D · ‖N‖_F / ‖D‖_F

    ``N`` (``numerator``) is ``S`` itself (the paper's rule, no first moment) or the bias-corrected first moment
    ``m̂`` (:func:`first_moment`); ``v`` always comes from ``S``. ``t`` (``step``) counts row-statistic updates from
    1. A zero ``N`` gives ``D = 0``.
    """
    if step < 1:
        raise ValueError(f"RowAdam step count starts at 1, got {step}")
    s32 = _float32(sketch)
    v_new = beta2 * row_stat + (1.0 - beta2) * s32.square().mean(dim=-1, keepdim=True)
    den = row_denominator(v_new, step, beta2, eps)
    scale = den.amin(dim=(-2, -1), keepdim=True) / den
    scale = scale / torch.sqrt(scale.square().mean(dim=(-2, -1), keepdim=True))
    if numerator is not None:
        s32 = _float32(numerator)
    direction = scale * s32
    d_norm = torch.linalg.vector_norm(direction, dim=(-2, -1), keepdim=True)
    s_norm = torch.linalg.vector_norm(s32, dim=(-2, -1), keepdim=True)
    # ``if d_norm > 0`` on the device (no host sync): a zero direction is multiplied by 1, which changes no bit.
    restore = torch.where(d_norm > 0, s_norm / d_norm, torch.ones_like(d_norm))
    # In place: the same products as ``direction * restore``, without a second stack-sized temporary (on a CPU the
    # group's temporaries come from glibc's heap, which keeps what it grew to: the floor of later updates).
    return direction.mul_(restore), v_new


def adam_direction(
    sketch: torch.Tensor,
    row_stat: torch.Tensor,
    step: int,
    beta2: float = 0.95,
    eps: float = 1e-8,
    numerator: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise Adam in sketch space (``step_mode: adam``); returns ``(D, v_new)``::

        v ← β2·v + (1−β2)·mean_j(S_ij²) ;  D = N / den     (den: :func:`row_denominator`)

    with ``N = S`` or ``m̂``. Unlike :func:`rowadam_direction` the norm is not restored: ``D``'s rows have the size
    Adam's steps have (about 1 per entry), so ``U = lr·D`` moves ``W`` by about ``lr`` per entry as a dense Adam
    step of the same ``lr`` does (``‖ΔW_i‖ ≈ lr·sqrt(d_in)`` with ``E[PᵀP] = I``).
    """
    if step < 1:
        raise ValueError(f"Adam step count starts at 1, got {step}")
    s32 = _float32(sketch)
    v_new = beta2 * row_stat + (1.0 - beta2) * s32.square().mean(dim=-1, keepdim=True)
    num = s32 if numerator is None else _float32(numerator)
    return num / row_denominator(v_new, step, beta2, eps), v_new


def entry_adam_direction(
    sketch: torch.Tensor,
    second_moment: torch.Tensor,
    age: int,
    beta2: float = 0.95,
    eps: float = 1e-8,
    numerator: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-entry Adam in sketch space (``update_rule: adam``); returns ``(D, V_new)``, inputs untouched::

        V ← β2·V + (1−β2)·S²                      (per entry of the d_out × r sketch)
        root = sqrt(V / (1 − β2^a))               (a: merged updates V has averaged, from 1)
        D    = N / (root + max(ε·mean(root), tiny))

    ``N`` is ``S`` or the bias-corrected first moment ``m̂``; ``ε`` is relative to the matrix's mean root (as
    RowAdam's), so the rule does not depend on the gradient's scale. With the sketch's basis fixed (``refresh_every:
    0``) this is Adam on the ``d_out × r`` coordinates ``S = G Pᵀ``: the step LoRA's AdamW takes on its ``B`` while its
    ``A`` (here ``P``) is frozen. ``V`` is computed in fp32 from ``V`` as stored.
    """
    if age < 1:
        raise ValueError(f"second-moment age starts at 1, got {age}")
    s32 = _float32(sketch)
    # The same operations as the formulas above, each stack-sized result formed once and then updated in place: a
    # group's temporaries are what bounds the update's peak (on a CPU glibc's heap keeps what it grew to).
    v_new = _float32(second_moment).mul(beta2).add_(s32.square().mul_(1.0 - beta2))
    den = v_new.div(1.0 - beta2**age).sqrt_()  # root
    den.add_(torch.clamp(eps * den.mean(dim=(-2, -1), keepdim=True), min=TINY))
    num = s32 if numerator is None else _float32(numerator)
    return torch.div(num, den, out=den), v_new


def gram_preconditioned(
    numerator: torch.Tensor, gram: torch.Tensor, tokens: torch.Tensor, damping: float
) -> torch.Tensor:
    """``N Γ̃⁻¹`` with ``Γ̃ = Γ/n + (λ·tr(Γ/n)/r + tiny)·I`` (``input_precondition: gram``); inputs untouched.

    ``Γ = Σ z zᵀ`` is the ``r × r`` Gram of the update's projected layer inputs ``z = P x`` over its ``n`` tokens
    (``tokens``), so ``Γ/n = P A Pᵀ`` with ``A`` the inputs' second moment: the layer's KL for a step ``ΔW = U P`` is,
    on its input side, ``tr(U P A Pᵀ Uᵀ)``, and the step that gains most for it is ``U ∝ S (P A Pᵀ)⁻¹`` — K-FAC's
    input factor, exact inside the sketch. ``λ`` (relative to the mean eigenvalue) keeps directions the batch barely
    visits from blowing up. Works on one matrix (``(d_out, r)``, ``(r, r)``, ``(1,)``) or a stack (``(k, …)``).
    """
    n = tokens.clamp(min=1.0).reshape(*tokens.shape[:-1] if gram.dim() == 2 else tokens.shape, 1, 1)
    second = gram / n
    rank = second.shape[-1]
    mean = second.diagonal(dim1=-2, dim2=-1).sum(dim=-1).reshape(n.shape) / rank
    eye = torch.eye(rank, dtype=second.dtype, device=second.device)
    damped = second + (damping * mean + TINY) * eye
    return torch.linalg.solve(damped, _float32(numerator).mT).mT  # N Γ̃⁻¹ (Γ̃ symmetric)


def sgd_direction(sketch: torch.Tensor) -> torch.Tensor:
    """SGD mode: ``D = S``."""
    return _float32(sketch).clone()


def first_moment(sketch: torch.Tensor, moment: torch.Tensor, beta1: float, weight: float | None = None) -> torch.Tensor:
    """``m ← β1·m + (1−β1)·S`` in fp32 (from ``m`` as stored: fp32 or bf16), the sketch-space first moment;
    returns the new fp32 ``m``, inputs untouched. The caller rounds it to the storage dtype when it commits.
    ``weight`` replaces ``1−β1`` as the new sketch's weight (a horizon in KL, :func:`horizon_decay`)."""
    # ``β1·m`` is a new tensor (``m`` as stored is never written); the second product is added to it in place.
    return _float32(moment).mul(beta1).add_(_float32(sketch).mul(1.0 - beta1 if weight is None else weight))


def horizon_decay(beta1: float, moved_kl: float | None, reference_kl: float) -> float:
    """The first moment's decay for one update when its horizon is a distance in policy space, not a count of
    updates: ``β = β1^√(κ/κ_ref)``, ``κ`` the KL the previous merged update moved the policy (``moved_kl``).

    The gradients a moment holds go stale as the policy moves away from where they were taken, and distance in
    policy space grows as ``√KL``: a moment that keeps ``β1`` per update of KL ``κ_ref`` keeps ``β1^2`` per update
    of ``4·κ_ref`` and ``1`` (nothing decays) across an update that did not move the policy. ``moved_kl`` ``None`` (no
    update merged yet) or not finite (not priced) reads as ``κ_ref``: the moment decays by ``β1``.
    """
    if moved_kl is None or not math.isfinite(moved_kl):
        return beta1
    return beta1 ** math.sqrt(max(moved_kl, 0.0) / reference_kl)


def moment_mass(mass: float, decay: float, weight: float) -> float:
    """The total weight of the sketches a first moment holds after ``m ← decay·m + weight·S``: ``decay·c + weight``.

    ``m / c`` is the weighted mean of the sketches (the bias-corrected moment): with a constant ``decay = β1`` and
    ``weight = 1−β1`` it is ``c_a = 1 − β1^a`` (:func:`bias_corrected`); with a varying decay the weights no longer
    sum to a closed form, so ``c`` is carried (from 0 when the moment starts)."""
    return decay * mass + weight


def bias_corrected(moment: torch.Tensor, beta1: float, age: int) -> torch.Tensor:
    """``m̂ = m / (1 − β1^a)``, ``a`` the moment's updates since it started (from 1)."""
    if age < 1:
        raise ValueError(f"first-moment age starts at 1, got {age}")
    return moment / (1.0 - beta1**age)


def transfer_moment(moment: torch.Tensor, old: torch.Tensor, new: torch.Tensor, squared: bool = False) -> torch.Tensor:
    """Carry a first moment from projection ``old`` to ``new``: ``m ← m · (P_old P_oldᵀ)⁻¹ · P_old · P_newᵀ``.

    ``m`` is a sketch ``M P_oldᵀ`` of a dense moment ``M``; ``m (P_old P_oldᵀ)⁻¹ P_old`` is the least-norm ``M̂``
    with that sketch (``M`` restricted to the row space of ``P_old``), and ``M̂ P_newᵀ`` its sketch in the new
    basis. The transfer to the same basis is the identity; with orthonormal rows (``P Pᵀ = I``, e.g. a square
    orthogonal ``P``) it is ``m · P_old · P_newᵀ``. Computed in float64, returned in ``m``'s dtype.

    ``squared``: carry a per-entry second moment ``V`` (``update_rule: adam``) the way the variance of ``m``'s entries
    goes, ``V ← V · (C ∘ C)`` with ``C`` the same carry matrix (exact for independent entries; the identity for the
    same basis).
    """
    p_old, p_new = old.to(torch.float64), new.to(torch.float64)
    carry = torch.linalg.solve(p_old @ p_old.mT, p_old @ p_new.mT)  # (r × r): (P_old P_oldᵀ)⁻¹ P_old P_newᵀ
    if squared:
        carry = carry.square()
    return (moment.to(torch.float64) @ carry).to(moment.dtype)


def lr_factor(step: int, warmup_steps: int, decay_steps: int, min_ratio: float) -> float:
    """Multiplier of ``lr`` after ``step`` completed updates: linear warmup, then cosine decay to ``min_ratio``.

    Update ``k`` (from 0) uses ``(k+1)/(warmup+1)`` during the warmup, then
    ``min + (1 − min)·½(1 + cos(π·min((k − warmup)/decay, 1)))`` — dense AdamW's schedule (algorithm.md §10).
    ``warmup_steps = 0`` and ``min_ratio = 1`` give a constant 1.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    progress = min((step - warmup_steps) / max(decay_steps, 1), 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def projection_gram(projection: torch.Tensor) -> torch.Tensor:
    """``P Pᵀ`` in float64, the r × r Gram matrix through which :func:`lifted_sq_norm` measures ``‖D P‖``.

    It depends only on ``P``, so a caller measuring several factors against one projection (the proposal, then
    the guard before the merge) forms it once.
    """
    p64 = projection.to(torch.float64)
    return torch.bmm(p64, p64.mT) if p64.dim() == 3 else p64 @ p64.T


def lifted_sq_norm(
    direction: torch.Tensor, projection: torch.Tensor | None = None, *, gram: torch.Tensor | None = None
) -> torch.Tensor:
    """``‖D P‖_F²`` without forming the d_out × d_in product: ``Σ (D (P Pᵀ)) ⊙ D``, an r × r Gram matrix.

    Pass ``projection`` (``P``), or ``gram``: ``P Pᵀ`` from :func:`projection_gram` (the same value, not recomputed).
    Returns a 0-dim float64 tensor on ``D``'s device (``(k,)`` for a stack; reading it is the caller's choice: it
    syncs the device).
    """
    if gram is None:
        if projection is None:
            raise ValueError("lifted_sq_norm needs the projection or its Gram matrix")
        gram = projection_gram(projection)
    d64 = direction.to(torch.float64)
    product = torch.bmm(d64, gram) if d64.dim() == 3 else d64 @ gram  # bmm: what matmul runs on a stack
    return matrix_sum(product * d64)


def factor_gain(sketches: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """``⟨S, U⟩ = ⟨G Pᵀ, U⟩ = ⟨G, U P⟩``: the first-order decrease of the loss when ``W ← W − U P`` is merged,
    computed from the sketch without ``G``. ``S`` and ``U`` fp32 ``(d_out, r)`` or stacks ``(k, d_out, r)``; returns
    a 0-dim tensor or ``(k,)``: one fp32 dot product per matrix (one batched GEMM for a stack, no temporaries). The
    update merged at multiplier α gains ``α·⟨S, U⟩`` (up to the factor's bf16 rounding)."""
    if sketches.dim() == 2:
        return torch.dot(sketches.view(-1), factors.view(-1))
    k, n = sketches.shape[0], sketches.shape[1] * sketches.shape[2]
    return torch.bmm(sketches.view(k, 1, n), factors.view(k, n, 1)).view(k)


def ratio_scale(
    weight_sq_norm: float | torch.Tensor, lifted_sq_norm_total: float | torch.Tensor, ratio: float
) -> float:
    """``c = update_ratio · sqrt(Σ‖W‖² / Σ‖D P‖²)`` so that ``‖c·D P‖ = update_ratio·‖W‖`` over all matrices.

    A zero total direction (all sketches zero) gives ``c = 0``: no step, never ``0·inf``.
    """
    w = float(weight_sq_norm)
    d = float(lifted_sq_norm_total)
    if d == 0.0:
        return 0.0
    return ratio * (w / d) ** 0.5
