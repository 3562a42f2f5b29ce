"""``LoGRAWorkerExtension``: the receiving end of policy sync, mixed into every vLLM worker (algorithm.md §9).

vLLM builds its worker class with this class as a mixin (``LLM(worker_extension_cls=...)``), so these methods
run inside each worker — each tensor-parallel rank, in the engine process — and are reached through
``LLM.collective_rpc``. Arguments travel as bytes (safetensors), which works in-process and across processes.

Two ways to apply an update, chosen per platform by :meth:`logra_setup`:

- ``inplace`` (GPU builds): each trainer matrix maps to a slice of a vLLM parameter — a row block of the fused
  ``qkv_proj``/``gate_up_proj``, a row shard of a column-parallel layer, a column shard of a row-parallel one —
  and the factor update is merged into that slice where it lies (:mod:`logra_pl.rollout.slices`).
- ``shadow`` (the CPU build, where vLLM repacks linear weights for oneDNN and drops the plain tensor, so in-place
  edits have no effect): the worker keeps the checkpoint tensors in the trainer's dtype, applies the payload to
  them with the trainer's own :func:`~logra_pl.sketch.payload.apply_payload` (so they stay bit-identical to the
  trainer), and hands them to vLLM's ``reload_weights``, which re-fuses and repacks. This mode works on GPU too
  and is exact with a bf16 engine (fp32 master copy in host memory), at the cost of a full reload per update.

The caller (``VLLMEngine``) resets vLLM's prefix cache after every update: cached KV blocks of a prompt were
computed with the old weights and would otherwise be reused silently.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import time
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import load_file
from safetensors.torch import save as st_save

from logra_pl.rollout.protocol import checkpoint_key
from logra_pl.rollout.slices import EngineSlice, apply_payload_to_slices, column_parallel_slices, row_parallel_slice
from logra_pl.sketch.payload import Payload, apply_payload

SYNC_MODES = ("auto", "inplace", "shadow")


def engine_slices(model: torch.nn.Module) -> dict[str, EngineSlice]:
    """``{trainer matrix name: its slice on this rank}`` for every linear layer of a vLLM model.

    Fused layers are expanded with the model's ``packed_modules_mapping`` (``qkv_proj → q/k/v``,
    ``gate_up_proj → gate/up``); tensor-parallel shapes come from the layers themselves.
    """
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )

    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    out: dict[str, EngineSlice] = {}
    for name, module in model.named_modules():
        param = f"{name}.weight"
        prefix, _, leaf = name.rpartition(".")

        def qualify(part: str, prefix: str = prefix) -> str:
            return f"{prefix}.{part}" if prefix else part

        if isinstance(module, QKVParallelLinear):
            q, k, v = packed.get(leaf, ["q_proj", "k_proj", "v_proj"])
            reps = module.num_kv_head_replicas
            parts = [
                (qualify(q), module.total_num_heads * module.head_size, 1),
                (qualify(k), module.total_num_kv_heads * module.head_size, reps),
                (qualify(v), module.total_num_kv_heads * module.v_head_size, reps),
            ]
            out.update(column_parallel_slices(param, parts, module.input_size, module.tp_rank, module.tp_size))
        elif isinstance(module, MergedColumnParallelLinear):
            names = packed.get(leaf)
            if names is None or len(names) != len(module.output_sizes):
                raise ValueError(f"cannot tell which trainer matrices are fused into {name!r} ({leaf} not in {packed})")
            parts = [(qualify(n), size, 1) for n, size in zip(names, module.output_sizes, strict=True)]
            out.update(column_parallel_slices(param, parts, module.input_size, module.tp_rank, module.tp_size))
        elif isinstance(module, RowParallelLinear):
            out[name] = row_parallel_slice(param, module.output_size, module.input_size, module.tp_rank, module.tp_size)
        elif isinstance(module, ColumnParallelLinear):
            parts = [(name, module.output_size, 1)]
            out.update(column_parallel_slices(param, parts, module.input_size, module.tp_rank, module.tp_size))
        elif isinstance(module, ReplicatedLinear):
            size = (module.output_size, module.input_size)
            out[name] = EngineSlice(param, (0, size[0]), 0, (0, size[1]), size[1], size[0])
    return out


def tensors_to_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """Safetensors bytes of named tensors (contiguous CPU copies).

    A tensor that shares storage with an earlier one (tied ``lm_head``/``embed_tokens``) is sent once, under the
    first name: the receiver's tie restores the other.
    """
    seen: set[tuple[int, int]] = set()
    out: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        ident = (value.untyped_storage().data_ptr(), value.storage_offset())
        if ident in seen:
            continue
        seen.add(ident)
        out[key] = value.detach().contiguous().cpu()
    return st_save(out)


def tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    """A 16-hex-digit BLAKE2b digest of named tensors: names, dtypes, shapes and bytes, in name order.

    The trainer and an engine compute it on their own copies; equal digests mean bit-identical weights.
    """
    h = hashlib.blake2b(digest_size=8)
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class LoGRAWorkerExtension:
    """Methods vLLM mixes into its worker class; called through ``collective_rpc`` (see the module docstring)."""

    def logra_setup(self, mode: str = "auto", master_dtype: str | None = None) -> dict[str, Any]:
        """Build the slice map and, in ``shadow`` mode, the checkpoint-format master copy. Return a summary.

        Arguments:
            mode: ``auto`` (``shadow`` on CPU, ``inplace`` elsewhere), ``inplace`` or ``shadow``.
            master_dtype: dtype of the shadow copy (the trainer's, e.g. ``"float32"``); default: as stored.
        """
        from vllm.platforms import current_platform

        if mode not in SYNC_MODES:
            raise ValueError(f"unknown weight-sync mode {mode!r}: use one of {SYNC_MODES}")
        if mode == "auto":
            mode = "shadow" if current_platform.is_cpu() else "inplace"
        model = self.model_runner.get_model()
        self._logra_mode = mode
        self._logra_slices = engine_slices(model)
        self._logra_shadow: dict[str, torch.Tensor] = {}
        if mode == "shadow":
            self._logra_shadow = _read_checkpoint(self.vllm_config.model_config.model)
            if master_dtype is not None:
                dtype = getattr(torch, master_dtype)
                self._logra_shadow = {k: v.to(dtype) for k, v in self._logra_shadow.items()}
        tp = next(iter(self._logra_slices.values()), None)
        return {
            "mode": mode,
            "platform": "cpu" if current_platform.is_cpu() else current_platform.device_name,
            "matrices": len(self._logra_slices),
            "shadow_bytes": sum(t.numel() * t.element_size() for t in self._logra_shadow.values()),
            "tp_rank": getattr(self, "rank", 0),
            "example_slice": None if tp is None else repr(tp),
        }

    def logra_apply_payload(self, data: bytes) -> dict[str, float]:
        """Apply one serialized :class:`Payload`: ``W ← W − F P`` on every matrix it names."""
        start = time.perf_counter()
        payload = Payload.from_bytes(data)
        if self._logra_mode == "shadow":
            apply_payload(payload, self._logra_shadow)
            self._logra_reload()
        else:
            model = self.model_runner.get_model()
            apply_payload_to_slices(payload, self._logra_slices, dict(model.named_parameters()))
            if payload.dense:  # new values of densely trained parameters (logra.dense_params), loaded as they are
                model.load_weights(weights=iter(payload.dense.items()))
        return {"matrices": float(len(payload.factors)), "seconds": time.perf_counter() - start}

    def logra_load_weights(self, data: bytes, reload: bool = True) -> dict[str, float]:
        """Overwrite named tensors (checkpoint names, trainer wrappers stripped) with the serialized values.

        ``reload=False`` (``shadow`` mode) only updates the master copy, so a load sent in several chunks reloads
        vLLM's weights once, at :meth:`logra_reload` after the last chunk.
        """
        start = time.perf_counter()
        tensors = {checkpoint_key(k): v for k, v in st_load(data).items()}
        if self._logra_mode == "shadow":
            tied = bool(getattr(self.vllm_config.model_config.hf_config, "tie_word_embeddings", False))
            unknown = [k for k in tensors if k not in self._logra_shadow and not (tied and k == "lm_head.weight")]
            if unknown:
                raise KeyError(f"the engine's checkpoint has no tensors {unknown[:5]}: was it built from this policy?")
            for key, value in tensors.items():
                if key in self._logra_shadow:
                    self._logra_shadow[key].copy_(value)
            if reload:
                self._logra_reload()
        else:
            self.model_runner.get_model().load_weights(weights=iter(tensors.items()))
        return {"tensors": float(len(tensors)), "seconds": time.perf_counter() - start}

    def logra_get_weights(self, names: list[str]) -> bytes:
        """The engine's current values of trainer matrices (``<module>.weight``), for checks and tests.

        ``shadow`` mode returns the master copy; ``inplace`` mode reads this rank's slices back (whole matrices
        without tensor parallelism; the local block otherwise).
        """
        out: dict[str, torch.Tensor] = {}
        params = dict(self.model_runner.get_model().named_parameters())
        for key in names:
            if self._logra_mode == "shadow":
                out[key] = self._logra_shadow[key]
                continue
            sl = self._logra_slices[key[: -len(".weight")]]
            out[key] = params[sl.param].data[sl.local_row : sl.local_row + sl.num_rows]
        return tensors_to_bytes(out)

    def logra_digest(self, names: list[str]) -> dict[str, str]:
        """``{name: digest}`` of the engine's values of ``<module>.weight`` tensors (see :func:`tensor_digest`)."""
        return {name: tensor_digest({name: t}) for name, t in st_load(self.logra_get_weights(names)).items()}

    def logra_reload(self) -> None:
        """Hand the master copy to vLLM after a chunked load (``shadow`` mode; a no-op in ``inplace`` mode)."""
        if self._logra_mode == "shadow":
            self._logra_reload()

    def _logra_reload(self) -> None:
        """Hand the whole master copy to vLLM's ``reload_weights`` (it re-fuses and repacks each layer).

        vLLM warns, on every reload, about layers with no checkpoint tensors (rotary caches, a tied ``lm_head``);
        those keep their tensors by design, so the warning is silenced for the call.
        """
        quiet = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            self.reload_weights(weights_iterator=iter(list(self._logra_shadow.items())), is_checkpoint_format=True)
        finally:
            quiet.setLevel(level)
        # A tied ``lm_head`` has no checkpoint tensor, so the reload skips it — but on CPUs its GEMM runs on a
        # copy packed from the embedding at load time, which would keep computing logits with the old embedding.
        # Re-pack it from the (reloaded, shared) embedding weight.
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        method = getattr(head, "quant_method", None)
        if getattr(self.vllm_config.model_config.hf_config, "tie_word_embeddings", False) and method is not None:
            method.process_weights_after_loading(head)


def _read_checkpoint(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of a ``save_pretrained`` folder's safetensors files, in their stored dtype."""
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(
            f"shadow weight sync needs the model as safetensors files, and {folder!r} has none: "
            "save the policy with save_pretrained(safe_serialization=True)"
        )
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(f))
    return tensors
