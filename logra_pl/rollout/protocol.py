"""The served-engine API (version 1), defined once: what ``logra-pl serve`` accepts and answers.

Both sides use these models: the server (:mod:`logra_pl.rollout.serve.app`) validates every JSON body with them and
answers with them; the trainer's client (:class:`~logra_pl.rollout.remote.RemoteEngine`) builds its requests and
reads the answers with the same classes. A body that does not fit a model is refused with a 400 whose message
names the field (:func:`describe`). Sampling fields take their defaults and their checks from
:class:`~logra_pl.rollout.base.SamplingConfig`, the contract of the in-process engines.

Binary bodies (a LoGRA payload, safetensors chunks of full weights) travel as ``application/octet-stream`` with
the version headers below; the answers are JSON (:class:`WeightsAnswer`). Paths (all under ``/v1``) and their
models:

- ``GET /v1/health`` → :class:`HealthInfo`
- ``POST /v1/generate`` :class:`GenerateRequest` → :class:`GenerateResponse`
- ``POST /v1/probe`` :class:`ProbeRequest` → :class:`GenerateResponse` (greedy, one response per prompt)
- ``POST /v1/payload`` payload bytes + :data:`EXPECT_HEADER`, :data:`NEW_HEADER` (and :data:`HOLD_HEADER`)
  → :class:`WeightsAnswer`
- ``POST /v1/weights`` safetensors bytes + the version headers, :data:`CHUNK_HEADER`, :data:`FULL_HEADER`
  → :class:`WeightsAnswer`
- ``POST /v1/weights/path`` :class:`WeightsPathRequest` → :class:`WeightsAnswer`
- ``POST /v1/weights/digest`` :class:`DigestRequest` → :class:`DigestAnswer`
- ``POST /v1/reset_prefix_cache`` → :class:`ResetAnswer`

Every refusal is :class:`ErrorAnswer` (``{"error": ..., "version": ...}``) with a 4xx status: 400 malformed,
401 no or wrong key (:data:`AUTH_HEADER`), 409 other weights than the request expects, 413 too large, 422
non-finite log-probs.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from logra_pl.rollout.base import SamplingConfig
from logra_pl.sketch.targets import canonical_name

API_VERSION = 1
API_KEY_ENV = "LOGRA_PL_API_KEY"  # where both sides read the key of weight-changing requests by default
AUTH_HEADER = "Authorization"  # ``Bearer <api key>`` on weight-changing requests
EXPECT_HEADER = "X-LoGRA-Expect-Version"  # the version a weight change applies to
NEW_HEADER = "X-LoGRA-New-Version"  # the version it creates
CHUNK_HEADER = "X-LoGRA-Chunk"  # ``<index>/<total>`` of a chunked full load
FULL_HEADER = "X-LoGRA-Full"  # ``1``: the load covers every served tensor (accepted from any version)
HOLD_HEADER = "X-LoGRA-Hold"  # ``<count>/<seconds>``: serve that many generate requests at the old version first
MAX_WAIT_S = 600.0  # the longest wait a request may ask of an engine (``wait_s``, a hold's seconds)
OCTET_STREAM = "application/octet-stream"

_SAMPLING = SamplingConfig()  # the defaults of every sampling field
_SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingConfig))


def bearer(api_key: str) -> str:
    """The :data:`AUTH_HEADER` value that carries ``api_key``."""
    return f"Bearer {api_key}"


def parse_chunk(value: str | None) -> tuple[int, int]:
    """``(index, total)`` of a :data:`CHUNK_HEADER` value (absent: ``0/1``, a load in one request)."""
    try:
        index, total = (int(x) for x in (value or "0/1").split("/"))
        if not 0 <= index < total:
            raise ValueError(value)
    except ValueError as err:
        raise ValueError(f"malformed {CHUNK_HEADER} header {value!r}: use '<index>/<total>'") from err
    return index, total


def parse_hold(value: str | None) -> tuple[int, float]:
    """``(count, seconds)`` of a :data:`HOLD_HEADER` value (absent: ``0/0``, no hold)."""
    try:
        count, seconds = (value or "0/0").split("/")
        out = int(count), float(seconds)
        if out[0] < 0 or not 0 <= out[1] <= MAX_WAIT_S:
            raise ValueError(value)
    except ValueError as err:
        raise ValueError(
            f"malformed {HOLD_HEADER} header {value!r}: use '<count>/<seconds>', seconds at most {MAX_WAIT_S:g}"
        ) from err
    return out


def describe(err: ValidationError) -> str:
    """A validation error as one line naming each offending field (``prompts.0.2: Input should be ...``)."""
    parts = []
    for e in err.errors(include_url=False):
        where = ".".join(str(x) for x in e["loc"]) or "body"
        parts.append(f"{where}: {e['msg']}")
    return "; ".join(parts)


class _Request(BaseModel):
    """A request body: an unknown field is an error (a misspelt one would otherwise be ignored silently)."""

    model_config = ConfigDict(extra="forbid")


class _Answer(BaseModel):
    """An answer: fields a newer server adds are ignored by an older trainer (``api`` says what both speak)."""

    model_config = ConfigDict(extra="ignore")


# -------------------------------------------------------------------------------------------------- sampling
class GenerateRequest(_Request):
    """``POST /v1/generate``: token ids in; one response per row (prompt ``i`` repeated ``n`` times in a row).

    Arguments:
        prompts: tokenized prompts.
        n, temperature, top_p, max_new_tokens, seed: as :class:`~logra_pl.rollout.base.SamplingConfig` (same
            defaults, same checks).
        seeds: one sampling seed per response (the trainer's choice); None: derived from ``prompt_seeds`` or
            ``seed``.
        stop_token_ids: tokens that end a response.
        expect_version: the weights the trainer expects; the engine refuses (409) when it holds others.
        prompt_seeds: one seed per prompt (response ``k`` gets ``(seed · 1_000_003 + k) mod 2⁶³``).
        wait_s: when ``expect_version`` is a later version of the run the engine holds, wait up to this long for
            it before refusing (an asynchronous trainer's request that overtook its weight change); 0: refuse
            at once, as version-1 clients expect.
    """

    prompts: list[list[int]]
    n: int = _SAMPLING.n
    temperature: float = _SAMPLING.temperature
    top_p: float = _SAMPLING.top_p
    max_new_tokens: int = _SAMPLING.max_new_tokens
    seeds: list[int] | None = None
    stop_token_ids: list[int] = []
    expect_version: str | None = None
    seed: int = _SAMPLING.seed
    prompt_seeds: list[int] | None = None
    wait_s: float = 0.0

    @field_validator("wait_s")
    @classmethod
    def _bounded_wait(cls, value: float) -> float:
        if not 0.0 <= value <= MAX_WAIT_S:
            raise ValueError(f"wait_s must lie in [0, {MAX_WAIT_S:g}] seconds")
        return value

    @field_validator(*_SAMPLING_FIELDS)
    @classmethod
    def _sampling_value(cls, value: Any, info: Any) -> Any:
        SamplingConfig(**{info.field_name: value})  # SamplingConfig's own check of this one value
        return value

    @model_validator(mode="after")
    def _one_seed_per_response(self) -> GenerateRequest:
        if self.seeds is not None and len(self.seeds) != len(self.prompts) * self.n:
            raise ValueError(f"{len(self.seeds)} seeds for {len(self.prompts) * self.n} responses")
        return self

    def sampling(self) -> SamplingConfig:
        """The request's sampling settings."""
        return SamplingConfig(**{name: getattr(self, name) for name in _SAMPLING_FIELDS})


class ProbeRequest(_Request):
    """``POST /v1/probe``: greedy generation with log-probs (``n=1``, temperature 0), for verification."""

    prompts: list[list[int]]
    max_new_tokens: int = _SAMPLING.max_new_tokens
    stop_token_ids: list[int] = []
    expect_version: str | None = None

    @field_validator("max_new_tokens")
    @classmethod
    def _sampling_value(cls, value: int) -> int:
        SamplingConfig(max_new_tokens=value)
        return value

    def generate_request(self) -> GenerateRequest:
        """The greedy generate request this probe is."""
        return GenerateRequest(**self.model_dump(), n=1, temperature=0.0, top_p=1.0)


class Completion(_Answer):
    """One response: its token ids, the log-prob of each under the distribution it was drawn from, why it ended."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]


class GenerateResponse(_Answer):
    """Answer of ``/v1/generate`` and ``/v1/probe``: responses in row order, the weights that sampled them."""

    responses: list[Completion]
    version: str
    seconds: float


# --------------------------------------------------------------------------------------------------- weights
class WeightsAnswer(_Answer):
    """Answer of a weight change (``/v1/payload``, ``/v1/weights``, ``/v1/weights/path``).

    ``applied: false`` answers a repeated request: the engine already holds ``version`` (the first answer was
    lost). ``matrices`` and ``update_index`` describe an applied payload, ``chunk`` an applied weight chunk.
    """

    version: str
    applied: bool
    matrices: int | None = None
    update_index: int | None = None
    chunk: int | None = None
    seconds: float | None = None


class WeightsPathRequest(_Request):
    """``POST /v1/weights/path``: load the safetensors files of a folder the trainer and the engine share."""

    path: str
    expect_version: str | None = None
    new_version: str | None = None
    full: bool = False


class DigestRequest(_Request):
    """``POST /v1/weights/digest``: the tensors to digest (checkpoint names)."""

    names: list[str] = []


class DigestAnswer(_Answer):
    """``{name: digest}`` of the engine's current values, and the version they belong to."""

    digests: dict[str, str]
    version: str


class ResetAnswer(_Answer):
    """Answer of ``/v1/reset_prefix_cache``."""

    version: str


# ---------------------------------------------------------------------------------------------------- status
class HealthInfo(BaseModel):
    """``GET /v1/health``: the engine's state and what the trainer checks before it trains against it.

    Unknown fields are kept (a newer server may report more); the trainer checks ``api`` first.
    """

    model_config = ConfigDict(extra="allow")

    status: str = "ok"
    api: int
    engine_id: str
    version: str
    loading: bool = False
    model: str
    dtype: str
    master_dtype: str
    sync_mode: str | None = None
    platform: str | None = None
    tensor_parallel_size: int = 1
    max_model_len: int
    vocab_size: int
    matrices: dict[str, list[int]] = {}
    tensors: list[str] = []
    counts: dict[str, int] = {}
    uptime_s: float = 0.0

    def stored_dtype(self) -> str:
        """The dtype the engine stores its weights in: the master copy's in ``shadow`` mode, else vLLM's."""
        return self.master_dtype if self.sync_mode == "shadow" else self.dtype


class ErrorAnswer(BaseModel):
    """The body of every refusal: what is wrong, and the engine's weights version where it matters (409)."""

    model_config = ConfigDict(extra="allow")

    error: str
    version: str | None = None


def checkpoint_key(key: str) -> str:
    """A trainer state-dict key as it appears in a checkpoint, and on the wire of a full weight load (wrapper prefixes
    such as activation checkpointing's and FSDP's stripped): the one name the trainer and every engine use."""
    module, _, leaf = key.rpartition(".")
    return f"{canonical_name(module)}.{leaf}" if module else key
