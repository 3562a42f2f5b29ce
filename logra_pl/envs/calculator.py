"""A calculator tool on arithmetic problems: the tool-calling example environment (tutorial 07).

The policy may write ``<tool_call>{"name": "calculate", "arguments": {"expression": "..."}}</tool_call>`` blocks;
each is run by :func:`calculate` in a :class:`~logra_pl.envs.tools.ToolRunner` (worker processes, a time limit, an
output cap) and its result comes back as a tool message. A reply without a call is the final answer: the
conversation ends and the run's verifier scores it against the item (a reasoning-gym ``chain_sum`` or
``basic_arithmetic`` item, say). A malformed call, an unknown tool or an expression the calculator refuses is
answered with the error, as a tool message, and counted (``env/tool_errors``).
"""

from __future__ import annotations

import ast
import json
import operator
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from logra_pl.envs.base import Message, Turn
from logra_pl.envs.tools import Tool, ToolRunner

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, not {type(node).__name__}")


def calculate(expression: str) -> str:
    """The value of an arithmetic expression (numbers, ``+ - * / // % **``, parentheses), as text; an integral
    float is written as an integer. Anything else is refused with a ``ValueError`` naming it."""
    if not isinstance(expression, str) or not expression.strip():
        raise ValueError("expression must be a non-empty string such as '3 * (4 + 5)'")
    value = _evaluate(ast.parse(expression.strip(), mode="eval"))
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


CALCULATOR = Tool(
    name="calculate",
    function=calculate,
    description="Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses).",
    parameters={
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. 3 * (4 + 5)"}},
        "required": ["expression"],
    },
)

SYSTEM_PROMPT = (
    "You may use a calculator. To call it, write\n"
    '<tool_call>\n{"name": "calculate", "arguments": {"expression": "3 * (4 + 5)"}}\n</tool_call>\n'
    "and its result comes back. When you know the answer, reply without a tool call."
)


class CalculatorEnv:
    """Arithmetic problems with a calculator tool (see the module docstring).

    Arguments:
        max_turns: most replies per conversation (tool calls included); the last one should be the answer.
        max_tokens: most tokens of a conversation after its first prompt.
        timeout_s: seconds one calculator call may run (``9**9**9`` is stopped here, its worker replaced).
        max_output_chars: a tool result's cap, in characters.
        workers: calculator worker processes.
        describe_tools: ``system``: a system message describes the tool and its call format (works with any chat
            template, the tiny model's ChatML too); ``template``: the chat template renders the tool's schema
            (``apply_chat_template(..., tools=...)``; Qwen2.5's does).
        system_prompt: that system message (``describe_tools: system``); None: :data:`SYSTEM_PROMPT`, which shows a
            whole call. A policy taught the format by the warm start's demonstrations needs no example: a short
            message keeps its conversations (and the warm start) short.
    """

    verify_final = True

    def __init__(
        self,
        max_turns: int = 3,
        max_tokens: int = 512,
        timeout_s: float = 2.0,
        max_output_chars: int = 200,
        workers: int = 1,
        describe_tools: Literal["system", "template"] = "system",
        system_prompt: str | None = None,
    ) -> None:
        if describe_tools not in ("system", "template"):
            raise ValueError(f"describe_tools must be 'system' or 'template', got {describe_tools!r}")
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns must be an integer >= 1, got {max_turns!r}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        if system_prompt is not None and (not isinstance(system_prompt, str) or not system_prompt.strip()):
            raise ValueError(f"system_prompt must be a non-empty string or None, got {system_prompt!r}")
        self.max_turns, self.max_tokens, self.describe_tools = max_turns, max_tokens, describe_tools
        self.system_prompt = SYSTEM_PROMPT if system_prompt is None else system_prompt
        self.runner = ToolRunner([CALCULATOR], timeout_s=timeout_s, max_output_chars=max_output_chars, workers=workers)

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The calculator's schema for the chat template (``describe_tools: template``), else none."""
        return self.runner.schemas() if self.describe_tools == "template" else []

    def start(self, item: Mapping[str, Any]) -> list[Message]:
        """The item's messages, after a system message describing the calculator (``describe_tools: system``)."""
        messages = [dict(m) for m in item["messages"]]
        if self.describe_tools == "system":
            return [{"role": "system", "content": self.system_prompt}, *(m for m in messages if m["role"] != "system")]
        return messages

    def step(self, item: Mapping[str, Any], messages: Sequence[Message]) -> Turn:
        """No ``<tool_call>`` in the reply: the answer, done. Else every block's result as a tool message."""
        reply = messages[-1]["content"]
        if "<tool_call>" not in reply:
            return Turn(done=True)
        results = self.runner.run_text(reply)
        errors = sum(not r.ok for r in results)
        observations = [{"role": "tool", "content": r.content} for r in results]
        return Turn(observations=observations, info={"tool_calls": float(len(results)), "tool_errors": float(errors)})

    def demonstration(self, item: Mapping[str, Any]) -> list[Message] | None:
        """The intended conversation for the warm start: one call on the item's expression (``metadata.expression``,
        as reasoning-gym's arithmetic tasks give it), the calculator's result, then the gold answer. None for an
        item without an expression the calculator accepts."""
        expression = (item.get("metadata") or {}).get("expression")
        if not isinstance(expression, str):
            return None
        try:
            result = calculate(expression)
        except (ValueError, SyntaxError, ArithmeticError):
            return None
        call = json.dumps({"name": CALCULATOR.name, "arguments": {"expression": expression}})
        return [
            *self.start(item),
            {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
            {"role": "tool", "content": result},
            {"role": "assistant", "content": str(item["answer"])},
        ]

    def state_dict(self) -> dict[str, int]:
        """The calculator's counters (calls, errors, timeouts, ...), for checkpoints."""
        return self.runner.state_dict()

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Restore counters saved by :meth:`state_dict`."""
        self.runner.load_state_dict(state)

    def close(self) -> None:
        """Stop the calculator's workers."""
        self.runner.close()
