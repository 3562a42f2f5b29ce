"""``ProjectedAdamW``: dense AdamW whose step lives in a rank-``r`` subspace of each matrix's outputs (a diagnostic).

Why: LoGRA with its sketch on the outputs' side (``R`` seeded ``r × d_out``, fixed) moves each matrix only along the
``r`` output directions ``R`` spans, and at a KL budget of 4e-3 on SmolLM2 it still trails dense AdamW on two prompt
orders where dense AdamW with its moments in rotated outputs at full rank does not (docs/benchmarks.md). Whether the
subspace loses by its size or by where it points is what this method tells apart. It is AdamW on the coordinates of
the gradient in an orthonormal basis ``Q`` (``r × d_out``) of that subspace::

    G' = Q G,   m, v ← Adam(G'),   ΔW = −lr·Qᵀ (m̂/(√v̂ + ε))        (G', m, v: r × d_in)

with ``Q`` either ``random`` (seeded, orthonormal rows: LoGRA's outputs' side with a dense gradient) or ``gradient``:
the top-``r`` left singular vectors of the gradient of the update that draws it, the subspace that holds most of
that gradient (the basis GaLore projects on). ``refresh_every`` draws a new ``Q`` every that many updates (0: the
first one is kept); the moments are carried to it as LoGRA carries its own, ``m ← C m`` and ``v ← (C∘C) v`` with
``C = Q_new Q_oldᵀ``. A matrix with ``d_out < r`` gets ``r = d_out``. Weight decay is decoupled and applied to ``W``.
It needs whole matrices: a sharded (FSDP) parameter is refused. It has no dense-gradient-free form: LoGRA's sketch
never holds ``G``, so a ``gradient`` basis built into LoGRA would have to come from a sketch of ``G``'s range.
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

BASES = ("random", "gradient")


def random_basis(d_out: int, rank: int, seed: int) -> torch.Tensor:
    """``r × d_out`` seeded random rows, orthonormal (QR of a Gaussian, signs fixed), float64."""
    gen = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(d_out, rank, generator=gen, dtype=torch.float64))
    return (q * torch.where(torch.diagonal(r) < 0, -1.0, 1.0)).T.contiguous()


def gradient_basis(grad: torch.Tensor, rank: int) -> torch.Tensor:
    """The top-``rank`` left singular vectors of ``grad`` (``d_out × d_in``) as ``r × d_out`` orthonormal rows (float64;
    each vector's sign fixed so its largest entry is positive, which makes the basis a function of ``grad``)."""
    u = torch.linalg.svd(grad.double(), full_matrices=False)[0][:, :rank]
    signs = torch.sign(u.gather(0, u.abs().argmax(0, keepdim=True)))
    return (u * torch.where(signs == 0, 1.0, signs)).T.contiguous()


class _ProjectedAdamWCore(DeltaStepOptimizer):
    """AdamW on the coordinates of each gradient in a rank-``r`` basis of its outputs (module docstring)."""

    def __init__(self, params: Any, rank: int, basis: str, refresh_every: int, seed: int, **adamw: Any) -> None:
        super().__init__(params, **adamw)
        self.rank, self.basis, self.refresh_every, self.seed = rank, basis, refresh_every, seed
        self._drawn: dict[int, tuple[float, torch.Tensor]] = {}  # a basis drawn for a step not yet committed

    def _draw(self, index: int, g: torch.Tensor, step: float) -> torch.Tensor:
        """The basis update ``step`` draws for parameter ``index``, once per proposal (its previews and step agree)."""
        drawn = self._drawn.get(index)
        if drawn is not None and drawn[0] == step and drawn[1].shape[1] == g.shape[0]:
            return drawn[1]
        rank = min(self.rank, g.shape[0])
        count = int(step - 1) // self.refresh_every if self.refresh_every else 0
        q = (
            random_basis(g.shape[0], rank, self.seed * 1_000_003 + index * 1_009 + count)
            if self.basis == "random"
            else gradient_basis(g, rank)
        )
        self._drawn[index] = (step, q)
        return q

    @override
    def _deltas(self, commit: bool) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        index = -1
        for group in self.param_groups:
            lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                if p.dim() != 2:
                    raise ValueError(f"ProjectedAdamW projects matrices; got a parameter of shape {tuple(p.shape)}")
                if hasattr(p, "to_local"):  # a shard's rows are not the matrix's outputs: its subspace is not Q's
                    raise ValueError("ProjectedAdamW needs whole matrices: run it without FSDP (one process or DDP)")
                w, g = local(p.detach()), local(p.grad)
                state = self.state[p]
                step = float(state["step"]) + 1 if "step" in state else 1.0
                due = "basis" not in state or (self.refresh_every and (step - 1) % self.refresh_every == 0)
                q = self._draw(index, g, step) if due else state["basis"]
                m, v = state.get("exp_avg"), state.get("exp_avg_sq")
                if due and m is not None:  # carry the moments to the new basis: m ← C m, v ← (C∘C) v
                    carry = (q @ state["basis"].T).to(m.dtype)
                    m, v = carry @ m, carry.square() @ v
                g_proj = q.to(g.dtype) @ g
                m = g_proj * (1 - beta1) if m is None else m * beta1 + g_proj * (1 - beta1)
                v = g_proj.square() * (1 - beta2) if v is None else v * beta2 + g_proj.square() * (1 - beta2)
                denom = v.sqrt().div_(math.sqrt(1 - beta2**step)).add_(eps)
                delta = q.T.to(g.dtype) @ m.div(denom).mul_(-lr / (1 - beta1**step))
                if wd:
                    delta.sub_(w, alpha=lr * wd)
                if commit:
                    state["step"] = torch.tensor(step)
                    state["basis"], state["exp_avg"], state["exp_avg_sq"] = q, m, v
                yield p, delta

    @override
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Take the step, then forget the bases drawn for it (the state keeps the one taken)."""
        super().step(closure)
        self._drawn.clear()


class ProjectedAdamWOptimizer(DeltaProposing, _ProjectedAdamWCore):
    """:class:`_ProjectedAdamWCore` stepping through a proposal, as every dense method's optimizer does."""

    @override
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """One proposal: the bases its previews draw are the ones its step takes, and none outlives it (a vetoed
        proposal's gradient basis is not the next gradient's)."""
        self._drawn.clear()
        try:
            return super().step(closure)
        finally:
            self._drawn.clear()


@dataclass
class ProjectionConfig:
    """The rank-``r`` subspace of each matrix's outputs that the step lives in.

    Arguments:
        rank: ``r``, the subspace's dimension (``min(r, d_out)`` per matrix).
        basis: ``random`` (seeded orthonormal rows) or ``gradient`` (the top-``r`` left singular vectors of the
            gradient of the update that draws it).
        refresh_every: a new basis every that many updates, the moments carried to it; 0 keeps the first.
        seed: seed of the random bases.
    """

    rank: int = 64
    basis: str = "random"
    refresh_every: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.basis not in BASES:
            raise ConfigError(f"projection.basis must be one of {BASES}, got {self.basis!r}")
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"projection.rank must be a positive integer, got {self.rank!r}")
        if not isinstance(self.refresh_every, int) or self.refresh_every < 0:
            raise ConfigError(
                f"projection.refresh_every must be 0 (never) or a positive integer, got {self.refresh_every!r}"
            )


class ProjectedAdamW(AdamWInBasis):
    """Dense AdamW on the target matrices with its step in a rank-``r`` subspace of their outputs (a diagnostic;
    module docstring).

    Arguments:
        adamw: learning rate, moments, schedule (:class:`~logra_pl.methods.adamw.AdamWConfig`; ``train_all`` is
            refused: norms and embeddings are not matrices to project).
        projection: rank, basis, refresh and seed (:class:`ProjectionConfig`).
    """

    optimizer_class = ProjectedAdamWOptimizer

    def __init__(self, adamw: AdamWConfig | None = None, projection: ProjectionConfig | None = None) -> None:
        super().__init__(adamw)
        self.projection = as_settings(ProjectionConfig, projection, "projection")

    @override
    def optimizer_options(self) -> dict[str, Any]:
        p = self.projection
        return {"rank": p.rank, "basis": p.basis, "refresh_every": p.refresh_every, "seed": p.seed}

    @override
    def report(self, policy: nn.Module, targets: Sequence[str]) -> str:
        grads, moments = self._state_text(policy)
        p = self.projection
        refresh = f"refreshed every {p.refresh_every} updates" if p.refresh_every else "fixed"
        return (
            f"dense AdamW with its step in a rank-{p.rank} {p.basis} subspace of the matrices' outputs ({refresh}) "
            f"trains {self.trained_parameter_count(policy):,} parameters: {grads} of gradients and {moments} of moments"
        )
