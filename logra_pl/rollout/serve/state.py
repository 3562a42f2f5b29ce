"""The state of one served engine: the vLLM engine client, its weights version, and the checks every request passes.

:class:`EngineState` is what the routes of :mod:`logra_pl.rollout.serve.app` call. It holds vLLM's ``AsyncLLM``
engine client (anything with the same methods: ``generate``, ``collective_rpc``, ``reset_prefix_cache`` and a
``model_config.max_model_len``), the weights version (:class:`~logra_pl.rollout.versions.VersionLedger`, where
the version rules live) and a readers/writer lock (:class:`WeightsLock`): many generations at a time, or one
weight change. A payload or weight chunk is parsed and checked — names, shapes, finiteness — before it reaches
the engine, so a malformed one gets a 4xx (:class:`RequestError`) and leaves the weights untouched. Every weight
change ends with ``reset_prefix_cache``: KV blocks computed with old weights must not be reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from logra_pl.rollout.protocol import (
    API_VERSION,
    DigestAnswer,
    GenerateRequest,
    GenerateResponse,
    HealthInfo,
    WeightsAnswer,
    checkpoint_key,
    parse_chunk,
)
from logra_pl.rollout.serve.settings import ServeSettings
from logra_pl.rollout.versions import VersionError, VersionLedger


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

    async def wait_until(self, predicate: Any, timeout: float) -> bool:
        """Wait until ``predicate()`` holds (checked whenever a generation or a change ends), at most ``timeout``
        seconds; whether it held."""
        async with self._cond:
            try:
                await asyncio.wait_for(self._cond.wait_for(predicate), timeout)
            except TimeoutError:
                return bool(predicate())
        return True

    async def notify(self) -> None:
        """Wake the waiters: something they wait for may hold now (a generate request was counted)."""
        async with self._cond:
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
        self.ledger = VersionLedger.fresh(self.engine_id)
        self.shapes = checkpoint_shapes(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        self.tied = bool(config.get("tie_word_embeddings", False))
        self.vocab_size = int(config.get("vocab_size", 0))
        self.max_model_len = int(client.model_config.max_model_len)
        self.lock = WeightsLock()
        self.counts = {"payloads": 0, "full_loads": 0, "refused": 0, "generate_requests": 0, "hold_timeouts": 0}
        self.started = time.time()

    @property
    def version(self) -> str:
        """The version of the weights the engine holds."""
        return self.ledger.version

    @contextlib.contextmanager
    def _versions(self) -> Iterator[None]:
        """The ledger's refusals as HTTP errors (409s counted in ``counts["refused"]``)."""
        try:
            yield
        except VersionError as err:
            if err.status == 409:
                self.counts["refused"] += 1
                raise RequestError(409, str(err), version=err.version) from None
            raise RequestError(err.status, str(err)) from None

    # -------------------------------------------------------------------------------------------- views
    def health(self) -> HealthInfo:
        """The engine's state, as ``GET /v1/health`` reports it."""
        matrices = {
            k[: -len(".weight")]: shape
            for k, (shape, _) in self.shapes.items()
            if k.endswith(".weight") and len(shape) == 2
        }
        return HealthInfo(
            status="ok",
            api=API_VERSION,
            engine_id=self.engine_id,
            version=self.version,
            loading=self.ledger.loading is not None,
            model=str(self.settings.model),
            dtype=self.settings.dtype,
            master_dtype=self.settings.master_dtype,
            sync_mode=self.info[0].get("mode"),
            platform=self.info[0].get("platform"),
            tensor_parallel_size=self.settings.tensor_parallel_size,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            matrices=matrices,
            tensors=sorted(self.shapes),
            counts=dict(self.counts),
            uptime_s=time.time() - self.started,
        )

    # ----------------------------------------------------------------------------------------- sampling
    async def generate(self, body: GenerateRequest) -> GenerateResponse:
        """Sample one response per row (``prompts`` repeated ``n`` times in a row) with its own seed."""
        from vllm.inputs import TokensPrompt

        from logra_pl.errors import PolicyDivergedError
        from logra_pl.rollout.base import expand_prompts
        from logra_pl.rollout.vllm import request_params, rollout_from_outputs, row_seeds

        prompts = body.prompts
        sampling = body.sampling()
        try:
            rows, index, seeds = expand_prompts(prompts, sampling, self.max_model_len, body.prompt_seeds)
        except ValueError as err:
            raise RequestError(400, f"malformed generate request: {err}") from err
        if body.seeds is not None:  # one seed per response, chosen by the trainer
            seeds = [int(x) % 2**63 for x in body.seeds]
        eos = body.stop_token_ids
        if any(t < 0 or (self.vocab_size and t >= self.vocab_size) for p in prompts for t in p):
            raise RequestError(400, f"prompt token ids must lie in [0, {self.vocab_size})")
        params = request_params(sampling, seeds if seeds is not None else row_seeds(sampling, len(rows)), eos)
        expect = body.expect_version
        if body.wait_s and self.ledger.may_arrive(expect):  # overtook its weight change: wait for it (bounded)
            await self.lock.wait_until(lambda: not self.ledger.may_arrive(expect), body.wait_s)
        async with self.lock.read():
            with self._versions():
                self.ledger.admit_generate(expect)
            await self.lock.notify()  # a change held for this request may go once the generation ends
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
        return GenerateResponse(responses=responses, version=version, seconds=time.perf_counter() - start)

    # ------------------------------------------------------------------------------------------ weights
    def check_payload(self, data: bytes) -> Any:
        """Parse a payload and check it against the served model before any weight is touched."""
        from logra_pl.sketch.config import DISTRIBUTIONS
        from logra_pl.sketch.payload import Payload

        try:  # refresh/refresh_every are checked here: a bad or contradictory pair is a ValueError
            payload = Payload.from_bytes(data)
        except (ValueError, TypeError) as err:
            raise RequestError(400, f"malformed payload: {err}") from err
        if payload.distribution not in DISTRIBUTIONS:
            raise RequestError(400, f"malformed payload: unknown projection distribution {payload.distribution!r}")
        if not payload.factors:
            raise RequestError(400, "malformed payload: no factors")
        for name, factor in payload.factors.items():
            entry = self.shapes.get(f"{name}.weight")
            if entry is None:
                raise RequestError(400, f"malformed payload: the served model has no matrix {name!r}")
            d_out, d_in = entry[0]
            rank = payload.matrix_rank(d_in)
            if factor.ndim != 2 or factor.shape[0] != d_out or factor.shape[1] != rank or rank > d_in:
                raise RequestError(
                    400,
                    f"malformed payload: factor of {name!r} has shape {tuple(factor.shape)}, the served matrix is "
                    f"{d_out}x{d_in} at rank {rank}",
                )
            if not bool(torch.isfinite(factor).all()):
                raise RequestError(400, f"payload factor of {name!r} is not finite: refused, weights unchanged")
        if payload.dense:  # new values of densely trained parameters: names, shapes, finite
            self.check_named(dict(payload.dense))
        return payload

    def check_tensors(self, data: bytes) -> dict[str, torch.Tensor]:
        """Parse safetensors bytes of full tensors and check names, shapes and finiteness."""
        from safetensors.torch import load as st_load

        try:
            tensors = {checkpoint_key(k): v for k, v in st_load(data).items()}
        except Exception as err:
            raise RequestError(400, f"malformed weights: not safetensors bytes ({err})") from err
        return self.check_named(tensors)

    def check_named(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Check tensors by name against the served model: known names, the served shapes, finite values."""
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

    async def apply_payload(
        self, data: bytes, expect: str | None, new: str | None, hold: tuple[int, float] = (0, 0.0)
    ) -> WeightsAnswer:
        """Merge a checked payload into every worker, reset the prefix cache, move to version ``new``.

        ``hold = (count, seconds)``: first serve ``count`` generate requests at ``expect`` (waiting up to
        ``seconds``; past that the change goes ahead, and a request that comes later is refused and repaired)."""
        payload = self.check_payload(data)
        count, seconds = hold
        if count and not await self.lock.wait_until(lambda: not self.ledger.holds(expect, count), seconds):
            self.counts["hold_timeouts"] += 1
        async with self.lock.write():
            with self._versions():
                admitted = self.ledger.admit(expect, new)
            if not admitted:
                return WeightsAnswer(version=self.version, applied=False)
            start = time.perf_counter()
            self.ledger.begin(new)
            await self.client.collective_rpc("logra_apply_payload", args=(data,))
            await self.client.reset_prefix_cache()
            self.ledger.commit(new)
            self.counts["payloads"] += 1
        return WeightsAnswer(
            version=self.version,
            applied=True,
            matrices=len(payload.factors),
            update_index=payload.update_index,
            seconds=time.perf_counter() - start,
        )

    async def load_weights(
        self,
        tensors: dict[str, torch.Tensor],
        data: bytes,
        expect: str | None,
        new: str | None,
        chunk: str | None,
        full: bool = False,
    ) -> WeightsAnswer:
        """Load one chunk of weights; the last chunk of a complete, in-order transfer sets version ``new``.

        A ``full`` load (every tensor of the policy) replaces the weights whatever they were, so it is accepted
        from any version — it is how a restarted or out-of-sync engine is repaired. A partial load (the tensors a
        dense update changed) builds on the previous weights and must name them, like a payload.
        """
        from logra_pl.rollout.vllm_worker import tensors_to_bytes

        try:
            index, total = parse_chunk(chunk)
        except ValueError as err:
            raise RequestError(400, str(err)) from err
        async with self.lock.write():
            with self._versions():
                admitted = self.ledger.admit_chunk(expect, new, index, total, full)
            if not admitted:
                return WeightsAnswer(version=self.version, applied=False)
            start = time.perf_counter()
            self.ledger.begin(new)
            payload = data if data else tensors_to_bytes(tensors)
            await self.client.collective_rpc("logra_load_weights", args=(payload, False))
            if self.ledger.chunk_loaded(index):
                await self.client.collective_rpc("logra_reload")
                await self.client.reset_prefix_cache()
                self.ledger.finish_load(new)
                self.counts["full_loads"] += 1
        return WeightsAnswer(version=self.version, applied=True, chunk=index, seconds=time.perf_counter() - start)

    async def digest(self, names: Sequence[str]) -> DigestAnswer:
        """Digests of the engine's current values of ``<module>.weight`` tensors."""
        unknown = [n for n in names if n not in self.shapes]
        if unknown:
            raise RequestError(400, f"unknown tensors {unknown[:5]}")
        async with self.lock.read():
            result = await self.client.collective_rpc("logra_digest", args=(list(names),))
            return DigestAnswer(digests=result[0], version=self.version)


async def _final(stream: AsyncIterator[Any]) -> Any:
    """The last output of a vLLM request stream (the finished request)."""
    last = None
    async for out in stream:
        last = out
    return last
