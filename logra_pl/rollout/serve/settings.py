"""``ServeSettings``: what ``logra-pl serve`` starts — the model, its dtypes, the engines and their devices, the
address and its safety (an API key beyond loopback) — checked when built, before any engine starts."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

from logra_pl.errors import ConfigError, check_choice, check_int, check_range
from logra_pl.rollout.protocol import API_KEY_ENV


@dataclass
class ServeSettings:
    """What ``logra-pl serve`` starts.

    Arguments:
        model: the policy: a ``save_pretrained`` folder, ``tiny[:preset]``, ``smollm2``, a ``.gguf`` file or a hub id
            (anything but a safetensors folder is written once to the cache as one).
        dtype: engine weights and activations (``float32`` for exact sync on CPU, ``bfloat16`` on GPUs).
        master_dtype: dtype of the worker's master copy in ``shadow`` sync mode: the trainer's parameter dtype, so
            merges stay bit-identical to the trainer's.
        tensor_parallel_size: vLLM tensor-parallel ranks per engine.
        data_parallel_size: independent engines started, on ports ``port, port+1, ...``, each on its own devices.
        host: address to bind; anything but a loopback address needs an API key.
        port: port of the first engine.
        devices: GPU indices to use (``"4,5,6,7"``), split over the engines; default: ``CUDA_VISIBLE_DEVICES``.
        api_key: shared token required by weight-changing requests (default: ``$LOGRA_PL_API_KEY``).
        max_request_mib: largest request body accepted (payloads and weight chunks).
        kv_cache_gib: KV-cache size on the CPU build.
        gpu_memory_utilization: share of GPU memory vLLM takes (GPU builds).
        max_model_len: longest prompt + response; None: the model's context.
        max_num_seqs: sequences scheduled at once.
        sync_mode: ``auto`` | ``inplace`` | ``shadow`` (see :mod:`logra_pl.rollout.vllm_worker`).
        enforce_eager: no CUDA graphs / compilation.
        seed: engine seed (every request carries its own sampling seeds).
    """

    model: str = "tiny"
    dtype: str = "float32"
    master_dtype: str = "float32"
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    host: str = "127.0.0.1"
    port: int = 8100
    devices: str | None = None
    api_key: str | None = None
    max_request_mib: float = 1024.0
    kv_cache_gib: float = 1.0
    gpu_memory_utilization: float = 0.85
    max_model_len: int | None = None
    max_num_seqs: int = 256
    sync_mode: str = "auto"
    enforce_eager: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        dtypes = ("float32", "bfloat16", "float16")
        check_choice("dtype", self.dtype, dtypes)
        check_choice("master_dtype", self.master_dtype, dtypes)
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        check_int("data_parallel_size", self.data_parallel_size, 1)
        check_int("port", self.port, 1, 65535 - self.data_parallel_size + 1)
        check_range("max_request_mib", self.max_request_mib, 0.0, low_open=True)
        check_choice("sync_mode", self.sync_mode, ("auto", "inplace", "shadow"))
        if self.api_key is None:
            self.api_key = os.environ.get(API_KEY_ENV) or None
        if not is_loopback(self.host) and not self.api_key:
            raise ConfigError(
                f"--host {self.host} exposes the engine beyond this machine, and anyone who reaches it could change "
                f"the policy's weights: set --api-key (or {API_KEY_ENV}) and give the trainer the same key (in the "
                "variable its model.engine.init_args.api_key_env names), or bind to 127.0.0.1"
            )

    def device_groups(self) -> list[str | None]:
        """The devices of each engine (``CUDA_VISIBLE_DEVICES`` values), or None per engine on CPUs."""
        source = self.devices if self.devices is not None else os.environ.get("CUDA_VISIBLE_DEVICES")
        if not source:
            return [None] * self.data_parallel_size
        ids = [d.strip() for d in str(source).split(",") if d.strip()]
        need = self.data_parallel_size * self.tensor_parallel_size
        if len(ids) < need:
            raise ConfigError(
                f"{self.data_parallel_size} engines x tensor_parallel_size {self.tensor_parallel_size} need {need} "
                f"devices, --devices gives {len(ids)} ({source}): list more devices or lower the sizes"
            )
        t = self.tensor_parallel_size
        return [",".join(ids[i * t : (i + 1) * t]) for i in range(self.data_parallel_size)]


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (nothing beyond this machine can connect)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
