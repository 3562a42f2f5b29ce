"""``PolicyModuleView``: what the callbacks read from a policy module — the whole contract, kept with the callbacks.

:class:`~logra_pl.module.LoGRAPolicyModule` meets it; so can a LightningModule of your own, and then every callback
of :mod:`logra_pl.callbacks` works with it. It is made of objects that each do their own job, not of methods on the
module: the update method (what it trains, its sketches, its step control), the engine link (the engine, syncs, the
order of engine calls), the sampler (prompts in, responses out) and the trainer's passes (log-probs before an update).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from logra_pl.train.step import StepContext


@runtime_checkable
class PolicyModuleView(Protocol):
    """What callbacks read from the policy module — the whole contract.

    Attributes:
        policy: the trained causal LM.
        tokenizer: its tokenizer.
        method: the :class:`~logra_pl.methods.UpdateMethod` (``trained_tensors(policy)``, ``full_state(policy)``,
            ``sketcher``, ``ships_factors``, ``makes_proposals``, ``keeps_sketches``; for step controllers
            ``logit_tangent``, ``applied_updates``, ``applied``).
        targets: the trained matrices (last name parts).
        step_context: the current step's :class:`~logra_pl.train.step.StepContext`, or None.
        rollout_settings: the run's :class:`~logra_pl.train.settings.RolloutSettings`.
        policy_source: where the policy came from (``model.policy``).
        dtype_name: the policy's parameter dtype (``float32``...).
        link: the :class:`~logra_pl.train.engine_link.EngineLink` (``engine``; ``sync_full`` and ``submit``: engine
            calls in order with every other, on the asynchronous worker when rollouts are sampled ahead;
            ``configure`` and ``shipped``: what each step sends, and its bytes and seconds), or None before
            ``configure_model``.
        sampler: the :class:`~logra_pl.train.sampler.Sampler` (``encode``, ``generate``), or None before it.
        passes: the :class:`~logra_pl.train.passes.TrainerPasses` (``logprobs``), or None before it.
        loss_config: the :class:`~logra_pl.losses.Loss` of the updates (what a diagnostic recomputes a gradient of,
            through :func:`~logra_pl.train.backward.microbatch_loss`).
        microbatch_size: responses per forward/backward pass.

    Every callback that reads part of it says which (its ``READS``: ``PredictedKLControl`` reads ``policy``,
    ``method`` and ``step_context``; ``tests/callbacks/test_contract.py`` holds it) and checks it at setup, so a
    module of your own needs only what its callbacks read.
    """

    policy: Any
    tokenizer: Any
    method: Any
    targets: tuple[str, ...]
    step_context: StepContext | None
    rollout_settings: Any
    policy_source: str
    dtype_name: str
    link: Any
    sampler: Any
    passes: Any
    loss_config: Any
    microbatch_size: int


CONTRACT = 'logra_pl.callbacks.contract.PolicyModuleView (docs/extending.md, "Your own LightningModule")'
EVERYTHING: tuple[str, ...] = tuple(PolicyModuleView.__annotations__)


def missing_from_view(pl_module: Any, needs: tuple[str, ...] = EVERYTHING) -> list[str]:
    """The attributes of ``needs`` (by default the whole :class:`PolicyModuleView`) that ``pl_module`` lacks."""
    return [name for name in needs if not hasattr(pl_module, name)]


def view_of(pl_module: Any, needs: tuple[str, ...] = EVERYTHING) -> PolicyModuleView | None:
    """``pl_module`` when it has the attributes of ``needs`` (by default the whole contract), else None: callbacks
    that also work with other Lightning modules do nothing of the policy kind without them. A callback that reads
    part of the contract passes that part, so a LightningModule of your own needs only what it reads."""
    return pl_module if not missing_from_view(pl_module, needs) else None


def require_view(pl_module: Any, who: str, needs: tuple[str, ...] = EVERYTHING) -> PolicyModuleView:
    """``pl_module`` as a policy module, or a ``TypeError`` naming the attributes of ``needs`` it lacks: for
    callbacks that read the policy update itself and would otherwise do nothing, silently."""
    missing = missing_from_view(pl_module, needs)
    if missing:
        reads = "the whole contract:" if needs == EVERYTHING else f"{', '.join(needs)} of the contract,"
        raise TypeError(
            f"{who} works with a policy module: {type(pl_module).__name__} has no {', '.join(missing)} "
            f"(it reads {reads} {CONTRACT})"
        )
    return pl_module
