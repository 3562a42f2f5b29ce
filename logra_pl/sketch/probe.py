"""How a proposal changes the policy (algorithm.md §6): logit tangents along the step, predicted and realized KL.

LoGRA (:func:`logit_tangent`): along ``W(α) = W − α U P`` each selected layer's output moves by ``−α (X Pᵀ) Uᵀ``
(on the outputs' side, along ``W − α (U R)ᵀ``, by ``−α (X U) R``).
The logit tangent ``t = dz/dα`` at ``α = 0`` comes from one forward-mode pass (JVP) in which every selected layer
adds ``−(X Pᵀ) Uᵀ`` to its output's tangent, or from a central finite difference that adds ``∓h (X Pᵀ) Uᵀ`` to the
layer outputs (the model with weights ``W ∓ h U P``, weights untouched).

Any parameter step (:func:`parameter_logit_tangent`, dense AdamW and LoRA): along ``θ(α) = θ + α Δθ``,
``t = J Δθ``, the logits' JVP in direction ``Δθ`` — one forward-mode pass with every stepped parameter a dual
tensor (``torch.func.functional_call``), or a central difference over ``θ ± h Δθ`` (restored exactly).

With ``p = softmax(z/T)`` and ``t' = t/T``, the KL of a step of size α is ``≈ α² · ½ Σ_v p_v (t'_v − Σ_u p_u t'_u)²``
per position.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Literal

import torch
import torch.autograd.forward_ad as fwad
from torch import nn
from torch.func import functional_call

from logra_pl.runtime.checkpointing import checkpointed_layers
from logra_pl.sketch.merge import local_tensor
from logra_pl.sketch.payload import Proposal
from logra_pl.sketch.side import INPUTS
from logra_pl.sketch.trace import traced_call

ProbeMode = Literal["jvp", "fd"]


def _layer_delta(
    x: torch.Tensor,
    factor: torch.Tensor,
    projection: torch.Tensor,
    scale: torch.Tensor | None = None,
    side: str = INPUTS,
) -> torch.Tensor:
    """``−(X Pᵀ) Uᵀ`` (``−(X diag(s) Pᵀ) Uᵀ`` with an input scale ``s``): the change of a layer's output per unit α,
    in the output's dtype. On the outputs' side (``ΔW = −(U R)ᵀ``, ``U`` ``d_in × r``): ``−(X U) R``."""
    x = fwad.unpack_dual(x).primal
    if side != INPUTS:
        return -torch.matmul(torch.matmul(x, factor.to(x.dtype)), projection.to(x.dtype))
    if scale is not None:
        x = x * scale.to(x.dtype)
    z = torch.matmul(x, projection.to(x.dtype).T)
    return -torch.matmul(z, factor.to(x.dtype).T)


@contextlib.contextmanager
def _output_hooks(modules: Mapping[str, nn.Module], hook_for) -> Iterator[None]:
    handles = [module.register_forward_hook(hook_for(name)) for name, module in modules.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _checkpointing_bypassed(model: nn.Module) -> Iterator[None]:
    """Run activation-checkpointed layers plainly for a no-grad forward-mode pass.

    A non-reentrant checkpoint wrapper (torch's ``checkpoint_wrapper``, ``runtime/checkpointing.py``) passes the
    layer's inputs through an autograd ``Function`` that, in torch 2.11, has no ``jvp``: a forward-mode pass through
    it raises ``NotImplementedError`` (found by the first CUDA run of ``logra-pl fit``; torch 2.13 lets it through).
    A probe keeps nothing for a backward, so there is nothing to checkpoint: here each wrapper calls its layer
    (hooks included) directly, and is restored on exit.
    """
    wrappers = checkpointed_layers(model)
    for wrapper in wrappers:
        wrapper.forward = wrapper._checkpoint_wrapped_module.__call__  # type: ignore[method-assign]
    try:
        yield
    finally:
        for wrapper in wrappers:
            del wrapper.forward


@contextlib.contextmanager
def _math_attention(model: nn.Module) -> Iterator[None]:
    """Route attention through the eager (math) implementation, which supports forward-mode AD."""
    config = getattr(model, "config", None)
    previous = getattr(config, "_attn_implementation", None)
    if previous is None or previous == "eager":
        yield
        return
    config._attn_implementation = "eager"
    try:
        yield
    finally:
        config._attn_implementation = previous


def _check_probed(proposal: Proposal, modules: Mapping[str, nn.Module]) -> None:
    """Refuse a proposal naming a matrix that is not among the probed modules."""
    missing = [n for n in proposal.matrices if n not in modules]
    if missing:
        raise KeyError(f"proposal matrices {missing[:3]} are not among the probed modules")


@traced_call("logra.kl_probe")
def logit_tangent(
    model: nn.Module,
    modules: Mapping[str, nn.Module],
    proposal: Proposal,
    model_inputs: Mapping[str, torch.Tensor],
    mode: ProbeMode = "jvp",
    fd_step: float = 1e-3,
    dense: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z, dz/dα)``: logits at α=0 and their rate of change along the proposal, both ``(B, T, V)``.

    Arguments:
        model: the policy (weights untouched).
        modules: ``{name: nn.Linear}`` of the selected matrices (the proposal's keys).
        proposal: per-matrix ``U`` (fp32, at α=1) and ``P``.
        model_inputs: keyword inputs of the forward (``input_ids``, ``attention_mask``, ``position_ids``).
        mode: ``"jvp"`` (one forward-mode pass, eager attention) or ``"fd"`` (two perturbed passes).
        fd_step: ``h`` of the central difference, in units of the nominal step.
        dense: ``{name: parameter}`` of densely trained parameters (``logra.dense_params``); their steps
            ``proposal.dense`` add their tangents (algorithm.md §6). In ``jvp`` mode that part is a central
            difference over two more forwards (the parameters are moved by ``±h·delta`` and restored exactly):
            forward-mode AD would have to replace parameters that FSDP manages.
    """
    _check_probed(proposal, modules)
    mats = proposal.matrices
    with torch.no_grad():
        if mode == "jvp":

            def hook_for(name):
                def hook(module, args, output):
                    m = mats[name]
                    delta = _layer_delta(args[0], m.factor, m.projection, m.input_scale, proposal.sketch_side)
                    primal, tangent = fwad.unpack_dual(output)
                    return fwad.make_dual(primal, delta if tangent is None else tangent + delta)

                return hook

            with (
                _math_attention(model),
                _checkpointing_bypassed(model),
                fwad.dual_level(),
                _output_hooks(modules, hook_for),
            ):
                out = model(**model_inputs, use_cache=False).logits
                primal, tangent = fwad.unpack_dual(out)
                primal, tangent = primal.clone(), (torch.zeros_like(primal) if tangent is None else tangent.clone())
            if dense and proposal.dense:
                plus = _moved(model, {}, proposal, model_inputs, fd_step, dense)
                minus = _moved(model, {}, proposal, model_inputs, -fd_step, dense)
                tangent = tangent + ((plus.double() - minus.double()) / (2 * fd_step)).to(tangent.dtype)
            return primal, tangent
        if mode != "fd":
            raise ValueError(f"unknown probe mode {mode!r}: use 'jvp' or 'fd'")
        logits = {
            sign: _moved(model, modules, proposal, model_inputs, sign * fd_step, dense) for sign in (1.0, -1.0, 0.0)
        }
        tangent = (logits[1.0].double() - logits[-1.0].double()) / (2 * fd_step)
        return logits[0.0], tangent.to(logits[0.0].dtype)


def _moved(
    model: nn.Module,
    modules: Mapping[str, nn.Module],
    proposal: Proposal,
    model_inputs: Mapping[str, torch.Tensor],
    alpha: float,
    dense: Mapping[str, torch.Tensor] | None,
) -> torch.Tensor:
    """Logits of the model with weights ``W − α U P`` on ``modules`` and ``logra.dense_params`` moved by ``α·delta``
    (restored bit for bit), weights untouched; at ``α = 0`` the plain forward. ``modules = {}`` moves only the dense
    parameters (the JVP probe's central difference over them)."""
    mats = proposal.matrices

    def hook_for(name):
        def hook(module, args, output):
            m = mats[name]
            return output + alpha * _layer_delta(args[0], m.factor, m.projection, m.input_scale, proposal.sketch_side)

        return hook

    with _output_hooks(modules if alpha != 0.0 else {}, hook_for), _dense_shift(dense or {}, proposal, alpha):
        return model(**model_inputs, use_cache=False).logits


@traced_call("logra.kl_probe")
def moved_logits(
    model: nn.Module,
    modules: Mapping[str, nn.Module],
    proposal: Proposal,
    model_inputs: Mapping[str, torch.Tensor],
    alpha: float,
    dense: Mapping[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Logits ``(B, T, V)`` of the policy the proposal at multiplier ``alpha`` would make, weights untouched.

    Every selected layer adds ``−α (X Pᵀ) Uᵀ`` to its output (the layer with weights ``W − α U P``) and each
    ``logra.dense_params`` parameter is moved by ``α·delta`` for the forward and restored bit for bit: the step
    before it is merged, for a step controller that checks the KL the step really takes (the line search of
    :class:`~logra_pl.callbacks.PredictedKLControl`, algorithm.md §6).
    """
    _check_probed(proposal, modules)
    with torch.no_grad():
        return _moved(model, modules, proposal, model_inputs, alpha, dense)


@traced_call("logra.kl_probe")
def parameter_moved_logits(
    model: nn.Module, deltas: Mapping[str, torch.Tensor], model_inputs: Mapping[str, torch.Tensor], alpha: float
) -> torch.Tensor:
    """Logits ``(B, T, V)`` at ``θ + α·Δθ`` (``deltas`` as :func:`parameter_logit_tangent` takes them): the
    parameters are moved in place (their local shards under FSDP) for one forward and restored bit for bit."""
    params = dict(model.named_parameters())
    missing = [n for n in deltas if n not in params]
    if missing:
        raise KeyError(f"stepped parameters {missing[:3]} are not parameters of the probed model")
    with torch.no_grad():
        return _parameter_moved(model, params, deltas, model_inputs, alpha)


def _parameter_moved(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    deltas: Mapping[str, torch.Tensor],
    model_inputs: Mapping[str, torch.Tensor],
    alpha: float,
) -> torch.Tensor:
    """Logits at ``θ + α·Δθ``, the parameters moved in place for the forward and restored bit for bit."""
    with _parameter_shift(params, deltas, alpha):
        return model(**model_inputs, use_cache=False).logits


@contextlib.contextmanager
def _dense_shift(dense: Mapping[str, torch.Tensor], proposal: Proposal, h: float) -> Iterator[None]:
    """Move each ``logra.dense_params`` parameter by ``h·delta`` for the block; restore its exact values after."""
    with _parameter_shift(dense, {name: step.delta for name, step in proposal.dense.items()}, h):
        yield


@contextlib.contextmanager
def _parameter_shift(
    params: Mapping[str, torch.Tensor], deltas: Mapping[str, torch.Tensor], h: float
) -> Iterator[None]:
    """Move each parameter by ``h·delta`` (its local shard under FSDP) for the block; restore its exact values after.

    ``deltas`` not in ``params`` are ignored; ``h = 0`` moves nothing."""
    saved = {}
    try:
        for name, delta in deltas.items():
            if h == 0.0 or name not in params:
                continue
            local = local_tensor(params[name])
            saved[name] = local.detach().clone()
            local.data.add_((h * delta).to(local.dtype))
        yield
    finally:
        for name, value in saved.items():
            local_tensor(params[name]).data.copy_(value)


@traced_call("logra.kl_probe")
def parameter_logit_tangent(
    model: nn.Module,
    deltas: Mapping[str, torch.Tensor],
    model_inputs: Mapping[str, torch.Tensor],
    mode: ProbeMode = "jvp",
    fd_step: float = 1e-3,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z, dz/dα)`` along ``θ(α) = θ + α·Δθ`` of named parameters of ``model``: logits at α = 0 and ``J·Δθ``.

    Arguments:
        model: the policy (weights untouched: exactly as before when this returns).
        deltas: ``{parameter name in model.named_parameters(): Δθ}`` (same shape as the parameter, or as its
            local shard when the parameter is an FSDP-sharded ``DTensor``). Unnamed parameters stay fixed.
        model_inputs: keyword inputs of the forward (``input_ids``, ``attention_mask``, ``position_ids``).
        mode: ``"jvp"``: one forward-mode pass (eager attention) in which each stepped parameter is the dual tensor
            ``(θ, Δθ)``, swapped in by ``torch.func.functional_call`` (tied parameters follow). Parameters that
            FSDP shards cannot be swapped (FSDP gathers its own), so over those ``jvp`` falls back to the central
            difference. ``"fd"``: ``(z(θ + hΔθ) − z(θ − hΔθ)) / 2h``, the parameters moved in place and restored
            bit for bit.
        fd_step: ``h`` of the central difference, in units of the step.
    """
    if mode not in ("jvp", "fd"):
        raise ValueError(f"unknown probe mode {mode!r}: use 'jvp' or 'fd'")
    params = dict(model.named_parameters())
    missing = [n for n in deltas if n not in params]
    if missing:
        raise KeyError(f"stepped parameters {missing[:3]} are not parameters of the probed model")
    sharded = any(hasattr(params[n], "to_local") for n in deltas)
    with torch.no_grad():
        if mode == "jvp" and not sharded:
            with _math_attention(model), _checkpointing_bypassed(model), fwad.dual_level():
                duals = {n: fwad.make_dual(params[n].detach(), d.to(params[n].dtype)) for n, d in deltas.items()}
                kwargs = {**model_inputs, "use_cache": False}
                out = functional_call(model, duals, (), kwargs, strict=False).logits
                primal, tangent = fwad.unpack_dual(out)
                primal, tangent = primal.clone(), (torch.zeros_like(primal) if tangent is None else tangent.clone())
            return primal, tangent
        logits = {
            sign: _parameter_moved(model, params, deltas, model_inputs, sign * fd_step) for sign in (1.0, -1.0, 0.0)
        }
        tangent = (logits[1.0].double() - logits[-1.0].double()) / (2 * fd_step)
        return logits[0.0], tangent.to(logits[0.0].dtype)


def predicted_kl_terms(logits: torch.Tensor, tangent: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per position ``½ Σ_v p_v (t'_v − Σ_u p_u t'_u)²`` in float64 (``logits``/``tangent``: ``(N, V)``)."""
    z = logits.to(torch.float64) / temperature
    t = tangent.to(torch.float64) / temperature
    p = torch.softmax(z, dim=-1)
    mean = (p * t).sum(dim=-1, keepdim=True)
    return 0.5 * (p * (t - mean).square()).sum(dim=-1)


def realized_kl_terms(
    logits_before: torch.Tensor, logits_after: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Per position ``KL(p_before ‖ p_after)`` from full distributions, in float64."""
    lp = torch.log_softmax(logits_before.to(torch.float64) / temperature, dim=-1)
    lq = torch.log_softmax(logits_after.to(torch.float64) / temperature, dim=-1)
    return (lp.exp() * (lp - lq)).sum(dim=-1)
