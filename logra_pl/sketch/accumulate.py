"""Sketch accumulation (algorithm.md §3): ``S += dYᵀ (X Pᵀ)`` in backward, never forming ``G = dYᵀ X``.

A forward hook on each selected ``nn.Linear`` computes ``Z = X Pᵀ`` (tokens × r) and routes the layer output
through :class:`SketchGrad`, an identity autograd function that saves only ``Z``. Its backward adds
``dYᵀ Z`` (d_out × r, fp32) into the matrix's sketch buffer and passes ``dY`` through unchanged. Summed over
microbatches, ``S = (Σ dYᵀ X) Pᵀ = G Pᵀ`` exactly.

On the outputs' side (``logra.sketch_side: outputs``, :mod:`~logra_pl.sketch.side`) the hook saves the layer input ``X``
itself (tokens × d_in, what a dense weight gradient keeps) and the backward adds ``Xᵀ (dY Rᵀ)`` (d_in × r) into the
buffer: summed over microbatches, ``Σ Xᵀ dY Rᵀ = Gᵀ Rᵀ = Tᵀ`` exactly, ``R`` the ``r × d_out`` projection.

Activation checkpointing (non-reentrant) replays the forward, and with it this hook, to rebuild ``Z``; the
replayed graph is never back-propagated, so the accumulation runs once per microbatch. In the first pass of a layer
checkpointed by :func:`~logra_pl.runtime.checkpointing.enable_activation_checkpointing` the hook saves a placeholder
of ``Z``'s shape: that pass's saved tensors are dropped unread, so ``Z`` is computed once per microbatch, in the replay.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from logra_pl.runtime.checkpointing import replayed_later
from logra_pl.sketch.input_scale import scaled_signs
from logra_pl.sketch.projection import PackedProjections
from logra_pl.sketch.side import INPUTS, sketch_dims
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
        input_sq: a ``(d_in,)`` fp32 buffer (and ``input_tokens``, a 1-element one) into which backward adds the
            sums of the microbatch's squared inputs ``Σ_t x_tj²`` and its token count (``logra.input_scaling: rms``);
            None: not kept. Added in backward, so only forwards that are back-propagated count (not the KL probe's).
        input_scale: the ``(d_in,)`` per-channel scale ``s`` of the current update (``input_scaling: rms``): ``Z =
            (X diag(s)) Pᵀ`` in the fp32 path; the bf16 path's signs already hold ``sign(P)·s``. None: unscaled.
        operands: the dtype of the two matmuls' operands (``logra.sketch_operands``): ``torch.float32``, or
            ``torch.bfloat16`` — ``X`` and ``dY`` in bf16, ``P`` as its signs times one scale, ``Z`` as two bf16
            terms, every product accumulated in fp32 (:func:`mixed_mm`). Applies once the sketcher installs a
            stacked projection with its signs (:meth:`set_stacked_projection`).

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
        operands: torch.dtype = torch.float32,
        input_sq: torch.Tensor | None = None,
        input_tokens: torch.Tensor | None = None,
        side: str = INPUTS,
    ) -> None:
        self.name = name
        self.module = module
        self.rank = rank
        self.side = side
        self.d_out, self.d_in = module.out_features, module.in_features  # the layer's
        rows = sketch_dims(self.d_out, self.d_in, side)[0]
        device = module.weight.device
        if side != INPUTS and (gram is not None or input_sq is not None):
            raise ValueError(f"{name!r}: an outputs-side sketch keeps no Gram or input statistics")
        if sketch is None:
            sketch = torch.zeros(rows, rank, dtype=torch.float32, device=device)
        elif tuple(sketch.shape) != (rows, rank):
            raise ValueError(f"sketch buffer of {name!r} has shape {tuple(sketch.shape)}, expected {(rows, rank)}")
        self.sketch = sketch
        self.gram, self.gram_tokens = gram, gram_tokens
        self.input_sq, self.input_tokens = input_sq, input_tokens
        self.input_scale: torch.Tensor | None = None
        self.operands = operands
        self._signs: torch.Tensor | None = None  # bf16 sign(P) (r × d_in) with bf16 operands, else None
        self.scale: float | None = None  # |P|'s one non-zero magnitude, with the signs (read once per new P)
        self._projection: torch.Tensor | None = torch.empty(0, device=sketch.device)
        self._projection_row: tuple[torch.Tensor, int] | None = None  # (stack, row) until first read
        self._packed: tuple[PackedProjections, int] | None = None  # (packed stack, row): P built at each read
        self.seed = -1
        # A grad-requiring leaf routed into SketchGrad so backward reaches the hook even when nothing
        # below this layer requires grad (frozen embeddings, algorithm.md §1). It never receives a gradient.
        self.anchor = torch.zeros((), device=sketch.device, requires_grad=True)
        self.handle: Any = None

    @property
    def width(self) -> int:
        """The projection's width: the layer's ``d_in`` (inputs' side) or ``d_out`` (outputs')."""
        return sketch_dims(self.d_out, self.d_in, self.side)[1]

    @property
    def projection(self) -> torch.Tensor:
        """``P`` (r × d_in, fp32) of the current update: its row of the group's stack, viewed when first read; with
        packed projections, built from its draws at each read (the caller's to let go)."""
        if self._packed is not None:
            packed, row = self._packed
            return packed[row]
        if self._projection is None:
            assert self._projection_row is not None
            stack, row = self._projection_row
            self._projection = stack[row]
        return self._projection

    @projection.setter
    def projection(self, value: torch.Tensor) -> None:
        self._projection, self._projection_row, self._packed = value, None, None
        self.signs = self.scale = None  # the fp32 path until signs come with a stacked projection

    @property
    def signs(self) -> torch.Tensor | None:
        """The bf16 operand ``sign(P)`` (``sign(P)·s`` with input scales) with bf16 operands, else ``None``; with
        packed projections built at each read, like :attr:`projection`."""
        if self._packed is not None and self.scale is not None:
            p = self.projection
            return p.sign().to(torch.bfloat16) if self.input_scale is None else scaled_signs(p, self.input_scale)
        return self._signs

    @signs.setter
    def signs(self, value: torch.Tensor | None) -> None:
        self._signs = value

    @property
    def stored_projection(self) -> torch.Tensor:
        """What holds ``P`` between reads: its fp32 row (a view of the group's stack), or, packed, the row of draws
        it is built from (memory accounting reads this, not :attr:`projection`, which builds a packed ``P``)."""
        if self._packed is not None:
            packed, row = self._packed
            return packed.draws[row]
        return self.projection

    @property
    def stored_signs(self) -> torch.Tensor | None:
        """The bf16 signs held between reads (``None`` when packed: they are built at each read)."""
        return self._signs

    def set_packed_projection(self, packed: PackedProjections, row: int, seed: int, scale: float | None) -> None:
        """Install row ``row`` of a packed stack as ``P`` (built from its draws at each read), and its seed;
        ``scale`` (``P = scale·sign(P)``) for bf16 operands, whose signs are then built at each read too."""
        self._projection, self._projection_row, self._packed = None, None, (packed, row)
        self.seed = seed
        self._signs = None
        self.scale = scale if self.operands == torch.bfloat16 else None

    def set_projection(self, projection: torch.Tensor, seed: int) -> None:
        """Install ``P`` (on the sketch's device) and its seed for the coming update: how a matrix sketched on its own,
        outside a :class:`~logra_pl.sketch.LoGRASketcher`, gets its projection (``tutorials/01_sketch_core``)."""
        self.projection = projection if projection.device == self.sketch.device else projection.to(self.sketch.device)
        self.seed = seed

    def set_stacked_projection(
        self,
        stack: torch.Tensor,
        row: int,
        seed: int,
        signs: torch.Tensor | None = None,
        scales: list[float] | None = None,
    ) -> None:
        """Install row ``row`` of a ``(k, r, d_in)`` stack (on the sketch's device) as ``P``, and its seed; the row
        is viewed when ``P`` is first read (the sketcher installs whole groups at once). ``signs`` (``(k, r, d_in)``
        bf16) and ``scales`` (``k`` floats): ``P = scale·signs`` for bf16 operands."""
        self._projection, self._projection_row, self._packed = None, (stack, row), None
        self.seed = seed
        bf16 = self.operands == torch.bfloat16 and signs is not None and scales is not None
        self.signs = signs[row] if bf16 else None
        self.scale = scales[row] if bf16 else None

    def hook(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor | None:
        """Forward hook: save ``Z = X Pᵀ`` (outputs' side: ``X``) and route the output through :class:`SketchGrad`."""
        if not torch.is_grad_enabled():
            return None  # rollouts, log-prob scoring, evaluation: nothing to accumulate
        x = args[0].detach().reshape(-1, self.d_in)
        if self.side != INPUTS:  # X as the layer saw it (a view: a checkpointed first pass's is dropped unread)
            return SketchGrad.apply(output, x, self.anchor, self, None)
        stats = self.input_sq is not None
        if replayed_later():  # a checkpointed layer's first pass: the backward reads the Z its replay computes
            z = x.new_empty((x.shape[0], self.rank), dtype=torch.float32)
            sq = x.new_empty(self.d_in, dtype=torch.float32) if stats else None
            return SketchGrad.apply(output, z, self.anchor, self, sq)
        with traced("logra.sketch.project"), _no_autocast(x.device):
            sq = None
            signs = self.signs
            if signs is not None:  # bf16 X times P's signs (times s, exact in bf16), fp32 sums; P's scale c
                z = mixed_mm(x.to(torch.bfloat16), signs.T)  # is applied in the backward
                if stats:
                    sq = x.to(torch.float32).square().sum(0)  # never in place: x may be fp32 already
            else:  # fp32 even under autocast (bf16-mixed training): exact for the bf16 activations it sees
                xf = x.to(torch.float32)
                if stats:
                    sq = xf.square().sum(0)
                z = torch.matmul(xf if self.input_scale is None else xf * self.input_scale, self.projection.T)
        return SketchGrad.apply(output, z, self.anchor, self, sq)

    def accumulate(self, grad_output: torch.Tensor, z: torch.Tensor) -> None:
        """``S += dYᵀ Z`` in fp32 (and, with a Gram buffer, ``Γ += Z_mᵀ Z_m`` over the rows with a gradient); with
        bf16 operands, ``Z`` is ``X sign(P)ᵀ`` and ``S += c·(dYᵀ Z_hi + dYᵀ Z_lo)``: ``dY`` in bf16 times ``Z``'s two
        bf16 terms, each product summed in fp32, ``P``'s scale ``c`` folded into the sums. On the outputs' side ``z`` is
        ``X`` (:meth:`accumulate_outputs`)."""
        if self.side != INPUTS:
            self.accumulate_outputs(grad_output, z)
            return
        if self.scale is not None:  # bf16 operands: z came from P's signs
            with traced("logra.sketch.accumulate"), _no_autocast(grad_output.device):
                dy16 = grad_output.reshape(-1, self.d_out).to(torch.bfloat16)
                high = z.to(torch.bfloat16)
                low = torch.sub(z, high).to(torch.bfloat16)  # fp32 z − bf16 high, promoted: exact in fp32
                mixed_addmm_(self.sketch, dy16.T, high, self.scale)
                mixed_addmm_(self.sketch, dy16.T, low, self.scale)
                self._add_gram(dy16, z, self.scale**2)
            return
        dy = grad_output.reshape(-1, self.d_out).to(torch.float32)
        with traced("logra.sketch.accumulate"), _no_autocast(dy.device):
            self.sketch.addmm_(dy.T, z)
            self._add_gram(dy, z)

    def accumulate_outputs(self, grad_output: torch.Tensor, x: torch.Tensor) -> None:
        """Outputs' side: ``Tᵀ += Xᵀ (dY Rᵀ)`` in fp32, ``dY Rᵀ`` (tokens × r) formed first. With bf16 operands it is
        the inputs' path mirrored: ``Z = dY sign(R)ᵀ`` from bf16 ``dY`` summed in fp32, then ``Tᵀ += c·(Xᵀ Z_hi +
        Xᵀ Z_lo)`` from bf16 ``X``."""
        with traced("logra.sketch.accumulate"), _no_autocast(grad_output.device):
            signs = self.signs
            if signs is not None:
                assert self.scale is not None
                z = mixed_mm(grad_output.reshape(-1, self.d_out).to(torch.bfloat16), signs.T)
                x16 = x.to(torch.bfloat16)
                high = z.to(torch.bfloat16)
                low = torch.sub(z, high).to(torch.bfloat16)
                mixed_addmm_(self.sketch, x16.T, high, self.scale)
                mixed_addmm_(self.sketch, x16.T, low, self.scale)
                return
            dy = grad_output.reshape(-1, self.d_out).to(torch.float32)
            self.sketch.addmm_(x.to(torch.float32).T, torch.matmul(dy, self.projection.T))

    def add_input_stats(self, sq: torch.Tensor, tokens: int) -> None:
        """Add one microbatch's ``Σ_t x_tj²`` and token count to the update's input statistics (backward)."""
        assert self.input_sq is not None and self.input_tokens is not None
        self.input_sq.add_(sq)
        self.input_tokens.add_(tokens)

    def _add_gram(self, dy: torch.Tensor, z: torch.Tensor, scale: float = 1.0) -> None:
        """``Γ += scale·Z_mᵀ Z_m`` over the rows ``m`` with a non-zero output gradient, and their count (if kept)."""
        if self.gram is not None:
            live = z[dy.ne(0).any(dim=1)]  # padding after a row's last token gets no gradient: left out
            self.gram.addmm_(live.T, live, alpha=scale)
            self.gram_tokens.add_(live.shape[0])


# ``torch.mm``/``torch.addmm`` with ``out_dtype=float32`` for bf16 operands: CUDA (and the meta device) have them.
_MIXED_MM_DEVICES = ("cuda", "meta") if hasattr(torch.ops.aten.addmm, "dtype_out") else ()


def mixed_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of bf16 operands as an fp32 result with fp32 accumulation: on a GPU the tensor cores' bf16 GEMM
    with an fp32 output (``torch.mm(..., out_dtype=torch.float32)``); elsewhere the same products — exact in fp32,
    as a product of two bf16 values has at most 16 significant bits — summed by an fp32 GEMM."""
    if a.device.type in _MIXED_MM_DEVICES:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.to(torch.float32), b.to(torch.float32))


def mixed_addmm_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float) -> None:
    """``out += alpha·(a @ b)`` in place for bf16 ``a``, ``b`` and an fp32 ``out``, summed in fp32: one GEMM on a GPU
    (``torch.addmm(..., out_dtype=float32, out=out)``), the same products in fp32 elsewhere."""
    if a.device.type in _MIXED_MM_DEVICES:
        torch.addmm(out, a, b, alpha=alpha, out_dtype=torch.float32, out=out)
    else:
        out.addmm_(a.to(torch.float32), b.to(torch.float32), alpha=alpha)


def _no_autocast(device: torch.device) -> AbstractContextManager[object]:
    """Autocast off on ``device`` (the sketch's matmuls run in fp32); nothing to turn off on ``meta``, where the
    cost count (``benchmarks/update_cost.py``) runs the hooks on shapes alone."""
    return nullcontext() if device.type == "meta" else torch.autocast(device_type=device.type, enabled=False)


class SketchGrad(torch.autograd.Function):
    """Identity on the layer output whose backward accumulates ``dYᵀ Z`` into the matrix's sketch.

    Only ``Z`` (tokens × r) is saved for backward — not the layer input ``X`` (tokens × d_in; the outputs' side saves
    ``X`` in its place) — and, with input statistics kept, the ``d_in`` sums of its squares, added to the update's
    statistics in backward: a forward that is never back-propagated (the KL probe's) leaves them alone, and a
    checkpointed layer's replay supplies them.
    """

    @staticmethod
    def forward(
        ctx: Any,
        output: torch.Tensor,
        z: torch.Tensor,
        anchor: torch.Tensor,
        sketch: MatrixSketch,
        sq: torch.Tensor | None = None,
    ) -> Any:
        ctx.save_for_backward(z, sq)
        ctx.matrix = sketch
        ctx.tokens = z.shape[0]
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        z, sq = ctx.saved_tensors
        ctx.matrix.accumulate(grad_output, z)
        if sq is not None:
            ctx.matrix.add_input_stats(sq, ctx.tokens)
        return grad_output, None, None, None, None

    @staticmethod
    def jvp(ctx: Any, output_tangent: torch.Tensor, *_: Any) -> torch.Tensor:
        # Forward-mode AD (the KL probe) sees an identity; forward returned a view, so the tangent is one too.
        return output_tangent.view_as(output_tangent)
