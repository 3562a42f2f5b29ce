"""``logra-pl serve``: vLLM engines behind an HTTP API that speaks the rollout-engine contract (algorithm.md §9).

The paper's topology puts the training ranks and the generation engines on different GPUs, often different hosts.
This module serves one vLLM engine — vLLM's own ``AsyncLLM`` engine client, built by vLLM's server machinery, with
the :class:`~logra_pl.rollout.vllm_worker.LoGRAWorkerExtension` in every worker — behind a small FastAPI app run by
uvicorn (both ship with vLLM). :class:`~logra_pl.rollout.remote.RemoteEngine` is the trainer's side.

The API (version 1, every path under ``/v1``; documented in docs/serving.md):

- ``GET  /v1/health``: state of the engine — its weights ``version``, model, dtypes, context, matrix shapes.
- ``POST /v1/generate``: token ids in; token ids, finish reasons and the exact log-probs of the sampled tokens out
  (the contract of the in-process engines), one seed per response.
- ``POST /v1/probe``: greedy generation with log-probs, for verification.
- ``POST /v1/payload``: a serialized LoGRA factor payload (``W ← W − F P`` on every matrix it names).
- ``POST /v1/weights``: full tensors as safetensors bytes, in one or several chunks; ``POST /v1/weights/path``:
  the same, read from safetensors files on a filesystem the server shares with the trainer.
- ``POST /v1/weights/digest``: digests of the engine's weights (bit-identical weights ⇔ equal digests).
- ``POST /v1/reset_prefix_cache``.

**Weight versions.** The server's weights carry a version string. Every weight change names the version it
expects to replace and the one it creates; a change that does not start from the server's version is refused
with 409, so a lost or duplicated update is detected instead of applied twice (a request repeated after its
response was lost finds the new version in place and is answered 200 without applying it again). A generate
request may name the version it expects: then it is refused (409) rather than sampled from other weights. A
fresh server starts at ``base:<engine id>``, so a restarted engine is recognised by its version. Every weight
change ends with ``reset_prefix_cache`` (KV blocks computed with old weights must not be reused) and waits for
running generations to finish first.

**Safety.** The server binds to 127.0.0.1 unless told otherwise; bound anywhere else it refuses to start without an
API key (``--api-key`` or ``LOGRA_PL_API_KEY``), which every weight-changing request must then carry as
``Authorization: Bearer <key>``. Request bodies are bounded (``--max-request-mib``). A payload or weight chunk is
parsed and checked — names, shapes, finiteness — before it reaches the engine, so a malformed one gets a 4xx and
leaves the weights untouched.
"""

# No `from __future__ import annotations` here: FastAPI reads the handlers' annotations (`Request`) as objects.
import argparse
import asyncio
import contextlib
import hmac
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from logra_pl.errors import ConfigError, check_choice, check_int, check_range
from logra_pl.rollout.remote import API_KEY_ENV, API_VERSION, CHUNK_HEADER, EXPECT_HEADER, FULL_HEADER, NEW_HEADER

READY_LINE = "logra-pl serve: ready at"


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
                f"the policy's weights: set --api-key (or {API_KEY_ENV}) and give the trainer the same key "
                "(model.remote.api_key), or bind to 127.0.0.1"
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


# ----------------------------------------------------------------------------------------------- the model
def checkpoint_shapes(folder: str | Path) -> dict[str, tuple[list[int], str]]:
    """``{tensor name: (shape, dtype)}`` of a safetensors folder, read from the file headers (no tensor data)."""
    from safetensors import safe_open

    out: dict[str, tuple[list[int], str]] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                sl = f.get_slice(key)
                out[key] = (list(sl.get_shape()), str(sl.get_dtype()))
    return out


def served_model_folder(source: str, dtype: str) -> Path:
    """A safetensors folder of ``source`` that vLLM can read (written once to the cache when needed)."""
    from logra_pl.models.load import load_policy, resolve_source
    from logra_pl.rollout.registry import engine_model_folder

    resolved = resolve_source(source)
    return engine_model_folder(source, resolved, dtype, lambda: load_policy(source, dtype=getattr(torch, dtype)))


class WeightsLock:
    """Many generations at a time, or one weight change: a change waits until running generations finish."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writing = False

    @contextlib.asynccontextmanager
    async def read(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writing)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def write(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writing and self._readers == 0)
            self._writing = True
        try:
            yield
        finally:
            async with self._cond:
                self._writing = False
                self._cond.notify_all()


class RequestError(Exception):
    """A request the server refuses: an HTTP status and a message that names the problem."""

    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.extra = extra


# ---------------------------------------------------------------------------------------------- the state
class EngineState:
    """One served engine: the vLLM engine client, the weights version and the checks every request passes.

    Arguments:
        client: vLLM's ``AsyncLLM`` (an ``EngineClient``) with the LoGRA worker extension.
        settings: the serve settings.
        model_dir: the safetensors folder the engine was built from.
        info: what ``logra_setup`` returned from the workers (sync mode, platform...).
    """

    def __init__(self, client: Any, settings: ServeSettings, model_dir: Path, info: list[dict[str, Any]]) -> None:
        self.client = client
        self.settings = settings
        self.model_dir = model_dir
        self.info = info
        self.engine_id = uuid.uuid4().hex[:12]
        self.version = f"base:{self.engine_id}"
        self.loading: dict[str, Any] | None = None  # chunked full load in progress: {"version", "next", "total"}
        self.shapes = checkpoint_shapes(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        self.tied = bool(config.get("tie_word_embeddings", False))
        self.vocab_size = int(config.get("vocab_size", 0))
        self.max_model_len = int(client.model_config.max_model_len)
        self.lock = WeightsLock()
        self.counts = {"payloads": 0, "full_loads": 0, "refused": 0, "generate_requests": 0}
        self.started = time.time()

    # -------------------------------------------------------------------------------------------- views
    def health(self) -> dict[str, Any]:
        """The engine's state, as ``GET /v1/health`` reports it."""
        matrices = {
            k[: -len(".weight")]: shape
            for k, (shape, _) in self.shapes.items()
            if k.endswith(".weight") and len(shape) == 2
        }
        return {
            "status": "ok",
            "api": API_VERSION,
            "engine_id": self.engine_id,
            "version": self.version,
            "loading": self.loading is not None,
            "model": str(self.settings.model),
            "dtype": self.settings.dtype,
            "master_dtype": self.settings.master_dtype,
            "sync_mode": self.info[0].get("mode"),
            "platform": self.info[0].get("platform"),
            "tensor_parallel_size": self.settings.tensor_parallel_size,
            "max_model_len": self.max_model_len,
            "vocab_size": self.vocab_size,
            "matrices": matrices,
            "tensors": sorted(self.shapes),
            "counts": dict(self.counts),
            "uptime_s": time.time() - self.started,
        }

    # ----------------------------------------------------------------------------------------- sampling
    async def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        """Sample one response per row (``prompts`` repeated ``n`` times in a row) with its own seed."""
        from vllm.inputs import TokensPrompt

        from logra_pl.errors import PolicyDivergedError
        from logra_pl.rollout.base import SamplingConfig, expand_prompts
        from logra_pl.rollout.vllm import request_params, rollout_from_outputs, row_seeds

        try:
            prompts = [[int(t) for t in p] for p in body["prompts"]]
            sampling = SamplingConfig(
                n=int(body.get("n", 1)),
                temperature=float(body.get("temperature", 1.0)),
                top_p=float(body.get("top_p", 1.0)),
                max_new_tokens=int(body.get("max_new_tokens", 32)),
                seed=int(body.get("seed", 0)),
            )
            prompt_seeds = body.get("prompt_seeds")
            rows, index, seeds = expand_prompts(prompts, sampling, self.max_model_len, prompt_seeds)
            if body.get("seeds") is not None:  # one seed per response, chosen by the trainer
                seeds = [int(x) % 2**63 for x in body["seeds"]]
                if len(seeds) != len(rows):
                    raise ValueError(f"{len(seeds)} seeds for {len(rows)} responses")
            eos = [int(t) for t in body.get("stop_token_ids", [])]
        except (KeyError, TypeError, ValueError) as err:
            raise RequestError(400, f"malformed generate request: {err}") from err
        if any(t < 0 or (self.vocab_size and t >= self.vocab_size) for p in prompts for t in p):
            raise RequestError(400, f"prompt token ids must lie in [0, {self.vocab_size})")
        params = request_params(sampling, seeds if seeds is not None else row_seeds(sampling, len(rows)), eos)
        expect = body.get("expect_version")
        async with self.lock.read():
            if expect is not None and expect != self.version:
                self.counts["refused"] += 1
                raise RequestError(
                    409,
                    f"the engine holds weights {self.version!r}, the request expects {expect!r}",
                    version=self.version,
                )
            self.counts["generate_requests"] += 1
            start = time.perf_counter()
            batch = uuid.uuid4().hex[:8]
            outputs = await asyncio.gather(
                *(
                    _final(self.client.generate(TokensPrompt(prompt_token_ids=row), p, request_id=f"{batch}-{i}"))
                    for i, (row, p) in enumerate(zip(rows, params, strict=True))
                )
            )
            version = self.version
        try:  # the in-process engine's own reading of vLLM's outputs: ids, processed log-probs, finish reasons
            rollout = rollout_from_outputs(outputs, rows, index, start)
        except PolicyDivergedError as err:
            raise RequestError(422, f"non-finite log-probs for sampled tokens: {err}") from err
        responses = [
            {"token_ids": ids, "logprobs": lps, "finish_reason": reason}
            for ids, lps, reason in zip(rollout.response_ids, rollout.logprobs, rollout.finish_reasons, strict=True)
        ]
        return {"responses": responses, "version": version, "seconds": time.perf_counter() - start}

    # ------------------------------------------------------------------------------------------ weights
    def _check_versions(self, expect: str | None, new: str | None) -> bool:
        """True when the change must be applied; False when it already was (a repeated request). 409 otherwise."""
        if not new:
            raise RequestError(400, f"a weight change needs the {NEW_HEADER} header (the version it creates)")
        if self.version == new:
            return False
        if expect != self.version:
            self.counts["refused"] += 1
            raise RequestError(
                409,
                f"the engine holds weights {self.version!r}; this change applies to {expect!r}: an update was lost "
                "or the engine restarted — resend the full weights",
                version=self.version,
            )
        return True

    def check_payload(self, data: bytes) -> Any:
        """Parse a payload and check it against the served model before any weight is touched."""
        from logra_pl.sketch.payload import Payload

        try:
            payload = Payload.from_bytes(data)
        except (ValueError, TypeError) as err:
            raise RequestError(400, f"malformed payload: {err}") from err
        if payload.distribution not in ("rademacher", "gaussian"):
            raise RequestError(400, f"malformed payload: unknown projection distribution {payload.distribution!r}")
        if not payload.factors:
            raise RequestError(400, "malformed payload: no factors")
        for name, factor in payload.factors.items():
            entry = self.shapes.get(f"{name}.weight")
            if entry is None:
                raise RequestError(400, f"malformed payload: the served model has no matrix {name!r}")
            d_out, d_in = entry[0]
            if factor.ndim != 2 or factor.shape[0] != d_out or factor.shape[1] != payload.rank or payload.rank > d_in:
                raise RequestError(
                    400,
                    f"malformed payload: factor of {name!r} has shape {tuple(factor.shape)}, the served matrix is "
                    f"{d_out}x{d_in} at rank {payload.rank}",
                )
            if not bool(torch.isfinite(factor).all()):
                raise RequestError(400, f"payload factor of {name!r} is not finite: refused, weights unchanged")
        if payload.dense:  # new values of densely trained parameters: names, shapes, finite
            self._check_named(dict(payload.dense))
        return payload

    def check_tensors(self, data: bytes) -> dict[str, torch.Tensor]:
        """Parse safetensors bytes of full tensors and check names, shapes and finiteness."""
        from safetensors.torch import load as st_load

        from logra_pl.rollout.vllm_worker import _checkpoint_key

        try:
            tensors = {_checkpoint_key(k): v for k, v in st_load(data).items()}
        except Exception as err:
            raise RequestError(400, f"malformed weights: not safetensors bytes ({err})") from err
        return self._check_named(tensors)

    def _check_named(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not tensors:
            raise RequestError(400, "malformed weights: no tensors")
        for key, value in tensors.items():
            entry = self.shapes.get(key)
            if entry is None and self.tied and key == "lm_head.weight":
                continue
            if entry is None:
                raise RequestError(400, f"malformed weights: the served model has no tensor {key!r}")
            if list(value.shape) != entry[0]:
                raise RequestError(
                    400, f"malformed weights: {key!r} has shape {list(value.shape)}, the served one {entry[0]}"
                )
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise RequestError(400, f"weights {key!r} are not finite: refused, weights unchanged")
        return tensors

    async def apply_payload(self, data: bytes, expect: str | None, new: str | None) -> dict[str, Any]:
        """Merge a checked payload into every worker, reset the prefix cache, move to version ``new``."""
        payload = self.check_payload(data)
        async with self.lock.write():
            if not self._check_versions(expect, new):
                return {"version": self.version, "applied": False}
            start = time.perf_counter()
            self.version = f"partial:{new}"  # an error inside the engine leaves a version no trainer expects
            await self.client.collective_rpc("logra_apply_payload", args=(data,))
            await self.client.reset_prefix_cache()
            self.version = str(new)
            self.counts["payloads"] += 1
        return {
            "version": self.version,
            "applied": True,
            "matrices": len(payload.factors),
            "update_index": payload.update_index,
            "seconds": time.perf_counter() - start,
        }

    async def load_weights(
        self,
        tensors: dict[str, torch.Tensor],
        data: bytes,
        expect: str | None,
        new: str | None,
        chunk: str | None,
        full: bool = False,
    ) -> dict[str, Any]:
        """Load one chunk of weights; the last chunk of a complete, in-order transfer sets version ``new``.

        A ``full`` load (every tensor of the policy) replaces the weights whatever they were, so it is accepted
        from any version — it is how a restarted or out-of-sync engine is repaired. A partial load (the tensors a
        dense update changed) builds on the previous weights and must name them, like a payload.
        """
        from logra_pl.rollout.vllm_worker import tensors_to_bytes

        try:
            index, total = (int(x) for x in (chunk or "0/1").split("/"))
            if not 0 <= index < total:
                raise ValueError(chunk)
        except ValueError as err:
            raise RequestError(400, f"malformed {CHUNK_HEADER} header {chunk!r}: use '<index>/<total>'") from err
        async with self.lock.write():
            if index == 0:
                if not new:
                    raise RequestError(400, f"a weight change needs the {NEW_HEADER} header (the version it creates)")
                if self.version == new:
                    return {"version": self.version, "applied": False}
                if not full:
                    self._check_versions(expect, new)
                self.loading = {"version": new, "next": 0, "total": total}
            elif self.loading is None or self.loading["version"] != new or self.loading["next"] != index:
                self.counts["refused"] += 1
                raise RequestError(
                    409,
                    f"chunk {index}/{total} of weights {new!r} does not continue the transfer in progress "
                    f"({self.loading}): restart the transfer from chunk 0",
                    version=self.version,
                )
            start = time.perf_counter()
            self.version = f"partial:{new}"
            payload = data if data else tensors_to_bytes(tensors)
            await self.client.collective_rpc("logra_load_weights", args=(payload, False))
            self.loading["next"] = index + 1
            if index + 1 == total:
                await self.client.collective_rpc("logra_reload")
                await self.client.reset_prefix_cache()
                self.version = str(new)
                self.loading = None
                self.counts["full_loads"] += 1
        return {"version": self.version, "applied": True, "chunk": index, "seconds": time.perf_counter() - start}

    async def digest(self, names: Sequence[str]) -> dict[str, Any]:
        """Digests of the engine's current values of ``<module>.weight`` tensors."""
        unknown = [n for n in names if n not in self.shapes]
        if unknown:
            raise RequestError(400, f"unknown tensors {unknown[:5]}")
        async with self.lock.read():
            result = await self.client.collective_rpc("logra_digest", args=(list(names),))
            return {"digests": result[0], "version": self.version}


async def _final(stream: AsyncIterator[Any]) -> Any:
    """The last output of a vLLM request stream (the finished request)."""
    last = None
    async for out in stream:
        last = out
    return last


# ------------------------------------------------------------------------------------------------- the app
def build_app(state: EngineState) -> Any:
    """The FastAPI app of one engine (see the module docstring for the endpoints)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    settings = state.settings
    limit = int(settings.max_request_mib * 2**20)
    app = FastAPI(title="logra-pl engine", version=str(API_VERSION))

    async def body_of(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and int(declared) > limit:
            raise RequestError(
                413, f"request of {int(declared)} bytes exceeds --max-request-mib {settings.max_request_mib:g}"
            )
        chunks = []
        size = 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise RequestError(413, f"request exceeds --max-request-mib {settings.max_request_mib:g}")
            chunks.append(part)
        return b"".join(chunks)

    async def json_of(request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await body_of(request))
        except json.JSONDecodeError as err:
            raise RequestError(400, f"request body is not JSON: {err}") from err
        if not isinstance(body, dict):
            raise RequestError(400, "request body must be a JSON object")
        return body

    def authorize(request: Request) -> None:
        if not settings.api_key:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {settings.api_key}".encode()):
            raise RequestError(401, "weight-changing requests need 'Authorization: Bearer <api key>'")

    @app.exception_handler(RequestError)
    async def refused(request: Request, err: RequestError) -> JSONResponse:
        return JSONResponse({"error": str(err), **err.extra}, status_code=err.status)

    @app.get("/v1/health")
    async def health() -> dict[str, Any]:
        return state.health()

    @app.post("/v1/generate")
    async def generate(request: Request) -> dict[str, Any]:
        return await state.generate(await json_of(request))

    @app.post("/v1/probe")
    async def probe(request: Request) -> dict[str, Any]:
        body = await json_of(request)
        body.update(n=1, temperature=0.0, top_p=1.0, prompt_seeds=None, seeds=None)
        return await state.generate(body)

    @app.post("/v1/payload")
    async def payload(request: Request) -> dict[str, Any]:
        authorize(request)
        data = await body_of(request)
        return await state.apply_payload(data, request.headers.get(EXPECT_HEADER), request.headers.get(NEW_HEADER))

    @app.post("/v1/weights")
    async def weights(request: Request) -> dict[str, Any]:
        authorize(request)
        data = await body_of(request)
        tensors = state.check_tensors(data)
        h = request.headers
        full = h.get(FULL_HEADER, "0") == "1"
        return await state.load_weights(
            tensors, data, h.get(EXPECT_HEADER), h.get(NEW_HEADER), h.get(CHUNK_HEADER), full
        )

    @app.post("/v1/weights/path")
    async def weights_path(request: Request) -> dict[str, Any]:
        authorize(request)
        body = await json_of(request)
        from safetensors.torch import load_file

        from logra_pl.rollout.vllm_worker import _checkpoint_key

        path = Path(str(body.get("path", "")))
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        if not files or not all(f.is_file() for f in files):
            raise RequestError(400, f"no safetensors files at {str(path)!r} on the engine's host")
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            tensors.update({_checkpoint_key(k): v for k, v in load_file(str(f)).items()})
        state._check_named(tensors)
        expect, new, full = body.get("expect_version"), body.get("new_version"), bool(body.get("full", False))
        return await state.load_weights(tensors, b"", expect, new, "0/1", full)

    @app.post("/v1/weights/digest")
    async def digest(request: Request) -> dict[str, Any]:
        body = await json_of(request)
        return await state.digest([str(n) for n in body.get("names", [])])

    @app.post("/v1/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> dict[str, Any]:
        authorize(request)
        async with state.lock.write():
            await state.client.reset_prefix_cache()
        return {"version": state.version}

    return app


# ----------------------------------------------------------------------------------------------- running
async def serve_engine(settings: ServeSettings) -> None:
    """Build one vLLM engine (vLLM's engine-client machinery), then serve the API until SIGINT/SIGTERM."""
    import uvicorn
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client_from_engine_args

    from logra_pl.rollout.vllm import VLLMSettings, engine_kwargs

    folder = served_model_folder(settings.model, settings.master_dtype)
    vs = VLLMSettings(
        dtype=settings.dtype,
        tensor_parallel_size=settings.tensor_parallel_size,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        kv_cache_gib=settings.kv_cache_gib,
        max_model_len=settings.max_model_len,
        enforce_eager=settings.enforce_eager,
        sync_mode=settings.sync_mode,
        max_num_seqs=settings.max_num_seqs,
        seed=settings.seed,
    )
    kwargs = engine_kwargs(vs, str(folder), settings.master_dtype, in_process=False)
    engine_args = AsyncEngineArgs(**kwargs, disable_log_stats=True)
    async with build_async_engine_client_from_engine_args(engine_args) as client:
        info = await client.collective_rpc("logra_setup", args=(settings.sync_mode, settings.master_dtype))
        state = EngineState(client, settings, folder, info)
        app = build_app(state)
        config = uvicorn.Config(
            app, host=settings.host, port=settings.port, log_level="warning", timeout_keep_alive=60, access_log=False
        )
        server = uvicorn.Server(config)
        url = f"http://{settings.host}:{settings.port}"
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            mode = info[0].get("mode")
            print(f"{READY_LINE} {url} (model {settings.model}, {mode} sync, {state.version})", flush=True)
        await task


def run_engines(settings: ServeSettings) -> int:
    """Start ``data_parallel_size`` engine processes (one port and device group each) and wait for them."""
    groups = settings.device_groups()
    children: list[subprocess.Popen[bytes]] = []
    for i, devices in enumerate(groups):
        env = dict(os.environ)
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices
        if settings.api_key:
            env[API_KEY_ENV] = settings.api_key
        child = asdict(settings) | {"data_parallel_size": 1, "port": settings.port + i, "devices": None}
        child.pop("api_key")
        args = [sys.executable, "-m", "logra_pl.cli", "serve", *_as_flags(child)]
        children.append(subprocess.Popen(args, env=env))
    stopping = False

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True
        for c in children:
            if c.poll() is None:
                c.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    codes = [c.wait() for c in children]
    return 0 if stopping else max(codes)


def _as_flags(values: dict[str, Any]) -> list[str]:
    out = []
    for key, value in values.items():
        if value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else f"--no-{flag[2:]}")
        else:
            out += [flag, str(value)]
    return out


def parse_args(argv: Sequence[str] | None = None) -> ServeSettings:
    """``logra-pl serve`` flags → :class:`ServeSettings` (``--help`` lists them)."""
    defaults = ServeSettings()
    p = argparse.ArgumentParser(
        prog="logra-pl serve",
        description="Serve vLLM engines with LoGRA factor sync over HTTP (docs/serving.md).",
    )
    p.add_argument("--model", default=defaults.model, help="folder | tiny[:preset] | smollm2 | file.gguf | hub id")
    p.add_argument("--dtype", default=defaults.dtype, help="engine dtype: float32 | bfloat16 | float16")
    p.add_argument("--master-dtype", default=defaults.master_dtype, help="shadow master copy dtype (the trainer's)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM tensor-parallel ranks per engine")
    p.add_argument("--data-parallel-size", type=int, default=1, help="engines, on ports port..port+D-1")
    p.add_argument("--host", default=defaults.host, help="bind address (non-loopback needs --api-key)")
    p.add_argument("--port", type=int, default=defaults.port, help="port of the first engine")
    p.add_argument("--devices", default=None, help="GPU ids split over the engines, e.g. 4,5,6,7")
    p.add_argument("--api-key", default=None, help=f"token for weight-changing requests (or ${API_KEY_ENV})")
    p.add_argument("--max-request-mib", type=float, default=defaults.max_request_mib, help="largest request body")
    p.add_argument("--kv-cache-gib", type=float, default=defaults.kv_cache_gib, help="KV cache (CPU build)")
    p.add_argument("--gpu-memory-utilization", type=float, default=defaults.gpu_memory_utilization)
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + response limit")
    p.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    p.add_argument("--sync-mode", default="auto", help="auto | inplace | shadow")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args(argv)
    return ServeSettings(**{k: v for k, v in vars(ns).items()})


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``logra-pl serve``."""
    settings = parse_args(argv)
    if settings.data_parallel_size > 1:
        return run_engines(settings)
    groups = settings.device_groups()
    if groups[0] is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = groups[0]
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve_engine(settings))
    return 0
