"""The one item schema every logra-pl data module emits, and the helpers that build and check it.

An item is a plain ``dict`` with (at least) these keys:

``messages``
    the chat the policy sees: a non-empty list of ``{"role": str, "content": str}``; an optional ``system``
    message comes first (and only first), and at least one message is a ``user`` message.
``answer``
    the gold answer, as a string (``""`` when a task has no single gold answer and its scorer reads ``metadata``).
``task``
    the task or source name (a reasoning-gym task, ``dapo_math``, ``math500``, a file stem, a hub id).
``id``
    a stable string, unique within a split: the same source row gives the same id in every run.
``metadata``
    a free ``dict`` (the source's other fields).

Data modules may add keys of their own (reasoning-gym items keep ``question`` and reasoning-gym's ``metadata``,
which its scorers read). :func:`prompt_key` — the content of the first user message — is what deduplication,
train/eval disjointness and per-prompt sampling seeds use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from logra_pl.errors import ConfigError

ITEM_KEYS = ("messages", "answer", "task", "id", "metadata")
ROLES = ("system", "user", "assistant", "tool")


def _where(item: Mapping[str, Any]) -> str:
    ident = item.get("id")
    return f"item {ident!r}" if isinstance(ident, str) and ident else "item"


def validate_item(item: Any) -> None:
    """Check that ``item`` follows the schema; a :class:`ConfigError` names the missing or ill-typed key.

    Arguments:
        item: the item to check (a mapping with ``messages``, ``answer``, ``task``, ``id``, ``metadata``).
    """
    if not isinstance(item, Mapping):
        raise ConfigError(f"an item must be a dict with keys {list(ITEM_KEYS)}, got a {type(item).__name__}")
    where = _where(item)
    missing = [k for k in ITEM_KEYS if k not in item]
    if missing:
        raise ConfigError(f"{where} is missing {missing} (it has keys {sorted(map(str, item))})")
    for key in ("answer", "task", "id"):
        if not isinstance(item[key], str):
            raise ConfigError(f"{where}: {key!r} must be a str, got {type(item[key]).__name__} {item[key]!r}")
    for key in ("task", "id"):
        if not item[key]:
            raise ConfigError(f"{where}: {key!r} must be a non-empty string")
    if not isinstance(item["metadata"], Mapping):
        raise ConfigError(f"{where}: 'metadata' must be a dict, got {type(item['metadata']).__name__}")
    messages = item["messages"]
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        shape = "a non-empty list of {'role', 'content'} dicts"
        raise ConfigError(f"{where}: 'messages' must be {shape}, got {messages!r:.200}")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise ConfigError(f"{where}: 'messages'[{i}] must be a dict with 'role' and 'content', got {message!r}")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise ConfigError(f"{where}: 'messages'[{i}] has role {role!r}; use one of {list(ROLES)}")
        if role == "system" and i:
            raise ConfigError(f"{where}: 'messages'[{i}] is a system message; only the first message may be one")
        if not isinstance(content, str):
            raise ConfigError(f"{where}: 'messages'[{i}]['content'] must be a str, got {type(content).__name__}")
    if not any(m["role"] == "user" for m in messages):
        raise ConfigError(f"{where}: 'messages' has no user message (roles: {[m['role'] for m in messages]})")


def make_item(
    messages: Sequence[Mapping[str, str]],
    answer: str,
    task: str,
    id: str,
    metadata: Mapping[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Build a schema item (messages copied as plain ``{"role", "content"}`` dicts) and validate it.

    Arguments:
        messages: the chat (an optional system message first, then at least one user message).
        answer: the gold answer, a string.
        task: task / source name.
        id: stable unique identifier.
        metadata: free dict of the source's other fields (copied; default empty).
        **extra: further keys the data module keeps (e.g. reasoning-gym's ``question``).
    """
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ConfigError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    chat = [
        {"role": m["role"], "content": m["content"]} if isinstance(m, Mapping) and "role" in m and "content" in m else m
        for m in messages
    ]
    item = {"messages": chat, "answer": answer, "task": task, "id": id, "metadata": dict(metadata or {}), **extra}
    validate_item(item)
    return item


def item_task(item: Any) -> str:
    """The task an item is counted under (per-task metrics, log lines): its ``task``, else a reasoning-gym entry's
    ``metadata.source_dataset``, else ``"all"`` — also for a malformed item (a verifier may be handed anything).

    Arguments:
        item: a schema item, or anything a verifier was called with.
    """
    if not isinstance(item, Mapping):
        return "all"
    metadata = item.get("metadata")
    task = item.get("task") or (metadata.get("source_dataset") if isinstance(metadata, Mapping) else None)
    return str(task) if task else "all"


def prompt_key(item: Mapping[str, Any]) -> str:
    """The content of the item's first user message: the key of dedup, train/eval disjointness and sampling seeds.

    Arguments:
        item: a schema item (only its ``messages`` are read).
    """
    messages = item.get("messages") if isinstance(item, Mapping) else None
    if isinstance(messages, Sequence) and not isinstance(messages, str | bytes):
        for message in messages:
            if isinstance(message, Mapping) and message.get("role") == "user":
                return str(message.get("content"))
    raise ConfigError(f"{_where(item) if isinstance(item, Mapping) else 'item'} has no user message in 'messages'")
