"""``LoRAMethod``: the paper's LoRA baseline (§3.4.2) on peft — adapters on the target matrices, AdamW on them.

Engines, exports and full syncs see the merged matrices ``W + (α/r)·B A`` under their plain names
(:class:`~logra_pl.lora.MergedState`), never the adapters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from logra_pl.guard import DivergenceGuard
from logra_pl.lora import LoRAConfig, MergedState, attach_lora, lora_layers, merged_tensors
from logra_pl.methods.adamw import DenseAdamW
from logra_pl.methods.base import count_text
from logra_pl.optim import AdamWConfig


class LoRAMethod(DenseAdamW):
    """LoRA adapters on the module's target matrices, trained by AdamW; the base weights stay frozen.

    Arguments:
        lora: adapter rank, alpha, dropout (:class:`~logra_pl.lora.LoRAConfig`).
        adamw: the adapters' AdamW and schedule.
    """

    name = "lora"

    def __init__(self, lora: LoRAConfig | None = None, adamw: AdamWConfig | None = None) -> None:
        super().__init__(adamw)
        self.lora = lora or LoRAConfig()

    @override
    def prepare_policy(self, policy: nn.Module, targets: Sequence[str]) -> None:
        attach_lora(policy, targets, self.lora)

    @override
    def configure_optimizers(self, policy: nn.Module, targets: Sequence[str], guard: DivergenceGuard) -> Any:
        self.guard = guard
        opt, sched = self.adamw.build(attach_lora(policy, targets, self.lora))
        self.optimizer = opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    @override
    def trained_tensors(self, policy: nn.Module) -> dict[str, torch.Tensor]:
        return merged_tensors(policy)

    @override
    def changed_numel(self, policy: nn.Module) -> int:
        return sum(t.numel() for t in merged_tensors(policy).values())

    @override
    def full_state(self, policy: nn.Module, dtype: torch.dtype | None = None) -> Mapping[str, torch.Tensor]:
        return MergedState(policy, dtype=dtype)

    @override
    def report(self, policy: nn.Module, targets: Sequence[str]) -> str:
        adapters, moments = self._state_text(policy)
        cfg, count = self.lora, count_text(self.trained_parameter_count(policy))
        return (
            f"LoRA trains {count} adapter parameters (rank {cfg.rank}, alpha {cfg.alpha:g}) on "
            f"{len(lora_layers(policy))} matrices ({', '.join(targets)}); the base weights are frozen. Its state: "
            f"{adapters} of adapters, as much again of gradients and {moments} of Adam moments"
        )
