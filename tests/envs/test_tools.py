"""Tools of multi-turn rollouts: parsing Qwen2.5/Hermes tool calls, the tool schema, and ToolRunner's real worker
processes (time limit, output cap, errors returned to the model).

The tools are module-level functions of this module: the forkserver workers import it to unpickle them (keep its
imports light; transformers is imported inside the one test that needs it). One runner (2 workers, 1 s limit,
1,000-character cap) is shared by the module; each test starts from zeroed counters.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import logra_pl
from logra_pl.envs import Tool, ToolCall, ToolResult, ToolRunner, parse_tool_calls
from logra_pl.envs.tools import parse_tool_blocks
from logra_pl.errors import ConfigError

TIMEOUT_S = 1.0
CAP = 1000
MARKER = f"\n[output cut at {CAP} characters]"


# -- tools (module level: the workers import them) -----------------------------------------------------------------


def add(a: int, b: int) -> int:
    return a + b


def power(base: int, exponent: int) -> int:
    return base**exponent


def shout(n: int) -> str:
    print("x" * n)
    return "printed"


def weather(city: str) -> dict:
    return {"city": city, "sky": "clear", "temperature_c": [12, 15]}


def no_such_city(city: str) -> str:
    raise ValueError(f"no such city:\n  {city!r} (try another)")


def long_failure() -> str:
    raise RuntimeError("z" * 5000)


def broken_backend() -> str:
    raise ConfigError("the weather backend is not configured")


def wait_then(seconds: float, label: str) -> str:
    time.sleep(seconds)
    return label


def exit_worker() -> str:
    os._exit(3)


def sigterm_action() -> str:
    return str(signal.getsignal(signal.SIGTERM))


ADD_PARAMETERS = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
TOOLS = [
    Tool("add", add, "Add two integers.", ADD_PARAMETERS),
    Tool("power", power, "base ** exponent", {"type": "object", "required": ["base", "exponent"]}),
    Tool("shout", shout),
    Tool("weather", weather, "The weather in a city."),
    Tool("no_such_city", no_such_city),
    Tool("long_failure", long_failure),
    Tool("broken_backend", broken_backend),
    Tool("wait_then", wait_then),
    Tool("exit_worker", exit_worker),
    Tool("sigterm_action", sigterm_action),
]
NAMES = ", ".join(repr(tool.name) for tool in TOOLS)


@pytest.fixture(scope="module")
def shared() -> Iterator[ToolRunner]:
    with ToolRunner(TOOLS, timeout_s=TIMEOUT_S, max_output_chars=CAP, workers=2) as runner:
        yield runner


@pytest.fixture
def runner(shared: ToolRunner) -> ToolRunner:
    shared.load_state_dict({})
    return shared


def _counts(**nonzero: int) -> dict[str, int]:
    names = ("calls", "errors", "timeouts", "unknown_tool", "bad_arguments", "parse_errors", "truncated")
    return {name: nonzero.get(name, 0) for name in names}


# -- parsing -------------------------------------------------------------------------------------------------------


def test_parse_one_call() -> None:
    block = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    calls, errors = parse_tool_calls(f"Let me add them.\n{block}")
    assert calls == [ToolCall("add", {"a": 2, "b": 3}, block)]
    assert errors == []


def test_parse_two_calls_ignoring_the_text_around_them() -> None:
    first = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    second = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": -1}}</tool_call>'
    calls, errors = parse_tool_calls(f"I will call two tools. {first}\nand then </tool_call> {second} done.")
    assert calls == [ToolCall("weather", {"city": "Oslo"}, first), ToolCall("add", {"a": 1, "b": -1}, second)]
    assert errors == []


def test_parse_arguments_given_as_a_json_string() -> None:
    block = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 4, \\"b\\": 5}"}</tool_call>'
    assert parse_tool_calls(block) == ([ToolCall("add", {"a": 4, "b": 5}, block)], [])


def test_parse_a_call_without_arguments() -> None:
    block = '<tool_call>{"name": "weather"}</tool_call>'
    assert parse_tool_calls(block) == ([ToolCall("weather", {}, block)], [])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>',
            "tool call 1: not valid JSON (Expecting property name enclosed in double quotes at line 1 column 38): "
            '\'{"name": "add", "arguments": {"a": 1,}}\'',
        ),
        (
            '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',
            'tool call 1: no "name" (a non-empty string naming the tool; got none): \'{"arguments": {"a": 1}}\'',
        ),
        (
            '<tool_call>{"name": 7, "arguments": {}}</tool_call>',
            'tool call 1: no "name" (a non-empty string naming the tool; got a number): '
            '\'{"name": 7, "arguments": {}}\'',
        ),
        (
            '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
            'tool call 1 (add): "arguments" must be a JSON object, got an array',
        ),
        (
            '<tool_call>{"name": "add", "arguments": "[1, 2]"}</tool_call>',
            'tool call 1 (add): "arguments" is a string that holds an array, not an object',
        ),
        (
            '<tool_call>["add", 1, 2]</tool_call>',
            'tool call 1: expected a JSON object with "name" and "arguments", got an array: \'["add", 1, 2]\'',
        ),
        (
            'Here: <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}',
            "tool call 1: <tool_call> is not closed by </tool_call>: "
            '\'{"name": "add", "arguments": {"a": 1, "b": 2}}\'',
        ),
    ],
    ids=["bad-json", "no-name", "name-not-a-string", "arguments-array", "arguments-string-array", "array", "unclosed"],
)
def test_parse_malformed_block_gives_a_message_and_no_call(text: str, message: str) -> None:
    calls, errors = parse_tool_calls(text)
    assert calls == []
    assert errors == [message]
    assert "\n" not in errors[0]


def test_parse_an_unclosed_block_before_a_good_one() -> None:
    good = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    blocks = parse_tool_blocks('<tool_call>{"name": "weather", ' + good)
    assert blocks == [
        'tool call 1: <tool_call> is not closed by </tool_call>: \'{"name": "weather",\'',
        ToolCall("add", {"a": 1, "b": 2}, good),
    ]


@pytest.mark.parametrize("text", ["", "The answer is 5.", 'no tags: {"name": "add", "arguments": {}}', "</tool_call>"])
def test_parse_text_without_calls_gives_nothing(text: str) -> None:
    assert parse_tool_calls(text) == ([], [])


# -- the tool and its schema ---------------------------------------------------------------------------------------


def test_tool_schema() -> None:
    tool = Tool("add", add, "Add two integers.", ADD_PARAMETERS)
    expected = {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
    assert tool.schema() == expected
    tool.schema()["function"]["parameters"]["required"].append("c")  # a copy: the tool is unchanged
    assert tool.schema() == expected
    assert Tool("shout", shout).schema() == {
        "type": "function",
        "function": {"name": "shout", "description": "", "parameters": {"type": "object", "properties": {}}},
    }


# The tools part of a Qwen2.5-style template: one JSON line per tool between <tools> tags.
CHAT_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endfor %}
"""


def test_schema_renders_in_a_chat_template_with_tools() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "add": 1, "two": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.chat_template = CHAT_TEMPLATE
    tools = [Tool("add", add, "Add two integers.", ADD_PARAMETERS), Tool("weather", weather, "The weather.")]
    messages = [{"role": "user", "content": "add two numbers"}]
    text = tokenizer.apply_chat_template(messages, tools=[tool.schema() for tool in tools], tokenize=False)
    assert '"name": "add"' in text and '"name": "weather"' in text
    rendered = text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].splitlines()
    assert [json.loads(line) for line in rendered] == [tool.schema() for tool in tools]
    assert text.endswith("<|im_start|>user\nadd two numbers<|im_end|>\n")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"name": "", "function": add}, ValueError, "identifier-like"),
        ({"name": "2add", "function": add}, ValueError, "identifier-like"),
        ({"name": "add two", "function": add}, ValueError, "identifier-like"),
        ({"name": "add", "function": "add"}, TypeError, "function must be callable"),
        ({"name": "add", "function": add, "parameters": {"type": "array"}}, ValueError, '"type": "object"'),
        ({"name": "add", "function": add, "parameters": {"type": "object", "required": "a"}}, ValueError, "required"),
    ],
)
def test_tool_is_validated_at_construction(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        Tool(**kwargs)


def test_runner_refuses_duplicate_names_and_unpicklable_functions() -> None:
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        ToolRunner([Tool("add", add), Tool("add", power)])
    with pytest.raises(TypeError, match=r"tool 'square' .* cannot be pickled.*module-level function"):
        ToolRunner([Tool("add", add), Tool("square", lambda x: x * x)])


# -- running calls in worker processes -----------------------------------------------------------------------------


def test_a_call_returns_its_value_as_text(runner: ToolRunner) -> None:
    calls = [ToolCall("add", {"a": 2, "b": 3}), ToolCall("weather", {"city": "Oslo"})]
    assert runner.run(calls) == [
        ToolResult(calls[0], "5", None),
        ToolResult(calls[1], '{"city": "Oslo", "sky": "clear", "temperature_c": [12, 15]}', None),
    ]
    assert runner.counters() == _counts(calls=2)


def test_hung_tool_times_out_and_the_pool_recovers(runner: ToolRunner) -> None:
    hung = ToolCall("power", {"base": 10, "exponent": 10**8})  # one big-int power in C: minutes
    start, wall_start = time.perf_counter(), time.time()
    (result,) = runner.run([hung])
    elapsed, wall_elapsed = time.perf_counter() - start, time.time() - wall_start
    assert result == ToolResult(hung, "error: the tool 'power' gave no result within 1 s", "timeouts")
    # pebble times calls on the wall clock (see tests/rewards/test_bounded_verifier.py).
    assert max(elapsed, wall_elapsed) >= TIMEOUT_S
    assert elapsed < TIMEOUT_S + 10
    # The hung worker was killed and replaced: the same runner answers the next calls.
    assert [r.content for r in runner.run([ToolCall("power", {"base": 2, "exponent": 10})] * 3)] == ["1024"] * 3
    assert runner.counters() == _counts(calls=4, timeouts=1)


def test_workers_die_at_once_on_sigterm(runner: ToolRunner) -> None:
    # pebble stops a timed-out worker with SIGTERM: with the default action it dies even inside C code, at once
    # (pebble's own handler would wait for the C routine, and pebble falls back to SIGKILL only later).
    assert [r.content for r in runner.run([ToolCall("sigterm_action", {})] * 2)] == [str(signal.SIG_DFL)] * 2


def test_a_megabyte_printed_is_cut_at_the_cap_in_the_worker(runner: ToolRunner, capfd: pytest.CaptureFixture) -> None:
    (result,) = runner.run([ToolCall("shout", {"n": 1_000_000})])
    assert result.kind is None and result.truncated
    assert result.content == "printed\n" + "x" * (CAP - len("printed\n")) + MARKER
    assert len(result.content) <= CAP + len(MARKER)
    (short,) = runner.run([ToolCall("shout", {"n": 3})])
    assert (short.content, short.truncated) == ("printed\nxxx\n", False)
    assert runner.counters() == _counts(calls=2, truncated=1)
    out, err = capfd.readouterr()
    assert "xxx" not in out and "xxx" not in err


def test_tool_output_never_reaches_the_trainers_stdout(tmp_path: Path) -> None:
    """End to end in a fresh interpreter whose stdout is a pipe: neither a tool's print (kept, in the tool message)
    nor what it writes to file descriptor 1 directly (dropped) lands in the caller's stdout."""
    script = tmp_path / "chatty.py"
    script.write_text(
        textwrap.dedent(
            """
            import os

            from logra_pl.envs import Tool, ToolCall, ToolRunner


            def chatty() -> str:
                print("PRINTED-BY-TOOL")
                os.write(1, b"WRITTEN-TO-FD-1\\n")
                return "ok"


            if __name__ == "__main__":
                with ToolRunner([Tool("chatty", chatty)], timeout_s=30) as runner:
                    (result,) = runner.run([ToolCall("chatty", {})])
                print("RESULT", repr(result.content), result.kind)
            """
        )
    )
    root = str(Path(logra_pl.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "RESULT 'ok\\nPRINTED-BY-TOOL\\n' None\n"
    assert "PRINTED-BY-TOOL" not in done.stderr and "WRITTEN-TO-FD-1" not in done.stderr


def test_a_raising_tool_returns_one_error_line(runner: ToolRunner) -> None:
    call = ToolCall("no_such_city", {"city": "Atlantis"})
    assert runner.run([call]) == [
        ToolResult(call, "error: ValueError: no such city: 'Atlantis' (try another)", "errors")
    ]
    (long,) = runner.run([ToolCall("long_failure", {})])
    assert (long.kind, long.truncated) == ("errors", True)
    assert long.content == ("error: RuntimeError: " + "z" * 5000)[:CAP] + MARKER
    assert runner.counters() == _counts(calls=2, errors=2, truncated=1)


def test_a_dead_worker_is_an_error_and_is_replaced(runner: ToolRunner) -> None:
    (died,) = runner.run([ToolCall("exit_worker", {})])
    assert died.kind == "errors"
    assert died.content.startswith("error: the tool 'exit_worker' failed in its worker: ")
    assert [r.content for r in runner.run([ToolCall("add", {"a": 1, "b": 1})])] == ["2"]
    assert runner.counters() == _counts(calls=2, errors=1)


def test_a_logra_error_propagates(runner: ToolRunner) -> None:
    with pytest.raises(ConfigError, match="the weather backend is not configured"):
        runner.run([ToolCall("broken_backend", {})])
    assert runner.run([ToolCall("add", {"a": 1, "b": 2})])[0].content == "3"


def test_unknown_tool(runner: ToolRunner) -> None:
    call = ToolCall("calculator", {"expression": "2+3"})
    (result,) = runner.run([call])
    assert result == ToolResult(
        call, f"error: there is no tool named 'calculator'; the tools are: {NAMES}", "unknown_tool"
    )
    assert runner.counters() == _counts(calls=1, unknown_tool=1)


@pytest.mark.parametrize(
    ("arguments", "content"),
    [
        ({"a": 1}, "error: bad arguments for the tool 'add': missing the required argument(s) 'b'"),
        ({}, "error: bad arguments for the tool 'add': missing the required argument(s) 'a', 'b'"),
        (
            {"a": 1, "b": 2, "c": 3},
            "error: bad arguments for the tool 'add': got an unexpected keyword argument 'c' (it takes: a, b)",
        ),
    ],
)
def test_bad_arguments(runner: ToolRunner, arguments: dict, content: str) -> None:
    call = ToolCall("add", arguments)
    assert runner.run([call]) == [ToolResult(call, content, "bad_arguments")]
    assert runner.counters() == _counts(calls=1, bad_arguments=1)


def test_arguments_the_function_does_not_take_without_a_schema(runner: ToolRunner) -> None:
    call = ToolCall("weather", {"town": "Oslo"})
    (result,) = runner.run([call])
    assert result.kind == "bad_arguments"
    assert result.content == (
        "error: bad arguments for the tool 'weather': missing a required argument: 'city' (it takes: city)"
    )


def test_several_calls_keep_their_order(runner: ToolRunner) -> None:
    # The first calls finish last: results come back in the order of the calls, not of completion.
    calls = [
        ToolCall("wait_then", {"seconds": 0.6, "label": "first"}),
        ToolCall("wait_then", {"seconds": 0.3, "label": "second"}),
        ToolCall("nope", {}),
        ToolCall("wait_then", {"seconds": 0.0, "label": "third"}),
        ToolCall("add", {"a": 1}),
        ToolCall("add", {"a": 20, "b": 22}),
    ]
    results = runner.run(calls)
    assert [r.call for r in results] == calls
    assert [r.kind for r in results] == [None, None, "unknown_tool", None, "bad_arguments", None]
    assert [r.content for r in results if r.kind is None] == ["first", "second", "third", "42"]
    assert runner.counters() == _counts(calls=6, unknown_tool=1, bad_arguments=1)


def test_run_text_answers_every_block_in_order(runner: ToolRunner) -> None:
    text = (
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
        "<tool_call>{not json}</tool_call>\n"
        '<tool_call>{"name": "weather", "arguments": {"city": "Rome"}}</tool_call>'
    )
    results = runner.run_text(text)
    assert [r.kind for r in results] == [None, "parse_errors", None]
    assert results[0].content == "3" and results[2].content.startswith('{"city": "Rome"')
    assert results[1].call is None
    assert results[1].content.startswith("error: tool call 2: not valid JSON")
    assert 'write each call as <tool_call>{"name": "<tool name>"' in results[1].content
    assert runner.counters() == _counts(calls=2, parse_errors=1)


def test_counters_state_dict_round_trip_and_copies_without_a_pool(runner: ToolRunner) -> None:
    runner.run([ToolCall("nope", {}), ToolCall("add", {}), ToolCall("shout", {"n": 2 * CAP})])
    runner.run_text("<tool_call>oops")
    expected = _counts(calls=3, unknown_tool=1, bad_arguments=1, parse_errors=1, truncated=1)
    assert runner.counters() == expected
    assert (runner.calls, runner.truncated) == (3, 1)
    state = runner.state_dict()
    assert state == expected
    fresh = ToolRunner(TOOLS)
    fresh.load_state_dict(state)
    assert fresh.counters() == expected and not fresh._pool.started
    fresh.load_state_dict({"calls": 7})  # a counter left out restarts from 0
    assert fresh.counters() == _counts(calls=7)
    copy = pickle.loads(pickle.dumps(runner))
    assert runner._pool.started and not copy._pool.started
    assert copy.counters() == expected and list(copy.tools) == list(runner.tools)


def test_close_is_idempotent_and_the_pool_restarts() -> None:
    runner = ToolRunner([Tool("add", add)], workers=1)
    runner.close()
    with runner:
        assert runner.run([ToolCall("add", {"a": 1, "b": 1})])[0].content == "2"
    assert not runner._pool.started
    runner.close()
    assert runner.run([ToolCall("add", {"a": 2, "b": 2})])[0].content == "4"
    runner.close()
