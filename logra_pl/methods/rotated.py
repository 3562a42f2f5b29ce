"""``RotatedAdamW``: dense AdamW with its moments in a rotated basis of each matrix's inputs or outputs (a diagnostic).

Why: every rule that normalizes in mixed input coordinates (LoGRA's sketch-space Adam at rank 64 or at full rank on
an orthogonal projection, LoRA's ``B`` under a random ``A``) lost at least one prompt order at a KL budget of 4e-3
on SmolLM2, where dense AdamW, which normalizes each entry of ``W`` on its own, took off on all five
(docs/benchmarks.md). Adam is not rotation invariant: ``m/√v`` per entry depends on the basis. This method is AdamW
with everything the same but the basis its moments and per-entry normalization see, on one side of the matrix at a
time, at full rank (nothing projected away)::

    rotate: inputs     G' = G Qᵀ,  m, v ← Adam(G'),  ΔW = −lr·(m̂/(√v̂ + ε)) Q        (Q: d_in × d_in)
    rotate: outputs    G' = Q G,   m, v ← Adam(G'),  ΔW = −lr·Qᵀ (m̂/(√v̂ + ε))       (Q: d_out × d_out)

``Q = Q_a ⊗ Q_b`` is a seeded random orthogonal matrix built from two small ones (``a·b = d``, ``b`` the largest
divisor of ``d`` not above ``√d``): every rotated coordinate mixes every channel, and applying it costs
``d·(a + b)`` per row instead of ``d²``. Against dense AdamW, ``inputs`` is the mixing of LoGRA's sketch without its
rank; ``outputs`` is the mixing LoGRA never does (its rows are the matrix's own). Weight decay is decoupled and
applied to ``W`` itself, as torch's AdamW does. The moments are kept in the parameter's dtype, like torch's. It needs
whole matrices: a sharded (FSDP) parameter is refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from logra_pl.config import as_settings
from logra_pl.errors import ConfigError
from logra_pl.methods.adamw import AdamWConfig
from logra_pl.methods.basis_adamw import AdamWInBasis, DeltaProposing, DeltaStepOptimizer
from logra_pl.methods.proposing import local

SIDES = ("inputs", "outputs")


def kron_factors(d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two seeded random orthogonal matrices ``Q_a`` (``a × a``) and ``Q_b`` (``b × b``), ``a·b = d``, ``b`` the
    largest divisor of ``d`` with ``b ≤ √d``; ``Q = Q_a ⊗ Q_b`` (float64, QR of a Gaussian with the signs fixed)."""
    b = max(k for k in range(1, math.isqrt(d) + 1) if d % k == 0)
    gen = torch.Generator().manual_seed(seed)

    def orthogonal(n: int) -> torch.Tensor:
        q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
        return q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(n, dtype=torch.float64))

    return orthogonal(d // b), orthogonal(b)


def rotate_rows(x: torch.Tensor, qa: torch.Tensor, qb: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Each row ``x_i`` (length ``a·b``) to ``Q x_i`` (``inverse``: ``Qᵀ x_i``), ``Q = Q_a ⊗ Q_b``: ``x Qᵀ`` (or
    ``x Q``), without forming ``Q``."""
    rows, (a, b) = x.shape[0], (qa.shape[0], qb.shape[0])
    qa, qb = qa.to(x.dtype), qb.to(x.dtype)
    if inverse:
        qa, qb = qa.T, qb.T
    return torch.einsum("nij,ki,lj->nkl", x.reshape(rows, a, b), qa, qb).reshape(rows, a * b)


class _RotatedAdamWCore(DeltaStepOptimizer):
    """AdamW with its moments in a rotated basis of one side of each 2-D parameter (module docstring)."""

    def __init__(self, params: Any, rotate: str, seed: int, **adamw: Any) -> None:
        super().__init__(params, **adamw)
        self.rotate, self.seed = rotate, seed
        self._factors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _q(self, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        if d not in self._factors:
            self._factors[d] = kron_factors(d, self.seed * 1_000_003 + d)
        return self._factors[d]

    def to_rotated(self, t: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """``G Qᵀ`` (inputs) or ``Q G`` (outputs); ``inverse``: back, ``Δ' Q`` or ``Qᵀ Δ'``."""
        if self.rotate == "inputs":
            return rotate_rows(t, *self._q(t.shape[1]), inverse=inverse)
        return rotate_rows(t.T, *self._q(t.shape[0]), inverse=inverse).T

    @override
    def _deltas(self, commit: bool) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        for group in self.param_groups:
            lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dim() != 2:
                    raise ValueError(f"RotatedAdamW rotates matrices; got a parameter of shape {tuple(p.shape)}")
                if hasattr(p, "to_local"):  # a shard's rows or columns are not the matrix's: its rotation is not Q's
                    raise ValueError("RotatedAdamW needs whole matrices: run it without FSDP (one process or DDP)")
                w, g = local(p.detach()), local(p.grad)
                state = self.state[p]
                step = float(state["step"]) + 1 if "step" in state else 1.0
                g_rot = self.to_rotated(g)
                m = g_rot * (1 - beta1) if "exp_avg" not in state else state["exp_avg"] * beta1 + g_rot * (1 - beta1)
                v = (
                    g_rot.square() * (1 - beta2)
                    if "exp_avg_sq" not in state
                    else state["exp_avg_sq"] * beta2 + g_rot.square() * (1 - beta2)
                )
                denom = v.sqrt().div_(math.sqrt(1 - beta2**step)).add_(eps)
                delta = self.to_rotated(m.div(denom).mul_(-lr / (1 - beta1**step)), inverse=True)
                if wd:
                    delta.sub_(w, alpha=lr * wd)
                if commit:
                    state["step"] = torch.tensor(step)
                    state["exp_avg"], state["exp_avg_sq"] = m, v
                yield p, delta


class RotatedAdamWOptimizer(DeltaProposing, _RotatedAdamWCore):
    """:class:`_RotatedAdamWCore` stepping through a proposal, as every dense method's optimizer does."""


@dataclass
class RotationConfig:
    """Which side of each matrix the moments are rotated on.

    Arguments:
        rotate: ``inputs`` (the columns mixed, as LoGRA's sketch does) or ``outputs`` (the rows mixed).
        seed: seed of the rotations (one per dimension).
    """

    rotate: str = "inputs"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rotate not in SIDES:
            raise ConfigError(f"rotation.rotate must be one of {SIDES}, got {self.rotate!r}")


class RotatedAdamW(AdamWInBasis):
    """Dense AdamW on the target matrices with its moments in a rotated basis (a diagnostic; module docstring).

    Arguments:
        adamw: learning rate, moments, schedule (:class:`~logra_pl.methods.adamw.AdamWConfig`; ``train_all`` is
            refused: norms and embeddings are not matrices to rotate).
        rotation: the side and seed (:class:`RotationConfig`).
    """

    optimizer_class = RotatedAdamWOptimizer

    def __init__(self, adamw: AdamWConfig | None = None, rotation: RotationConfig | None = None) -> None:
        super().__init__(adamw)
        self.rotation = as_settings(RotationConfig, rotation, "rotation")

    @override
    def optimizer_options(self) -> dict[str, Any]:
        return {"rotate": self.rotation.rotate, "seed": self.rotation.seed}

    @override
    def report(self, policy: nn.Module, targets: Sequence[str]) -> str:
        grads, moments = self._state_text(policy)
        return (
            f"dense AdamW with its moments rotated on the matrices' {self.rotation.rotate} trains "
            f"{self.trained_parameter_count(policy):,} parameters: {grads} of gradients and {moments} of moments"
        )
