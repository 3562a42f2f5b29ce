"""The LoGRA sketch core in pure PyTorch (no Lightning): one formula of docs/algorithm.md per function.

- :mod:`~logra_pl.sketch.targets` — which ``nn.Linear`` weights are sketched (§1)
- :mod:`~logra_pl.sketch.projection` — seeded projections ``P`` (§2)
- :mod:`~logra_pl.sketch.accumulate` — the hook that accumulates ``S = G Pᵀ`` (§3)
- :mod:`~logra_pl.sketch.update` — RowAdam/SGD directions and the global scale (§4)
- :mod:`~logra_pl.sketch.merge` — ``W ← W − F P`` on any row shard (§5)
- :mod:`~logra_pl.sketch.payload` — the proposal and its compact payload (§5, §9)
- :mod:`~logra_pl.sketch.sketcher` — :class:`LoGRASketcher`, tying the steps of one update together
- :mod:`~logra_pl.sketch.host` — per-matrix device scalars read on the host in one transfer
- :mod:`~logra_pl.sketch.memory` — bytes of training state by kind
- :mod:`~logra_pl.sketch.diagnostics` — how much of a dense gradient a sketch keeps (paper D.3)
- :mod:`~logra_pl.sketch.trace` — named ranges of each phase for profiler traces
"""

from logra_pl.sketch.accumulate import MatrixSketch, SketchGrad
from logra_pl.sketch.config import DEFAULT_TARGETS, LoGRAConfig, LoGRAConfigError
from logra_pl.sketch.diagnostics import SketchFidelity, sketch_fidelity
from logra_pl.sketch.memory import MemoryReport, memory_report
from logra_pl.sketch.merge import merge_chunk_rows, merge_operand, merge_rows_
from logra_pl.sketch.payload import MatrixProposal, Payload, Proposal, apply_payload, weight_tensors
from logra_pl.sketch.projection import make_projection, name_hash, projection_seed
from logra_pl.sketch.sketcher import LoGRASketcher
from logra_pl.sketch.targets import canonical_name, select_targets
from logra_pl.sketch.update import lifted_sq_norm, projection_gram, ratio_scale, rowadam_direction, sgd_direction

__all__ = [
    "DEFAULT_TARGETS",
    "LoGRAConfig",
    "LoGRAConfigError",
    "LoGRASketcher",
    "MatrixProposal",
    "MatrixSketch",
    "MemoryReport",
    "Payload",
    "Proposal",
    "SketchFidelity",
    "SketchGrad",
    "apply_payload",
    "canonical_name",
    "lifted_sq_norm",
    "make_projection",
    "memory_report",
    "merge_chunk_rows",
    "merge_operand",
    "merge_rows_",
    "name_hash",
    "projection_gram",
    "projection_seed",
    "ratio_scale",
    "rowadam_direction",
    "select_targets",
    "sgd_direction",
    "sketch_fidelity",
    "weight_tensors",
]
