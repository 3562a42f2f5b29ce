"""Input-channel scaling (algorithm.md §3a, ``logra.input_scaling: rms``): the sketch and the step in scaled inputs.

A decoder's attention inputs have a few loud channels (SmolLM2: 6 of 576 channels hold 63% of ``E[x²]``). Dense
Adam gives each input channel its own step size; a sketch normalized in mixed coordinates (``S = G Pᵀ``) cannot,
and its mapped-back step follows the loud channels (``benchmarks/input_channels.py``). Replacing ``P`` by
``Q = P·diag(s)`` with ``s_j ∝ (rms x_j + ε)^(-1/2)`` puts half of the per-channel normalization on each side of
the rule: the sketch ``S = G Qᵀ`` sees the inputs divided by ``√rms``, the step ``ΔW = U Q`` divides once more.
``⟨S, U⟩`` is still the update's exact first-order gain, as ``⟨G, U Q⟩ = ⟨G Qᵀ, U⟩``.

The statistics are the mean squares of the layer inputs over the tokens of each merged update's forwards (summed in
backward, all-reduced with the sketches), averaged by an EMA across updates. ``s`` is fixed within an update (the
sketch stays linear in the batch) and is rounded to bf16: ``sign(P)·s`` is then exact in bf16 (the tensor-core
sketch path), and the merge's column scale ``c·s_j`` is exact in float64 (:func:`~logra_pl.sketch.merge.merge_stack_`).
"""

from __future__ import annotations

import torch

# ε of ``s_j = (rms_j + ε)^(-1/2)``, relative to the matrix's mean channel rms: a dead channel gets at most
# ``√(1/INPUT_SCALE_FLOOR)`` = 10× a typical channel's scale, not an unbounded one.
INPUT_SCALE_FLOOR = 1e-2


def ema_mean_squares(ema: torch.Tensor, sums: torch.Tensor, tokens: torch.Tensor, beta: float) -> torch.Tensor:
    """``β·ema + (1 − β)·Σx²/n`` per matrix and channel: ``ema`` and ``sums`` are ``(k, d_in)``, ``tokens`` ``(k,)``
    (fp32, the update's totals over every rank). Returns a new tensor."""
    mean_sq = sums / tokens.clamp_min(1).unsqueeze(-1)
    return ema * beta + mean_sq * (1.0 - beta)


def input_scales(ema: torch.Tensor, age: int, beta: float) -> torch.Tensor:
    """``s`` of every matrix from its EMA of mean squares after ``age`` (≥ 1) EMA steps: ``(k, d_in)`` fp32.

    ``rms_j = √(ema_j / (1 − β^age))`` (bias-corrected), ``s_j = (rms_j + ε)^(-1/2)`` with ``ε`` =
    :data:`INPUT_SCALE_FLOOR` × the matrix's mean ``rms``, normalized so that ``mean_j s_j² = 1`` (``‖Q‖ = ‖P‖`` in
    expectation: a step of the unscaled rule's size for the same learning rate), then rounded to bf16 (kept in fp32).
    """
    if age < 1:
        raise ValueError(f"input scales need at least one EMA step of statistics, got age {age}")
    rms = (ema.to(torch.float64) / (1.0 - beta**age)).clamp_min(0).sqrt()
    eps = INPUT_SCALE_FLOOR * rms.mean(dim=-1, keepdim=True)
    s = (rms + eps).rsqrt()
    s = torch.where(torch.isfinite(s), s, torch.ones_like(s))  # an all-zero matrix (never fed): unscaled
    s = s / s.square().mean(dim=-1, keepdim=True).sqrt()
    return s.to(torch.bfloat16).to(torch.float32)


def scaled_signs(projection: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``sign(P)·s`` in bf16 (exact: ``s`` is bf16-valued) for the tensor-core sketch path: ``(k, r, d_in)``."""
    return (projection.sign() * scales.unsqueeze(-2)).to(torch.bfloat16)
