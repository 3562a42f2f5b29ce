"""What the dense AdamW diagnostics share: AdamW whose moments live in another basis of each target matrix.

``RotatedAdamW`` (``rotated.py``), ``ProjectedAdamW`` (``projected.py``) and ``TwoSidedAdamW`` (``two_sided.py``)
each keep AdamW's moments in coordinates torch's AdamW does not know, so each writes its step as one generator,
``_deltas(commit)``: every parameter's ``ΔW`` at its group's ``lr`` and, with ``commit``, its new state kept. The rest
is the same for all three and lives here: :class:`DeltaStepOptimizer` takes that step and counts its squared norm,
:class:`DeltaProposing` mixes the proposal (step controllers, the divergence guard) in around it, and
:class:`AdamWInBasis` is the update method, :class:`~logra_pl.methods.adamw.DenseAdamW` with its optimizer built from
the subclass's class and options.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from typing_extensions import override

from logra_pl.errors import ConfigError
from logra_pl.methods.adamw import AdamWConfig, DenseAdamW
from logra_pl.methods.proposing import ProposingOptimizer


class DeltaStepOptimizer(torch.optim.Optimizer):
    """A torch optimizer whose step is ``W ← W + ΔW`` for each ``ΔW`` that :meth:`_deltas` yields.

    Arguments:
        params: the target matrices.
        lr: learning rate (the proposing mixin scales it by α for one step).
        betas: Adam's ``(β1, β2)``.
        eps: Adam's ``ε``.
        weight_decay: decoupled weight decay, applied to ``W`` itself.
    """

    def __init__(self, params: Any, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.last_update_sq = 0.0

    def _deltas(self, commit: bool) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        """``(parameter, ΔW)`` at each group's ``lr`` for every parameter with a gradient; ``commit`` keeps the new
        state (moments, bases, step count), without it nothing is changed."""
        raise NotImplementedError(f"{type(self).__name__} does not say what its step is")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Take the step at each group's ``lr``; :attr:`last_update_sq` is its squared norm."""
        self.last_update_sq = 0.0
        for p, delta in self._deltas(commit=True):
            self.last_update_sq += float(delta.double().square().sum())
            p.add_(delta)


class DeltaProposing(ProposingOptimizer):
    """Mixed in before a :class:`DeltaStepOptimizer`: its step is proposed first, and the proposal's ``ΔW`` is the
    step's own ``_deltas`` without committing them."""

    @override
    def step_deltas(self) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        with torch.no_grad():
            yield from self._deltas(commit=False)  # type: ignore[attr-defined]


class AdamWInBasis(DenseAdamW):
    """Dense AdamW on the target matrices with its optimizer :attr:`optimizer_class` (a :class:`DeltaProposing`
    :class:`DeltaStepOptimizer`), built with AdamW's settings and the subclass's :meth:`optimizer_options`.

    Arguments:
        adamw: learning rate, moments, schedule (:class:`~logra_pl.methods.adamw.AdamWConfig`; ``train_all`` is
            refused: norms and embeddings are not matrices).
    """

    optimizer_class: ClassVar[type[ProposingOptimizer]]

    def __init__(self, adamw: AdamWConfig | None = None) -> None:
        super().__init__(adamw)
        if self.adamw.train_all:
            raise ConfigError(
                f"{type(self).__name__} keeps its moments in a basis of the target matrices only: set "
                "adamw.train_all: false"
            )

    def optimizer_options(self) -> dict[str, Any]:
        """The keyword arguments :attr:`optimizer_class` takes beyond AdamW's (its basis, rank, seed, ...)."""
        return {}

    @override
    def build_optimizer(self, params: list[nn.Parameter]) -> tuple[ProposingOptimizer, LambdaLR]:
        a = self.adamw
        opt = self.optimizer_class(
            params,
            lr=a.lr,
            betas=tuple(a.betas),
            eps=a.eps,
            weight_decay=a.weight_decay,
            **self.optimizer_options(),
        )
        return opt, LambdaLR(opt, a.lr_factor)

    @override
    def applied_norm(self, inner: Any) -> float:
        return math.sqrt(inner.last_update_sq)
