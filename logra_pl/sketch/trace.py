"""Named ranges for profiler traces: where LoGRA's own work sits in a ``torch.profiler`` (or Lightning
``PyTorchProfiler``) recording.

The ranges are ``logra.sketch.project`` (the forward hook's ``Z = X Pᵀ``, algorithm.md §3), ``logra.sketch.accumulate``
(the backward's ``S += dYᵀ Z``), ``logra.propose`` (§4) and ``logra.apply`` (§5), and ``logra.kl_probe`` (§6). The
first two run per matrix per microbatch (the projection again where activation checkpointing recomputes a layer),
thousands of times per update on a large model, and ``torch.profiler.record_function`` costs microseconds per call
even when nothing records, so a range is opened only while a profiler is recording — or while a cost count listens
(:func:`listening`: ``benchmarks/update_cost.py`` reads :func:`open_ranges` from a dispatch mode to charge each
operator call to the range it runs in).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, TypeVar

import torch
from torch.profiler import record_function

F = TypeVar("F", bound=Callable[..., Any])


_OPEN: list[str] | None = None  # the ranges open now while a cost count listens; None: nobody listens


def traced(name: str) -> AbstractContextManager[object]:
    """``record_function(name)`` while a torch profiler records, the range on :func:`open_ranges` while a cost count
    listens, else a no-op context."""
    if _OPEN is not None:
        return _opened(name)
    return record_function(name) if torch.autograd._profiler_enabled() else nullcontext()


@contextmanager
def _opened(name: str) -> Iterator[None]:
    assert _OPEN is not None
    _OPEN.append(name)
    try:
        yield
    finally:
        _OPEN.pop()


@contextmanager
def listening() -> Iterator[None]:
    """While inside: every :func:`traced` range is kept on :func:`open_ranges` (innermost last)."""
    global _OPEN
    before, _OPEN = _OPEN, []
    try:
        yield
    finally:
        _OPEN = before


def open_ranges() -> tuple[str, ...]:
    """The ranges open now, outermost first (empty when nobody listens)."""
    return tuple(_OPEN or ())


def traced_call(name: str) -> Callable[[F], F]:
    """Decorator: every call of the function runs inside :func:`traced` ``(name)``."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with traced(name):
                return fn(*args, **kwargs)

        return inner  # type: ignore[return-value]

    return wrap
