"""LLMJudge against a chat-completions endpoint written here (a real HTTP server on localhost standing in for
``vllm serve``, since no judge model exists offline): parsing, retries, timeouts, the API key, bounded concurrency,
failures through the runner, and 2 updates through ``logra-pl fit``."""

from __future__ import annotations

import json
import math
import re
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from logra_pl.cli import LoGRACLI
from logra_pl.errors import ConfigError
from logra_pl.rewards import BoundedVerifier, LLMJudge
from logra_pl.rewards.judge import JudgeError, JudgeTimeout, question_of
from tests.helpers.cli import quick_fit_args

RESPONSE = re.compile(r"Response to grade:\n(.*)\n\nHow correct", re.DOTALL)


def grade(response: str) -> int:
    """The stand-in judge's grade of a response: its length mod 11 (a 0–10 score)."""
    return len(response) % 11


class JudgeServer:
    """``POST /v1/chat/completions`` in OpenAI's format. The graded response decides the behaviour: ``slow`` sleeps
    longer than the client waits, ``flaky`` answers 503 on its first two requests, ``denied`` gets a 401, ``garbled``
    a reply without a score, ``broken`` a body that is not a chat completion; any other gets ``<score>grade</score>``
    after some reasoning text."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.headers: list[dict[str, str]] = []
        self.flaky_left = 2
        self.in_flight = 0
        self.max_in_flight = 0
        self.delay_s = 0.0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # quiet
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append(body)
                    server.headers.append(dict(self.headers))
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    status, payload = server.answer(self.path, body)
                finally:
                    with server.lock:
                        server.in_flight -= 1
                data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def answer(self, path: str, body: dict) -> tuple[int, object]:
        if path != "/v1/chat/completions":
            return 404, {"error": f"no route {path}"}
        text = body["messages"][-1]["content"]
        found = RESPONSE.search(text)
        response = found.group(1) if found else ""
        time.sleep(self.delay_s)
        if response == "slow":
            time.sleep(1.0)
        if response == "flaky":
            with self.lock:
                self.flaky_left -= 1
                if self.flaky_left >= 0:
                    return 503, {"error": "overloaded"}
        if response == "denied":
            return 401, {"error": "bad key"}
        if response == "broken":
            return 200, "not json at all"
        reply = "no verdict here" if response == "garbled" else f"Reasoning: fine.\n<score>{grade(response)}</score>"
        return 200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[JudgeServer]:
    found = JudgeServer()
    yield found
    found.close()


def _item(question: str = "2 + 2?", answer: str = "4") -> dict:
    return {"messages": [{"role": "user", "content": question}], "answer": answer, "task": "t", "id": question}


def test_scores_come_from_the_reply(server: JudgeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JUDGE_KEY", "sekret")
    judge = LLMJudge(url=server.url, model="judge-7b", api_key_env="JUDGE_KEY", extra_body={"seed": 3})
    assert judge("four", _item()) == pytest.approx(0.1 * grade("four"))
    (body,) = server.requests
    assert body["model"] == "judge-7b" and body["temperature"] == 0.0 and body["seed"] == 3
    assert "Task:\n2 + 2?" in body["messages"][-1]["content"]
    assert "Reference answer (may be empty):\n4" in body["messages"][-1]["content"]
    assert server.headers[0]["Authorization"] == "Bearer sekret"
    monkeypatch.delenv("JUDGE_KEY")
    judge("five", _item())
    assert "Authorization" not in server.headers[1]  # no key set: none sent


def test_parse_rule() -> None:
    judge = LLMJudge(scale=1.0)
    assert judge.parse("<score>3</score> on reflection <score> 7.5 </score>") == 7.5  # the last match counts
    assert judge.parse("<score>-2</score>") == -2.0
    with pytest.raises(JudgeError, match="no score matching"):
        judge.parse("I would give it a 7")
    tagged = LLMJudge(score_pattern=r"Rating: \[\[(\d+)\]\]", scale=0.5)  # MT-Bench style
    assert tagged.parse("... Rating: [[8]]") == 4.0
    with pytest.raises(ConfigError, match="needs a group"):
        LLMJudge(score_pattern=r"\d+")
    with pytest.raises(ConfigError, match="never shows the judge the response"):
        LLMJudge(rubric="rate {question}")
    with pytest.raises(ConfigError, match="not a template"):
        LLMJudge(rubric="rate {response} {nope}")
    with pytest.raises(ConfigError, match="http"):
        LLMJudge(url="localhost:8000")
    assert question_of({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}) == "a"


def test_retries_with_backoff_then_success(server: JudgeServer) -> None:
    judge = LLMJudge(url=server.url, retries=3, backoff_s=0.01)
    assert judge("flaky", _item()) == pytest.approx(0.1 * grade("flaky"))
    assert len(server.requests) == 3  # two 503s, then the answer


def test_retries_run_out(server: JudgeServer) -> None:
    judge = LLMJudge(url=server.url, retries=1, backoff_s=0.01)
    with pytest.raises(JudgeError, match=r"failed \(2 attempt\(s\)\).*HTTP 503"):
        judge("flaky", _item())
    assert len(server.requests) == 2


def test_client_errors_are_not_retried(server: JudgeServer) -> None:
    judge = LLMJudge(url=server.url, retries=3, backoff_s=0.01)
    with pytest.raises(JudgeError, match="HTTP 401"):
        judge("denied", _item())
    assert len(server.requests) == 1
    with pytest.raises(JudgeError, match="not a chat completion"):
        judge("broken", _item())


def test_timeouts_are_retried_then_reported_as_timeouts(server: JudgeServer) -> None:
    judge = LLMJudge(url=server.url, timeout_s=0.2, retries=1, backoff_s=0.01)
    with pytest.raises(JudgeTimeout, match=r"did not answer within 0.2 s \(2 attempt\(s\)\)") as info:
        judge("slow", _item())
    assert isinstance(info.value, TimeoutError)
    assert len(server.requests) == 2


def test_a_batch_through_the_runner(server: JudgeServer) -> None:
    responses = ["four", "slow", "garbled", "denied", "the answer is 4", "flaky"]
    judge = LLMJudge(url=server.url, timeout_s=0.2, retries=2, backoff_s=0.01, max_concurrency=3)
    with BoundedVerifier(judge, timeout_s=5.0, workers=2, correct_threshold=0.5) as bounded:
        scores = bounded.run(responses, [_item()] * len(responses))
        assert not bounded._pool.started  # judged in this process, concurrently: no worker processes
        assert bounded.counters() == {"errors": 2, "timeouts": 1, "long_answers": 0, "nan": 0}
    kinds = [f.kind if f is not None else None for f in scores.failures]
    assert kinds == [None, "timeouts", "errors", "errors", None, None]
    for k in (0, 4, 5):
        assert scores.rewards[k] == pytest.approx(0.1 * grade(responses[k]))
        assert scores.correct[k] == (0.1 * grade(responses[k]) >= 0.5)
    assert "no score matching" in scores.failures[2].message and "HTTP 401" in scores.failures[3].message
    assert all(math.isnan(scores.rewards[k]) for k in (1, 2, 3))


def test_concurrency_is_bounded(server: JudgeServer) -> None:
    server.delay_s = 0.05
    judge = LLMJudge(url=server.url, max_concurrency=2)
    responses = [f"response {k}" for k in range(8)]
    assert judge.score_batch(responses, [_item()] * 8) == pytest.approx([0.1 * grade(r) for r in responses])
    assert len(server.requests) == 8
    assert server.max_in_flight <= 2


def test_two_updates_through_the_cli(server: JudgeServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["logra-pl"])
    judge = [f"--model.verifier.init_args.url={server.url}", "--model.verifier.init_args.model=judge"]
    cli = LoGRACLI(
        args=[
            *quick_fit_args(2, tmp_path / "runs"),
            "--model.verifier.class_path=logra_pl.rewards.LLMJudge",
            *judge,
            "--model.verifier.init_args.scale=1.0",
        ]
    )
    module = cli.model
    assert cli.trainer.global_step == 2 and module.method.applied_updates == 2
    assert len(server.requests) == 2 * 8  # every response of both updates, judged once
    ctx = module.step_context
    texts = module.tokenizer.batch_decode(ctx.rollout.response_ids, skip_special_tokens=True)
    assert ctx.rewards.tolist() == [float(grade(t)) for t in texts]  # the judge's grades, 0-10, not clamped
    assert ctx.all_scored and module.scorer.counters()["errors"] == 0


def test_an_unreachable_judge_fails_in_a_few_lines() -> None:
    """No server at the URL: each response's failure names the URL and the connection error in one message, and
    its traceback is the judge's own (not the three chained ones of httpx and httpcore), at most 8 lines."""
    from logra_pl.rewards.failures import TRACEBACK_LINES

    judge = LLMJudge(url="http://127.0.0.1:9/v1", timeout_s=1.0, retries=1, backoff_s=0.01)
    with BoundedVerifier(judge, timeout_s=5.0, workers=1, correct_threshold=0.5) as bounded:
        scores = bounded.run(["four"], [_item()])
    (failure,) = scores.failures
    assert failure.kind == "errors"
    assert "the judge at http://127.0.0.1:9/v1 failed (2 attempt(s)): ConnectError" in failure.message
    lines = failure.traceback.splitlines()
    assert 2 <= len(lines) <= TRACEBACK_LINES and lines[0].startswith("Traceback")
    assert "direct cause" not in failure.traceback and "During handling" not in failure.traceback
    assert lines[-1].startswith("logra_pl.rewards.judge.JudgeError: the judge at http://127.0.0.1:9/v1 failed")
