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
from collections.abc import Iterable, Mapping, Sequence
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
    ids, mask, lab = pad_left(rows, labels, tokenizer.pad_token_id)
    return ids, mask, lab


def conversation_labels(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]] | None = None
) -> tuple[list[int], list[int]]:
    """A conversation's token ids and labels: each assistant message's tokens as the policy samples them (its
    content and the template's end-of-turn token) are labels, everything else -100.

    The text is cut where a multi-turn rollout cuts it (:func:`logra_pl.envs.episodes.run_episodes`): every segment
    the policy did not write — the first prompt, then what the template adds after a reply up to the next generation
    prompt — is tokenised on its own, and so is each reply. A supervised example therefore has the very token
    boundaries the policy later samples and is trained on.

    Raises ``ValueError`` when a message after the first is not appended by the template as a continuation (the
    template rewrites earlier turns), or the conversation does not end with an assistant message.
    """
    from logra_pl.envs.episodes import render  # the same rendering as rollouts (envs imports no warm start)

    if not messages or messages[-1]["role"] != "assistant":
        raise ValueError("a demonstration must end with the policy's (assistant) reply")
    eos = tokenizer.eos_token
    ids: list[int] = []
    labels: list[int] = []
    text = ""
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(tokenizer, messages[:k], tools, prompt=True)
        full = render(tokenizer, messages[: k + 1], tools, prompt=False)
        if not prompt.startswith(text) or not full.startswith(prompt):
            raise ValueError("the chat template does not render this conversation turn by turn (it rewrites a turn)")
        reply = full[len(prompt) :]
        end = reply.find(eos) + len(eos) if eos and eos in reply else len(reply)
        context = tokenizer(prompt[len(text) :], add_special_tokens=False).input_ids
        sampled = tokenizer(reply[:end], add_special_tokens=False).input_ids
        ids += context + sampled
        labels += [-100] * len(context) + sampled
        text = prompt + reply[:end]
    return ids, labels


def pad_left(rows: Sequence[list[int]], labels: Sequence[list[int]], pad: int) -> tuple[torch.Tensor, ...]:
    """Rows of ids and their labels, left-padded: ``(input_ids, attention_mask, labels)``."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + list(r) for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    lab = torch.tensor([[-100] * (width - len(r)) + list(r) for r in labels])
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
        demonstrations: with a multi-turn environment (``model.env``), the share of problems taught by the
            environment's ``demonstration(item)`` (a whole conversation: a tool call, its result, the answer), the
            rest by the answer alone after the environment's first messages; 0 (default) teaches answers only.
            With an environment every example starts as its conversations do (its system message included).
    """

    task: str = "chain_sum"
    task_config: dict[str, Any] = field(default_factory=dict)
    steps: int = 450
    batch_size: int = 64
    lr: float = 2e-3
    seed: int = 1234
    demonstrations: float = 0.0

    def __post_init__(self) -> None:
        from reasoning_gym.factory import DATASETS

        if self.task not in DATASETS:
            raise ConfigError(f"unknown warm_start.task {self.task!r}: use a reasoning-gym task, e.g. 'chain_sum'")
        check_int("warm_start.steps", self.steps, 0)
        check_int("warm_start.batch_size", self.batch_size, 1)
        check_range("warm_start.lr", self.lr, 0.0, low_open=True)
        check_int("warm_start.seed", self.seed, 0)
        check_range("warm_start.demonstrations", self.demonstrations, 0.0, 1.0)


def _task_items(settings: WarmStart, system_prompt: str | None, exclude: set[str], size: int) -> list[dict[str, Any]]:
    """The warm start's problems as schema items (what an environment's ``start`` and ``demonstration`` read)."""
    from logra_pl.data.schema import make_item

    head = [{"role": "system", "content": system_prompt}] if system_prompt else []
    data = reasoning_gym.create_dataset(settings.task, size=size, seed=settings.seed, **settings.task_config)
    return [
        make_item(
            [*head, {"role": "user", "content": it["question"]}],
            str(it["answer"]),
            settings.task,
            f"warm-{i}",
            it.get("metadata"),
            question=it["question"],
        )
        for i, it in enumerate(data)
        if it["question"] not in exclude
    ]


def example_conversation(env: Any, item: Mapping[str, Any], demonstrate: bool) -> list[dict[str, Any]]:
    """One warm-start conversation: the environment's demonstration of ``item`` (when ``demonstrate`` and it has
    one), else its first messages followed by the gold answer as the policy's reply."""
    if demonstrate:
        shown = env.demonstration(item)
        if shown is not None:
            return [dict(m) for m in shown]
    return [*(dict(m) for m in env.start(item)), {"role": "assistant", "content": str(item["answer"])}]


def _env_fingerprint(env: Any, settings: WarmStart, system_prompt: str | None) -> str:
    """What the environment makes of the first problems (first messages, demonstrations, tool schemas): its part
    of the cache key, so a changed system message or call format trains anew."""
    from logra_pl.envs.base import tool_schemas

    items = _task_items(settings, system_prompt, set(), 4)
    shown = [example_conversation(env, it, True) for it in items] + [
        example_conversation(env, it, False) for it in items
    ]
    blob = json.dumps({"env": type(env).__qualname__, "conversations": shown, "tools": tool_schemas(env)}, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def warm_start_key(
    source: str, settings: WarmStart, exclude: Iterable[str], system_prompt: str | None, env: Any | None = None
) -> str:
    """16 hex digits over the base policy's location, the settings, the excluded questions and system prompt (and
    the environment's conversations, when there is one)."""
    fields = dataclasses.asdict(settings)
    if not fields["demonstrations"]:
        del fields["demonstrations"]  # the default: keys (and cached folders) of runs before the field existed hold
    payload = {
        "source": resolve_source(source).location,
        "settings": fields,
        "exclude": hashlib.sha256("\n".join(sorted(exclude)).encode()).hexdigest(),
        "system": system_prompt,
    }
    if env is not None:
        payload["env"] = _env_fingerprint(env, settings, system_prompt)
    blob = json.dumps(payload, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def check_demonstrations(settings: WarmStart, env: Any | None) -> None:
    """``demonstrations > 0`` needs an environment that can demonstrate: a clear error otherwise."""
    if not settings.demonstrations:
        return
    if env is None:
        raise ConfigError(
            f"warm_start.demonstrations={settings.demonstrations} needs a multi-turn environment (model.env): "
            "its demonstration(item) conversations are what is taught; set it to 0 for answers only"
        )
    if not callable(getattr(env, "demonstration", None)):
        raise ConfigError(
            f"warm_start.demonstrations={settings.demonstrations}: {type(env).__name__} has no "
            "demonstration(item) method; give it one (see logra_pl.envs.base.Environment) or set it to 0"
        )


def warm_start_policy(
    source: str,
    settings: WarmStart,
    exclude: Iterable[str] = (),
    system_prompt: str | None = None,
    cache_dir: str | Path | None = None,
    env: Any | None = None,
) -> Path:
    """Return the folder of ``source`` after the warm start, training it only if no cached copy exists.

    With ``env`` (a multi-turn environment) every example is a conversation as the environment starts it, and a
    share ``settings.demonstrations`` of them is the environment's demonstration (:func:`example_conversation`),
    trained on the assistant tokens only (:func:`conversation_labels`)."""
    check_demonstrations(settings, env)
    exclude = set(exclude)
    root = Path(cache_dir) if cache_dir is not None else cache_root() / "warm"
    target = root / f"warm-{warm_start_key(source, settings, exclude, system_prompt, env)}"
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
        size = max(4 * settings.batch_size, 4096)
        if env is None:
            pool = [
                it
                for it in reasoning_gym.create_dataset(
                    settings.task, size=size, seed=settings.seed, **settings.task_config
                )
                if it["question"] not in exclude
            ]
        else:
            from logra_pl.envs.base import tool_schemas

            pool, tools = _task_items(settings, system_prompt, exclude, size), tool_schemas(env)
        if len(pool) < settings.batch_size:
            raise ValueError(f"warm start: only {len(pool)} problems of {settings.task!r} remain after excluding eval")
        gen = torch.Generator().manual_seed(settings.seed)
        loss = torch.tensor(float("nan"))
        bar = tqdm(range(settings.steps), desc="warm start", unit="step", disable=not log.isEnabledFor(logging.INFO))
        for _ in bar:
            pick = torch.randint(0, len(pool), (settings.batch_size,), generator=gen).tolist()
            if env is None:
                ids, mask, labels = answer_batch(tokenizer, (pool[i] for i in pick), system_prompt)
            else:
                shown = (torch.rand(len(pick), generator=gen) < settings.demonstrations).tolist()
                pairs = [
                    conversation_labels(tokenizer, example_conversation(env, pool[i], d), tools)
                    for i, d in zip(pick, shown, strict=True)
                ]
                ids, mask, labels = pad_left([p[0] for p in pairs], [p[1] for p in pairs], tokenizer.pad_token_id)
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
