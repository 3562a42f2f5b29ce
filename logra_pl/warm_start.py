"""Supervised warm start: teach a tiny policy the answer format before RL, cached by its settings.

A random tiny model never samples a correct answer, so RL has nothing to reinforce. A short supervised
phase on the task's answers (answer tokens only, eval questions excluded) brings the sampled reward to
~0.2, where RL has signal. The result is saved as a ``save_pretrained`` folder keyed by a hash of every
input, so a second run loads it instead of training again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import reasoning_gym
import torch
from tqdm.auto import tqdm

from logra_pl.errors import ConfigError, check_int, check_range
from logra_pl.models.load import load_policy, resolve_source
from logra_pl.models.tiny import cache_root

log = logging.getLogger(__name__)


def answer_batch(
    tokenizer: Any, items: Iterable[Mapping[str, Any]], system_prompt: str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chat prompts + gold answers, left-padded: ``(input_ids, attention_mask, labels)`` with loss on answers only."""
    rows, labels = [], []
    for item in items:
        messages = [] if not system_prompt else [{"role": "system", "content": system_prompt}]
        messages.append({"role": "user", "content": item["question"]})
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        p_ids = tokenizer(prompt, add_special_tokens=False).input_ids
        a_ids = tokenizer(str(item["answer"]) + tokenizer.eos_token, add_special_tokens=False).input_ids
        rows.append(p_ids + a_ids)
        labels.append([-100] * len(p_ids) + a_ids)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    lab = torch.tensor([[-100] * (width - len(r)) + r for r in labels])
    return ids, mask, lab


@dataclass
class WarmStart:
    """Settings of the supervised warm start.

    Arguments:
        task: reasoning-gym task to learn the answers of.
        task_config: that task's generator settings (match the RL data's).
        steps: AdamW updates.
        batch_size: problems per update.
        lr: AdamW learning rate (all parameters trained).
        seed: problem and initialisation seed.
    """

    task: str = "chain_sum"
    task_config: dict[str, Any] = field(default_factory=dict)
    steps: int = 450
    batch_size: int = 64
    lr: float = 2e-3
    seed: int = 1234

    def __post_init__(self) -> None:
        from reasoning_gym.factory import DATASETS

        if self.task not in DATASETS:
            raise ConfigError(f"unknown warm_start.task {self.task!r}: use a reasoning-gym task, e.g. 'chain_sum'")
        check_int("warm_start.steps", self.steps, 0)
        check_int("warm_start.batch_size", self.batch_size, 1)
        check_range("warm_start.lr", self.lr, 0.0, low_open=True)
        check_int("warm_start.seed", self.seed, 0)


def warm_start_key(source: str, settings: WarmStart, exclude: Iterable[str], system_prompt: str | None) -> str:
    """16 hex digits over the base policy's location, the settings, the excluded questions and system prompt."""
    blob = json.dumps(
        {
            "source": resolve_source(source).location,
            "settings": dataclasses.asdict(settings),
            "exclude": hashlib.sha256("\n".join(sorted(exclude)).encode()).hexdigest(),
            "system": system_prompt,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def warm_start_policy(
    source: str,
    settings: WarmStart,
    exclude: Iterable[str] = (),
    system_prompt: str | None = None,
    cache_dir: str | Path | None = None,
) -> Path:
    """Return the folder of ``source`` after the warm start, training it only if no cached copy exists."""
    exclude = set(exclude)
    root = Path(cache_dir) if cache_dir is not None else cache_root() / "warm"
    target = root / f"warm-{warm_start_key(source, settings, exclude, system_prompt)}"
    if (target / "config.json").is_file():
        log.info("warm start: using cached %s", target)
        return target
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    log.info(
        "warm start: %d supervised steps on %r answers, so the policy samples correct answers RL can reinforce "
        "(once; cached in %s for the next runs)",
        settings.steps,
        settings.task,
        target,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        model, tokenizer = load_policy(source)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)
        pool = [
            it
            for it in reasoning_gym.create_dataset(
                settings.task, size=max(4 * settings.batch_size, 4096), seed=settings.seed, **settings.task_config
            )
            if it["question"] not in exclude
        ]
        if len(pool) < settings.batch_size:
            raise ValueError(f"warm start: only {len(pool)} problems of {settings.task!r} remain after excluding eval")
        gen = torch.Generator().manual_seed(settings.seed)
        loss = torch.tensor(float("nan"))
        bar = tqdm(range(settings.steps), desc="warm start", unit="step", disable=not log.isEnabledFor(logging.INFO))
        for _ in bar:
            pick = torch.randint(0, len(pool), (settings.batch_size,), generator=gen).tolist()
            ids, mask, labels = answer_batch(tokenizer, (pool[i] for i in pick), system_prompt)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss = loss.detach()
            bar.set_postfix(answer_loss=f"{float(loss):.3f}", refresh=False)
        bar.close()
    tmp = Path(tempfile.mkdtemp(prefix=".warm-", dir=root))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "logra_warm_start.json").write_text(
            json.dumps(
                {
                    "source": source,
                    **dataclasses.asdict(settings),
                    "final_loss": float(loss),
                    "seconds": time.perf_counter() - start,
                },
                indent=2,
            )
        )
        try:
            tmp.rename(target)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("warm start done in %.1f s (answer loss %.4f): %s", time.perf_counter() - start, float(loss), target)
    return target
