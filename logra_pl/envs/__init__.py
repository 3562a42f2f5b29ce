"""Multi-turn rollouts: the environment contract (:mod:`logra_pl.envs.base`), the episode runner that drives
conversations on any engine (:mod:`logra_pl.envs.episodes`), and the tools a model may call, run in worker processes
under a time limit (:mod:`logra_pl.envs.tools`). Two examples: a calculator tool (:mod:`logra_pl.envs.calculator`)
and a feedback game (:mod:`logra_pl.envs.higher_lower`)."""

from logra_pl.envs.base import Environment, Message, Turn, check_environment, check_message, tool_schemas
from logra_pl.envs.calculator import CALCULATOR, CalculatorEnv, calculate
from logra_pl.envs.episodes import Episodes, continuation_ids, episode_metrics, episode_scores, render, run_episodes
from logra_pl.envs.higher_lower import HigherLowerEnv, last_integer
from logra_pl.envs.tools import Tool, ToolCall, ToolResult, ToolRunner, parse_tool_calls

__all__ = [
    "CALCULATOR",
    "CalculatorEnv",
    "Environment",
    "Episodes",
    "HigherLowerEnv",
    "Message",
    "Tool",
    "ToolCall",
    "ToolResult",
    "ToolRunner",
    "Turn",
    "calculate",
    "check_environment",
    "check_message",
    "continuation_ids",
    "episode_metrics",
    "episode_scores",
    "last_integer",
    "parse_tool_calls",
    "render",
    "run_episodes",
    "tool_schemas",
]
