"""The loss registry and settings blocks of earlier versions (deprecated): ``LossSpec``/``register_loss``,
``LossConfig(kind=...)``, ``Baseline(kind=...)`` and the old ``loss: {kind: ...}`` / ``baseline: {kind: ...}`` sections.

Old checkpoints pickle ``LossConfig`` and ``Baseline`` in their hyper-parameters and old configs write the ``{kind:
...}`` sections, so they keep working: each builds the loss or baseline object of the current layout (same
arithmetic, same plan), and :func:`translate_section` turns an old section into its ``class_path`` form where configs
and checkpoints are read (the CLI's YAML loader, resume comparisons, ``load_from_checkpoint``), with a
``FutureWarning`` giving the form to write from now on.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

import torch

from logra_pl.config import flow, import_dotted
from logra_pl.errors import ConfigError, check_choice, check_int, check_range
from logra_pl.losses import (
    AdvantageBaseline,
    GroupBaseline,
    Loss,
    PPOClip,
    ReinforceTIS,
    RLOOBaseline,
    RunningBaseline,
    ppo_clip_loss,
    ppo_stats,
    reinforce_tis_loss,
    shuffled_plan,
)
from logra_pl.losses.base import Reference, check_length_reference
from logra_pl.losses.baselines import OutcomeMode

BaselineKind = Literal["running", "group", "rloo"]
BASELINE_KINDS: dict[str, type[AdvantageBaseline]] = {
    "running": RunningBaseline,
    "group": GroupBaseline,
    "rloo": RLOOBaseline,
}


# ---------------------------------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class LossSpec:
    """Deprecated — a loss is now a :class:`Loss` object. One loss of the old registry.

    Arguments:
        fn: ``fn(logp, reference, advantages, mask, num_tokens, weights, **params) -> loss`` (a scalar tensor; the
            token sum divided by ``num_tokens``).
        reference: the log-probs ``fn`` is given as ``reference``: ``"rollout"`` or ``"trainer"`` (the rollout is
            then used for ``ppo_epochs × ppo_minibatches`` updates).
        params: names of ``fn``'s hyper-parameters, read from ``LossConfig`` fields or ``LossConfig.params``.
        stats: optional ``stats(logp, reference, mask, **params) -> {name: (numerator, denominator)}``.
    """

    fn: Callable[..., torch.Tensor]
    reference: Reference
    params: tuple[str, ...] = ()
    stats: Callable[..., dict[str, tuple[float, float]]] | None = None

    def as_loss(self, name: str) -> Loss:
        """The loss ``model.loss: <name>`` means, where ``name`` is this spec's registered name or dotted path."""
        return SpecLoss(name)


LOSSES: dict[str, LossSpec] = {}


def register_loss(name: str, spec: LossSpec) -> LossSpec:
    """Deprecated — subclass :class:`Loss` instead. Add a loss under ``name`` (``LossConfig(kind=name)``)."""
    warnings.warn(
        "register_loss/LossSpec are deprecated: write a logra_pl.losses.Loss subclass and select it by class_path",
        DeprecationWarning,
        stacklevel=2,
    )
    return _register(name, spec)


def _register(name: str, spec: LossSpec) -> LossSpec:
    if spec.reference not in ("rollout", "trainer"):
        raise ValueError(f"loss {name!r}: reference must be 'rollout' or 'trainer', got {spec.reference!r}")
    LOSSES[name] = spec
    if name not in Loss.registry.names:  # a name of the old registry is a short name of model.loss (a SpecLoss)
        Loss.registry.add(name, spec)
    return spec


def resolve_loss(kind: str) -> LossSpec:
    """The spec of ``kind``: a registered name, or a dotted path ``package.module.NAME`` to a :class:`LossSpec`."""
    if kind in LOSSES:
        return LOSSES[kind]
    spec = import_dotted(kind, "loss.kind")
    if isinstance(spec, LossSpec):
        return _register(kind, spec)
    menu = Loss.registry.names
    choices = ", ".join(f"{name} ({cls.__module__.rpartition('.')[0]}.{cls.__name__})" for name, cls in menu.items())
    suggest = f"--model.loss {kind}" if kind in menu else "--model.loss <name>"
    raise ConfigError(
        f"unknown loss.kind {kind!r}: the old loss.kind section knows only {sorted(LOSSES)}. Losses are chosen by "
        f"name or class_path now: {suggest}, one of {choices}, or your own Loss subclass by its class_path; "
        "configs/overlays/ has one overlay per loss (gspo.yaml, cispo.yaml, dr_grpo.yaml, ...)"
    )


_register("reinforce_tis", LossSpec(reinforce_tis_loss, "rollout", ("tis_cap",)))
_register("ppo", LossSpec(ppo_clip_loss, "trainer", ("clip_eps",), stats=ppo_stats))
_BUILTIN_SPECS = {name: LOSSES[name] for name in ("reinforce_tis", "ppo")}


class SpecLoss(Loss):
    """A loss of the deprecated registry (:class:`LossSpec`) as a :class:`Loss`: what ``LossConfig(kind=...)``
    builds for a kind that is not built in, and the YAML form of such a loss while it is being ported.

    Arguments:
        spec: a registered name or the dotted path of a :class:`LossSpec`.
        params: the hyper-parameters the spec lists (passed to its ``fn`` and ``stats``).
        epochs: passes over each rollout when the spec's reference is ``"trainer"``.
        minibatches: updates per pass (likewise).
        length_reference: reweight each response by ``length_reference / L``; None: off.
    """

    def __init__(
        self,
        spec: str,
        params: dict[str, float] | None = None,
        epochs: int = 2,
        minibatches: int = 2,
        length_reference: float | None = None,
    ) -> None:
        resolved = resolve_loss(spec)
        params = dict(params or {})
        missing = [name for name in resolved.params if name not in params]
        if missing:
            raise ConfigError(f"loss {spec!r} needs the hyper-parameter {missing[0]!r}: set loss.params.{missing[0]}")
        check_int("loss.epochs", epochs, 1)
        check_int("loss.minibatches", minibatches, 1)
        check_length_reference(length_reference)
        self.spec_name = spec
        self.params = params
        self.epochs = epochs
        self.minibatches = minibatches
        self.length_reference = length_reference
        self.registered = resolved

    def init_args(self) -> dict[str, Any]:
        return {
            "spec": self.spec_name,
            "params": dict(self.params),
            "epochs": self.epochs,
            "minibatches": self.minibatches,
            "length_reference": self.length_reference,
        }

    @property
    def reference(self) -> Reference:  # type: ignore[override]
        return self.registered.reference

    @property
    def spec(self) -> LossSpec:
        return self.registered

    def hyper_parameters(self) -> dict[str, Any]:
        return {name: self.params[name] for name in self.registered.params}

    def plan(self, rows: int, generator_seed: int) -> list[list[int]]:
        if self.reference == "rollout":
            return [list(range(rows))]
        return shuffled_plan(rows, generator_seed, self.epochs, self.minibatches)

    def __call__(
        self,
        logp: torch.Tensor,
        ref_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        num_tokens: int,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.registered.fn(logp, ref_logp, advantages, mask, num_tokens, weights, **self.hyper_parameters())

    def stats(self, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, tuple[float, float]]:
        if self.registered.stats is None:
            return {}
        return self.registered.stats(logp, ref_logp, mask, **self.hyper_parameters())


class LegacyLossSettings(TypedDict, total=False):
    """The keys of the old ``loss: {kind: ..., tis_cap: ...}`` section (deprecated). Old configs and the
    hyper-parameters of old CLI checkpoints hold it; :func:`translate_section` reads it with a ``FutureWarning``
    that gives the ``class_path`` form, and refuses it without a ``kind``."""

    kind: str
    tis_cap: float
    clip_eps: float
    ppo_epochs: int
    ppo_minibatches: int
    length_reference: float | None
    params: dict[str, float]


@dataclass
class LossConfig:
    """Deprecated — pass a loss object (:class:`~logra_pl.losses.ReinforceTIS`, :class:`~logra_pl.losses.PPOClip`,
    your own :class:`~logra_pl.losses.Loss`), or in YAML ``loss: {class_path: ..., init_args: ...}``.

    The policy-gradient surrogate as one settings block. Old checkpoints pickle it in their hyper-parameters, so it
    stays importable; the module turns it into the object :meth:`build` returns (same arithmetic, same plan).

    Arguments:
        kind: ``"reinforce_tis"`` (:class:`~logra_pl.losses.ReinforceTIS`), ``"ppo"``
            (:class:`~logra_pl.losses.PPOClip`), or a name or dotted path of the deprecated registry
            (:class:`~logra_pl.losses.SpecLoss`).
        tis_cap: truncation of the rollout importance ratio (REINFORCE+TIS).
        clip_eps: PPO ratio clip ``ε``.
        ppo_epochs: passes over each rollout batch (losses against the pre-update trainer, e.g. PPO).
        ppo_minibatches: updates per pass (likewise); each is one optimizer step.
        length_reference: reweight each response by ``length_reference / L`` (algorithm.md §8 uses 1024); None: off.
        params: hyper-parameters of a registered loss that are not fields here (by the names its spec lists).
    """

    kind: str = "reinforce_tis"
    tis_cap: float = 2.0
    clip_eps: float = 0.2
    ppo_epochs: int = 2
    ppo_minibatches: int = 2
    length_reference: float | None = None
    params: dict[str, float] = field(default_factory=dict)

    @property
    def spec(self) -> LossSpec:
        """The registered loss of ``kind``."""
        return resolve_loss(self.kind)

    def hyper_parameters(self) -> dict[str, Any]:
        """The keyword arguments the loss (and its statistics) take, by the names its spec lists."""
        out = {}
        for name in self.spec.params:
            if name in self.params:
                out[name] = self.params[name]
            elif hasattr(self, name) and name != "params":
                out[name] = getattr(self, name)
            else:
                raise ConfigError(f"loss {self.kind!r} needs the hyper-parameter {name!r}: set loss.params.{name}")
        return out

    def build(self) -> Loss:
        """The loss object these settings mean: :class:`ReinforceTIS`, :class:`PPOClip`, or a :class:`SpecLoss`."""
        spec, params = self.spec, self.hyper_parameters()
        if spec is _BUILTIN_SPECS["reinforce_tis"]:
            return ReinforceTIS(length_reference=self.length_reference, **params)
        if spec is _BUILTIN_SPECS["ppo"]:
            return PPOClip(
                epochs=self.ppo_epochs,
                minibatches=self.ppo_minibatches,
                length_reference=self.length_reference,
                **params,
            )
        return SpecLoss(
            self.kind,
            params=params,
            epochs=self.ppo_epochs,
            minibatches=self.ppo_minibatches,
            length_reference=self.length_reference,
        )

    def to_config(self) -> dict[str, Any]:
        """The ``class_path`` form of these settings (what a resume compares)."""
        return self.build().to_config()

    def __post_init__(self) -> None:
        warnings.warn(
            "LossConfig is deprecated: pass a loss object (logra_pl.losses.ReinforceTIS, PPOClip, or your Loss "
            "subclass); in YAML loss: {class_path: logra_pl.losses.PPOClip, init_args: {clip_eps: 0.2}}",
            DeprecationWarning,
            stacklevel=3,
        )
        self.hyper_parameters()  # an unknown kind or a missing hyper-parameter fails here
        check_range(
            "loss.tis_cap",
            self.tis_cap,
            0.0,
            low_open=True,
            hint="a cap of 0 zeroes every token's weight",
        )
        check_range("loss.clip_eps", self.clip_eps, 0.0, 1.0, low_open=True, high_open=True)
        check_int("loss.ppo_epochs", self.ppo_epochs, 1)
        check_int("loss.ppo_minibatches", self.ppo_minibatches, 1)
        if self.length_reference is not None:
            check_range("loss.length_reference", self.length_reference, 0.0, low_open=True)


@dataclass
class Baseline:
    """Deprecated — use :class:`RunningBaseline`, :class:`GroupBaseline` or :class:`RLOOBaseline`. The baseline as
    one settings block with a ``kind``; old checkpoints pickle it, and the module builds the new object from it.

    Arguments:
        kind: ``"running"``, ``"group"`` or ``"rloo"``.
        momentum, mode, success_threshold, success_value, failure_value: as :class:`AdvantageBaseline`.
        value: the current baseline ``b`` (0 at the start).
    """

    kind: BaselineKind = "running"
    momentum: float = 0.9
    mode: OutcomeMode = "outcome"
    success_threshold: float = 1.0
    success_value: float = 1.0
    failure_value: float = -0.01
    value: float = 0.0

    def __post_init__(self) -> None:
        warnings.warn(
            f"Baseline(kind=...) is deprecated: use logra_pl.losses.{BASELINE_KINDS[self.kind].__name__}"
            if self.kind in BASELINE_KINDS
            else "Baseline(kind=...) is deprecated: use RunningBaseline, GroupBaseline or RLOOBaseline",
            DeprecationWarning,
            stacklevel=3,
        )
        check_choice("baseline.kind", self.kind, tuple(BASELINE_KINDS))
        check_range("baseline.value", self.value)
        self.build()

    def build(self) -> AdvantageBaseline:
        """The baseline object of ``kind``, with these settings and the current ``value``."""
        check_choice("baseline.kind", self.kind, tuple(BASELINE_KINDS))
        baseline = BASELINE_KINDS[self.kind](
            momentum=self.momentum,
            mode=self.mode,
            success_threshold=self.success_threshold,
            success_value=self.success_value,
            failure_value=self.failure_value,
        )
        baseline.value = float(self.value)
        return baseline

    def to_config(self) -> dict[str, Any]:
        """The ``class_path`` form of these settings (what a resume compares; ``value`` is state, not a setting)."""
        return self.build().to_config()

    def outcomes(self, rewards: torch.Tensor) -> torch.Tensor:
        return self.build().outcomes(rewards)

    def advantages(
        self,
        rewards: torch.Tensor,
        all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
        groups: list[int] | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As the object of ``kind`` would (and ``value`` moves the same way)."""
        baseline = self.build()
        adv = baseline.advantages(rewards, all_reduce_sum, groups)
        self.value = baseline.value
        return adv

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class LegacyBaselineSettings(TypedDict, total=False):
    """The keys of the old ``baseline: {kind: ..., momentum: ...}`` section (deprecated). Old configs and the
    hyper-parameters of old CLI checkpoints hold it; :func:`build_baseline` reads it with a ``FutureWarning`` that
    gives the ``class_path`` form, and refuses it without a ``kind``."""

    kind: str
    momentum: float
    mode: str
    success_threshold: float
    success_value: float
    failure_value: float
    value: float


# -------------------------------------------------------------------------------------------- the old sections
LEGACY: dict[str, type] = {"loss": LossConfig, "baseline": Baseline}


def _built(kind: str, section: Mapping[str, Any], setting: str) -> Any:
    """The object an old ``{kind: ..., <arguments>}`` section means (its dataclass's ``build()``)."""
    what = setting.rpartition(".")[2]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return LEGACY[kind](**dict(section)).build()
    except TypeError as err:
        given = flow(dict(section))
        raise ConfigError(f"{setting} {given}: {err}; write {what}: {{class_path: ..., init_args: {{...}}}}") from None


def is_old_section(value: Any) -> bool:
    """A mapping of the old form: arguments under a ``kind``, no ``class_path``."""
    return isinstance(value, Mapping) and "kind" in value and "class_path" not in value


def translate_section(section: Mapping[str, Any], kind: str, setting: str) -> dict[str, Any]:
    """The ``{class_path, init_args}`` form of an old ``{kind: ..., <arguments>}`` section of ``kind`` (``loss`` or
    ``baseline``), with a ``FutureWarning`` that gives it as the form to write from now on. A baseline's ``value``
    (state an old section carried) stays beside the class path (``value``), for the caller to restore."""
    built = _built(kind, section, setting)
    translated = built.to_config(short=True)
    what = setting.rpartition(".")[2]
    warnings.warn(
        f"{setting} {{kind: {section['kind']}, ...}} is the deprecated form (an old config or checkpoint); it is read "
        f"as {what}: {flow(translated)}, the form to write from now on",
        FutureWarning,
        stacklevel=3,
    )
    return built.to_config()


def class_path_form(value: Any, kind: str) -> Any:
    """An old section or settings object in the ``{class_path, init_args}`` form (plain data), for resume
    comparisons; anything else is returned unchanged."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            if is_old_section(value):
                return _built(kind, value, f"model.{kind}").to_config()
            if isinstance(value, LossConfig | Baseline):
                return value.to_config()
        except (ConfigError, TypeError, ValueError):
            return value
    return value


def translate_config(config: Any) -> Any:
    """A whole config (or one subcommand's) with the old ``model.loss`` / ``model.baseline`` sections in their
    ``class_path`` form: what the CLI's YAML loader reads through. Anything else is returned unchanged."""
    if not isinstance(config, dict):
        return config
    for holder in [config, *(v for v in config.values() if isinstance(v, dict))]:
        model = holder.get("model")
        if not isinstance(model, dict):
            continue
        for kind in ("loss", "baseline"):
            if is_old_section(model.get(kind)):
                model[kind] = translate_section(model[kind], kind, f"model.{kind}")
    return config


def built_form(value: Any, registry: Any, setting: str) -> Any:
    """What a loss or baseline setting of an older kind means now: a settings object (``LossConfig``,
    ``Baseline``: their ``build()``), a name or dotted path of the old loss registry (its ``LossSpec`` as a
    :class:`SpecLoss`); anything else is returned as it is."""
    if not isinstance(value, str | Mapping | Loss | AdvantageBaseline) and callable(getattr(value, "build", None)):
        return value.build()
    if isinstance(value, str):
        target = registry.names.get(value)
        if target is None and "." in value:
            try:
                target = import_dotted(value, setting)
            except ConfigError:
                return value
        if isinstance(target, LossSpec):
            return target.as_loss(value)
    return value


def translate_hparams(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """A checkpoint's module hyper-parameters with the old sections (``loss``, ``baseline``) translated: what
    ``load_from_checkpoint`` is given. A baseline's ``value`` is state; the checkpoint restores it."""
    return dict(hparams) | {
        kind: translate_section(hparams[kind], kind, f"model.{kind}")
        for kind in ("loss", "baseline")
        if is_old_section(hparams.get(kind))
    }
