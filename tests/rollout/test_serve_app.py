"""The served API without vLLM: the real routes and engine state over a fake engine client, and RemoteEngine on them.

The fake client stands in for vLLM's ``AsyncLLM``: it records every ``collective_rpc`` (what would reach the
workers) and answers ``generate`` with fixed tokens. The real-vLLM proof of the same API is
tests/rollout/test_served.py.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save as st_save
from safetensors.torch import save_file

from logra_pl.errors import StaleEngineError
from logra_pl.rollout.base import SamplingConfig, StaleableEngine
from logra_pl.rollout.protocol import (
    CHUNK_HEADER,
    EXPECT_HEADER,
    FULL_HEADER,
    HOLD_HEADER,
    NEW_HEADER,
    GenerateRequest,
)
from logra_pl.rollout.remote import RemoteEngine, RemoteSettings
from logra_pl.rollout.serve.server import EngineState, ServeSettings, build_app
from logra_pl.rollout.vllm_worker import tensors_to_bytes
from logra_pl.sketch.payload import Payload

fastapi = pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

KEY = "app-test-key"
D_OUT, D_IN, VOCAB = 8, 6, 50
MATRIX = "model.layers.0.mlp.up_proj"
TENSORS = {f"{MATRIX}.weight": (D_OUT, D_IN), "model.embed_tokens.weight": (VOCAB, D_IN)}
HAS_VLLM = importlib.util.find_spec("vllm") is not None  # generate builds vLLM SamplingParams


class FakeClient:
    """vLLM's engine client as EngineState uses it; every response is tokens 7, 8 with log-probs -0.5, -0.25."""

    def __init__(self) -> None:
        self.model_config = SimpleNamespace(max_model_len=64)
        self.rpcs: list[str] = []
        self.requests: list[Any] = []

    async def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        self.rpcs.append(method)
        if method == "logra_digest":
            return [{name: f"digest-{name}" for name in args[0]}]
        return [None]

    async def reset_prefix_cache(self) -> None:
        self.rpcs.append("reset_prefix_cache")

    async def generate(self, prompt: Any, params: Any, request_id: str):
        self.requests.append((prompt, params))
        steps = [{7: SimpleNamespace(logprob=-0.5)}, {8: SimpleNamespace(logprob=-0.25)}]
        yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7, 8], logprobs=steps, finish_reason="stop")])


@pytest.fixture
def served(tmp_path: Path) -> tuple[TestClient, EngineState]:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB, "tie_word_embeddings": True}))
    save_file({k: torch.zeros(shape) for k, shape in TENSORS.items()}, str(tmp_path / "model.safetensors"))
    settings = ServeSettings(model="fake", api_key=KEY, max_request_mib=1.0)
    state = EngineState(FakeClient(), settings, tmp_path, [{"mode": "shadow", "platform": "fake"}])
    with TestClient(build_app(state)) as client:
        yield client, state


def _payload(update: int = 0, rows: int = D_OUT) -> bytes:
    factor = torch.ones(rows, 2, dtype=torch.bfloat16)
    return Payload({MATRIX: factor}, update, 0, 2, "rademacher", True).to_bytes()


def _headers(expect: str, new: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}", EXPECT_HEADER: expect, NEW_HEADER: new, **extra}


def test_health_reports_the_engine(served) -> None:
    client, state = served
    info = client.get("/v1/health").json()
    assert info["api"] == 1 and info["version"] == f"base:{state.engine_id}" and info["sync_mode"] == "shadow"
    assert info["matrices"] == {MATRIX: [D_OUT, D_IN], "model.embed_tokens": [VOCAB, D_IN]}
    assert info["tensors"] == sorted(TENSORS) and info["max_model_len"] == 64


def test_a_bad_body_gets_a_400_naming_the_field(served) -> None:
    client, state = served
    cases = {
        "prompts.0.1": {"prompts": [[1, "x"]]},
        "top_p": {"prompts": [[1]], "top_p": 2.0},  # SamplingConfig's own check
        "temprature": {"prompts": [[1]], "temprature": 0.5},  # a misspelt field is not ignored
        "prompts": {"n": 2},
        "2 seeds for 1 responses": {"prompts": [[1]], "seeds": [1, 2]},
    }
    for field, body in cases.items():
        r = client.post("/v1/generate", json=body)
        assert r.status_code == 400 and field in r.json()["error"], (field, r.text)
    r = client.post("/v1/generate", content=b"{not json")
    assert r.status_code == 400 and "/v1/generate" in r.json()["error"]
    r = client.post("/v1/weights/path", json={"expect_version": "x"}, headers=_headers("", "x"))
    assert r.status_code == 400 and "path" in r.json()["error"]
    assert not state.client.rpcs  # nothing reached the engine


def test_generate_samples_with_the_requested_seeds_or_refuses_other_weights(served) -> None:
    if not HAS_VLLM:
        pytest.skip("generate builds vLLM SamplingParams: the vllm extra is not installed")
    client, state = served
    body = GenerateRequest(prompts=[[1, 2], [3]], n=2, seeds=[11, 12, 13, 14], stop_token_ids=[8], max_new_tokens=4)
    answer = client.post("/v1/generate", json=body.model_dump(exclude_unset=True)).json()
    assert answer["version"] == state.version and len(answer["responses"]) == 4
    assert answer["responses"][0] == {"token_ids": [7, 8], "logprobs": [-0.5, -0.25], "finish_reason": "stop"}
    rows = [(p["prompt_token_ids"], params.seed, params.max_tokens) for p, params in state.client.requests]
    assert rows == [([1, 2], 11, 4), ([1, 2], 12, 4), ([3], 13, 4), ([3], 14, 4)]
    probe = client.post("/v1/probe", json={"prompts": [[5]], "max_new_tokens": 2}).json()
    assert len(probe["responses"]) == 1 and state.client.requests[-1][1].temperature == 0.0
    r = client.post("/v1/generate", json={"prompts": [[1]], "expect_version": "run/1"})
    assert r.status_code == 409 and r.json()["version"] == state.version
    r = client.post("/v1/generate", json={"prompts": [[VOCAB]]})
    assert r.status_code == 400 and "token ids" in r.json()["error"]


def test_weight_changes_follow_the_version_rules(served) -> None:
    client, state = served
    base = state.version
    assert client.post("/v1/payload", content=_payload(), headers={NEW_HEADER: "r/1"}).status_code == 401
    r = client.post("/v1/payload", content=_payload(rows=3), headers=_headers(base, "r/1"))
    assert r.status_code == 400 and "shape" in r.json()["error"]
    assert client.post("/v1/payload", content=b"\0" * (2 * 2**20), headers=_headers(base, "r/1")).status_code == 413
    # Full weights in two chunks, accepted from the engine's base version.
    chunks = [{k: torch.ones(s)} for k, s in TENSORS.items()]
    for i, chunk in enumerate(chunks):
        flags = {CHUNK_HEADER: f"{i}/2", FULL_HEADER: "1"}
        answer = client.post("/v1/weights", content=tensors_to_bytes(chunk), headers=_headers("", "r/1", **flags))
        assert answer.json().keys() == {"version", "applied", "chunk", "seconds"}  # no null fields
        assert (answer.json()["version"], answer.json()["chunk"]) == ("r/1" if i else "partial:r/1", i)
    assert state.version == "r/1" and state.client.rpcs[-2:] == ["logra_reload", "reset_prefix_cache"]
    # A payload in order is applied; its repeat is not; one after a lost update is refused.
    answer = client.post("/v1/payload", content=_payload(1), headers=_headers("r/1", "r/2")).json()
    assert answer["applied"] is True and answer["version"] == "r/2" and answer["matrices"] == 1
    merges = state.client.rpcs.count("logra_apply_payload")
    assert client.post("/v1/payload", content=_payload(1), headers=_headers("r/1", "r/2")).json() == {
        "version": "r/2",
        "applied": False,
    }
    r = client.post("/v1/payload", content=_payload(3), headers=_headers("r/3", "r/4"))
    assert r.status_code == 409 and r.json()["version"] == "r/2"
    assert state.client.rpcs.count("logra_apply_payload") == merges and state.counts["refused"] == 1
    late = _headers("r/2", "r/5", **{CHUNK_HEADER: "1/2"})  # chunk 1 of a transfer that never began
    r = client.post("/v1/weights", content=tensors_to_bytes(chunks[1]), headers=late)
    assert r.status_code == 409 and "restart the transfer from chunk 0" in r.json()["error"]
    digests = client.post("/v1/weights/digest", json={"names": [f"{MATRIX}.weight"]}).json()
    assert digests == {"digests": {f"{MATRIX}.weight": f"digest-{MATRIX}.weight"}, "version": "r/2"}


def test_asynchronous_waits_a_held_change_and_a_request_that_overtook_its_change(served) -> None:
    """Version-1 rules plus the two bounded waits of asynchronous trainers: a payload held for ``count`` requests at
    the version it replaces, and a generate request for the next version waiting for it (``wait_s``)."""
    if not HAS_VLLM:
        pytest.skip("generate builds vLLM SamplingParams: the vllm extra is not installed")
    import threading
    import time

    client, state = served
    full = tensors_to_bytes({k: torch.ones(s) for k, s in TENSORS.items()})
    assert (
        client.post("/v1/weights", content=full, headers=_headers("", "r/1", **{FULL_HEADER: "1"})).status_code == 200
    )
    answers: dict[str, Any] = {}

    def post(key: str, path: str, **kwargs: Any) -> threading.Thread:
        thread = threading.Thread(target=lambda: answers.__setitem__(key, client.post(path, **kwargs)))
        thread.start()
        return thread

    # A change held for two requests at r/1 (two ranks' shares of one batch sampled by r/1) waits for both.
    held = post("held", "/v1/payload", content=_payload(1), headers=_headers("r/1", "r/2", **{HOLD_HEADER: "2/30"}))
    time.sleep(0.5)
    assert state.version == "r/1" and "held" not in answers
    assert client.post("/v1/generate", json={"prompts": [[1]], "expect_version": "r/1"}).json()["version"] == "r/1"
    time.sleep(0.3)
    assert state.version == "r/1" and "held" not in answers  # one of two served: still held
    assert client.post("/v1/generate", json={"prompts": [[2]], "expect_version": "r/1"}).json()["version"] == "r/1"
    held.join(10)
    assert answers["held"].json()["applied"] is True and state.version == "r/2"
    # A request for r/3 that overtook its change waits for it; one for the past is refused at once.
    early = post("early", "/v1/generate", json={"prompts": [[1]], "expect_version": "r/3", "wait_s": 30})
    time.sleep(0.5)
    assert "early" not in answers
    assert client.post("/v1/payload", content=_payload(2), headers=_headers("r/2", "r/3")).json()["applied"]
    early.join(10)
    assert answers["early"].status_code == 200 and answers["early"].json()["version"] == "r/3"
    start = time.perf_counter()
    late = client.post("/v1/generate", json={"prompts": [[1]], "expect_version": "r/2", "wait_s": 30})
    assert late.status_code == 409 and time.perf_counter() - start < 5
    # Without wait_s (a version-1 client) a request for a later version is refused at once, as before.
    assert client.post("/v1/generate", json={"prompts": [[1]], "expect_version": "r/4"}).status_code == 409
    # A hold whose requests never come ends after its seconds: the change goes ahead, counted.
    t0 = time.perf_counter()
    answer = client.post("/v1/payload", content=_payload(3), headers=_headers("r/3", "r/4", **{HOLD_HEADER: "5/0.3"}))
    assert answer.json()["applied"] and state.version == "r/4" and time.perf_counter() - t0 >= 0.3
    assert state.counts["hold_timeouts"] == 1
    bad = client.post("/v1/payload", content=_payload(4), headers=_headers("r/4", "r/5", **{HOLD_HEADER: "x"}))
    assert bad.status_code == 400 and HOLD_HEADER in bad.json()["error"]
    r = client.post("/v1/generate", json={"prompts": [[1]], "wait_s": 601})
    assert r.status_code == 400 and "wait_s" in r.json()["error"]


def test_remote_engine_speaks_the_same_models(served, monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's client against the real routes: its requests validate there, its answers parse here."""
    client, state = served
    monkeypatch.setattr(httpx, "Client", lambda **kw: client)
    monkeypatch.setenv("APP_TEST_KEY", KEY)
    settings = RemoteSettings(urls=["http://testserver"], api_key_env="APP_TEST_KEY", retry_for_s=1.0)
    engine = RemoteEngine(settings, 8, vocab_size=VOCAB, matrices={MATRIX: (D_OUT, D_IN)}, run_id="run")
    assert isinstance(engine, StaleableEngine) and engine.never_synced and not engine.check_current()
    assert engine.context_limit == 64 and engine.receivers == 1 and engine.wire_dtype == torch.float32
    report = engine.load_weights({k: torch.ones(s) for k, s in TENSORS.items()})
    assert engine.check_current() and state.version == "run/1" and not engine.never_synced
    assert report.bytes == 4 * (D_OUT * D_IN + VOCAB * D_IN) and report.receivers == 1
    report = engine.apply_payload(Payload.from_bytes(_payload(1)))
    assert state.version == "run/2" and report.bytes == len(_payload(1))
    assert engine.weights_digest([f"{MATRIX}.weight"]) == {f"{MATRIX}.weight": f"digest-{MATRIX}.weight"}
    engine.versions.next()  # an update lost on the way: the next one is refused and the engine marked stale
    engine.apply_payload(Payload.from_bytes(_payload(3)))
    assert not engine.check_current() and engine.stale_engines() == ["http://testserver"]
    if HAS_VLLM:
        with pytest.raises(StaleEngineError):
            engine.generate([[1, 2]], SamplingConfig(max_new_tokens=2), prompt_seeds=[0])
        engine.load_weights({k: torch.ones(s) for k, s in TENSORS.items()})  # the repair: full weights
        rollout = engine.generate([[1, 2]], SamplingConfig(n=2, max_new_tokens=2), prompt_seeds=[0])
        assert rollout.response_ids == [[7, 8], [7, 8]] and rollout.logprobs == [[-0.5, -0.25]] * 2
        assert rollout.finish_reasons == ["stop", "stop"] and engine.check_current()


def test_payload_projection_fields_are_checked_before_any_worker_sees_them(served) -> None:
    """A hadamard payload with refresh_every reaches the workers as sent; a bad distribution or period gets a 400."""
    client, state = served
    factor = torch.ones(D_OUT, 2, dtype=torch.bfloat16)  # D_IN = 6 = 2·3: a non-power-of-two Hadamard width
    good = Payload({MATRIX: factor}, 4, 0, 2, "hadamard", refresh_every=3)
    header = good.header()
    bad_headers = {
        "unknown projection distribution 'sparse'": {**header, "distribution": "sparse"},
        "refresh_every must be a non-negative integer": {**header, "refresh_every": -1},
        "contradicts": {**header, "refresh": False},
    }
    for message, bad in bad_headers.items():
        data = st_save({MATRIX: factor}, metadata={"logra": json.dumps(bad)})
        r = client.post("/v1/payload", content=data, headers=_headers(state.version, "r/1"))
        assert r.status_code == 400 and "malformed payload" in r.json()["error"] and message in r.json()["error"], (
            r.text
        )
    assert not state.client.rpcs  # nothing reached the engine
    answer = client.post("/v1/payload", content=good.to_bytes(), headers=_headers(state.version, "r/1"))
    assert answer.status_code == 200 and answer.json()["applied"] is True, answer.text
    assert state.client.rpcs.count("logra_apply_payload") == 1
    received = Payload.from_bytes(good.to_bytes())  # what the workers parse from the same bytes
    assert (received.distribution, received.refresh_every, received.seed(MATRIX)) == ("hadamard", 3, good.seed(MATRIX))
