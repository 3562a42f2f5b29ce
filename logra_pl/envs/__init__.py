"""Environments for multi-turn rollouts: the tools a model may call and the runner that calls them safely."""

from logra_pl.envs.tools import Tool, ToolCall, ToolResult, ToolRunner, parse_tool_calls

__all__ = ["Tool", "ToolCall", "ToolResult", "ToolRunner", "parse_tool_calls"]
