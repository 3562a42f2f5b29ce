"""Tools for multi-turn rollouts: what the model may call, how its calls are read, and how they run safely.

A :class:`Tool` is a plain Python callable with the JSON schema of its arguments; :meth:`Tool.schema` is the form
chat templates take (``tokenizer.apply_chat_template(messages, tools=[tool.schema() for tool in tools])``).

:func:`parse_tool_calls` reads the calls out of an assistant turn written in the Qwen2.5 / Hermes format that
Qwen2.5's own chat template asks for::

    <tool_call>
    {"name": "calc", "arguments": {"expression": "2+3"}}
    </tool_call>

:class:`ToolRunner` runs the calls the way :class:`~logra_pl.rewards.BoundedVerifier` runs a verifier, and for the
same reason: a tool can run for minutes inside C code (``10**10**8`` is one big-integer power), which neither a
thread nor a signal handler interrupts. Each call runs in a pool of worker processes forked from a ``forkserver``
(never from the trainer, which holds torch/OpenMP threads), under a time limit after which its worker is killed and
replaced. What a tool returns or prints is cut to a character cap inside the worker, so a tool that prints a megabyte
costs the trainer a few kilobytes, and nothing a tool prints reaches the trainer's stdout.

A wrong call is the model's mistake, not the run's: an unknown tool, bad arguments, a tool that raises or runs past
its time, or a ``<tool_call>`` block that cannot be read each give a :class:`ToolResult` whose ``content`` — the
error text — goes back to the model as the tool message, and is counted. Only a
:class:`~logra_pl.errors.LoGRAError` raised by a tool (it cannot work at all) propagates.

A script that uses the pool must guard its entry point with ``if __name__ == "__main__":`` (each worker imports
the main module, as with any ``forkserver``/``spawn`` multiprocessing).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import inspect
import io
import json
import logging
import math
import os
import pickle
import re
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from logra_pl.errors import LoGRAError
from logra_pl.rewards.failures import exception_failure
from logra_pl.runtime.workers import WorkerPool, main_imports

log = logging.getLogger(__name__)

ToolFailureKind = Literal["timeouts", "errors", "unknown_tool", "bad_arguments", "parse_errors"]

COUNTERS = ("calls", "errors", "timeouts", "unknown_tool", "bad_arguments", "parse_errors", "truncated")

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

# What a chat template accepts as a function name (OpenAI's rule: letters, digits, "_" and "-", at most 64).
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")
_FORMAT_HINT = 'write each call as <tool_call>{"name": "<tool name>", "arguments": {<arguments>}}</tool_call>'


# ------------------------------------------------------------------------------------------------------------------
# What the model may call, and what comes back.


def _empty_parameters() -> dict[str, Any]:
    return {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    """A plain Python callable the model may call, with the JSON schema of its arguments.

    Arguments:
        name: the name the model calls it by: letters, digits, ``_`` and ``-``, not starting with a digit, at most
            64 characters.
        function: called as ``function(**arguments)``; its return value is the tool message (``str()`` of it, JSON
            for a dict or list), followed by what it printed. It runs in a worker process, so it must be picklable:
            a module-level function (not a lambda or closure) or an instance of a module-level class.
        description: what the tool does, for the model.
        parameters: the JSON schema of the arguments object (``{"type": "object", "properties": {...},
            "required": [...]}``). Its ``required`` names are checked before a call runs; the rest is for the model.
            Stored as a copy.

    Example::

        def add(a: int, b: int) -> int:
            return a + b

        ADD = Tool("add", add, "Add two integers.", {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        })
    """

    name: str
    function: Callable[..., Any]
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=_empty_parameters, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or _NAME.fullmatch(self.name) is None:
            raise ValueError(
                f"Tool name must be a non-empty identifier-like string (letters, digits, '_' or '-', not starting "
                f"with a digit, at most 64 characters), got {self.name!r}"
            )
        if not callable(self.function):
            raise TypeError(f"Tool {self.name!r}: function must be callable, got {type(self.function).__name__}")
        if not isinstance(self.description, str):
            raise TypeError(f"Tool {self.name!r}: description must be a string, got {type(self.description).__name__}")
        parameters = self.parameters
        if not isinstance(parameters, Mapping) or parameters.get("type") != "object":
            raise ValueError(
                f"Tool {self.name!r}: parameters must be the JSON schema of an object, a mapping with "
                f'"type": "object", got {parameters!r}'
            )
        properties = parameters.get("properties", {})
        if not isinstance(properties, Mapping):
            raise ValueError(f'Tool {self.name!r}: parameters["properties"] must be a mapping, got {properties!r}')
        required = parameters.get("required", [])
        if (
            isinstance(required, str)
            or not isinstance(required, Sequence)
            or not all(isinstance(key, str) for key in required)
        ):
            raise ValueError(f'Tool {self.name!r}: parameters["required"] must be a list of names, got {required!r}')
        object.__setattr__(self, "parameters", copy.deepcopy(dict(parameters)))

    @property
    def required(self) -> list[str]:
        """The argument names the schema requires."""
        return list(self.parameters.get("required", []))

    def schema(self) -> dict[str, Any]:
        """The tool as chat templates take it (OpenAI / Hugging Face style): ``{"type": "function", "function":
        {"name", "description", "parameters"}}``, a fresh copy."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": copy.deepcopy(dict(self.parameters)),
            },
        }


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote.

    Arguments:
        name: the tool it calls.
        arguments: the arguments object (keyword arguments of the tool's function).
        text: the call as the model wrote it, ``<tool_call>`` tags included.
    """

    name: str
    arguments: dict[str, Any] = field(hash=False)
    text: str = ""


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one call: the content of the tool message that goes back to the model.

    Arguments:
        call: the call, or None when the model's call could not be parsed.
        content: the tool's output, or on failure an error text starting with ``error:``.
        kind: None when the tool ran and returned; otherwise why not: ``timeouts``, ``errors`` (it raised, or its
            worker died), ``unknown_tool``, ``bad_arguments``, ``parse_errors``.
        truncated: the content was cut at the runner's ``max_output_chars``.
    """

    call: ToolCall | None
    content: str
    kind: ToolFailureKind | None
    truncated: bool = False

    @property
    def ok(self) -> bool:
        """Whether the tool ran and returned."""
        return self.kind is None


# ------------------------------------------------------------------------------------------------------------------
# Reading calls out of an assistant turn.


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """The ``<tool_call>`` blocks of an assistant turn, in order, and a one-line message per malformed block.

    Each block holds one JSON object ``{"name": ..., "arguments": {...}}``; ``arguments`` may also be a JSON string
    of an object, and may be left out (no arguments). A block that is not valid JSON, has no name, has arguments that
    are not an object, or is not closed by ``</tool_call>`` gives a message (``tool call <k>: <problem>``) instead
    of a call. Text outside the blocks is ignored.
    """
    blocks = parse_tool_blocks(text)
    return [b for b in blocks if isinstance(b, ToolCall)], [b for b in blocks if isinstance(b, str)]


def parse_tool_blocks(text: str) -> list[ToolCall | str]:
    """Like :func:`parse_tool_calls`, with the calls and the messages of malformed blocks in one list, in the order
    the blocks appear."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a string, got {type(text).__name__}")
    found: list[ToolCall | str] = []
    position, number = 0, 0
    while (start := text.find(TOOL_CALL_OPEN, position)) != -1:
        number += 1
        body_start = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_start)
        reopen = text.find(TOOL_CALL_OPEN, body_start)
        if end == -1 or (reopen != -1 and reopen < end):
            body = text[body_start : reopen if reopen != -1 else None]
            found.append(f"tool call {number}: {TOOL_CALL_OPEN} is not closed by {TOOL_CALL_CLOSE}: {_excerpt(body)}")
            if reopen == -1:
                break
            position = reopen
            continue
        position = end + len(TOOL_CALL_CLOSE)
        found.append(_parse_block(text[body_start:end], text[start:position], number))
    return found


def _parse_block(body: str, block: str, number: int) -> ToolCall | str:
    """One block's call, or the message saying what is wrong with it."""
    where = f"tool call {number}"
    try:
        value = json.loads(body)
    except json.JSONDecodeError as err:
        return f"{where}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno}): {_excerpt(body)}"
    if not isinstance(value, dict):
        return f'{where}: expected a JSON object with "name" and "arguments", got {_json_type(value)}: {_excerpt(body)}'
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        got = "none" if "name" not in value else _json_type(name)
        return f'{where}: no "name" (a non-empty string naming the tool; got {got}): {_excerpt(body)}'
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as err:
            return f'{where} ({name}): "arguments" is a string that is not valid JSON ({err.msg})'
        if not isinstance(arguments, dict):
            return f'{where} ({name}): "arguments" is a string that holds {_json_type(arguments)}, not an object'
    elif not isinstance(arguments, dict):
        return f'{where} ({name}): "arguments" must be a JSON object, got {_json_type(arguments)}'
    return ToolCall(name.strip(), arguments, block)


def _json_type(value: object) -> str:
    """The JSON type of a decoded value, with its article, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object" if isinstance(value, dict) else type(value).__name__


def _excerpt(text: str, limit: int = 80) -> str:
    """``text`` on one line, cut at ``limit`` characters, for messages."""
    line = " ".join(text.split())
    return repr(line if len(line) <= limit else line[:limit] + "...")


# ------------------------------------------------------------------------------------------------------------------
# Inside a worker process.

_worker_tools: dict[str, Callable[..., Any]] = {}


def _install_tools(functions: Mapping[str, Callable[..., Any]]) -> None:
    """Pool initializer: keep this worker's tool functions; make SIGTERM kill at once, even inside C code; send what
    reaches file descriptor 1 directly (C code, a subprocess) nowhere, so that it never lands in the trainer's stdout.
    """
    global _worker_tools
    # As in BoundedVerifier's workers: pebble stops a timed-out worker with SIGTERM, whose Python-level handler cannot
    # run while a C routine holds the interpreter.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    _worker_tools = dict(functions)


class _CappedText(io.TextIOBase):
    """A text stream that keeps the first ``limit`` characters written to it and notes whether more came."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.parts: list[str] = []
        self.size = 0
        self.over = False

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        room = self.limit - self.size
        kept = text[: max(room, 0)]
        self.over = self.over or len(kept) < len(text)
        if kept:
            self.parts.append(kept)
            self.size += len(kept)
        return len(text)

    def getvalue(self) -> str:
        return "".join(self.parts)


def _cut(text: str, limit: int, cut: bool = False) -> tuple[str, bool]:
    """``text`` cut at ``limit`` characters with a marker saying so (also when ``cut``: it was cut before), and
    whether it was."""
    if not cut and len(text) <= limit:
        return text, False
    return text[:limit] + f"\n[output cut at {limit} characters]", True


def _value_text(value: object) -> str:
    """A tool's return value as message text: a string as it is, a dict or list as JSON (``str()`` when it is not
    JSON-serialisable), anything else with ``str()``; None as nothing."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, dict | list | tuple):
        try:
            return json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):
            return str(value)
    return str(value)


# What one call sends back: (content, kind or None, truncated), the content already cut at the cap.
_Outcome = tuple[str, "ToolFailureKind | None", bool]


def _call_tool(name: str, arguments: Mapping[str, Any], limit: int) -> _Outcome:
    """Call the installed tool ``name`` with ``arguments`` and turn what it returned and printed into the tool
    message, cut at ``limit`` characters; a raise comes back as one error line. A
    :class:`~logra_pl.errors.LoGRAError` is raised: the tool cannot work at all."""
    function = _worker_tools.get(name)
    if function is None:
        raise RuntimeError(f"no tool named {name!r} installed in this worker process")
    printed = _CappedText(limit)
    try:
        with contextlib.redirect_stdout(printed):
            value = function(**arguments)
        text = _value_text(value)
    except LoGRAError:
        raise
    except (Exception, SystemExit) as err:
        content, truncated = _cut("error: " + exception_failure(err, "", skip_file=__file__).message, limit)
        return content, "errors", truncated
    output = printed.getvalue()
    if text and output and not text.endswith("\n"):
        text += "\n"
    content, truncated = _cut(text[: limit + 1] + output, limit, cut=printed.over)
    return content, None, truncated


# ------------------------------------------------------------------------------------------------------------------
# In the calling process.


def _tool_modules(tools: Sequence[Tool]) -> list[str]:
    """Modules the forkserver imports once, so that each worker starts in a fraction of a second: this module, those
    that define the tools' functions, and the main script's imports (see :mod:`logra_pl.runtime.workers`)."""
    names = [__name__]
    for tool in tools:
        names.append(getattr(tool.function, "__module__", None) or type(tool.function).__module__)
    names += main_imports()
    skip = ("__main__", "__mp_main__", "builtins")
    return [n for n in dict.fromkeys(names) if isinstance(n, str) and n not in skip]


class ToolRunner:
    """Runs tool calls in a pool of worker processes, each call under a time limit, its output capped.

    Arguments:
        tools: the tools the model may call (:class:`Tool`), with distinct names.
        timeout_s: seconds one call may run before its worker is killed and replaced and the call counts as a
            timeout (the clock starts when a worker picks the call up; it is pebble's, on wall time).
        max_output_chars: the most characters of a tool message: what the tool returned, then what it printed, cut
            there (in the worker) with a marker line saying so. Error texts are cut there too.
        workers: number of worker processes; the calls of one :meth:`run` run in parallel on them.

    A call's :class:`ToolResult` says what went wrong, if anything, and its ``content`` is what the model sees:
    ``unknown_tool`` (no tool of that name; the message lists the tools), ``bad_arguments`` (a ``required`` argument
    of the schema missing, or arguments the function does not accept: checked here, before the call is sent),
    ``errors`` (the tool raised: ``error: <Type>: <message>`` on one line; or its worker died), ``timeouts`` (past
    ``timeout_s``), ``parse_errors`` (a malformed block, from :meth:`run_text`). None of these raise. A
    :class:`~logra_pl.errors.LoGRAError` raised by a tool (it cannot work at all) propagates.

    Counters (int attributes, totals since construction or the loaded state): ``calls`` (calls given to :meth:`run`),
    one per failure kind (``errors``, ``timeouts``, ``unknown_tool``, ``bad_arguments``, ``parse_errors``), and
    ``truncated`` (contents cut at the cap). :meth:`state_dict` holds them for a checkpoint.

    The pool starts on the first call and is restarted if it broke; :meth:`close` (or leaving a ``with`` block)
    stops it, and a pool that is never closed is stopped at interpreter exit. A copy (pickle, deepcopy) gets the tools
    and counters, not the pool.

    Example::

        with ToolRunner([ADD], timeout_s=5.0) as runner:
            results = runner.run_text(assistant_text)
            messages += [{"role": "tool", "content": r.content} for r in results]
    """

    def __init__(
        self, tools: Sequence[Tool], timeout_s: float = 5.0, max_output_chars: int = 4000, workers: int = 2
    ) -> None:
        if isinstance(tools, Tool) or not isinstance(tools, Sequence):
            raise TypeError(f"tools must be a sequence of Tool, got {type(tools).__name__}")
        if not tools:
            raise ValueError("tools is empty: a ToolRunner needs at least one Tool")
        by_name: dict[str, Tool] = {}
        for tool in tools:
            if not isinstance(tool, Tool):
                raise TypeError(f"tools must hold Tool objects, got {type(tool).__name__}: {tool!r}")
            if tool.name in by_name:
                raise ValueError(f"two tools are named {tool.name!r}: tool names must be unique")
            by_name[tool.name] = tool
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float):
            raise TypeError(f"timeout_s must be a number of seconds, got {timeout_s!r}")
        if not math.isfinite(timeout_s) or timeout_s <= 0:
            raise ValueError(f"timeout_s must be finite and > 0, got {timeout_s!r}")
        if isinstance(max_output_chars, bool) or not isinstance(max_output_chars, int) or max_output_chars < 1:
            raise ValueError(f"max_output_chars must be an integer >= 1, got {max_output_chars!r}")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
        for tool in tools:
            try:
                pickle.dumps(tool.function)
            except Exception as err:
                raise TypeError(
                    f"the function of tool {tool.name!r} ({tool.function!r}) cannot be pickled ({type(err).__name__}: "
                    f"{err}), so it cannot be sent to worker processes: use a module-level function or an instance "
                    "of a module-level class (not a lambda or closure)"
                ) from err
        self.tools: dict[str, Tool] = by_name
        self.timeout_s = float(timeout_s)
        self.max_output_chars = max_output_chars
        self.workers = workers
        self.calls = 0
        self.errors = 0
        self.timeouts = 0
        self.unknown_tool = 0
        self.bad_arguments = 0
        self.parse_errors = 0
        self.truncated = 0
        self._signatures = {name: _signature(tool.function) for name, tool in by_name.items()}
        functions = {tool.name: tool.function for tool in tools}
        self._pool = WorkerPool(_install_tools, (functions,), _tool_modules(tools), workers, self.timeout_s, "tool")

    # -- counters ---------------------------------------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        """``{"calls": …, "errors": …, "timeouts": …, "unknown_tool": …, "bad_arguments": …, "parse_errors": …,
        "truncated": …}``."""
        return {name: int(getattr(self, name)) for name in COUNTERS}

    def state_dict(self) -> dict[str, int]:
        """The counters, for a checkpoint."""
        return self.counters()

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Restore counters saved by :meth:`state_dict` (a missing counter restarts from 0)."""
        for name in COUNTERS:
            setattr(self, name, int(state.get(name, 0)))

    def schemas(self) -> list[dict[str, Any]]:
        """The tools' :meth:`Tool.schema`, for ``tokenizer.apply_chat_template(..., tools=runner.schemas())``."""
        return [tool.schema() for tool in self.tools.values()]

    # -- running ----------------------------------------------------------------------------------------------------

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """The result of each call, in order. Valid calls run in parallel in the pool; unknown tools and bad arguments
        are answered here without running anything."""
        for call in calls:
            if not isinstance(call, ToolCall):
                raise TypeError(f"calls must hold ToolCall objects, got {type(call).__name__}: {call!r}")
        results: list[ToolResult | None] = [self._check(call) for call in calls]
        self.calls += len(calls)
        todo = [k for k, result in enumerate(results) if result is None]
        if todo:
            for k, result in zip(todo, self._run_in_pool([calls[k] for k in todo]), strict=True):
                results[k] = result
        done = [r for r in results if r is not None]
        for result in done:
            if result.kind is not None:
                setattr(self, result.kind, getattr(self, result.kind) + 1)
                log.debug("tool call failed (%s): %s", result.kind, result.content)
            self.truncated += result.truncated
        return done

    def run_text(self, text: str) -> list[ToolResult]:
        """Parse an assistant turn (:func:`parse_tool_blocks`) and run its calls: one result per ``<tool_call>``
        block, in order; a malformed block's result (``parse_errors``, ``call`` None) tells the model what is wrong
        and how to write a call."""
        blocks = parse_tool_blocks(text)
        ran = iter(self.run([b for b in blocks if isinstance(b, ToolCall)]))
        results = []
        for block in blocks:
            if isinstance(block, ToolCall):
                results.append(next(ran))
                continue
            content, truncated = _cut(f"error: {block}; {_FORMAT_HINT}", self.max_output_chars)
            self.parse_errors += 1
            self.truncated += truncated
            results.append(ToolResult(None, content, "parse_errors", truncated))
        return results

    def _check(self, call: ToolCall) -> ToolResult | None:
        """The result of a call that cannot run (an unknown tool, bad arguments), or None when it can."""
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(repr(name) for name in self.tools)
            return self._failed(
                call, "unknown_tool", f"error: there is no tool named {call.name!r}; the tools are: {known}"
            )
        problem = self._argument_problem(tool, call.arguments)
        if problem is None:
            return None
        return self._failed(call, "bad_arguments", f"error: bad arguments for the tool {tool.name!r}: {problem}")

    def _argument_problem(self, tool: Tool, arguments: object) -> str | None:
        """What is wrong with ``arguments`` for ``tool``, or None."""
        if not isinstance(arguments, Mapping):
            return f"the arguments must be a JSON object, got {type(arguments).__name__}"
        missing = [key for key in tool.required if key not in arguments]
        if missing:
            return "missing the required argument(s) " + ", ".join(repr(key) for key in missing)
        signature = self._signatures[tool.name]
        if signature is None:
            return None
        try:
            signature.bind(**arguments)
        except TypeError as err:
            accepted = ", ".join(
                p.name for p in signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            )
            return f"{err} (it takes: {accepted or 'no arguments'})"
        return None

    def _failed(self, call: ToolCall | None, kind: ToolFailureKind, message: str) -> ToolResult:
        content, truncated = _cut(" ".join(message.split()), self.max_output_chars)
        return ToolResult(call, content, kind, truncated)

    def _run_in_pool(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        results: dict[int, ToolResult] = {}
        args = [(call.name, call.arguments, self.max_output_chars) for call in calls]
        with contextlib.closing(self._pool.results(_call_tool, args)) as done:
            for k, future in done:
                if future is None:  # the pool stopped answering (it was restarted)
                    message = f"error: the tool {calls[k].name!r} gave no result"
                    results[k] = self._failed(calls[k], "errors", message)
                else:
                    results[k] = self._result(future, calls[k])
        return [results[k] for k in range(len(calls))]

    def _result(self, future: concurrent.futures.Future, call: ToolCall) -> ToolResult:
        """A finished call's result: its own, or a timeout, or an error when its worker died."""
        try:
            content, kind, truncated = future.result()
        except LoGRAError:
            raise
        except TimeoutError:
            message = f"error: the tool {call.name!r} gave no result within {self.timeout_s:g} s"
            return self._failed(call, "timeouts", message)
        except Exception as err:  # the worker died, or the pool broke
            found = exception_failure(err, "", skip_file=__file__)
            return self._failed(call, "errors", f"error: the tool {call.name!r} failed in its worker: {found.message}")
        return ToolResult(call, content, kind, truncated)

    # -- lifetime ---------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the worker pool (idempotent); the next call starts a new one."""
        self._pool.close()

    def __enter__(self) -> ToolRunner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}([{', '.join(self.tools)}], timeout_s={self.timeout_s:g}, "
            f"max_output_chars={self.max_output_chars}, workers={self.workers})"
        )


def _signature(function: Callable[..., Any]) -> inspect.Signature | None:
    """``function``'s signature, to check arguments before a call; None when it has none to read (some builtins)."""
    try:
        return inspect.signature(function)
    except (TypeError, ValueError):
        return None
