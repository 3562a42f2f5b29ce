"""``UpdateMethod``: how one policy update turns the step's gradients into new weights — the whole contract.

The module runs rollouts, losses and backward passes; everything that depends on *how* the weights are trained goes
through this one object: which tensors it trains and how their optimizer is built, the update itself (with the
divergence guard's check before anything is merged), what a rollout engine receives, the memory it holds, its console
line, its checkpoint kind, its memory plan (``logra-pl plan``) and what an export writes of it. Callbacks ask a method
what it can do (:attr:`UpdateMethod.ships_factors`,
:attr:`UpdateMethod.makes_proposals`, :attr:`UpdateMethod.keeps_sketches`, :attr:`UpdateMethod.sketcher`), never
what it is called; a step controller asks a method that makes proposals how its proposal moves the logits
(:meth:`UpdateMethod.logit_tangent`), how many updates it applied and whether a proposal was applied.

A new method is one class (``docs/extending.md``: "add an update method"), chosen in YAML by
``model.method: {class_path: my_pkg.MyMethod, init_args: {...}}``; a built-in one also registers its short name
(``@register("adamw")``, :mod:`logra_pl.config`) and is imported by ``logra_pl/methods/__init__.py``: that one word
makes ``logra-pl plan`` list it (:meth:`UpdateMethod.planned`, its own options by :meth:`UpdateMethod.plan_options`).
"""

from __future__ import annotations

import argparse
import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from logra_pl.config import Registry, class_path_of
from logra_pl.errors import ConfigError
from logra_pl.methods.guard import DivergenceGuard
from logra_pl.sketch.memory import MemoryReport, memory_report
from logra_pl.sketch.merge import full_tensor
from logra_pl.sketch.payload import Payload
from logra_pl.sketch.probe import ProbeMode

AllReduceSum = Callable[[torch.Tensor], torch.Tensor]


@runtime_checkable
class DataParallelRanks(Protocol):
    """What a data-parallel strategy offers the optimizers that wire themselves into it (the whole contract).

    Arguments:
        world_size: ranks training together (1: nothing to reduce).
        root_device: this rank's device.
        stats: ``{name: value}`` the strategy logs after each update (bytes and seconds of collectives).
    """

    world_size: int
    root_device: torch.device
    stats: dict[str, float]

    def row_offset(self, weight: torch.Tensor) -> int:
        """Global index of the first row of ``weight`` this rank holds (0 when it is not sharded)."""
        ...


@runtime_checkable
class ReplicatedStateOptimizer(Protocol):
    """An optimizer whose whole state is the same on every rank, wired into data parallelism by itself (the whole
    contract): a strategy saves and loads its ``state_dict`` as it is (never as sharded optimizer state) and calls
    :meth:`wire_ranks` once it has sharded the model, so the optimizer sets up the collectives its step needs."""

    def state_dict(self) -> dict[str, Any]:
        """The whole state, identical on every rank."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        ...

    def wire_ranks(self, ranks: DataParallelRanks) -> None:
        """Set up what each step must reduce over ``ranks`` (called once per setup, on every rank)."""
        ...


class GatheredState(Mapping[str, torch.Tensor]):
    """A state dict whose FSDP shards are all-gathered one tensor at a time, when read.

    Reading a value is a collective under FSDP: every rank must read the same keys in the same order (engines'
    ``load_weights`` iterate in key order on every rank). An engine that streams — :class:`RemoteEngine` sends
    chunks as it reads them — then never holds more than one chunk of gathered weights, instead of the whole
    model on every rank. :meth:`spec` gives a tensor's global shape and dtype without gathering it.
    """

    def __init__(self, state: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> None:
        self._state = state
        self.dtype = dtype  # floating tensors are cast to it after the gather (the engine's wire dtype)

    def __getitem__(self, key: str) -> torch.Tensor:
        value = self._state[key]
        value = full_tensor(value)
        if self.dtype is not None and value.is_floating_point():
            value = value.to(self.dtype)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)

    def spec(self, key: str) -> tuple[torch.Size, torch.dtype]:
        value = self._state[key]
        cast = self.dtype is not None and value.is_floating_point()
        return value.shape, self.dtype if cast else value.dtype


@dataclass
class StepResult:
    """What one update did.

    Arguments:
        rejected: why the update was not applied (the weights are unchanged), or None.
        update_norm: ``‖ΔW‖_F`` of the applied update (0 when rejected).
        payload: the factor payload merged into the weights, for engines that take factors (None otherwise).
    """

    rejected: str | None
    update_norm: float
    payload: Payload | None = None


@dataclass
class PlanShapes:
    """What a method's memory plan reads (``logra-pl plan``): the model built on the meta device and how it is
    sharded. The method's own settings (LoGRA's rank, AdamW's ``train_all``...) are the method's.

    Arguments:
        matrices: the target matrices (``nn.Linear`` on the meta device), by name.
        params: every parameter once (tied weights once).
        weights: bytes of the weights (and buffers) one rank holds.
        ranks: data-parallel ranks the parameters and dense state are sharded over (by rows, padded).
        dtype: the parameters' dtype.
    """

    matrices: dict[str, nn.Linear]
    params: list[torch.Tensor]
    weights: int
    ranks: int = 1
    dtype: torch.dtype = torch.float32

    def shard_bytes(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> int:
        """Bytes of one rank's dim-0 shard of ``t``, padded to ``ceil(rows / ranks)`` rows (as FSDP2 allocates it)."""
        rows = t.shape[0] if t.dim() > 0 else 1
        per_row = t[0].numel() if t.dim() > 0 else 1
        return math.ceil(rows / self.ranks) * per_row * (dtype or t.dtype).itemsize


@dataclass
class PlanSettings:
    """What ``logra-pl plan`` asks every method to plan with (:meth:`UpdateMethod.planned`): the settings all methods
    share, and each method's own options (those it added with :meth:`UpdateMethod.plan_options`).

    Arguments:
        rank: the low-rank methods' rank (LoGRA's sketch rank ``r``, LoRA's adapter rank).
        targets: the matrices every method trains.
        train_all: the dense methods train every parameter (embeddings, norms...), not only the targets.
        options: the methods' own options by name (``logra_rule``, ``sgd_momentum``...); a method reads its own and
            takes its default for one that is missing.
    """

    rank: int = 64
    targets: tuple[str, ...] = ()
    train_all: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)


def check_method(method: Any, setting: str = "model.method") -> None:
    """Raise :class:`ConfigError` unless ``method`` is an :class:`UpdateMethod`."""
    if not isinstance(method, UpdateMethod):
        raise ConfigError(
            f"{setting} {class_path_of(method)} is not an update method: name one by its short name or give an "
            "instance of a subclass of logra_pl.methods.UpdateMethod"
        )


class UpdateMethod(ABC):
    """How a policy update is formed and merged. Subclass it; the module and callbacks use only what is here.

    Class attributes:
        name: the kind recorded in checkpoints (a resume under another method is refused).
        ships_factors: an update reaches engines as a factor :class:`~logra_pl.sketch.payload.Payload` (not as
            the changed tensors).
        makes_proposals: ``optimizer.proposal`` exists during ``on_before_optimizer_step``, for step controllers
            to scale (``proposal.alpha``: the update applied is ``α`` times the proposal), price
            (``proposal.priced_kl``: the KL of the update at ``α``, which a method may read) or veto
            (``proposal.skip(reason)``: nothing applied); the divergence guard judges the update after them. Such a
            method also answers :meth:`logit_tangent`, :attr:`applied_updates` and :meth:`applied` (and
            :meth:`logits_at`, for a controller's line search).
        keeps_sketches: gradients reach the update as LoGRA sketches (:attr:`sketcher` is set once the optimizer is
            built), which sketch diagnostics measure.
        step_knob: the setting to lower when the divergence guard keeps rejecting updates.
    """

    registry: ClassVar[Registry] = Registry(
        "update method", "model.method", "logra_pl.methods.DenseAdamW", lambda method, at: check_method(method, at)
    )
    name: ClassVar[str] = "method"
    ships_factors: ClassVar[bool] = False
    makes_proposals: ClassVar[bool] = False
    keeps_sketches: ClassVar[bool] = False

    @property
    def step_knob(self) -> str:
        """The setting that sizes a step (named in the divergence message)."""
        return "lr"

    @property
    def sketcher(self) -> Any:
        """The :class:`~logra_pl.sketch.LoGRASketcher` of a sketching method (after ``configure_optimizers``)."""
        return None

    # ------------------------------------------------------------------------------------------ set up
    def __reduce__(self) -> str | tuple[Any, ...]:
        """Pickled (a checkpoint's hyper-parameters, a deep copy) as the method its settings build, never with a run's
        state (its optimizer, sketches, the policy they hold): when every init argument is kept as an attribute of
        its name (:meth:`to_config`); otherwise as any object."""
        config = self.to_config()
        params = [p for p in inspect.signature(type(self).__init__).parameters if p not in ("self", "args", "kwargs")]
        if set(config["init_args"]) != set(params):
            return super().__reduce__()
        return (_rebuilt_method, (type(self), config["init_args"]))

    def to_config(self) -> dict[str, Any]:
        """``{class_path, init_args}``: what a config writes for this method (resume comparisons read it), each init
        argument taken from the attribute of the same name (one the method does not keep is left out)."""
        params = [p for p in inspect.signature(type(self).__init__).parameters if p != "self"]
        args = {p: getattr(self, p) for p in params if hasattr(self, p)}
        return {"class_path": class_path_of(self), "init_args": args}

    @property
    def targets(self) -> tuple[str, ...] | None:
        """The matrices this method's own settings name, which the module trains when ``model.targets`` names none;
        None (the default): the module's default targets."""
        return None

    def check_fits(self, source: str, targets: Sequence[str]) -> None:
        """Settings that depend on the model's shapes, checked from its config before any weights load."""
        return None

    def prepare_policy(self, policy: nn.Module, targets: Sequence[str]) -> None:
        """Change the policy's modules after the engine copied it (e.g. inject adapters). Must be idempotent."""
        return None

    @abstractmethod
    def configure_optimizers(self, policy: nn.Module, targets: Sequence[str], guard: DivergenceGuard) -> Any:
        """What ``LightningModule.configure_optimizers`` returns: the optimizer (and schedule) of ``targets``."""

    # ---------------------------------------------------------------------------------------- updates
    @abstractmethod
    def step(self, optimizer: Any, scheduler: Any, all_reduce_sum: AllReduceSum) -> StepResult:
        """Take one update from the gradients the backward passes left (through Lightning's ``optimizer``, so its
        hooks fire); the divergence guard's check comes before any weight changes."""

    @abstractmethod
    def trained_tensors(self, policy: nn.Module) -> dict[str, torch.Tensor]:
        """The tensors an update changes, whole (FSDP shards gathered), named as an engine holds them."""

    @abstractmethod
    def changed_numel(self, policy: nn.Module) -> int:
        """Elements an update changes (global shapes, nothing gathered): what a dense sync would send."""

    def full_state(self, policy: nn.Module, dtype: torch.dtype | None = None) -> Mapping[str, torch.Tensor]:
        """Every tensor of the policy as an engine holds it, gathered lazily (a full sync, an export)."""
        return GatheredState(policy.state_dict(), dtype=dtype)

    # ------------------------------------------------------------------ step control (makes_proposals)
    @property
    def applied_updates(self) -> int:
        """Updates applied so far (vetoed, rejected and skipped ones not counted; restored on resume): the update
        index a step controller's budget schedule is at, minus one."""
        raise NotImplementedError(f"{type(self).__name__} makes no proposals: it counts no applied updates")

    def applied(self, proposal: Any) -> bool:
        """Whether ``proposal`` became the last update taken and changed the weights (False when it was vetoed,
        rejected or skipped, or is not the last one)."""
        raise NotImplementedError(f"{type(self).__name__} makes no proposals")

    def logit_tangent(
        self,
        policy: nn.Module,
        proposal: Any,
        model_inputs: Mapping[str, torch.Tensor],
        mode: ProbeMode = "jvp",
        fd_step: float = 1e-3,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(z, dz/dα)``: the policy's logits (``(B, T, V)``) with the weights as they are (``α = 0``) and their rate
        of change along ``proposal`` at ``α = 0``, by forward-mode AD (``mode="jvp"``) or a central difference of
        step ``fd_step`` (``"fd"``). The weights are left exactly as they were (algorithm.md §6)."""
        raise NotImplementedError(f"{type(self).__name__} makes no proposals to probe")

    def logits_at(
        self, policy: nn.Module, proposal: Any, model_inputs: Mapping[str, torch.Tensor], alpha: float
    ) -> torch.Tensor:
        """The policy's logits (``(B, T, V)``) as they would be after ``proposal`` is applied at multiplier
        ``alpha``, computed without applying it: the weights are left exactly as they were. A step controller's line
        search measures the KL a step really takes with it (algorithm.md §6)."""
        raise NotImplementedError(f"{type(self).__name__} makes no proposals to measure")

    @property
    def last_gain(self) -> float | None:
        """The first-order gain of the last update: ``−⟨∇L, Δθ⟩``, the decrease of the update's loss ``L`` that the
        step taken (``Δθ``, α included) predicts to first order, over all ranks; 0 when the update was not applied.
        None: this method does not measure it. Every built-in method does, each exactly: the dense ones from their
        gradients and deltas (LoRA's in adapter space), LoGRA from its sketches (``α·⟨S, U⟩ = ⟨G, α·U P⟩``)."""
        return None

    def keep_last_step(self) -> bool:
        """Keep every applied step until the next update, so that the next update measures that step's gain on its
        own loss (:attr:`next_batch_gain`). Returns whether this method can; the base class cannot. The kept step is
        a diagnostic's, outside the training state that :meth:`memory` counts: a dense method keeps a copy of every
        trained tensor (LoRA: of its adapters), LoGRA its merged factors (``d_out × r`` per matrix)."""
        return False

    @property
    def next_batch_gain(self) -> float | None:
        """``−⟨∇L', Δθ⟩``: the first-order gain of the last applied step ``Δθ`` (α included) on the loss ``L'`` of
        the update after it, its gradient taken at the weights that step produced, over all ranks. Where
        :attr:`last_gain` says how well a step fits the batch it came from, this says how much of it carries to a
        batch it has not seen. None: not measured for this update (the method keeps no step, no step was applied
        yet, the update never reached its measure, or — LoGRA — the basis changed since the kept step)."""
        return None

    def metrics(self) -> dict[str, float]:
        """Scalars of the last update (``guard/relative_update`` at least)."""
        return {}

    def memory(self, policy: nn.Module) -> MemoryReport:
        """Bytes of training state by kind."""
        return memory_report(policy)

    def plan_memory(self, shapes: PlanShapes) -> MemoryReport:
        """The per-rank training state this method, with its settings, would hold for a model of these shapes
        (``logra-pl plan``), by the kinds :meth:`memory` measures on a live run."""
        raise NotImplementedError(f"{type(self).__name__} has no memory plan")

    @classmethod
    def plan_options(cls, parser: argparse.ArgumentParser) -> None:
        """Add this method's own options to ``logra-pl plan`` (``--<name>-...``, stored as ``<name>_...``), which
        :meth:`planned` reads from :attr:`PlanSettings.options`. Default: none."""
        return None

    @classmethod
    def planned(cls, settings: PlanSettings) -> UpdateMethod:
        """The method as ``logra-pl plan`` counts it, from the plan's shared settings and this method's own options.
        Default: the method with its defaults."""
        return cls()

    # ------------------------------------------------------------------------------------------ exports
    @classmethod
    def exported_tensors(cls, tensors: dict[str, torch.Tensor], hparams: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The policy's tensors as a plain model holds them, from a checkpoint's (``logra-pl export``; ``hparams``:
        the module's saved hyper-parameters). Default: as they are."""
        return tensors

    # ------------------------------------------------------------------------------------------ console
    @abstractmethod
    def trained_parameter_count(self, policy: nn.Module) -> int:
        """Parameters the updates change (the model summary's "trained" count)."""

    @abstractmethod
    def report(self, policy: nn.Module, targets: Sequence[str]) -> str:
        """One line on what this method trains and the state it holds for it."""


def _rebuilt_method(cls: type[UpdateMethod], init_args: Mapping[str, Any]) -> UpdateMethod:
    """A method built again from its settings (what :meth:`UpdateMethod.__reduce__` pickles)."""
    return cls(**init_args)


def count_text(n: int) -> str:
    """``1.2 M``-style parameter counts for console lines."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return str(n)


def bytes_text(n: int) -> str:
    """``3.0 MiB``-style byte counts for console lines."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def relative(update_sq: float, weight_sq: float) -> float:
    """``‖ΔW‖/‖W‖`` from squared norms (inf for a non-zero update of zero weights)."""
    return math.sqrt(update_sq / weight_sq) if weight_sq > 0 else (0.0 if update_sq == 0 else math.inf)
