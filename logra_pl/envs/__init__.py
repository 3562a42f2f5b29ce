"""Multi-turn rollouts: environments, the episode runner, tools (:mod:`logra_pl.envs.base`,
:mod:`logra_pl.envs.episodes`)."""

from logra_pl.envs.base import Environment, Message, Turn, check_environment, check_message, tool_schemas
from logra_pl.envs.episodes import Episodes, continuation_ids, render, run_episodes

__all__ = [
    "Environment",
    "Episodes",
    "Message",
    "Turn",
    "check_environment",
    "check_message",
    "continuation_ids",
    "render",
    "run_episodes",
    "tool_schemas",
]
