"""Multi-turn rollouts on any engine: each trajectory's token ids grow turn by turn, never re-tokenised.

For every prompt, ``sampling.n`` trajectories run side by side. A turn is one ``generate`` call for the trajectories
still going (``n = 1`` each, their own seeds): the sampled tokens are appended with their log-probs and a mask of 1;
the reply, decoded, goes to the environment (:class:`~logra_pl.envs.base.Environment`); its observation messages
are rendered by the chat template and only the new text — the end of the assistant's turn, the observations, the
next generation prompt — is tokenised and appended, with a mask of 0 and log-prob 0.0 (the engine did not sample
them; they are never trained on).

Exactness. The log-prob of every sampled token is the engine's, under the distribution it was drawn from, exactly
as in a one-turn rollout: the engine sees the whole trajectory so far as its prompt. Appending ids (instead of
rendering the conversation and tokenising it again each turn) keeps the tokens the policy actually produced: a
reply whose text would tokenise differently on its own (the model may sample ``"1", "2"`` where the tokenizer
writes ``"12"``) stays as sampled, so the trainer scores the very tokens the engine scored. Where the chat template
renders a finished assistant turn exactly as the prompt-plus-sampled text reads (ChatML, Qwen2.5), the trajectory's
text is the rendered conversation, character for character; a template that rewrites an earlier turn (one that
drops a reasoning block from past replies) is refused with an error saying so.

Seeds. Response ``k`` of a prompt with seed ``s`` has the trajectory seed ``(s · 1_000_003 + k) mod 2⁶³`` (as a
one-turn rollout's response has), and its turn ``t`` is sampled with ``(trajectory seed · 1_000_003 + t) mod 2⁶³``:
a trajectory does not depend on the batch, rank or engine it runs on, nor on the other trajectories' lengths.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from logra_pl.envs.base import Message, Turn, check_environment, check_message, tool_schemas
from logra_pl.errors import EnvironmentFailedError
from logra_pl.rewards.failures import Scores
from logra_pl.rollout.base import FinishReason, Rollout, SamplingConfig, derived_seed

Generate = Callable[[list[list[int]], SamplingConfig, list[int] | None], Rollout]


@dataclass
class Episodes:
    """Multi-turn trajectories, one row per trajectory (prompt ``i`` repeated ``n`` times in a row).

    Arguments:
        rollout: the trajectories as a :class:`~logra_pl.rollout.base.Rollout` — ``prompt_ids`` the first prompt,
            ``response_ids`` everything after it, ``response_masks`` 1 at the sampled tokens, ``logprobs`` the
            engine's at those and 0.0 at the inserted ones; ``finish_reasons`` ``"stop"`` for a trajectory the
            environment ended, ``"length"`` for one cut by the token budget or the turn limit.
        messages: each trajectory's conversation, first messages included.
        rewards: each trajectory's environment reward (the sum of its turns' rewards).
        turns: the policy's replies per trajectory.
        info: per trajectory, the environment's counts summed over its turns.
        verify_final: the environment's ``verify_final`` (default True): the verifier scores each final reply.
    """

    rollout: Rollout
    messages: list[list[Message]]
    rewards: list[float]
    turns: list[int]
    info: list[dict[str, float]] = field(default_factory=list)
    verify_final: bool = True

    def __len__(self) -> int:
        return len(self.rollout)

    def final_replies(self) -> list[str]:
        """Each trajectory's last reply of the policy (what a verifier of the final answer scores)."""
        return [next((m["content"] for m in reversed(ms) if m["role"] == "assistant"), "") for ms in self.messages]


@dataclass(eq=False)
class _Trajectory:
    item: int
    prompt: list[int]
    seed: int | None
    messages: list[Message]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    info: dict[str, float] = field(default_factory=dict)
    finish: FinishReason | None = None

    def append(self, ids: Sequence[int], logprobs: Sequence[float] | None) -> None:
        self.ids += list(ids)
        self.mask += [1 if logprobs is not None else 0] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)


def render(tokenizer: Any, messages: Sequence[Message], tools: list[dict[str, Any]] | None, prompt: bool) -> str:
    """The chat template's text of ``messages`` (``prompt``: followed by the assistant's generation prompt)."""
    kwargs = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=prompt, tokenize=False, **kwargs)


def continuation_ids(
    tokenizer: Any,
    messages: Sequence[Message],
    observations: Sequence[Message],
    sampled_text: str,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The token ids to append after a reply: the chat template's text of ``messages + observations`` (with the
    generation prompt) past what the trajectory already reads — the prompt of ``messages[:-1]`` followed by the
    reply's sampled tokens, special tokens included (``sampled_text``).

    A reply that holds a special token before its end (a weak policy samples ``<|im_start|>`` mid-reply) reads, as
    a message, without it (``messages[-1]`` is the decoded text): the template then renders the message's content,
    not the sampled text. The continuation is what the template writes after that content, less the end-of-turn
    token when the policy sampled it itself; the sampled tokens stay as they were.

    Raises ``ValueError`` when the template does not render the conversation as a continuation of the prompt and the
    reply (it rewrites an earlier turn, or the reply): the trajectory would no longer be what the policy saw.
    """
    prompt = render(tokenizer, messages[:-1], tools, prompt=True)
    before = prompt + sampled_text
    after = render(tokenizer, [*messages, *observations], tools, prompt=True)
    if after.startswith(before):
        return tokenizer(after[len(before) :], add_special_tokens=False).input_ids
    content = prompt + messages[-1]["content"]
    if after.startswith(content) and sampled_text != messages[-1]["content"]:  # special tokens left out of the text
        rest = after[len(content) :]
        for special in sorted(tokenizer.all_special_tokens, key=len, reverse=True):
            if special and sampled_text.endswith(special) and rest.startswith(special):
                rest = rest[len(special) :]  # the end-of-turn token the policy sampled is in the trajectory already
                break
        return tokenizer(rest, add_special_tokens=False).input_ids
    pairs = enumerate(zip(before, after, strict=False))
    at = next((i for i, (a, b) in pairs if a != b), min(len(before), len(after)))
    raise ValueError(
        "the chat template renders the conversation differently from the tokens the policy saw (first "
        f"difference at character {at}: {before[at : at + 40]!r} vs {after[at : at + 40]!r}); multi-turn "
        "rollouts append tokens and never re-render a turn, so use a template that keeps earlier turns as "
        "they were (ChatML / Qwen2.5 do)"
    )


def run_episodes(
    generate: Generate,
    tokenizer: Any,
    env: Any,
    items: Sequence[Mapping[str, Any]],
    sampling: SamplingConfig,
    prompt_seeds: Sequence[int] | None = None,
    max_tokens: int = 1024,
) -> Episodes:
    """Run ``sampling.n`` conversations per item with ``env``; see the module docstring.

    Arguments:
        generate: the engine's ``generate(prompts, sampling, prompt_seeds)`` (or the module's, which repairs a
            stale served engine first).
        tokenizer: the policy's tokenizer (its chat template renders the messages).
        env: the :class:`~logra_pl.envs.base.Environment`.
        items: the task items; ``env.start(item)`` gives each conversation's first messages.
        sampling: ``n`` trajectories per item, temperature, top-p; ``max_new_tokens`` bounds each reply.
        prompt_seeds: one seed per item (see the module docstring); None: ``sampling.seed`` for every call.
        max_tokens: the most tokens a trajectory holds after its first prompt, sampled and inserted together; a
            reply gets at most what is left of it (and ``sampling.max_new_tokens``).
    """
    check_environment(env)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if prompt_seeds is not None and len(prompt_seeds) != len(items):
        raise ValueError(f"{len(prompt_seeds)} prompt seeds for {len(items)} items")
    start = time.perf_counter()
    tools = tool_schemas(env)
    trajectories: list[_Trajectory] = []
    for i, item in enumerate(items):
        first = [dict(m) for m in _call(env, "start", item)]
        for message in first:
            check_message(message)
        prompt = tokenizer(render(tokenizer, first, tools, prompt=True), add_special_tokens=False).input_ids
        for k in range(sampling.n):
            seed = None if prompt_seeds is None else derived_seed(prompt_seeds[i], k)
            trajectories.append(_Trajectory(i, prompt, seed, [dict(m) for m in first]))
    index = [i for i in range(len(items)) for _ in range(sampling.n)]
    generate_s = 0.0
    for turn in range(env.max_turns):
        going = [t for t in trajectories if t.finish is None]
        if not going:
            break
        # One call per reply budget, so every trajectory gets exactly min(max_new_tokens, what is left) tokens.
        by_budget: dict[int, list[_Trajectory]] = {}
        for t in going:
            by_budget.setdefault(min(sampling.max_new_tokens, max_tokens - len(t.ids)), []).append(t)
        for budget, part in by_budget.items():
            call = SamplingConfig(
                n=1, temperature=sampling.temperature, top_p=sampling.top_p, max_new_tokens=budget, seed=sampling.seed
            )
            seeds = None if part[0].seed is None else [derived_seed(t.seed, turn) for t in part]  # type: ignore[arg-type]
            t0 = time.perf_counter()
            out = generate([t.prompt + t.ids for t in part], call, seeds)
            generate_s += time.perf_counter() - t0
            for t, ids, logprobs, reason in zip(part, out.response_ids, out.logprobs, out.finish_reasons, strict=True):
                _reply(tokenizer, env, items[t.item], t, ids, logprobs, reason, tools, max_tokens)
    for t in trajectories:
        if t.finish is None:  # still going after its last allowed reply
            t.finish = "length"
    rollout = Rollout(
        prompt_ids=[t.prompt for t in trajectories],
        response_ids=[t.ids for t in trajectories],
        logprobs=[t.logprobs for t in trajectories],
        finish_reasons=[t.finish for t in trajectories],  # type: ignore[misc]
        prompt_index=index,
        timings={"generate_s": generate_s, "episodes_s": time.perf_counter() - start},
        response_masks=[t.mask for t in trajectories],
    )
    return Episodes(
        rollout=rollout,
        messages=[t.messages for t in trajectories],
        rewards=[t.reward for t in trajectories],
        turns=[t.turns for t in trajectories],
        info=[t.info for t in trajectories],
        verify_final=bool(getattr(env, "verify_final", True)),
    )


def _reply(
    tokenizer: Any,
    env: Any,
    item: Mapping[str, Any],
    t: _Trajectory,
    ids: list[int],
    logprobs: list[float],
    reason: FinishReason,
    tools: list[dict[str, Any]] | None,
    max_tokens: int,
) -> None:
    """Append one sampled reply to ``t`` and let the environment answer it."""
    t.append(ids, logprobs)
    t.turns += 1
    text = tokenizer.decode(ids, skip_special_tokens=True)
    t.messages.append({"role": "assistant", "content": text})
    if reason == "length" and not getattr(env, "continue_truncated", False):  # cut mid-reply: it ends here
        t.finish = "length"
        return
    answer = _call(env, "step", item, t.messages)
    t.reward += float(answer.reward)
    for name, value in answer.info.items():
        t.info[name] = t.info.get(name, 0.0) + float(value)
    if answer.done:
        t.finish = "stop"
        return
    sampled_text = tokenizer.decode(ids, skip_special_tokens=False)
    inserted = continuation_ids(tokenizer, t.messages, answer.observations, sampled_text, tools)
    if len(t.ids) + len(inserted) >= max_tokens:  # no room left for another reply
        t.finish = "length"
        return
    t.append(inserted, None)
    t.messages += [dict(m) for m in answer.observations]


def episode_scores(episodes: Episodes, scorer: Any, items: Sequence[Mapping[str, Any]], stop_at: int | None) -> Scores:
    """The rewards of multi-turn trajectories: each one's environment reward (the sum of its turns'), plus — when
    the environment's ``verify_final`` is true (the default) — the verifier's score of its final reply against its
    item, through ``scorer`` (a :class:`~logra_pl.rewards.BoundedVerifier`: time limit, failures, correctness). A
    trajectory whose final reply the verifier failed on has no reward, as a one-turn response would not.

    Without ``verify_final`` the reward is the environment's alone, and a trajectory is correct (pass@k) when it
    reaches ``scorer.correct_threshold``.
    """
    rollout = episodes.rollout
    row_items = [items[i] for i in rollout.prompt_index]
    if not episodes.verify_final:
        rewards = [float(r) for r in episodes.rewards]
        return Scores(rewards, [r >= scorer.correct_threshold for r in rewards], [None] * len(rewards))
    scores = scorer.run(episodes.final_replies(), row_items, stop_at)
    scores.rewards = [v + float(e) for v, e in zip(scores.rewards, episodes.rewards, strict=True)]
    return scores


def episode_metrics(parts: Sequence[Episodes]) -> dict[str, float]:
    """Over the trajectories of ``parts`` (an update's sampling rounds): ``env/turns`` (mean replies per
    trajectory), ``env/truncated`` (share cut by the token budget or the turn limit), ``env/reward`` (mean
    environment reward) and the mean per trajectory of every count the environment reported (``env/tool_calls``,
    ``env/tool_errors``, ...)."""
    turns = [t for p in parts for t in p.turns]
    reasons = [r for p in parts for r in p.rollout.finish_reasons]
    rewards = [r for p in parts for r in p.rewards]
    infos = [i for p in parts for i in p.info]
    n = max(len(turns), 1)
    out = {"env/turns": sum(turns) / n, "env/truncated": sum(r == "length" for r in reasons) / n}
    out["env/reward"] = sum(rewards) / n
    for name in dict.fromkeys(k for info in infos for k in info):
        out[f"env/{name}"] = sum(info.get(name, 0.0) for info in infos) / n
    return out


def _call(env: Any, method: str, item: Mapping[str, Any], *args: Any) -> Any:
    """``env.<method>(item, *args)``; an exception, or a ``step`` answer that is not a :class:`Turn`, stops the run
    with :class:`~logra_pl.errors.EnvironmentFailedError`: a few lines naming the environment, the method, the item
    and the first error (a broken environment would fail every conversation alike; training on fallbacks would
    hide it)."""
    name = f"{type(env).__name__}.{method}"
    try:
        answer = getattr(env, method)(item, *args)
    except Exception as err:
        first = (str(err).strip().splitlines() or [""])[0][:300]
        raise EnvironmentFailedError(
            f"the environment failed: {name} raised {type(err).__name__}: {first}\n"
            f"  on item {item.get('id', '?')!r} (task {item.get('task', '?')!r}); the run stops at an environment's "
            "first error (LOGRA_PL_TRACEBACK=1 prints the traceback)"
        ) from err
    if method == "step" and not isinstance(answer, Turn):
        raise EnvironmentFailedError(
            f"the environment failed: {name} returned {type(answer).__name__}, not a Turn (logra_pl.envs.Turn)\n"
            f"  on item {item.get('id', '?')!r} (task {item.get('task', '?')!r})"
        )
    return answer
