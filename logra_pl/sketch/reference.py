"""The sketch step one matrix at a time: the reference the grouped step is checked and measured against.

:class:`PerMatrixSketcher` is a :class:`~logra_pl.sketch.sketcher.LoGRASketcher` whose numerical kernels run the
formulas of algorithm.md §2-5 on each matrix alone, as the sketcher did before it grouped same-shaped matrices:
one RowAdam per sketch, one ``P Pᵀ`` and one ``‖D P‖²`` per matrix, ``‖W‖`` from a float64 copy of each weight,
one ``make_projection`` per seed, one ``transfer_moment`` per moment, and the merge
:func:`~logra_pl.sketch.merge.merge_rows_` per matrix. Everything around the kernels (the checks, the scales, the
guard, the bookkeeping) is the sketcher's own, so the two differ only in how the arithmetic is batched.

It is not used in training and is not selectable in a config: ``tests/sketch/test_fused.py`` checks that the grouped
step gives the same weights, row statistics, moments and payloads bit for bit, and ``benchmarks/sketch_step.py``
measures both (operator calls, wall time).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from logra_pl.sketch.config import LoGRAConfig, LoGRAConfigError
from logra_pl.sketch.groups import MatrixGroup
from logra_pl.sketch.merge import local_tensor, merge_operand, merge_rows_
from logra_pl.sketch.projection import make_projection
from logra_pl.sketch.sketcher import GroupStep, LoGRASketcher
from logra_pl.sketch.update import lifted_sq_norm, projection_gram, transfer_moment


class PerMatrixSketcher(LoGRASketcher):
    """:class:`~logra_pl.sketch.sketcher.LoGRASketcher` with every kernel run per matrix (same arguments).

    Per-matrix values are stacked into the per-group tensors the sketcher reads (stacking copies values, it changes
    no bit), and the state lives in the same group buffers, read through each matrix's views.
    """

    def __init__(self, model: nn.Module, config: LoGRAConfig | None = None, **kwargs: Any) -> None:
        if config is not None and config.input_scaling != "none":
            raise LoGRAConfigError(
                "PerMatrixSketcher is the reference of the unscaled kernels; input_scaling 'rms' is checked against "
                "dense computations instead (tests/sketch/test_input_scale.py): use LoGRASketcher"
            )
        if config is not None and config.sketch_side != "inputs":
            raise LoGRAConfigError(
                "PerMatrixSketcher is the reference of the inputs-side kernels; sketch_side 'outputs' is checked "
                "against dense computations instead (tests/sketch/test_outputs_side.py): use LoGRASketcher"
            )
        if config is not None and config.projection_storage != "dense":
            raise LoGRAConfigError(
                "PerMatrixSketcher draws each P in fp32 as the reference; projection_storage 'packed' is checked "
                "against the dense stacks instead (tests/sketch/test_packed_projections.py): use LoGRASketcher"
            )
        super().__init__(model, config, **kwargs)

    def _group_direction(self, group: MatrixGroup, step: int, grad_scale: float) -> GroupStep:
        rows = [
            self._rule(
                group.sketch[i],
                group.row_stats[i],
                None if group.moments is None else group.moments[i],
                step,
                grad_scale,
                None if group.second_moments is None else group.second_moments[i],
                None if group.grams is None else (group.grams[i], group.gram_tokens[i : i + 1]),
            )
            for i in range(group.size)
        ]
        d, v, m, second = zip(*rows, strict=True)
        return (
            torch.stack(d),
            None if v[0] is None else torch.stack(v),
            None if m[0] is None else torch.stack(m),
            None if second[0] is None else torch.stack(second),
        )

    def _sketch_finite(self) -> list[torch.Tensor]:
        return [torch.stack([torch.isfinite(s).all() for s in group.sketch]) for group in self.groups]

    def _lifted_sq_norms(self, stacks: list[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for group, factors in zip(self.groups, stacks, strict=True):
            grams = self._per_matrix_grams(group)
            out.append(torch.stack([lifted_sq_norm(f.float(), gram=g) for f, g in zip(factors, grams, strict=True)]))
        return out

    def _per_matrix_grams(self, group: MatrixGroup) -> list[torch.Tensor]:
        """``P Pᵀ`` of each matrix of the group, formed once per update (as the sketcher's own cache)."""
        key = self.groups.index(group)
        if key not in self._grams:
            self._grams[key] = torch.stack([projection_gram(p) for p in group.projection])
        return list(self._grams[key].unbind(0))

    def weight_norms(self) -> list[torch.Tensor]:
        return [
            torch.stack(
                [torch.linalg.vector_norm(local_tensor(w.weight).detach(), dtype=torch.float64) for w in g.linears]
            )
            for g in self.groups
        ]

    def _merge(self, group: MatrixGroup, factors: torch.Tensor) -> None:
        for i, (name, linear) in enumerate(zip(group.names, group.linears, strict=True)):
            weight = local_tensor(linear.weight)
            m = self.matrices[name]
            operand, scale = merge_operand(
                m.seed,
                m.rank,
                m.d_in,
                self.config.distribution,
                device=weight.device,
                projection=m.projection,
            )
            merge_rows_(
                weight.data,
                factors[i],
                operand,
                scale,
                row_offset=int(self.row_offsets.get(name, 0)),
                chunk_rows=self.config.merge_chunk_rows,
            )

    def _draw(self, group: MatrixGroup, seeds: list[int]) -> torch.Tensor:
        cfg = self.config
        return torch.stack(
            [make_projection(seed, group.rank, group.d_in, cfg.distribution, device=group.device) for seed in seeds]
        )

    def _transfer(
        self, group: MatrixGroup, rows: list[int], old: torch.Tensor, new: torch.Tensor, squared: bool = False
    ) -> None:
        kept = group.second_moments if squared else group.moments
        assert kept is not None
        for i in rows:
            kept[i] = transfer_moment(kept[i], old[i], new[i], squared)
