"""Memory accounting: bytes of training state by kind, for a module, its optimizer and its LoGRA sketcher.

Counts each storage once (tied weights, views), by what it is for: ``weights``, ``gradients``,
``optimizer_state``, ``sketches``, ``projections``, ``row_statistics``, ``sketch_moments`` (LoGRA's sketch-space
first moment, and the per-entry second moment of ``update_rule: adam``), ``reference_policy`` (the KL penalty's
frozen initial policy, counted by the module: it is not part of the trained model). ``dense_gradient_equivalent`` is
what fp32 dense gradients of the sketched weights would have cost — the memory LoGRA does not spend.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields

import torch
from torch import nn

from logra_pl.sketch.merge import local_tensor
from logra_pl.sketch.sketcher import LoGRASketcher

MiB = 1024**2


@dataclass
class MemoryReport:
    """Bytes of training state by kind."""

    weights: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    adapters: int = 0
    adapter_optimizer_state: int = 0
    sketches: int = 0
    projections: int = 0
    row_statistics: int = 0
    sketch_moments: int = 0
    reference_policy: int = 0
    dense_gradient_equivalent: int = 0

    @property
    def total(self) -> int:
        """Bytes actually held (the dense-gradient equivalent is a counterfactual, not included)."""
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "dense_gradient_equivalent")

    @property
    def persistent(self) -> int:
        """Bytes that live across updates: weights, gradients, optimizer state (adapters and theirs), row statistics,
        sketch-space first moments and a KL penalty's reference policy.

        Sketches and projections are per-update working buffers (reset every update), so they are not counted.
        """
        held = self.weights + self.gradients + self.optimizer_state + self.row_statistics + self.sketch_moments
        return held + self.adapters + self.adapter_optimizer_state + self.reference_policy

    def as_mib(self) -> dict[str, float]:
        """Every field and the total in MiB."""
        out = {f.name: getattr(self, f.name) / MiB for f in fields(self)}
        out["total"] = self.total / MiB
        return out

    def format(self) -> str:
        """One line per kind, in MiB."""
        return "\n".join(f"  {k:<26}{v:12.3f} MiB" for k, v in self.as_mib().items())


def _storage_bytes(tensors: Iterable[torch.Tensor], seen: set[tuple[str, int]]) -> int:
    total = 0
    for t in tensors:
        t = local_tensor(t)
        if t.device.type == "meta":
            total += t.numel() * t.element_size()
            continue
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def local_state_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers held by this process (a sharded tensor's local shard), each
    storage once."""
    return _storage_bytes([*module.parameters(), *module.buffers()], set())


def memory_report(
    module: nn.Module, optimizer: torch.optim.Optimizer | None = None, sketcher: LoGRASketcher | None = None
) -> MemoryReport:
    """Bytes held by ``module``'s parameters and buffers, their ``.grad``, ``optimizer``'s state and the sketcher.

    LoRA adapters (parameters named ``...lora_A...``/``...lora_B...``) and their optimizer state are kinds of their
    own; their gradients count as gradients.
    """
    seen: set[tuple[str, int]] = set()
    report = MemoryReport()
    named = list(module.named_parameters())
    adapters = [p for n, p in named if ".lora_" in n]
    ids = {id(p) for p in adapters}
    params = [p for _, p in named]
    report.adapters = _storage_bytes(adapters, seen)
    report.weights = _storage_bytes(params, seen) + _storage_bytes(module.buffers(), seen)
    report.gradients = _storage_bytes((p.grad for p in params if p.grad is not None), seen)
    if optimizer is not None:

        def state_of(keep: bool) -> list[torch.Tensor]:
            return [
                v
                for p, st in optimizer.state.items()
                if (id(p) in ids) == keep
                for v in st.values()
                if isinstance(v, torch.Tensor)
            ]

        report.adapter_optimizer_state = _storage_bytes(state_of(True), seen)
        report.optimizer_state = _storage_bytes(state_of(False), seen)
    if sketcher is not None:
        dense_state = [v for st in getattr(sketcher, "dense_state", {}).values() for v in st.values()]
        report.optimizer_state += _storage_bytes(dense_state, seen)  # the dense_params' Adam moments
        report.sketches = _storage_bytes((m.sketch for m in sketcher.matrices.values()), seen)
        grams = [t for m in sketcher.matrices.values() for t in (m.gram, m.gram_tokens) if t is not None]
        report.sketches += _storage_bytes(grams, seen)  # input_precondition: gram's per-update Grams
        # The projections as held between uses (packed: their draws) and the bf16 sketch operands' signs.
        held = [m.stored_projection for m in sketcher.matrices.values()]
        signs = [m.stored_signs for m in sketcher.matrices.values() if m.stored_signs is not None]
        report.projections = _storage_bytes([*held, *signs], seen)
        report.row_statistics = _storage_bytes(sketcher.row_stats.values(), seen)
        # input_scaling: rms — the update's sums of squared inputs (with the sketches), the EMA and the scales
        stats = [t for m in sketcher.matrices.values() for t in (m.input_sq, m.input_tokens) if t is not None]
        report.sketches += _storage_bytes(stats, seen)
        kept = [t for g in getattr(sketcher, "groups", []) for t in (g.input_ema, g.input_scale) if t is not None]
        report.row_statistics += _storage_bytes(kept, seen)
        moments = [*getattr(sketcher, "moments", {}).values(), *getattr(sketcher, "second_moments", {}).values()]
        report.sketch_moments = _storage_bytes(moments, seen)
        report.dense_gradient_equivalent = sum(m.d_out * m.d_in * 4 for m in sketcher.matrices.values())
    return report
