"""The rollout-engine contract: sample responses with exact log-probs, receive weight updates, and be built from
settings (:class:`EngineSpec`, given an :class:`EngineRequest`; the short names live in
:mod:`logra_pl.rollout.registry`)."""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import torch

from logra_pl.config import Registry
from logra_pl.errors import ConfigError, PolicyDivergedError
from logra_pl.sketch.config import DEFAULT_TARGETS
from logra_pl.sketch.payload import Payload

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingConfig:
    """How responses are sampled.

    Arguments:
        n: responses per prompt.
        temperature: softmax temperature; 0 means greedy.
        top_p: nucleus mass kept (1.0 keeps the full distribution).
        max_new_tokens: response length limit; a response that hits it is truncated.
        seed: seed of this call's sampling generator (the engine derives per-call seeds from it).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"responses per prompt n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class Rollout:
    """Responses of one generate call, one row per response (prompt ``i`` repeated ``n`` times in a row).

    ``logprobs[k][j]`` is the log-probability of ``response_ids[k][j]`` under the distribution the engine
    actually sampled from (after temperature and top-p); for greedy decoding, under the raw logits.

    ``response_masks`` (multi-turn rollouts, :mod:`logra_pl.envs`): ``response_masks[k][j]`` is 1 where the policy
    sampled ``response_ids[k][j]`` and 0 where an environment inserted it (a tool result, an observation, the chat
    template's turn markers); an inserted token's log-prob is 0.0 and it is never trained on. ``None``: every
    response token was sampled (one turn).
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[FinishReason]
    prompt_index: list[int]
    timings: dict[str, float] = field(default_factory=dict)
    response_masks: list[list[int]] | None = None

    @classmethod
    def sampled(
        cls,
        rows: list[list[int]],
        index: list[int],
        responses: list[list[int]],
        logprobs: list[list[float]],
        finish_reasons: list[FinishReason],
        start: float,
    ) -> Rollout:
        """The rollout of one generate call, as every engine builds it: its rows (:func:`expand_prompts`), the
        responses sampled for them with their log-probs and finish reasons, and the call's seconds since ``start``
        (``time.perf_counter``). A non-finite log-prob of a sampled token means the weights are no longer finite:
        :class:`~logra_pl.errors.PolicyDivergedError`."""
        if not all(math.isfinite(lp) for row in logprobs for lp in row):
            raise PolicyDivergedError(
                "the engine reported non-finite log-probs for sampled tokens: the policy weights are no longer finite"
            )
        seconds = time.perf_counter() - start
        return cls(rows, responses, logprobs, finish_reasons, index, timings={"generate_s": seconds})

    def __len__(self) -> int:
        return len(self.response_ids)

    def sampled_mask(self, row: int) -> list[int]:
        """Row ``row``'s mask of sampled tokens (all ones for a one-turn rollout)."""
        if self.response_masks is None:
            return [1] * len(self.response_ids[row])
        return list(self.response_masks[row])

    @property
    def truncated(self) -> list[bool]:
        """Responses that hit ``max_new_tokens`` without an EOS."""
        return [r == "length" for r in self.finish_reasons]

    @property
    def num_response_tokens(self) -> int:
        """Tokens the policy sampled over all responses (an environment's inserted tokens not counted)."""
        if self.response_masks is None:
            return sum(len(r) for r in self.response_ids)
        return sum(sum(m) for m in self.response_masks)


@dataclass(frozen=True)
class SyncReport:
    """What one weight change sent to the engine (returned by ``apply_payload`` and ``load_weights``).

    Arguments:
        bytes: bytes sent, over all receivers (a payload's serialized size, or the tensors' bytes, times the
            receivers; a served engine counts it on every rank, though rank 0 alone sends).
        receivers: engines the change went to.
        seconds: time the change took (0 on a rank that sends nothing).
    """

    bytes: int
    receivers: int = 1
    seconds: float = 0.0


@runtime_checkable
class RolloutEngine(Protocol):
    """What the training module and its callbacks may read of a rollout engine — the whole contract.

    Implementations here: :class:`~logra_pl.rollout.hf.HFEngine` (transformers, in the trainer process),
    :class:`~logra_pl.rollout.vllm.VLLMEngine` and :class:`~logra_pl.rollout.remote.RemoteEngine` (``logra-pl
    serve`` engines over HTTP); engines are built from their settings (:mod:`logra_pl.rollout.registry`).

    Callers may read exactly:

    - ``context_limit``: longest prompt + response the engine accepts (tokens);
    - ``shares_weights``: the engine samples with the trainer's own parameters (nothing to sync);
    - ``receivers``: engines a weight change is sent to (served: one per URL; else 1);
    - the methods below; ``apply_payload`` and ``load_weights`` return a :class:`SyncReport`;
    - optionally ``wire_dtype`` (read with ``getattr``, default None): the dtype the engine stores its weights in;
      full loads are cast to it before they are sent.

    An engine that can hold other weights than the trainer expects (a served one: a lost update, a restart) also
    meets :class:`StaleableEngine`; :meth:`~logra_pl.train.engine_link.EngineLink.generate` then checks and
    repairs it before generating.
    """

    context_limit: int
    shares_weights: bool
    receivers: int

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, prompt_seeds: Sequence[int] | None = None
    ) -> Rollout:
        """Sample ``sampling.n`` responses per tokenized prompt, rows grouped by prompt.

        Every reported log-prob is that of the sampled token under the distribution it was drawn from (after
        temperature and top-p). With ``prompt_seeds`` a prompt's responses depend only on its seed (response ``k``
        uses ``(seed · 1_000_003 + k) mod 2⁶³``), not on the batch, rank or call — see :func:`expand_prompts`.
        Non-finite logits raise :class:`~logra_pl.errors.PolicyDivergedError`.
        """
        ...

    def apply_payload(self, payload: Payload) -> SyncReport:
        """Apply a LoGRA factor payload (``W ← W − F P``) to the engine's weights, exactly as the trainer merged it."""
        ...

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> SyncReport:
        """Overwrite the named tensors (checkpoint names; trainer wrapper prefixes ignored) in the engine."""
        ...

    def place(self, device: torch.device) -> bool:
        """Get ready to serve a trainer on ``device``; True when the engine moved and needs the weights resent."""
        ...

    def close(self) -> None:
        """Release the engine's resources (idempotent)."""
        ...


@runtime_checkable
class StaleableEngine(RolloutEngine, Protocol):
    """An engine that can hold other weights than the trainer expects, and knows when it might.

    Callers may read, besides :class:`RolloutEngine`:

    - ``never_synced``: no weights were sent yet (the first sync of a run, not a repair);
    - ``check_current()``: True when, as far as this process knows, every engine holds the expected weights (no
      network call); False means a full load is due;
    - ``stale_engines()``: the engines (URLs) known to hold other weights.
    """

    never_synced: bool

    def check_current(self) -> bool:
        """True when every engine is known to hold the expected weights (no network call)."""
        ...

    def stale_engines(self) -> list[str]:
        """Names (URLs) of the engines known to hold other weights than expected."""
        ...


def derived_seed(seed: int, index: int) -> int:
    """``(seed · 1_000_003 + index) mod 2⁶³``: the seed of response ``index`` of a prompt with ``seed`` (and of turn
    ``index`` of a multi-turn trajectory with ``seed``) — a function of its two arguments only, so a response does
    not depend on the batch, rank, engine or call it is sampled in."""
    return (int(seed) * 1_000_003 + index) % 2**63


def expand_prompts(
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    context_limit: int,
    prompt_seeds: Sequence[int] | None = None,
) -> tuple[list[list[int]], list[int], list[int] | None]:
    """Check a generate call's prompts and lay out its rows: ``(rows, prompt index per row, seed per row)``.

    Rows repeat each prompt ``n`` times in a row. With ``prompt_seeds``, response ``k`` of a prompt gets the seed
    ``(prompt_seed · 1_000_003 + k) mod 2⁶³``, so a prompt's responses do not depend on the batch, rank or engine
    call it is sampled in; without them the third element is None. Errors name the prompt and the fix.
    """
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: every prompt needs at least one token")
    too_long = [i for i, p in enumerate(prompts) if len(p) + sampling.max_new_tokens > context_limit]
    if too_long:
        i = too_long[0]
        raise ValueError(
            f"prompt {i} has {len(prompts[i])} tokens; with max_new_tokens={sampling.max_new_tokens} it exceeds "
            f"the engine's context of {context_limit}: shorten prompts or lower max_new_tokens"
        )
    if prompt_seeds is not None and len(prompt_seeds) != len(prompts):
        raise ValueError(f"{len(prompt_seeds)} prompt seeds for {len(prompts)} prompts")
    rows = [list(p) for p in prompts for _ in range(sampling.n)]
    index = [i for i in range(len(prompts)) for _ in range(sampling.n)]
    seeds = None
    if prompt_seeds is not None:
        seeds = [derived_seed(s, k) for s in prompt_seeds for k in range(sampling.n)]
    return rows, index, seeds


def cast_floats(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """``tensors`` with floating ones cast to ``dtype`` (None: unchanged) — what a full sync puts on the wire."""
    if dtype is None:
        return dict(tensors)
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}


# ------------------------------------------------------------------------------------------ building an engine
def _same_value(value: Any) -> Any:
    return value


@dataclass
class EngineRequest:
    """What an engine is built from: the loaded policy and the few settings of the run an engine reads.

    Arguments:
        source: the policy source the module loaded (a folder, ``tiny``, ``smollm2``, a ``.gguf`` file, a hub id).
        model: the loaded policy (the trainer's; copy it if the engine needs weights of its own).
        tokenizer: its tokenizer (left padding, a pad token).
        eos: token ids that end a response.
        world_size: training processes.
        share_weights: sample with the trainer's own weights instead of a copy (``rollout.share_weights``: only an
            engine in the trainer process can).
        max_batch: responses per forward batch (``rollout.max_batch``).
        dtype: the trainer's parameter dtype name (``float32``...): an engine's master copy must have it.
        targets: last name parts of the trained matrices (``q_proj``...), as ``model.targets``.
        rank: this process's global rank.
        broadcast: ``broadcast(value)`` returns rank 0's ``value`` on every rank (a collective: call it on all
            ranks or none); the identity in one process.
    """

    source: str
    model: Any
    tokenizer: Any
    eos: list[int]
    world_size: int = 1
    share_weights: bool = False
    max_batch: int = 256
    dtype: str = "float32"
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    rank: int = 0
    broadcast: Callable[[Any], Any] = _same_value


def check_engine_spec(spec: Any, setting: str = "model.engine") -> None:
    """Raise :class:`ConfigError` unless ``spec`` is engine settings (an :class:`EngineSpec`)."""
    if not isinstance(spec, EngineSpec):
        raise ConfigError(
            f"{setting} must be a name, a dotted path or engine settings (a subclass of {__name__}.EngineSpec), "
            f"got {type(spec).__name__}"
        )


class EngineSpec(ABC):
    """An engine's settings and how to build it: what ``model.engine: {class_path, init_args}`` instantiates.

    A spec subclasses this class (usually as a dataclass); its ``__init__`` arguments are the engine's YAML
    settings, and :meth:`build` makes the engine. (A base class rather than a protocol: jsonargparse accepts a
    protocol's implementation only when its ``build`` signature repeats the protocol's annotations exactly.) The
    shipped specs register their short names (``hf``, ``vllm``, ``remote``) with :func:`logra_pl.config.register`.

    Attributes:
        max_training_processes: the most training processes the engine can serve (checked by the CLI before it
            spawns them); None: any number.
    """

    registry: ClassVar[Registry] = Registry(
        "engine",
        "model.engine",
        "logra_pl.rollout.vllm.VLLMSettings",
        lambda spec, setting: check_engine_spec(spec, setting),
    )
    max_training_processes: ClassVar[int | None] = None

    @abstractmethod
    def build(self, request: EngineRequest) -> RolloutEngine:
        """The engine, built for the loaded policy ``request.model``."""


EngineBuilder = Callable[[EngineRequest], RolloutEngine]


@dataclass(frozen=True)
class BuilderSpec(EngineSpec):
    """A builder function ``EngineRequest -> engine`` used as a spec (``model.engine: my_package.build``).

    The function's own ``max_training_processes`` attribute, if it has one, is the spec's.
    """

    builder: EngineBuilder
    name: str

    def build(self, request: EngineRequest) -> RolloutEngine:
        return self.builder(request)

    @property
    def max_training_processes(self) -> int | None:  # the builder's own attribute, if it has one
        return getattr(self.builder, "max_training_processes", None)
