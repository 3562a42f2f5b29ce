"""Getting the policy a run trains: the source (after the cached supervised warm start), loaded with its tokenizer and
stop tokens, with rank 0 first when several processes share a cache on disk.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from logra_pl.models.load import load_policy, resolve_source
from logra_pl.rollout.base import EngineRequest
from logra_pl.runtime.dtypes import dtypes_of
from logra_pl.train.warm_start import WarmStart, warm_start_policy

log = logging.getLogger("logra_pl.module")

DTYPES = dtypes_of("float32", "bfloat16", "float64")
T = TypeVar("T")


def training_source(
    source: str, warm_start: WarmStart | None, resume_from: str | None, datamodule: Any, env: Any | None = None
) -> str:
    """The policy folder to load: ``source`` itself, or its warm-started copy (built and cached on first use; eval
    questions excluded; with a multi-turn ``env``, taught on its conversations). A resumed run skips the warm start:
    the checkpoint holds the weights."""
    if warm_start is not None and resume_from is not None:
        log.info("resuming from %s: the warm start is skipped (the checkpoint holds the weights)", resume_from)
    elif warm_start is not None:
        dm = datamodule
        exclude = dm.eval_questions if dm is not None and hasattr(dm, "eval_questions") else set()
        system = getattr(dm, "system_prompt", None)
        source = str(warm_start_policy(source, warm_start, exclude, system, env=env))
    resolve_source(source)  # builds a tiny model if named; load_policy resolves it again from the cache
    return source


def rank_zero_first(trainer: Any, build: Callable[[], T], check: Callable[[], None] = lambda: None) -> T:
    """``check()`` then ``build()`` on rank 0, then ``build()`` on the other ranks (which read what rank 0 cached).

    An error on rank 0 reaches every rank (the broadcast is also the barrier), so none waits forever.
    (transformers' ``save_pretrained`` writes nothing on non-zero ranks of an initialised process group.)
    """
    if trainer is None or trainer.world_size <= 1:
        check()
        return build()
    error: Exception | None = None
    result: Any = None
    if trainer.global_rank == 0:
        try:
            check()
            result = build()
        except Exception as err:
            error = err
    error = trainer.strategy.broadcast(error, src=0)
    if error is not None:
        raise error
    if trainer.global_rank != 0:
        result = build()
    return result


def load_training_policy(source: str, dtype: str, attn_implementation: str | None) -> tuple[Any, Any, list[int]]:
    """The model, its tokenizer (a chat template is required: prompts are chats) and every stop token id."""
    model, tokenizer = load_policy(source, dtype=DTYPES[dtype], attn_implementation=attn_implementation)
    if tokenizer.chat_template is None:
        raise ValueError(
            f"the tokenizer of policy {source!r} has no chat template: prompts are chats; use an instruct "
            "model or set tokenizer.chat_template in its folder"
        )
    eos = {tokenizer.eos_token_id}
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    eos |= set(gen_eos) if isinstance(gen_eos, list) else ({gen_eos} if gen_eos is not None else set())
    return model, tokenizer, sorted(eos)


def engine_request(
    trainer: Any, source: str, model: Any, tokenizer: Any, eos: list[int], rollout: Any, dtype: str, targets: list[str]
) -> EngineRequest:
    """What an engine spec builds from: the loaded policy and its stop tokens, the run's topology (world size, rank,
    and a broadcast of rank 0's value: served engines name weight versions by one run id), sampling and dtype."""
    world = trainer.world_size if trainer is not None else 1
    rank = int(trainer.global_rank) if trainer is not None else 0
    broadcast = (lambda value: trainer.strategy.broadcast(value, src=0)) if world > 1 else (lambda value: value)
    return EngineRequest(
        source,
        model,
        tokenizer,
        eos,
        world_size=world,
        share_weights=rollout.share_weights,
        max_batch=rollout.max_batch,
        dtype=dtype,
        targets=targets,
        rank=rank,
        broadcast=broadcast,
    )
