"""Sketch accumulation (algorithm.md §3): ``S += dYᵀ (X Pᵀ)`` in backward, never forming ``G = dYᵀ X``.

A forward hook on each selected ``nn.Linear`` computes ``Z = X Pᵀ`` (tokens × r) and routes the layer output
through :class:`SketchGrad`, an identity autograd function that saves only ``Z``. Its backward adds
``dYᵀ Z`` (d_out × r, fp32) into the matrix's sketch buffer and passes ``dY`` through unchanged. Summed over
microbatches, ``S = (Σ dYᵀ X) Pᵀ = G Pᵀ`` exactly.

Activation checkpointing (non-reentrant) replays the forward, and with it this hook, to rebuild ``Z``; the
replayed graph is never back-propagated, so the accumulation runs once per microbatch.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from logra_pl.sketch.trace import traced


class MatrixSketch:
    """The sketch state of one selected weight ``W`` of shape ``(d_out, d_in)``.

    Arguments:
        name: wrapper-free module name (the key of its projection seed and of its payload entry).
        module: the ``nn.Linear`` holding ``W``.
        rank: sketch rank ``r``.
        sketch: the ``(d_out, r)`` fp32 buffer to accumulate into (the sketcher passes its row of a group's stack,
            :mod:`logra_pl.sketch.groups`); default: a zero buffer of its own on the weight's device.
        gram: an ``(r, r)`` fp32 buffer (and ``gram_tokens``, a 1-element one) into which backward also accumulates
            ``Γ += Z_mᵀ Z_m`` over the rows ``m`` whose output gradient is non-zero, and their count
            (``logra.input_precondition: gram``); None: not kept.

    Holds the current projection ``P`` (r × d_in, fp32; installed by the sketcher), its seed, and the sketch
    buffer ``S`` (d_out × r, fp32).
    """

    def __init__(
        self,
        name: str,
        module: nn.Linear,
        rank: int,
        sketch: torch.Tensor | None = None,
        gram: torch.Tensor | None = None,
        gram_tokens: torch.Tensor | None = None,
    ) -> None:
        self.name = name
        self.module = module
        self.rank = rank
        self.d_out, self.d_in = module.out_features, module.in_features
        device = module.weight.device
        if sketch is None:
            sketch = torch.zeros(self.d_out, rank, dtype=torch.float32, device=device)
        elif tuple(sketch.shape) != (self.d_out, rank):
            raise ValueError(
                f"sketch buffer of {name!r} has shape {tuple(sketch.shape)}, expected {(self.d_out, rank)}"
            )
        self.sketch = sketch
        self.gram, self.gram_tokens = gram, gram_tokens
        self._projection: torch.Tensor | None = torch.empty(0, device=sketch.device)
        self._projection_row: tuple[torch.Tensor, int] | None = None  # (stack, row) until first read
        self.seed = -1
        # A grad-requiring leaf routed into SketchGrad so backward reaches the hook even when nothing
        # below this layer requires grad (frozen embeddings, algorithm.md §1). It never receives a gradient.
        self.anchor = torch.zeros((), device=sketch.device, requires_grad=True)
        self.handle: Any = None

    @property
    def projection(self) -> torch.Tensor:
        """``P`` (r × d_in, fp32) of the current update: its row of the group's stack, viewed when first read."""
        if self._projection is None:
            assert self._projection_row is not None
            stack, row = self._projection_row
            self._projection = stack[row]
        return self._projection

    @projection.setter
    def projection(self, value: torch.Tensor) -> None:
        self._projection, self._projection_row = value, None

    def set_projection(self, projection: torch.Tensor, seed: int) -> None:
        """Install ``P`` (on the sketch's device) and its seed for the coming update: how a matrix sketched on its own,
        outside a :class:`~logra_pl.sketch.LoGRASketcher`, gets its projection (``tutorials/01_sketch_core``)."""
        self.projection = projection if projection.device == self.sketch.device else projection.to(self.sketch.device)
        self.seed = seed

    def set_stacked_projection(self, stack: torch.Tensor, row: int, seed: int) -> None:
        """Install row ``row`` of a ``(k, r, d_in)`` stack (on the sketch's device) as ``P``, and its seed; the row
        is viewed when ``P`` is first read (the sketcher installs whole groups at once)."""
        self._projection, self._projection_row = None, (stack, row)
        self.seed = seed

    def hook(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor | None:
        """Forward hook: save ``Z = X Pᵀ`` and route the output through :class:`SketchGrad`."""
        if not torch.is_grad_enabled():
            return None  # rollouts, log-prob scoring, evaluation: nothing to accumulate
        x = args[0]
        # fp32 even under autocast (bf16-mixed training): the sketch is exact for the bf16 activations it sees.
        with traced("logra.sketch.project"), _no_autocast(x.device):
            z = torch.matmul(x.detach().reshape(-1, self.d_in).to(torch.float32), self.projection.T)
        return SketchGrad.apply(output, z, self.anchor, self)

    def accumulate(self, grad_output: torch.Tensor, z: torch.Tensor) -> None:
        """``S += dYᵀ Z`` in fp32 (and, with a Gram buffer, ``Γ += Z_mᵀ Z_m`` over the rows with a gradient)."""
        dy = grad_output.reshape(-1, self.d_out).to(torch.float32)
        with traced("logra.sketch.accumulate"), _no_autocast(dy.device):
            self.sketch.addmm_(dy.T, z)
            if self.gram is not None:
                live = z[dy.ne(0).any(dim=1)]  # padding after a row's last token gets no gradient: left out
                self.gram.addmm_(live.T, live)
                self.gram_tokens.add_(live.shape[0])


def _no_autocast(device: torch.device) -> AbstractContextManager[object]:
    """Autocast off on ``device`` (the sketch's matmuls run in fp32); nothing to turn off on ``meta``, where the
    cost count (``benchmarks/update_cost.py``) runs the hooks on shapes alone."""
    return nullcontext() if device.type == "meta" else torch.autocast(device_type=device.type, enabled=False)


class SketchGrad(torch.autograd.Function):
    """Identity on the layer output whose backward accumulates ``dYᵀ Z`` into the matrix's sketch.

    Only ``Z`` (tokens × r) is saved for backward — not the layer input ``X`` (tokens × d_in).
    """

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, z: torch.Tensor, anchor: torch.Tensor, sketch: MatrixSketch) -> Any:
        ctx.save_for_backward(z)
        ctx.matrix = sketch
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        (z,) = ctx.saved_tensors
        ctx.matrix.accumulate(grad_output, z)
        return grad_output, None, None, None

    @staticmethod
    def jvp(ctx: Any, output_tangent: torch.Tensor, *_: Any) -> torch.Tensor:
        # Forward-mode AD (the KL probe) sees an identity; forward returned a view, so the tangent is one too.
        return output_tangent.view_as(output_tangent)
