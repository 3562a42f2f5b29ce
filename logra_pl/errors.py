"""The errors logra-pl raises on purpose, and the checks that settings objects run at construction.

Every class here carries a message written for the user: what is wrong, with the value, and how to fix it. The
CLI prints such an error as one message (no traceback); anything else is a bug and keeps its traceback.

The ``check_*`` helpers are what the settings dataclasses call in ``__post_init__``: a bad value fails when the
object is built — before any model is loaded — not at the first training step.
"""

from __future__ import annotations

import math
from typing import Any


class LoGRAError(Exception):
    """Base of the errors whose message is complete for the user (the CLI prints it without a traceback)."""


class ConfigError(LoGRAError, ValueError):
    """A setting that cannot work; the message names the setting, its value and the fix."""


class ResumeMismatchError(LoGRAError, ValueError):
    """A checkpoint resumed with settings that change what its saved state means."""


class CheckpointNotFoundError(LoGRAError, FileNotFoundError):
    """A checkpoint to resume from could not be found; the message lists where it was looked for."""


class PolicyDivergedError(LoGRAError, RuntimeError):
    """Training stopped because the policy diverged (rejected updates in a row, or non-finite logits)."""


class VerifierFailedError(LoGRAError, RuntimeError):
    """Training stopped because the reward is broken: the verifier failed on too many responses for too many updates
    in a row (``scoring.max_failure_rate``, ``scoring.max_failed_updates``). The message names the verifier and holds
    its first failure, with the traceback."""


class EnvironmentFailedError(LoGRAError, RuntimeError):
    """Training stopped at a multi-turn environment's first error: its ``start`` or ``step`` raised, or returned
    something that is not a valid :class:`~logra_pl.envs.Turn`. The message names the environment, the method, the
    item and the error in a few lines; the original exception is the cause (``LOGRA_PL_TRACEBACK=1`` prints it)."""


class EngineUnavailableError(LoGRAError, ConnectionError):
    """A served rollout engine did not answer within the retry window; the message names its URL."""


class StaleEngineError(LoGRAError, RuntimeError):
    """A served engine holds other weights than the trainer expects (a lost update, a restarted engine).

    The module repairs it with a full resync before generating again; it reaches the user only if that fails.
    """

    def __init__(self, message: str, url: str = "", version: str | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.version = version


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def check_range(
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    hint: str = "",
) -> None:
    """``value`` is a finite number in the interval ``[low, high]`` (``(`` / ``)`` with ``low_open``/``high_open``)."""
    v = _number(name, value)
    too_low = low is not None and (v <= low if low_open else v < low)
    too_high = high is not None and (v >= high if high_open else v > high)
    if too_low or too_high:
        left = "(" if low_open else "["
        right = ")" if high_open or high is None else "]"
        interval = f"{left}{'-inf' if low is None else f'{low:g}'}, {'inf' if high is None else f'{high:g}'}{right}"
        raise ConfigError(f"{name} must lie in {interval}, got {value!r}" + (f": {hint}" if hint else ""))


def check_int(name: str, value: Any, low: int | None = None, high: int | None = None) -> None:
    """``value`` is an integer (not a bool) in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else (f"<= {high}" if low is None else f"in [{low}, {high}]")
        raise ConfigError(f"{name} must be an integer {bounds}, got {value!r}")


def check_choice(name: str, value: Any, choices: tuple[str, ...] | list[str]) -> None:
    """``value`` is one of ``choices``."""
    if value not in choices:
        raise ConfigError(f"unknown {name} {value!r}: use one of {', '.join(repr(c) for c in choices)}")
