"""``RemoteEngine``: the rollout-engine contract over HTTP, against ``logra-pl serve`` engines (algorithm.md §9).

``model.engine: {class_path: logra_pl.rollout.remote.RemoteSettings, init_args: {urls: [http://host:8100, ...]}}``
(or ``model.engine: remote`` for one engine on ``http://127.0.0.1:8100``). Every training rank has one
``RemoteEngine``; each sends its own prompts, spread over the engines (rank ``r`` starts at engine ``r mod E``), and
gets its responses with the exact log-probs of the sampled tokens. Weight changes are sent by global rank 0 only —
the merged LoGRA payload is identical on every rank (sketches are all-reduced before the proposal), so nothing needs
gathering for it — once to every engine. Full weights (the first sync, a repair) are all-gathered by the module on
every rank and sent by rank 0, in chunks or through a shared folder.

Every weight change creates a new version ``<run id>/<n>``; every rank counts the changes it took part in, so all
ranks know the version the engines should hold without talking to each other (:mod:`logra_pl.rollout.versions`
holds the rules). A generate request carries that version and the engine refuses it (409 →
:class:`~logra_pl.errors.StaleEngineError`) when it holds other weights: nothing is sampled from stale weights. The
module then agrees over all ranks that an engine is stale and repairs it with a full resync
(:meth:`logra_pl.train.engine_link.EngineLink.generate`). Requests and answers are the models of
:mod:`logra_pl.rollout.protocol`, shared with the server.

An engine that does not answer is retried with exponential backoff for ``retry_for_s`` seconds (a restarting
engine comes back within that window and is then resynced), after which the run stops with an error naming its URL.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from logra_pl.config import register
from logra_pl.errors import (
    ConfigError,
    EngineUnavailableError,
    LoGRAError,
    PolicyDivergedError,
    StaleEngineError,
    check_range,
)
from logra_pl.rollout.base import (
    EngineRequest,
    EngineSpec,
    FinishReason,
    Rollout,
    RolloutEngine,
    SamplingConfig,
    SyncReport,
    expand_prompts,
)
from logra_pl.rollout.protocol import (  # re-exported: the API's names were defined here before protocol.py
    API_KEY_ENV,
    API_VERSION,
    AUTH_HEADER,
    CHUNK_HEADER,
    EXPECT_HEADER,
    FULL_HEADER,
    NEW_HEADER,
    OCTET_STREAM,
    DigestAnswer,
    DigestRequest,
    GenerateRequest,
    GenerateResponse,
    HealthInfo,
    WeightsPathRequest,
    bearer,
    checkpoint_key,
    describe,
)
from logra_pl.rollout.versions import ExpectedVersions
from logra_pl.sketch.payload import Payload

__all__ = [
    "API_KEY_ENV",
    "API_VERSION",
    "CHUNK_HEADER",
    "EXPECT_HEADER",
    "FULL_HEADER",
    "NEW_HEADER",
    "RemoteEngine",
    "RemoteSettings",
]

_RETRY_STATUS = (502, 503, 504)


@register("remote")
@dataclass
class RemoteSettings(EngineSpec):
    """How the trainer reaches served engines (``model.engine: {class_path: ...RemoteSettings, init_args: ...}``).

    Arguments:
        urls: base URLs of ``logra-pl serve`` engines; prompts are spread over them, updates go to all.
        api_key_env: name of the environment variable that holds the key of weight-changing requests (the
            server's ``--api-key``). The key itself is never a setting: settings are saved with the run and in its
            checkpoints.
        timeout_s: longest wait for one response (a large generate batch takes a while).
        retry_for_s: how long an engine that does not answer is retried before the run stops with an error.
        backoff_s: first wait between retries; doubled after each, up to ``max_backoff_s``.
        max_backoff_s: longest wait between retries.
        chunk_mib: full weights are sent in requests of at most this size (keep below the server's
            ``--max-request-mib``).
        weights_path: a folder the trainer and the engines share (NFS, Lustre...): full weights are written there
            as safetensors and the engines read them, instead of receiving them over HTTP. None: over HTTP.
    """

    urls: list[str] = field(default_factory=lambda: ["http://127.0.0.1:8100"])
    api_key_env: str = API_KEY_ENV
    timeout_s: float = 600.0
    retry_for_s: float = 120.0
    backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    chunk_mib: float = 256.0
    weights_path: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.urls, str):
            self.urls = [self.urls]
        if not self.urls:
            raise ConfigError("remote.urls is empty: give the URL of at least one `logra-pl serve` engine")
        bad = [u for u in self.urls if not str(u).startswith(("http://", "https://"))]
        if bad:
            raise ConfigError(f"remote.urls must be http(s) URLs such as http://127.0.0.1:8100, got {bad}")
        self.urls = [str(u).rstrip("/") for u in self.urls]
        check_range("remote.timeout_s", self.timeout_s, 0.0, low_open=True)
        check_range("remote.retry_for_s", self.retry_for_s, 0.0)
        check_range("remote.backoff_s", self.backoff_s, 0.0, low_open=True)
        check_range("remote.max_backoff_s", self.max_backoff_s, 0.0, low_open=True)
        check_range("remote.chunk_mib", self.chunk_mib, 0.0, low_open=True)

    def build(self, request: EngineRequest) -> RolloutEngine:
        """A :class:`RemoteEngine` on these engines, checked against the trainer's policy; any number of ranks."""
        from logra_pl.sketch.targets import select_targets

        if request.share_weights:
            raise ConfigError("rollout.share_weights applies to the HF engine; served engines hold their own weights")
        run_id = uuid.uuid4().hex[:12]
        if request.world_size > 1:
            run_id = request.broadcast(run_id)  # every rank names the same weight versions
        targets = select_targets(request.model, request.targets)
        matrices = {name: (m.out_features, m.in_features) for name, m in targets.items()}
        return RemoteEngine(
            self,
            request.eos,
            rank=request.rank,
            world_size=request.world_size,
            run_id=run_id,
            trainer_dtype=request.dtype,
            matrices=matrices,
            vocab_size=int(request.model.config.vocab_size),
        )


class RemoteEngine:
    """Rollouts from, and weight updates to, ``logra-pl serve`` engines over HTTP.

    Meets :class:`~logra_pl.rollout.base.StaleableEngine`: it knows when an engine may hold other weights than
    the trainer's, and the module repairs it before generating.

    Arguments:
        settings: URLs, key, timeouts.
        eos_token_id: token (or tokens) that end a response.
        rank: this trainer process's global rank (rank 0 sends weight changes).
        world_size: training processes.
        run_id: the same string on every rank (the module broadcasts it); it names this run's weight versions.
        trainer_dtype: the trainer's parameter dtype; a ``shadow`` engine's master copy must have it.
        matrices: ``{name: (d_out, d_in)}`` of the trainer's target matrices, checked against every engine.
        vocab_size: the trainer's vocabulary size, checked against every engine.

    Attributes:
        versions: the version every engine should hold and the engines known to hold others
            (:class:`~logra_pl.rollout.versions.ExpectedVersions`).
        infos: ``{url: HealthInfo}`` of every engine, read at start.
        last_sync: ``{"bytes", "seconds"}`` of the last weight change (what :class:`~logra_pl.rollout.base.SyncReport`
            reports).
    """

    shares_weights = False

    def __init__(
        self,
        settings: RemoteSettings | None = None,
        eos_token_id: int | Sequence[int] = (),
        *,
        rank: int = 0,
        world_size: int = 1,
        run_id: str | None = None,
        trainer_dtype: str = "float32",
        matrices: Mapping[str, tuple[int, int]] | None = None,
        vocab_size: int | None = None,
    ) -> None:
        import httpx

        self.settings = s = settings or RemoteSettings()
        self.eos = sorted({eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id))
        self.rank = rank
        self.world_size = world_size
        self.versions = ExpectedVersions(run_id or uuid.uuid4().hex[:12])
        # Asynchronous rollouts on several ranks: a request may overtake the weight change it needs (rank 0 sends
        # changes), so it asks the engine to wait for that version this long (0: refuse at once, version 1).
        self.version_wait_s = 0.0
        self.trainer_dtype = trainer_dtype
        self.api_key = os.environ.get(s.api_key_env) or None
        self.http = httpx.Client(timeout=httpx.Timeout(s.timeout_s, connect=min(10.0, s.timeout_s)))
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(s.urls)), thread_name_prefix="logra-remote")
        self.last_sync: dict[str, float] = {}
        self.counts = {"retries": 0, "stale_refusals": 0, "full_loads": 0, "payloads": 0}
        self.infos = {url: self.health(url) for url in s.urls}
        self._check_engines(matrices, vocab_size)
        self.context_limit = min(info.max_model_len for info in self.infos.values())
        first = next(iter(self.infos.values()))
        self.wire_dtype = getattr(torch, first.stored_dtype(), None)  # full loads travel in the dtype the engine stores

    # -------------------------------------------------------------------------------------- the contract
    @property
    def receivers(self) -> int:
        """Engines every weight change goes to: one per URL."""
        return len(self.settings.urls)

    @property
    def run_id(self) -> str:
        return self.versions.run_id

    @property
    def expected(self) -> str | None:
        """The version every engine should hold; None until the first weight change."""
        return self.versions.expected

    @expected.setter
    def expected(self, version: str | None) -> None:
        self.versions.expected = version

    @property
    def stale(self) -> set[str]:
        """Engines known (on this rank) to hold other weights."""
        return self.versions.stale

    @property
    def never_synced(self) -> bool:
        """No weight change was sent yet: the first full load is a first sync, not a repair."""
        return self.versions.never_synced

    def check_current(self) -> bool:
        """True when, as far as this rank knows, every engine holds the expected weights (no network call)."""
        return self.versions.current()

    def stale_engines(self) -> list[str]:
        """URLs of the engines known (on this rank) to hold other weights, sorted."""
        return sorted(self.versions.stale)

    # ------------------------------------------------------------------------------------------- checks
    def _check_engines(self, matrices: Mapping[str, tuple[int, int]] | None, vocab_size: int | None) -> None:
        for url, info in self.infos.items():
            if vocab_size is not None and info.vocab_size != int(vocab_size):
                raise ConfigError(
                    f"{url} serves a model with vocabulary {info.vocab_size}, the trainer's policy has "
                    f"{vocab_size}: start `logra-pl serve --model` with the trainer's policy"
                )
            served = {k: tuple(v) for k, v in info.matrices.items()}
            mine = dict(matrices or {})
            wrong = {n: (tuple(shape), served.get(n)) for n, shape in mine.items() if served.get(n) != tuple(shape)}
            if wrong:
                name, (ours, theirs) = next(iter(wrong.items()))
                raise ConfigError(
                    f"{url} serves another model: {len(wrong)} trainer matrices differ, e.g. {name!r} is {ours} in the "
                    f"trainer and {theirs} in the engine; start `logra-pl serve --model` with the trainer's policy"
                )
            if info.sync_mode == "shadow" and info.master_dtype != self.trainer_dtype:
                raise ConfigError(
                    f"{url} keeps its master copy in {info.master_dtype}, the trainer's weights are "
                    f"{self.trainer_dtype}: merges would not match; restart it with --master-dtype {self.trainer_dtype}"
                )

    def place(self, device: torch.device) -> bool:
        """Served engines run on their own devices: nothing to move."""
        return False

    def close(self) -> None:
        """Close the HTTP connections (the served engines keep running)."""
        self.http.close()
        self.pool.shutdown(wait=False)

    # -------------------------------------------------------------------------------------------- HTTP
    def _headers(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        headers = dict(extra or {})
        if self.api_key:
            headers[AUTH_HEADER] = bearer(self.api_key)
        return headers

    def request(self, method: str, url: str, path: str, **kwargs: Any) -> dict[str, Any]:
        """One API call with retries: transport errors and 502/503/504 back off and retry until ``retry_for_s``.

        Returns the answer's JSON body. 409 raises :class:`StaleEngineError`; other errors raise with the server's
        message.
        """
        import httpx

        s = self.settings
        deadline = time.monotonic() + s.retry_for_s
        wait = s.backoff_s
        kwargs["headers"] = self._headers(kwargs.get("headers"))
        while True:
            try:
                response = self.http.request(method, f"{url}{path}", **kwargs)
            except httpx.TransportError as err:
                problem = f"{type(err).__name__}: {err}"
            else:
                if response.status_code not in _RETRY_STATUS:
                    return self._answer(url, path, response)
                problem = f"HTTP {response.status_code}"
            if time.monotonic() + wait > deadline:
                raise EngineUnavailableError(
                    f"rollout engine {url} did not answer {path} for {s.retry_for_s:g} s (last: {problem}): is "
                    "`logra-pl serve` running there? Restart it and resume with --ckpt_path last; "
                    "model.engine.init_args.retry_for_s sets how long to wait"
                )
            self.counts["retries"] += 1
            time.sleep(wait)
            wait = min(wait * 2, s.max_backoff_s)

    def _answer(self, url: str, path: str, response: Any) -> dict[str, Any]:
        try:
            body = response.json()
        except ValueError:
            body = {"error": response.text[:500]}
        status = response.status_code
        if status < 400:
            return body
        message = body.get("error", body)
        if status == 409:
            self.counts["stale_refusals"] += 1
            self.versions.refused(url)  # it holds other weights than expected until a full load succeeds
            raise StaleEngineError(f"{url}: {message}", url=url, version=body.get("version"))
        if status == 401:
            raise ConfigError(
                f"{url} refused {path}: {message}; put the server's key in ${self.settings.api_key_env} "
                "(model.engine.init_args.api_key_env names the variable)"
            )
        if status == 422 and "non-finite" in str(message):
            raise PolicyDivergedError(f"{url}: {message}")
        raise LoGRAError(f"{url} answered {path} with HTTP {status}: {message}")

    def health(self, url: str) -> HealthInfo:
        """``GET /v1/health`` of one engine (retried while it starts), checked to speak this trainer's API."""
        body = self.request("GET", url, "/v1/health")
        if int(body.get("api", 0)) != API_VERSION:
            raise ConfigError(f"{url} speaks engine API {body.get('api')}, the trainer {API_VERSION}: upgrade both")
        try:
            return HealthInfo.model_validate(body)
        except ValidationError as err:
            raise ConfigError(f"{url} answered /v1/health with {describe(err)}: upgrade both") from None

    # ---------------------------------------------------------------------------------------- sampling
    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, prompt_seeds: Sequence[int] | None = None
    ) -> Rollout:
        """Sample ``sampling.n`` responses per prompt on the engines; rows grouped by prompt, as every engine does.

        Each response has its own seed (from its prompt's seed, else from ``sampling.seed`` and its row), so what
        a prompt gets does not depend on which engine or batch it lands in. Raises :class:`StaleEngineError` when
        an engine holds other weights than the trainer expects.
        """
        from logra_pl.rollout.vllm import row_seeds

        start = time.perf_counter()
        rows, index, seeds = expand_prompts(prompts, sampling, self.context_limit, prompt_seeds)
        if seeds is None:
            seeds = row_seeds(sampling, len(rows))
        urls = self.settings.urls
        parts = _split(len(prompts), len(urls))
        jobs = []
        for k, (lo, hi) in enumerate(parts):
            url = urls[(self.rank + k) % len(urls)]
            body = GenerateRequest(
                prompts=[list(map(int, p)) for p in prompts[lo:hi]],
                n=sampling.n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_new_tokens=sampling.max_new_tokens,
                seeds=seeds[lo * sampling.n : hi * sampling.n],
                stop_token_ids=self.eos,
                expect_version=self.versions.expected,
                **({"wait_s": self.version_wait_s} if self.version_wait_s > 0 else {}),  # version-1 servers: unset
            )
            json = body.model_dump(exclude_unset=True)
            jobs.append(self.pool.submit(self.request, "POST", url, "/v1/generate", json=json))
        answers = [GenerateResponse.model_validate(a) for a in _results(jobs)]
        responses = [r for a in answers for r in a.responses]
        reasons: list[FinishReason] = ["stop" if r.finish_reason == "stop" else "length" for r in responses]
        ids, logprobs = [r.token_ids for r in responses], [r.logprobs for r in responses]
        return Rollout.sampled(rows, index, ids, logprobs, reasons, start)

    # ----------------------------------------------------------------------------------------- weights
    def _each_engine(self, send: Any) -> list[Any]:
        """Run ``send(url)`` for every engine at once; return results, re-raising the first error."""
        return _results([self.pool.submit(send, url) for url in self.settings.urls])

    def _report(self, nbytes: int, start: float | None) -> SyncReport:
        """The report of a change of ``nbytes`` per engine (``start`` None: this rank sent nothing)."""
        seconds = 0.0 if start is None else time.perf_counter() - start
        report = SyncReport(bytes=nbytes * self.receivers, receivers=self.receivers, seconds=seconds)
        self.last_sync = {"bytes": float(report.bytes), "seconds": report.seconds}
        return report

    def apply_payload(self, payload: Payload) -> SyncReport:
        """Rank 0 sends the payload to every engine; an engine that refuses it (409) is marked stale."""
        prev, new = self.versions.next()
        data = payload.to_bytes()
        if self.rank != 0:
            return self._report(len(data), None)
        start = time.perf_counter()

        def send(url: str) -> None:
            headers = {EXPECT_HEADER: prev or "", NEW_HEADER: new, "Content-Type": OCTET_STREAM}
            try:
                self.request("POST", url, "/v1/payload", content=data, headers=headers)
                self.counts["payloads"] += 1
            except StaleEngineError:
                pass  # marked stale by the refusal itself

        self._each_engine(send)
        return self._report(len(data), start)

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> SyncReport:
        """Stream tensors to every engine in chunks of ``chunk_mib`` (or through ``weights_path``); rank 0 sends.

        ``tensors`` may gather each value when it is read (the module passes FSDP shards that all-gather on
        access, a collective): every rank reads the same keys in the same order, one chunk at a time, so no rank
        ever holds more than one chunk of gathered weights. Only the tensors the engine serves are read (a tied
        ``lm_head`` is not sent twice). A load that covers every served tensor repairs any engine; a load of some
        tensors only (a dense update's) must apply to the expected weights, like a payload. An engine that refuses
        or loses a transfer part-way is marked stale; the module's next check resends everything.
        """
        from logra_pl.rollout.vllm_worker import tensors_to_bytes

        prev, new = self.versions.next()
        served = set(next(iter(self.infos.values())).tensors)
        names = [k for k in tensors if not served or checkpoint_key(k) in served]
        full = bool(served) and served <= {checkpoint_key(k) for k in names}
        sizes = {k: _nbytes(tensors, k) for k in names}
        plan = _plan_chunks(sizes, int(self.settings.chunk_mib * 2**20))
        nbytes = sum(sizes.values())
        self.last_sync = {"bytes": float(nbytes * self.receivers), "seconds": 0.0}
        start = time.perf_counter()
        folder = Path(str(self.settings.weights_path)) / new.replace("/", "-") if self.settings.weights_path else None
        tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}") if folder is not None else None
        failed: set[str] = set()
        for index, keys in enumerate(plan):
            chunk = {checkpoint_key(k): tensors[k] for k in keys}  # gathered here, on every rank
            if self.rank != 0:
                continue
            if tmp is not None:
                _write_chunk(chunk, tmp, index)
                continue
            data = tensors_to_bytes(chunk)
            headers = {
                EXPECT_HEADER: prev or "",
                NEW_HEADER: new,
                CHUNK_HEADER: f"{index}/{len(plan)}",
                FULL_HEADER: "1" if full else "0",
                "Content-Type": OCTET_STREAM,
            }

            def send(url: str, data: bytes = data, headers: dict[str, str] = headers) -> None:
                if url in failed:
                    return
                try:
                    self.request("POST", url, "/v1/weights", content=data, headers=headers)
                except StaleEngineError:
                    failed.add(url)

            self._each_engine(send)
            del chunk, data
        if self.rank != 0:
            return self._report(nbytes, None)
        if folder is not None and tmp is not None:
            _publish(tmp, folder)
            body = WeightsPathRequest(path=str(folder), expect_version=prev, new_version=new, full=full)

            def send_path(url: str) -> None:
                try:
                    self.request("POST", url, "/v1/weights/path", json=body.model_dump())
                except StaleEngineError:
                    failed.add(url)

            self._each_engine(send_path)
        for url in self.settings.urls:
            if url in failed:
                self.versions.refused(url)
            else:
                self.versions.accepted(url)
                self.counts["full_loads"] += 1
        return self._report(nbytes, start)

    # ------------------------------------------------------------------------------------ verification
    def weights_digest(self, names: Sequence[str], url: str | None = None) -> dict[str, str]:
        """``{name: digest}`` of an engine's current weights (:func:`~logra_pl.rollout.vllm_worker.tensor_digest`)."""
        body = DigestRequest(names=list(names)).model_dump()
        answer = self.request("POST", url or self.settings.urls[0], "/v1/weights/digest", json=body)
        return dict(DigestAnswer.model_validate(answer).digests)


def _results(jobs: list[Any]) -> list[Any]:
    """The results of ``jobs`` in order, after all of them finished; the first error is raised."""
    results, errors = [], []
    for job in jobs:
        try:
            results.append(job.result())
        except Exception as err:  # wait for every job before raising
            errors.append(err)
    if errors:
        raise errors[0]
    return results


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges of ``n`` items over at most ``parts`` engines, sizes differing by at most one."""
    parts = max(1, min(parts, n))
    base, extra = divmod(n, parts)
    out, lo = [], 0
    for k in range(parts):
        hi = lo + base + (1 if k < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def _nbytes(tensors: Mapping[str, Any], key: str) -> int:
    """Bytes of ``tensors[key]`` without reading it (a lazily gathered mapping reports global shapes)."""
    spec = getattr(tensors, "spec", None)
    shape, dtype = spec(key) if spec is not None else (tensors[key].shape, tensors[key].dtype)
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _plan_chunks(sizes: Mapping[str, int], limit: int) -> list[list[str]]:
    """Group names into chunks of at most ``limit`` bytes, in order (a larger single tensor is a chunk of its own)."""
    out: list[list[str]] = [[]]
    size = 0
    for key, nbytes in sizes.items():
        if out[-1] and size + nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(key)
        size += nbytes
    return out if out[0] else []


def _write_chunk(chunk: Mapping[str, torch.Tensor], folder: Path, index: int) -> None:
    """One chunk of a shared-folder load as ``model-<index>.safetensors`` (the engine reads every file)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in chunk.items()}
    save_file(tensors, str(folder / f"model-{index:05d}.safetensors"))


def _publish(tmp: Path, folder: Path) -> None:
    """Rename the finished temp folder into place and remove older loads (only the newest is kept)."""
    tmp.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, folder)
    for old in folder.parent.iterdir():
        if old.is_dir() and old != folder and not old.name.startswith("."):
            for f in old.glob("*.safetensors"):
                f.unlink()
            with contextlib.suppress(OSError):
                old.rmdir()
