"""The FastAPI app of one served engine: the routes of the API (:mod:`logra_pl.rollout.protocol`) over an
:class:`~logra_pl.rollout.serve.state.EngineState`.

Routes only read requests and write answers: a JSON body is read within ``--max-request-mib`` and validated by its
model (a body that does not fit gets a 400 naming the field), a binary body is handed to the state's checks, and
weight-changing routes need the API key when the server has one. Everything else — versions, checks, the lock —
is the state's.
"""

# No `from __future__ import annotations` here: FastAPI reads the handlers' annotations (`Request`) as objects.
import hmac
from pathlib import Path
from typing import Any, TypeVar

import torch
from pydantic import BaseModel, ValidationError

from logra_pl.rollout.protocol import (
    API_VERSION,
    CHUNK_HEADER,
    EXPECT_HEADER,
    FULL_HEADER,
    HOLD_HEADER,
    NEW_HEADER,
    DigestAnswer,
    DigestRequest,
    ErrorAnswer,
    GenerateRequest,
    GenerateResponse,
    HealthInfo,
    ProbeRequest,
    ResetAnswer,
    WeightsAnswer,
    WeightsPathRequest,
    bearer,
    checkpoint_key,
    describe,
    parse_hold,
)
from logra_pl.rollout.serve.state import EngineState, RequestError

M = TypeVar("M", bound=BaseModel)
_REFUSALS: dict[int | str, dict[str, Any]] = {status: {"model": ErrorAnswer} for status in (400, 401, 409, 413, 422)}


def _json(answer: BaseModel, exclude_none: bool = False) -> Any:
    """``answer`` as a JSON response, serialized once by its model (no second validation by FastAPI)."""
    from fastapi.responses import Response

    return Response(answer.model_dump_json(exclude_none=exclude_none), media_type="application/json")


def build_app(state: EngineState) -> Any:
    """The FastAPI app of one engine (the routes: :mod:`logra_pl.rollout.protocol`)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    settings = state.settings
    limit = int(settings.max_request_mib * 2**20)
    app = FastAPI(title="logra-pl engine", version=str(API_VERSION), responses=_REFUSALS)

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

    async def model_of(request: Request, model: type[M]) -> M:
        """The JSON body, validated by ``model``: a 400 naming the fields that do not fit."""
        data = await body_of(request)
        try:
            return model.model_validate_json(data)
        except ValidationError as err:
            raise RequestError(400, f"malformed {request.url.path} request: {describe(err)}") from None

    def authorize(request: Request) -> None:
        if not settings.api_key:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), bearer(settings.api_key).encode()):
            raise RequestError(401, "weight-changing requests need 'Authorization: Bearer <api key>'")

    @app.exception_handler(RequestError)
    async def refused(request: Request, err: RequestError) -> JSONResponse:
        return JSONResponse({"error": str(err), **err.extra}, status_code=err.status)

    @app.get("/v1/health", response_model=HealthInfo)
    async def health() -> Any:
        return _json(state.health())

    @app.post("/v1/generate", response_model=GenerateResponse)
    async def generate(request: Request) -> Any:
        return _json(await state.generate(await model_of(request, GenerateRequest)))

    @app.post("/v1/probe", response_model=GenerateResponse)
    async def probe(request: Request) -> Any:
        body = await model_of(request, ProbeRequest)
        return _json(await state.generate(body.generate_request()))

    @app.post("/v1/payload", response_model=WeightsAnswer)
    async def payload(request: Request) -> Any:
        authorize(request)
        data = await body_of(request)
        h = request.headers
        try:
            hold = parse_hold(h.get(HOLD_HEADER))
        except ValueError as err:
            raise RequestError(400, str(err)) from None
        answer = await state.apply_payload(data, h.get(EXPECT_HEADER), h.get(NEW_HEADER), hold)
        return _json(answer, exclude_none=True)

    @app.post("/v1/weights", response_model=WeightsAnswer)
    async def weights(request: Request) -> Any:
        authorize(request)
        data = await body_of(request)
        tensors = state.check_tensors(data)
        h = request.headers
        full = h.get(FULL_HEADER, "0") == "1"
        answer = await state.load_weights(
            tensors, data, h.get(EXPECT_HEADER), h.get(NEW_HEADER), h.get(CHUNK_HEADER), full
        )
        return _json(answer, exclude_none=True)

    @app.post("/v1/weights/path", response_model=WeightsAnswer)
    async def weights_path(request: Request) -> Any:
        authorize(request)
        body = await model_of(request, WeightsPathRequest)
        from safetensors.torch import load_file

        path = Path(body.path)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        if not files or not all(f.is_file() for f in files):
            raise RequestError(400, f"no safetensors files at {str(path)!r} on the engine's host")
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            tensors.update({checkpoint_key(k): v for k, v in load_file(str(f)).items()})
        state.check_named(tensors)
        answer = await state.load_weights(tensors, b"", body.expect_version, body.new_version, "0/1", body.full)
        return _json(answer, exclude_none=True)

    @app.post("/v1/weights/digest", response_model=DigestAnswer)
    async def digest(request: Request) -> Any:
        body = await model_of(request, DigestRequest)
        return _json(await state.digest(body.names))

    @app.post("/v1/reset_prefix_cache", response_model=ResetAnswer)
    async def reset_prefix_cache(request: Request) -> Any:
        authorize(request)
        async with state.lock.write():
            await state.client.reset_prefix_cache()
        return _json(ResetAnswer(version=state.version))

    return app
