"""``TwoSidedAdamW``: dense AdamW whose moments live in a sketch of each matrix's inputs and one of its outputs at once
(a diagnostic).

Why: at a KL budget of 4e-3 on SmolLM2 the rules that normalize in mixed input coordinates (LoGRA's sketch on the
inputs' side, LoRA's ``B`` under a random ``A``) lose some prompt orders, and the rule with its sketch on the outputs'
side keeps up with AdamW there only at r = 96; at 1e-3 the same r = 96 rule climbs less high than LoRA, where the
rank-64 rules on either side keep level with it (docs/benchmarks.md). LoRA's step has both sides: ``ΔB`` under the
input mixing of ``A`` and ``ΔA`` under the output mixing of ``B``. This method asks whether a rule with both sides,
each normalized per entry and on a fixed seeded basis, has the strengths of both. It is AdamW on two sets of
coordinates of the gradient::

    S = G Pᵀ (d_out × r_in),  T = R G (r_out × d_in),  m, v ← Adam(S), Adam(T)
    ΔW = −lr·[(m̂_S/(√v̂_S + ε)) P + Rᵀ (m̂_T/(√v̂_T + ε))]

with ``P`` (``r_in × d_in``) and ``R`` (``r_out × d_out``) seeded random rows, orthonormal, fixed for the run. ``S`` is
the inputs' side sketch and ``T`` the outputs' side sketch that LoGRA forms without ``G``; from a dense ``G`` they are
the same numbers, so this tells what the two-sided rule would learn before it is built into the sketcher. Either rank
may be 0 (one side only); a matrix with ``d < r`` gets ``r = d`` on that side. Weight decay is decoupled and applied to
``W``. The moments and bases are kept in the gradient's dtype. It needs whole matrices: a sharded (FSDP) parameter is
refused.
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
from logra_pl.methods.projected import random_basis
from logra_pl.methods.proposing import local


def side_seed(seed: int, index: int, side: str) -> int:
    """The seed of parameter ``index``'s basis on ``side`` (``inputs`` or ``outputs``): distinct for every pair."""
    return seed * 1_000_003 + index * 1_009 + (0 if side == "inputs" else 500)


def adam_direction(m: torch.Tensor, v: torch.Tensor, step: float, betas: tuple[float, ...], eps: float) -> torch.Tensor:
    """Adam's bias-corrected ``m̂ / (√v̂ + ε)`` at update ``step``."""
    beta1, beta2 = betas
    return (m / (1 - beta1**step)).div_(v.sqrt().div_(math.sqrt(1 - beta2**step)).add_(eps))


class _TwoSidedAdamWCore(DeltaStepOptimizer):
    """AdamW on an inputs' side and an outputs' side sketch of each gradient (module docstring)."""

    def __init__(self, params: Any, rank_inputs: int, rank_outputs: int, seed: int, **adamw: Any) -> None:
        super().__init__(params, **adamw)
        self.rank_inputs, self.rank_outputs, self.seed = rank_inputs, rank_outputs, seed

    def _bases(self, index: int, g: torch.Tensor, state: dict[str, Any]) -> tuple[torch.Tensor | None, ...]:
        """``P`` (``r_in × d_in``) and ``R`` (``r_out × d_out``) of parameter ``index``; None for a side of rank 0."""
        if "step" in state:  # drawn at the first update and kept
            return state.get("basis_inputs"), state.get("basis_outputs")
        d_out, d_in = g.shape

        def draw(d: int, rank: int, side: str) -> torch.Tensor | None:
            return random_basis(d, min(rank, d), side_seed(self.seed, index, side)).to(g.dtype) if rank else None

        return draw(d_in, self.rank_inputs, "inputs"), draw(d_out, self.rank_outputs, "outputs")

    @override
    def _deltas(self, commit: bool) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        index = -1
        for group in self.param_groups:
            lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
            betas = tuple(group["betas"])
            b1, b2 = betas
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                if p.dim() != 2:
                    raise ValueError(f"TwoSidedAdamW sketches matrices; got a parameter of shape {tuple(p.shape)}")
                if hasattr(p, "to_local"):  # a shard's rows are not the matrix's outputs: its sketches are not these
                    raise ValueError("TwoSidedAdamW needs whole matrices: run it without FSDP (one process or DDP)")
                w, g = local(p.detach()), local(p.grad)
                state = self.state[p]
                step = float(state["step"]) + 1 if "step" in state else 1.0
                basis_in, basis_out = self._bases(index, g, state)
                delta = torch.zeros_like(g)
                moments: dict[str, torch.Tensor] = {}
                for side, sketch in (
                    ("inputs", None if basis_in is None else g @ basis_in.T),
                    ("outputs", None if basis_out is None else basis_out @ g),
                ):
                    if sketch is None:
                        continue
                    m, v = state.get(f"exp_avg_{side}"), state.get(f"exp_avg_sq_{side}")
                    m = sketch * (1 - b1) if m is None else m * b1 + sketch * (1 - b1)
                    v = sketch.square() * (1 - b2) if v is None else v * b2 + sketch.square() * (1 - b2)
                    moments[f"exp_avg_{side}"], moments[f"exp_avg_sq_{side}"] = m, v
                    direction = adam_direction(m, v, step, betas, eps)
                    delta -= lr * (direction @ basis_in if side == "inputs" else basis_out.T @ direction)
                if wd:
                    delta.sub_(w, alpha=lr * wd)
                if commit:
                    state["step"] = torch.tensor(step)
                    bases = {"basis_inputs": basis_in, "basis_outputs": basis_out}
                    state.update({k: b for k, b in bases.items() if b is not None}, **moments)
                yield p, delta


class TwoSidedAdamWOptimizer(DeltaProposing, _TwoSidedAdamWCore):
    """:class:`_TwoSidedAdamWCore` stepping through a proposal, as every dense method's optimizer does."""


@dataclass
class TwoSidedConfig:
    """The two sketches of each matrix's gradient whose moments the step is made of.

    Arguments:
        rank_inputs: ``r_in``, the inputs' side sketch ``S = G Pᵀ`` (0: none).
        rank_outputs: ``r_out``, the outputs' side sketch ``T = R G`` (0: none).
        seed: seed of the bases (one pair per matrix, fixed for the run).
    """

    rank_inputs: int = 48
    rank_outputs: int = 48
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("rank_inputs", "rank_outputs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"sketches.{name} must be 0 (no such side) or a positive integer, got {value!r}")
        if not (self.rank_inputs or self.rank_outputs):
            raise ConfigError("sketches: rank_inputs and rank_outputs are both 0; give at least one side a rank")


class TwoSidedAdamW(AdamWInBasis):
    """Dense AdamW on the target matrices with its moments in an inputs' and an outputs' side sketch (a diagnostic;
    module docstring).

    Arguments:
        adamw: learning rate, moments, schedule (:class:`~logra_pl.methods.adamw.AdamWConfig`; ``train_all`` is
            refused: norms and embeddings are not matrices to sketch).
        sketches: the two ranks and the seed (:class:`TwoSidedConfig`).
    """

    optimizer_class = TwoSidedAdamWOptimizer

    def __init__(self, adamw: AdamWConfig | None = None, sketches: TwoSidedConfig | None = None) -> None:
        super().__init__(adamw)
        self.sketches = as_settings(TwoSidedConfig, sketches, "sketches")

    @override
    def optimizer_options(self) -> dict[str, Any]:
        s = self.sketches
        return {"rank_inputs": s.rank_inputs, "rank_outputs": s.rank_outputs, "seed": s.seed}

    @override
    def report(self, policy: nn.Module, targets: Sequence[str]) -> str:
        grads, _ = self._state_text(policy)
        s = self.sketches
        return (
            f"dense AdamW with its moments in a rank-{s.rank_inputs} inputs' and a rank-{s.rank_outputs} outputs' "
            f"sketch trains {self.trained_parameter_count(policy):,} parameters ({grads} of gradients)"
        )
