"""Activation checkpointing of a policy's decoder layers, on in any train/eval mode.

The policy stays in eval mode during training (module.py: trainer and engine must compute the same distribution),
and transformers' own ``gradient_checkpointing_enable`` only checkpoints ``if self.training`` — so with it every
layer silently kept its activations. Here each decoder layer (a class named in ``_no_split_modules``) is wrapped in
torch's non-reentrant checkpoint wrapper, which recomputes the layer in backward whatever the mode. State-dict keys
do not change (the wrapper strips its own prefix), and LoGRA's sketch names strip it too (``canonical_name``).

Recomputation and sketches: a layer's forward hooks run again in the replay, which re-creates ``Z = X Pᵀ`` for the
saved-tensor slots; the sketch is accumulated once, by the backward of the original graph. The first pass's tensors
are dropped, never read: the wrappers run that pass under :func:`first_pass` (torch's ``context_fn``), so a forward
hook can ask :func:`replayed_later` and save a placeholder instead of computing what the replay recomputes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from functools import partial

from torch import nn

_FIRST_PASS: ContextVar[bool] = ContextVar("logra_pl_checkpoint_first_pass", default=False)


def replayed_later() -> bool:
    """Whether the forward running now is the first pass of a layer checkpointed by
    :func:`enable_activation_checkpointing`: what it saves for the backward is dropped and recomputed there."""
    return _FIRST_PASS.get()


@contextmanager
def first_pass() -> Iterator[None]:
    """The context of a checkpointed layer's first pass (:func:`replayed_later` is true inside)."""
    token = _FIRST_PASS.set(True)
    try:
        yield
    finally:
        _FIRST_PASS.reset(token)


def _pass_contexts() -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
    """``torch.utils.checkpoint``'s ``context_fn``: the first pass under :func:`first_pass`, the replay as it is."""
    return first_pass(), nullcontext()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a transformers decoder (``_no_split_modules``), in order."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    # By class ancestry: FSDP2 swaps a sharded layer's class for a subclass named ``FSDP<Layer>``.
    layers = [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} declares no decoder layers (`_no_split_modules`): LoGRA shards and checkpoints "
            "transformers decoder-only causal LMs"
        )
    return layers


def checkpointed_layers(model: nn.Module) -> list[nn.Module]:
    """The checkpoint wrappers around decoder layers (empty when checkpointing is off)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return [m for m in model.modules() if isinstance(m, CheckpointWrapper)]


def enable_activation_checkpointing(model: nn.Module) -> int:
    """Wrap every decoder layer of ``model`` in a non-reentrant checkpoint wrapper (idempotent); return the count."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    done = checkpointed_layers(model)
    if done:
        return len(done)
    names = {type(m).__name__ for m in decoder_layers(model)}
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT, context_fn=_pass_contexts
        ),
        check_fn=lambda m: type(m).__name__ in names,
    )
    return len(checkpointed_layers(model))
