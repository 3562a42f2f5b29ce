"""``LoRAMethod``: the LoRA baseline (paper §3.4.2) on peft — ``model.method: logra_pl.methods.LoRAMethod``.

Low-rank adapters ``ΔW = (α/r)·B A`` (``A``: r × d_in, Kaiming-initialised; ``B``: d_out × r, zeros) are injected
with peft into the same target matrices LoGRA sketches (q, k, v, o, gate, up, down), the base weights are frozen,
and the adapters are trained by the module's AdamW (``model.adamw``). The rollout engine never sees adapters: it
receives the merged matrices ``W + (α/r)·B A`` under their plain names (:func:`merged_tensors`,
:class:`MergedState`), so HF and vLLM engines, factor-free ``PolicySync(mode="full")``, checkpoints' exports and
verification all work on ordinary weights.

Adapters are injected in ``configure_model`` (after the engine copied the policy), so a checkpoint's state dict —
which holds ``...q_proj.base_layer.weight`` and ``...q_proj.lora_A.default.weight`` — loads back before the
optimizer is built.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from logra_pl.config import as_settings, register
from logra_pl.errors import check_int, check_range
from logra_pl.methods.adamw import AdamWConfig, DenseAdamW
from logra_pl.methods.base import PlanSettings, PlanShapes, count_text
from logra_pl.methods.guard import DivergenceGuard
from logra_pl.sketch.memory import MemoryReport
from logra_pl.sketch.merge import full_tensor

ADAPTER = "default"
_BASE = ".base_layer"


@dataclass
class LoRAConfig:
    """LoRA adapters of the baseline.

    Arguments:
        rank: adapter rank ``r`` (the paper compares LoGRA and LoRA at 256).
        alpha: scale numerator: ``ΔW = (alpha / rank)·B A`` (peft's ``lora_alpha``; 2·rank is common).
        dropout: dropout on the adapter input (0: trainer and engine compute the same distribution).
    """

    rank: int = 256
    alpha: float = 512.0
    dropout: float = 0.0

    def __post_init__(self) -> None:
        check_int("lora.rank", self.rank, 1)
        check_range("lora.alpha", self.alpha, 0.0, low_open=True)
        check_range("lora.dropout", self.dropout, 0.0, 1.0, high_open=True)


def attach_lora(policy: nn.Module, targets: Iterable[str], config: LoRAConfig) -> list[nn.Parameter]:
    """Inject adapters into every ``nn.Linear`` whose last name part is in ``targets``; freeze everything else.

    Idempotent. Returns the adapter parameters (what the optimizer trains).
    """
    from peft import LoraConfig, inject_adapter_in_model

    if not lora_layers(policy):
        peft_config = LoraConfig(
            r=config.rank,
            lora_alpha=config.alpha,
            lora_dropout=config.dropout,
            target_modules=sorted(set(targets)),
            bias="none",
        )
        inject_adapter_in_model(peft_config, policy)
    adapters = []
    for name, p in policy.named_parameters():
        is_adapter = ".lora_" in name
        p.requires_grad_(is_adapter)
        if is_adapter:
            adapters.append(p)
    return adapters


def lora_layers(policy: nn.Module) -> dict[str, nn.Module]:
    """``{module name: peft LoRA layer}`` (the layer holds ``base_layer``, ``lora_A``, ``lora_B``)."""
    from logra_pl.sketch.targets import canonical_name

    return {
        canonical_name(n): m for n, m in policy.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")
    }


def merged_weight(layer: nn.Module) -> torch.Tensor:
    """``W + (alpha/r)·B A`` of one LoRA layer, in the base weight's dtype (FSDP shards gathered)."""
    base = full_tensor(layer.base_layer.weight).detach()
    a = full_tensor(layer.lora_A[ADAPTER].weight).detach()
    b = full_tensor(layer.lora_B[ADAPTER].weight).detach()
    delta = (b.float() @ a.float()) * float(layer.scaling[ADAPTER])
    return (base.float() + delta).to(base.dtype)


def merged_tensors(policy: nn.Module) -> dict[str, torch.Tensor]:
    """``{"<module>.weight": merged matrix}`` of every adapted matrix, under the plain (engine) names."""
    return {f"{name}.weight": merged_weight(layer) for name, layer in lora_layers(policy).items()}


class MergedState(Mapping[str, torch.Tensor]):
    """The policy's state dict as an engine expects it: adapted matrices merged under their plain names,
    adapter tensors left out. Values are gathered (FSDP) and merged when read, one at a time."""

    def __init__(self, policy: nn.Module, dtype: torch.dtype | None = None) -> None:
        self._state = policy.state_dict()
        self._layers = lora_layers(policy)
        self.dtype = dtype
        self._keys: dict[str, str | None] = {}  # plain name -> state key (None: a merged matrix)
        for key in self._state:
            if ".lora_" in key:
                continue
            if f"{_BASE}." in key:
                module = key[: key.index(_BASE)]
                if key.endswith(f"{_BASE}.weight") and module in self._layers:
                    self._keys[f"{module}.weight"] = None
                    continue
                self._keys[key.replace(_BASE, "")] = key
                continue
            self._keys[key] = key

    def __getitem__(self, name: str) -> torch.Tensor:
        key = self._keys[name]
        value = merged_weight(self._layers[name[: -len(".weight")]]) if key is None else full_tensor(self._state[key])
        if self.dtype is not None and value.is_floating_point():
            value = value.to(self.dtype)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def spec(self, name: str) -> tuple[torch.Size, torch.dtype]:
        key = self._keys[name]
        value = self._state[key] if key is not None else self._layers[name[: -len(".weight")]].base_layer.weight
        cast = self.dtype is not None and value.is_floating_point()
        return value.shape, self.dtype if cast else value.dtype


def merge_lora_state(tensors: Mapping[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """A LoRA run's state dict (``base_layer`` + ``lora_A``/``lora_B`` keys) as the plain model's: each adapted
    matrix merged, ``W + (alpha / r)·B A``, under its plain name; adapters dropped. Used by ``logra-pl export``."""
    out: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        if ".lora_" in key:
            continue
        if f"{_BASE}." not in key:
            out[key] = value
            continue
        module = key[: key.index(_BASE)]
        a_key, b_key = f"{module}.lora_A.{ADAPTER}.weight", f"{module}.lora_B.{ADAPTER}.weight"
        if key.endswith(f"{_BASE}.weight") and a_key in tensors:
            a, b = tensors[a_key].float(), tensors[b_key].float()
            value = (value.float() + (alpha / a.shape[0]) * (b @ a)).to(value.dtype)
        out[key.replace(_BASE, "")] = value
    return out


@register("lora")
class LoRAMethod(DenseAdamW):
    """LoRA adapters on the module's target matrices, trained by AdamW; the base weights stay frozen.

    Arguments:
        lora: adapter rank, alpha, dropout (:class:`~logra_pl.methods.lora.LoRAConfig`).
        adamw: the adapters' AdamW and schedule.
    """

    name = "lora"

    def __init__(self, lora: LoRAConfig | None = None, adamw: AdamWConfig | None = None) -> None:
        super().__init__(adamw)
        self.lora = as_settings(LoRAConfig, lora, "lora")

    @classmethod
    @override
    def planned(cls, settings: PlanSettings) -> LoRAMethod:
        """Adapters of the plan's rank (alpha 2·rank) on the targets, AdamW on them."""
        return cls(LoRAConfig(rank=settings.rank, alpha=2.0 * settings.rank))

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

    @override
    def plan_memory(self, shapes: PlanShapes) -> MemoryReport:
        """Per target matrix, adapters ``A`` (r × d_in) and ``B`` (d_out × r) in the weights' dtype (peft builds them
        so; FSDP shards them on dim 0 too), their gradients, and AdamW's state on them."""
        adapters = [
            torch.empty(shape, dtype=shapes.dtype, device="meta")
            for linear in shapes.matrices.values()
            for shape in ((self.lora.rank, linear.in_features), (linear.out_features, self.lora.rank))
        ]
        size = sum(shapes.shard_bytes(t) for t in adapters)
        state = sum(2 * shapes.shard_bytes(t) + 4 for t in adapters)
        return MemoryReport(weights=shapes.weights, gradients=size, adapters=size, adapter_optimizer_state=state)

    @classmethod
    @override
    def exported_tensors(cls, tensors: dict[str, torch.Tensor], hparams: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The adapters merged into their matrices (``W + (alpha/r)·B A``, the ``alpha`` the checkpoint trained with):
        an export is a plain model."""
        return merge_lora_state(tensors, _saved_alpha(hparams))


def _saved_alpha(hparams: Mapping[str, Any]) -> float:
    """LoRA's ``alpha`` in a module's saved hyper-parameters: its ``lora`` section, a ``method`` given as a LoRA
    method (an object, or its ``{class_path, init_args}`` form), or the default."""
    method = hparams.get("method")
    if isinstance(method, LoRAMethod):
        return float(method.lora.alpha)
    section = hparams.get("lora")
    if isinstance(method, Mapping) and isinstance(method.get("init_args"), Mapping):
        section = method["init_args"].get("lora", section)
    if isinstance(section, LoRAConfig):
        return float(section.alpha)
    if isinstance(section, Mapping):
        return float(section.get("alpha", LoRAConfig().alpha))
    return float(LoRAConfig().alpha)
