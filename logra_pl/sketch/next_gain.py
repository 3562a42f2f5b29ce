"""An update's first-order gain on the *next* update's loss, from the next update's sketches (algorithm.md §6).

A merged update changes each matrix by ``ΔW = −F Q`` (``F`` the payload's factors, ``α`` included; ``Q = P`` or
``P·diag(s)`` with ``input_scaling``). The next update's sketch of its loss ``L'`` is ``S' = G' Qᵀ`` on the same
``Q`` while the basis persists, so

    −⟨G', ΔW⟩ = ⟨G', F Q⟩ = ⟨G' Qᵀ, F⟩ = ⟨S', F⟩

is exact without ``G'``: one dot product per matrix, on sketches the next update forms anyway. When the basis changed
between the two updates (a refresh drew a new ``P``, or new input scales were set), ``S'`` is on another basis and
the gain is not measured. Dense parameters trained beside the sketches (``logra.dense_params``) add
``−⟨g', α·Δ⟩`` from their kept steps.

:class:`KeptStep` holds one merged update: per group, its factors in float32 (``k × d_out × r``, the size of a
first moment) and the basis they were merged on (the very tensors: a new basis is a new tensor, never an in-place
write), and the dense parameters' steps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from logra_pl.sketch.update import factor_gain


class KeptStep:
    """One merged update, kept to measure its gain on the next update's loss.

    Arguments:
        factors: per group, the merged ``(k, d_out, r)`` factors ``F`` (kept in float32).
        projections: per group, the ``(k, r, d_in)`` projections ``P`` they were merged with.
        input_scales: per group, the ``(k, d_in)`` input scales ``s`` (``Q = P·diag(s)``), or None.
        dense: ``{name: α·Δ}`` of the dense parameters (this process's shards).
    """

    def __init__(
        self,
        factors: Sequence[torch.Tensor],
        projections: Sequence[torch.Tensor],
        input_scales: Sequence[torch.Tensor | None],
        dense: Mapping[str, torch.Tensor],
    ) -> None:
        self.factors = [f.detach().to(torch.float32, copy=True) for f in factors]
        self.projections = list(projections)
        self.input_scales = list(input_scales)
        self.dense = dict(dense)

    def same_basis(self, projections: Sequence[torch.Tensor], input_scales: Sequence[torch.Tensor | None]) -> bool:
        """Whether the groups' current ``Q`` is the one this step was merged on (the same tensors)."""
        return all(a is b for a, b in zip(self.projections, projections, strict=True)) and all(
            a is b for a, b in zip(self.input_scales, input_scales, strict=True)
        )

    @torch.no_grad()
    def sketched_gains(self, sketches: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``⟨S', F⟩`` per group (``(k,)`` fp32 on the device; no sync): the kept step's gain on the loss whose raw
        sketches are ``sketches``, before the loss's ``grad_scale``."""
        return [factor_gain(s, f) for s, f in zip(sketches, self.factors, strict=True)]

    @torch.no_grad()
    def dense_gains(self, grads: Mapping[str, torch.Tensor | None]) -> list[torch.Tensor]:
        """``−⟨g', α·Δ⟩`` per dense parameter with a gradient (0-dim float64 on the device, before the loss's
        ``grad_scale``; ``grads`` the local shards)."""
        out = []
        for name, delta in self.dense.items():
            grad = grads.get(name)
            if grad is not None:
                out.append(-torch.dot(grad.reshape(-1).to(torch.float64), delta.reshape(-1).to(torch.float64)))
        return out
