"""The independent dense computation the sketch tests compare against: plain autograd on a copy of the model."""

from __future__ import annotations

import copy

import torch


def dense_target_gradients(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{module name: G}`` (float64, ``d_out × d_in``): the language-modelling loss's gradient on ``ids`` for every
    ``*proj`` linear of a copy of ``model``, every other parameter frozen, no sketch hook involved."""
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.requires_grad_(False)
    linears = {n: m for n, m in ref.named_modules() if isinstance(m, torch.nn.Linear) and "proj" in n}
    for m in linears.values():
        m.weight.requires_grad_(True)
    for hook_owner in ref.modules():  # a copied model keeps the sketch hooks of the original: not this computation
        hook_owner._forward_hooks.clear()
    ref(input_ids=ids, labels=ids).loss.backward()
    return {n: m.weight.grad.double() for n, m in linears.items()}
