"""Named ranges for profiler traces: where LoGRA's own work sits in a ``torch.profiler`` (or Lightning
``PyTorchProfiler``) recording.

The ranges are ``logra.sketch.project`` (the forward hook's ``Z = X Pᵀ``, algorithm.md §3), ``logra.sketch.accumulate``
(the backward's ``S += dYᵀ Z``), ``logra.propose`` (§4) and ``logra.apply`` (§5), and ``logra.kl_probe`` (§6). The
first two run per matrix per microbatch (the projection again where activation checkpointing recomputes a layer),
thousands of times per update on a large model, and ``torch.profiler.record_function`` costs microseconds per call
even when nothing records, so a range is opened only while a profiler is recording.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

import torch
from torch.profiler import record_function

F = TypeVar("F", bound=Callable[..., Any])


def traced(name: str) -> AbstractContextManager[object]:
    """``record_function(name)`` while a torch profiler records, else a no-op context."""
    return record_function(name) if torch.autograd._profiler_enabled() else nullcontext()


def traced_call(name: str) -> Callable[[F], F]:
    """Decorator: every call of the function runs inside :func:`traced` ``(name)``."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with traced(name):
                return fn(*args, **kwargs)

        return inner  # type: ignore[return-value]

    return wrap
