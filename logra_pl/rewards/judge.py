"""``LLMJudge``: a language model grades each response against a rubric, through an OpenAI-compatible chat endpoint.

The judge is any server that speaks ``POST <url>/chat/completions`` (OpenAI's chat-completions format): vLLM's own
server is the documented one — ``vllm serve Qwen/Qwen2.5-7B-Instruct --port 8000`` then ``url:
http://localhost:8000/v1``, ``model: Qwen/Qwen2.5-7B-Instruct`` — and hosted APIs work the same way with their key in
the environment variable ``api_key_env`` names (sent as ``Authorization: Bearer <key>``).

Per response: the rubric (a ``str.format`` template of ``{question}``, ``{response}`` and ``{answer}``) becomes the
user message (after an optional system message); the reply's **last** match of ``score_pattern`` (first group: a
number) times ``scale`` is the reward. A batch's requests run concurrently, at most ``max_concurrency`` at a time
(threads sharing one ``httpx.Client`` and its connections). A request that times out (``timeout_s``), cannot connect,
or gets a 429 or a 5xx answer is retried up to ``retries`` times after ``backoff_s·2^k`` seconds (or the server's
``Retry-After``, at most 60 s); any other HTTP error is not retried. A response with no score after that — an HTTP
failure, a reply without a parsable score — is a failure of that response (a timeout counts as a timeout), counted
and left out of the update by the runner's failure policy (:mod:`logra_pl.rewards.failures`); the other responses
of the batch keep their scores. One response costs at most ``(retries + 1)·timeout_s`` plus the back-off.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import re
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from logra_pl.errors import ConfigError, check_int, check_range

DEFAULT_RUBRIC = """You grade a response to a task.

Task:
{question}

Reference answer (may be empty):
{answer}

Response to grade:
{response}

How correct and complete is the response? Think briefly, then give a score from 0 (wrong or empty) to 10 (fully \
correct), written as <score>N</score>."""

DEFAULT_PATTERN = r"<score>\s*([-+]?\d+(?:\.\d+)?)\s*</score>"
_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class JudgeError(RuntimeError):
    """The judge gave no usable score for a response (an HTTP failure, or a reply without a score)."""


class JudgeTimeout(JudgeError, TimeoutError):
    """Every attempt at a response's judgement timed out (the runner counts it as a timeout)."""


def question_of(item: Mapping[str, Any]) -> str:
    """What the response answers: the last user message of ``item["messages"]``, else ``item["question"]``."""
    for message in reversed(item.get("messages") or []):
        if isinstance(message, Mapping) and message.get("role") == "user":
            return str(message.get("content", ""))
    return str(item.get("question", ""))


class LLMJudge:
    """The reward is a judge model's score of each response, read from its reply (see the module docstring).

    Arguments:
        url: the endpoint's base URL, up to ``/v1`` (requests go to ``<url>/chat/completions``).
        model: the model name the server serves (``vllm serve <model>``).
        rubric: the user message, a ``str.format`` template with ``{response}`` and optionally ``{question}``,
            ``{answer}`` (literal braces doubled).
        system_prompt: an optional system message before it.
        score_pattern: a regular expression whose first group is the score; its last match in the reply counts.
        scale: the reward is ``score·scale`` (0.1 maps the default rubric's 0–10 to 0–1).
        temperature: the judge's sampling temperature (0: greedy).
        max_tokens: the judge's reply length limit.
        timeout_s: seconds one request may take.
        retries: further attempts after a timeout, a connection error, a 408/429 or a 5xx.
        backoff_s: the wait before retry ``k`` is ``backoff_s·2^k`` (the server's ``Retry-After`` when it sends one).
        max_concurrency: requests in flight at once.
        api_key_env: the environment variable holding the API key (none sent when unset or empty).
        extra_body: more fields of the request body (e.g. ``{"top_p": 1.0, "seed": 0}``).

    Example (YAML, under ``model:``)::

        verifier:
          class_path: logra_pl.rewards.LLMJudge
          init_args: {url: "http://localhost:8000/v1", model: Qwen/Qwen2.5-7B-Instruct}
    """

    def __init__(
        self,
        url: str = "http://localhost:8000/v1",
        model: str = "judge",
        rubric: str = DEFAULT_RUBRIC,
        system_prompt: str | None = None,
        score_pattern: str = DEFAULT_PATTERN,
        scale: float = 0.1,
        temperature: float = 0.0,
        max_tokens: int = 512,
        timeout_s: float = 60.0,
        retries: int = 3,
        backoff_s: float = 1.0,
        max_concurrency: int = 8,
        api_key_env: str | None = "OPENAI_API_KEY",
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(f"LLMJudge url must start with http:// or https://, got {url!r}")
        try:
            rubric.format(question="", response="", answer="")
        except (KeyError, IndexError, ValueError) as err:
            raise ConfigError(
                f"LLMJudge rubric is not a template of {{question}}, {{response}}, {{answer}} ({type(err).__name__}: "
                f"{err}); double literal braces"
            ) from None
        if "{response}" not in rubric:
            raise ConfigError("LLMJudge rubric never shows the judge the response: put {response} in it")
        try:
            pattern = re.compile(score_pattern)
        except re.error as err:
            raise ConfigError(f"LLMJudge score_pattern {score_pattern!r} is not a regular expression: {err}") from None
        if pattern.groups < 1:
            raise ConfigError(f"LLMJudge score_pattern {score_pattern!r} needs a group around the number")
        check_range("LLMJudge scale", scale)
        check_range("LLMJudge temperature", temperature, 0.0)
        check_int("LLMJudge max_tokens", max_tokens, 1)
        check_range("LLMJudge timeout_s", timeout_s, 0.0, low_open=True)
        check_int("LLMJudge retries", retries, 0)
        check_range("LLMJudge backoff_s", backoff_s, 0.0)
        check_int("LLMJudge max_concurrency", max_concurrency, 1)
        self.url = url.rstrip("/")
        self.model = model
        self.rubric = rubric
        self.system_prompt = system_prompt
        self.score_pattern = score_pattern
        self.scale = float(scale)
        self.temperature = float(temperature)
        self.max_tokens = max_tokens
        self.timeout_s = float(timeout_s)
        self.retries = retries
        self.backoff_s = float(backoff_s)
        self.max_concurrency = max_concurrency
        self.api_key_env = api_key_env
        self.extra_body = dict(extra_body or {})
        self._pattern = pattern
        self._client: Any = None
        self._lock = threading.Lock()

    # -- one judgement -----------------------------------------------------------------------------------------------

    def messages(self, response: str, item: Mapping[str, Any]) -> list[dict[str, str]]:
        """The chat messages sent for ``response`` to ``item``."""
        gold = item.get("answer") if isinstance(item, Mapping) else None
        text = self.rubric.format(question=question_of(item), response=response, answer="" if gold is None else gold)
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": text}]

    def parse(self, reply: str) -> float:
        """The reward in a judge's reply: the last match of ``score_pattern``, times ``scale``.

        Raises:
            JudgeError: no match, or a match that is not a finite number.
        """
        found = self._pattern.findall(reply)
        if not found:
            shown = " ".join(reply.split())[:160]
            raise JudgeError(f"the judge's reply has no score matching {self.score_pattern!r}: {shown!r}")
        last = found[-1][0] if isinstance(found[-1], tuple) else found[-1]
        try:
            score = float(last)
        except ValueError:
            raise JudgeError(f"the judge's score {last!r} is not a number") from None
        if not math.isfinite(score):
            raise JudgeError(f"the judge's score {last!r} is not finite")
        return score * self.scale

    def judge(self, response: str, item: Mapping[str, Any]) -> float:
        """One judgement, with retries (see the module docstring).

        Raises:
            JudgeTimeout: every attempt timed out.
            JudgeError: the request failed otherwise, or the reply has no score.
        """
        return self.parse(self._reply(self.messages(response, item)))

    def _reply(self, messages: list[dict[str, str]]) -> str:
        import httpx

        body = {
            "model": self.model,
            "messages": messages,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            **self.extra_body,
        }
        last: Exception | None = None
        timed_out = False
        for attempt in range(self.retries + 1):
            wait = self.backoff_s * 2**attempt
            try:
                answer = self._http().post(f"{self.url}/chat/completions", json=body, headers=self._headers())
            except httpx.TimeoutException as err:
                last, timed_out = err, True
            except httpx.TransportError as err:
                last, timed_out = err, False
            else:
                if answer.status_code == 200:
                    return _content(answer)
                last, timed_out = JudgeError(f"HTTP {answer.status_code}: {answer.text[:200]}"), False
                if answer.status_code not in _RETRY_STATUS:
                    raise last
                wait = _retry_after(answer, wait)
            if attempt < self.retries:
                time.sleep(wait)
        attempts = f"{self.retries + 1} attempt(s)"
        if timed_out:
            raise JudgeTimeout(f"the judge at {self.url} did not answer within {self.timeout_s:g} s ({attempts})")
        raise JudgeError(f"the judge at {self.url} failed ({attempts}): {type(last).__name__}: {last}") from last

    def _headers(self) -> dict[str, str]:
        key = os.environ.get(self.api_key_env, "") if self.api_key_env else ""
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _http(self) -> Any:
        import httpx

        with self._lock:
            if self._client is None:
                limits = httpx.Limits(max_connections=self.max_concurrency)
                self._client = httpx.Client(timeout=self.timeout_s, limits=limits)
            return self._client

    # -- the verifier contract ---------------------------------------------------------------------------------------

    def __call__(self, response: str, item: Mapping[str, Any]) -> float:
        """The reward of one response (raises when it has none)."""
        return self.judge(response, item)

    def score_batch(self, responses: Sequence[str], items: Sequence[Mapping[str, Any]]) -> list[float | Exception]:
        """The rewards of a batch, judged concurrently; a response without a score is its exception."""
        with concurrent.futures.ThreadPoolExecutor(max_workers=self.max_concurrency) as pool:
            futures = [pool.submit(self.judge, r, it) for r, it in zip(responses, items, strict=True)]
        out: list[float | Exception] = []
        for future in futures:
            error = future.exception()
            out.append(future.result() if error is None else error)  # type: ignore[arg-type]
        return out

    def close(self) -> None:
        """Close the HTTP connections (a later call opens new ones)."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client"] = None
        state["_lock"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.url!r}, model={self.model!r})"


def _content(answer: Any) -> str:
    """The assistant message of a chat-completions answer."""
    try:
        content = answer.json()["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as err:
        raise JudgeError(f"the judge's answer is not a chat completion ({type(err).__name__}: {err})") from None
    if not isinstance(content, str):
        raise JudgeError(f"the judge's answer has no text content (got {type(content).__name__})")
    return content


def _retry_after(answer: Any, default: float) -> float:
    """The server's ``Retry-After`` in seconds (at most 60), else ``default``."""
    try:
        return min(max(float(answer.headers.get("retry-after", "")), 0.0), 60.0)
    except ValueError:
        return default
