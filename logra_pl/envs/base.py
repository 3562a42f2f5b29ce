"""The environment contract of multi-turn rollouts: what a conversation starts with, and what follows each reply.

A single-turn task is a prompt and a verifier. A multi-turn one is a conversation: the policy replies, the
environment answers (a tool's result, a game's feedback, a user's next message) or ends it, and so on for at most
``max_turns`` replies. :func:`~logra_pl.envs.episodes.run_episodes` drives the conversation on any rollout engine,
appending token ids turn by turn (earlier turns are never re-tokenised), and marks which tokens the policy sampled:
only those are trained on.

An environment is any object with the attributes and methods of :class:`Environment` — nothing to subclass. Its
methods run in the training process, once per trajectory and turn, so they must be quick; slow or unsafe work (a
tool, a sandbox) goes to worker processes with a time limit (:class:`~logra_pl.envs.tools.ToolRunner`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

Message = dict[str, Any]


@dataclass
class Turn:
    """What an environment says after one reply of the policy.

    Arguments:
        observations: messages appended to the conversation before the policy's next reply (``{"role": "tool",
            "content": ...}``, ``{"role": "user", ...}``); ignored when ``done``.
        done: the conversation is over (the last reply was the policy's answer, or the game ended).
        reward: what this reply earned (any finite float); a trajectory's environment reward is the sum over its
            turns. 0 for environments whose reward is a verifier's score of the final reply.
        info: counts to log, summed over the turns of a trajectory (e.g. ``{"tool_calls": 2, "tool_errors": 1}``).
    """

    observations: list[Message] = field(default_factory=list)
    done: bool = False
    reward: float = 0.0
    info: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not math.isfinite(float(self.reward)):
            raise ValueError(f"Turn.reward must be finite, got {self.reward!r}")
        if not self.done and not self.observations:
            raise ValueError("a Turn that is not done needs observations: the messages the policy answers next")
        for message in self.observations:
            check_message(message)


@runtime_checkable
class Environment(Protocol):
    """What :func:`~logra_pl.envs.episodes.run_episodes` reads of an environment — the whole contract.

    - ``max_turns``: the most replies of the policy per trajectory (≥ 1); a trajectory still going after its last
      reply ends there, truncated (``finish_reason`` ``"length"``, as a reply cut by the token budget).
    - ``start(item)``: the conversation's first messages (usually ``item["messages"]``).
    - ``step(item, messages)``: after each reply, with the conversation so far (its last message the policy's reply,
      ``{"role": "assistant", "content": text}``): a :class:`Turn`. The list is the runner's: read it, do not change it.
    - optionally ``tool_schemas()``: the JSON schemas of the tools the policy may call, given to the chat template
      (``apply_chat_template(..., tools=...)``) when the conversation starts;
    - optionally ``max_tokens`` (default 1024): the most tokens of a trajectory after its first prompt, replies and
      inserted messages together;
    - optionally ``verify_final`` (default True): the run's verifier scores each trajectory's final reply against its
      item, added to the environment's reward; False: the environment's reward is the whole reward;
    - optionally ``continue_truncated`` (default False): a reply cut by ``max_new_tokens`` still goes to ``step``
      (the chat template closes its turn; the closing is inserted, not sampled); False: such a reply ends the
      trajectory, truncated;
    - optionally ``state_dict()``/``load_state_dict(state)``: counters kept in checkpoints;
    - optionally ``demonstration(item)``: a whole conversation showing the intended behaviour (``start(item)``'s
      messages, then the policy's replies and the environment's answers, ending with the policy's last reply), or
      None for an item it cannot show; the supervised warm start trains on its assistant messages
      (``warm_start.demonstrations``: the share of problems taught this way), so a small policy starts RL already
      able to write the tool-call format.

    (``max_turns`` is read from the instance and checked by :func:`check_environment`; it is not declared here, so
    that a configuration's ``class_path`` is matched against the methods alone, as jsonargparse matches protocols.
    The methods are declared with ``Any`` and positional-only parameters for the same reason: jsonargparse accepts a
    class for a protocol only when its annotations equal the protocol's, so an environment written with plain
    ``def step(self, item, messages)``, other parameter names, or narrower types is accepted; the types are the
    ones above: ``start(item: Mapping) -> list[Message]``, ``step(item: Mapping, messages: Sequence[Message]) ->
    Turn``.)
    """

    def start(self, item: Any, /) -> Any:
        """The conversation's first messages (``list[Message]``)."""
        ...

    def step(self, item: Any, messages: Any, /) -> Any:
        """The environment's answer to the policy's last reply (``messages[-1]``): a :class:`Turn`."""
        ...


def check_message(message: Any) -> None:
    """A chat message: a mapping with a string ``role`` and a string ``content``; a clear error otherwise."""
    if not isinstance(message, Mapping):
        raise TypeError(f"a message must be a mapping with 'role' and 'content', got {type(message).__name__}")
    if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
        raise ValueError(f"a message needs a string 'role' and a string 'content', got {dict(message)!r}")


def check_environment(env: Any) -> None:
    """Fail early, naming what is missing, when ``env`` does not meet :class:`Environment`."""
    missing = [name for name in ("start", "step") if not callable(getattr(env, name, None))]
    if missing:
        raise TypeError(f"{type(env).__name__} is not an environment: it has no {' or '.join(missing)} method")
    turns = getattr(env, "max_turns", None)
    if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
        raise ValueError(f"{type(env).__name__}.max_turns must be an integer >= 1, got {turns!r}")


def tool_schemas(env: Any) -> list[dict[str, Any]] | None:
    """The environment's tool schemas for the chat template, or None when it offers no tools."""
    schemas = getattr(env, "tool_schemas", None)
    if not callable(schemas):
        return None
    out = list(schemas())
    return out or None
