"""Multi-turn rollouts (logra_pl.envs.episodes) on the real HF engine and the tiny model's ChatML tokenizer: which
tokens are the policy's, what the environment inserted, exact log-probs, seeds, budgets."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from logra_pl.envs import Turn, continuation_ids, run_episodes
from logra_pl.models import load_policy
from logra_pl.rollout.base import SamplingConfig
from logra_pl.rollout.hf import HFEngine
from logra_pl.train.logprobs import pack_responses, response_logprobs

QUESTIONS = ["1 + 2 =", "What is 4 - 3 + 5?", "State the final answer: 9 - 9 ="]


class Feedback:
    """A game of ``max_turns`` replies: after reply ``t`` the environment answers ``"hint t: ..."`` as a tool
    message, and ends the conversation after ``end_after`` replies (or when a reply contains ``stop_word``)."""

    def __init__(self, max_turns: int = 3, end_after: int = 3, stop_word: str | None = None) -> None:
        self.max_turns, self.end_after, self.stop_word = max_turns, end_after, stop_word

    def start(self, item: dict) -> list[dict]:
        return list(item["messages"])

    def step(self, item: dict, messages: list[dict]) -> Turn:
        replies = sum(m["role"] == "assistant" for m in messages)
        if replies >= self.end_after or (self.stop_word is not None and self.stop_word in messages[-1]["content"]):
            return Turn(done=True, reward=1.0, info={"replies": float(replies)})
        return Turn(observations=[{"role": "tool", "content": f"hint {replies}: {item['answer']}"}], reward=0.25)


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return load_policy(tiny_model_dir)


def _engine(policy) -> HFEngine:
    """The HF engine on the random tiny policy, which almost never samples ``<|im_end|>``: a third of the vocabulary
    also ends a reply, so replies end within a few tokens and conversations go on (the engine's real stop path)."""
    model, tok = policy
    stops = [tok.eos_token_id, *range(len(tok.all_special_ids) + 3, model.config.vocab_size // 3)]
    return HFEngine(model, stops, tok.pad_token_id)


def _items(n: int = 2) -> list[dict]:
    return [{"messages": [{"role": "user", "content": q}], "answer": str(i)} for i, q in enumerate(QUESTIONS[:n])]


def _runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of equal mask values: ``(value, start, stop)``."""
    out, start = [], 0
    for j in range(1, len(mask) + 1):
        if j == len(mask) or mask[j] != mask[start]:
            out.append((mask[start], start, j))
            start = j
    return out


def test_the_mask_marks_the_sampled_tokens_and_the_inserted_ones_are_the_templates_text(policy) -> None:
    model, tok = policy
    engine = _engine(policy)
    items = _items(2)
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=8, seed=0)
    episodes = run_episodes(engine.generate, tok, Feedback(), items, sampling, prompt_seeds=[11, 12], max_tokens=200)
    rollout = episodes.rollout
    assert len(episodes) == 4 and rollout.prompt_index == [0, 0, 1, 1]
    checked = 0
    for row in range(len(rollout)):
        ids, mask, messages = rollout.response_ids[row], rollout.response_masks[row], episodes.messages[row]
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        observations = [m["content"] for m in messages if m["role"] == "tool"]
        runs = _runs(mask)
        sampled = [(a, b) for v, a, b in runs if v == 1]
        inserted = [(a, b) for v, a, b in runs if v == 0]
        assert mask[0] == 1 and len(sampled) == len(replies) == episodes.turns[row]
        # Each sampled span is one reply as the policy wrote it; each inserted span is, in ChatML written out here,
        # the end of the assistant's turn, the tool message and the next generation prompt.
        for (a, b), reply in zip(sampled, replies, strict=True):
            assert tok.decode(ids[a:b], skip_special_tokens=True) == reply
        for (a, b), obs, (_, end) in zip(inserted, observations, sampled, strict=False):
            ended = ids[end - 1] == tok.eos_token_id
            expected = ("" if ended else "<|im_end|>") + f"\n<|im_start|>tool\n{obs}<|im_end|>\n<|im_start|>assistant\n"
            assert tok.decode(ids[a:b], skip_special_tokens=False) == expected
            checked += 1
        assert all(lp == 0.0 for lp, m in zip(rollout.logprobs[row], mask, strict=True) if m == 0)
        assert rollout.finish_reasons[row] == ("stop" if episodes.turns[row] == 3 and len(replies) == 3 else "length")
    assert checked >= 4  # trajectories went on after a reply (the check above ran)
    # The engine's log-prob of every sampled token is the trainer's, turn after turn (the inserted tokens masked).
    packed = pack_responses(rollout.prompt_ids, rollout.response_ids, tok.pad_token_id, rollout.response_masks)
    with torch.no_grad():
        trainer = response_logprobs(model, packed, 1.0)
    engine_lp = torch.zeros_like(trainer)
    for row, lps in enumerate(rollout.logprobs):
        engine_lp[row, : len(lps)] = torch.tensor(lps)
    assert float(((trainer - engine_lp) * packed.response_mask).abs().max()) < 1e-4
    assert torch.equal(packed.lengths, torch.tensor([float(sum(m)) for m in rollout.response_masks]))
    assert rollout.num_response_tokens == sum(sum(m) for m in rollout.response_masks)
    assert episodes.rewards == [0.25 * (t - 1) + (1.0 if t == 3 else 0.0) for t in episodes.turns]


def test_token_ids_equal_a_full_retokenisation_outside_the_sampled_replies(policy) -> None:
    """Re-tokenising the whole conversation gives the trajectory's ids, except that each sampled reply is
    tokenised canonically there (the policy may sample another split of the same text: the trajectory keeps it)."""
    tok = policy[1]
    engine = _engine(policy)
    items = _items(3)
    episodes = run_episodes(
        engine.generate, tok, Feedback(end_after=2), items, SamplingConfig(n=2, max_new_tokens=6, seed=1), [1, 2, 3]
    )
    rollout = episodes.rollout
    for row in range(len(rollout)):
        ids = rollout.prompt_ids[row] + rollout.response_ids[row]
        mask = [0] * len(rollout.prompt_ids[row]) + rollout.response_masks[row]
        text = tok.decode(ids, skip_special_tokens=False)
        canonical: list[int] = []
        for value, a, b in _runs(mask):
            span = ids[a:b]
            text_of_span = tok.decode(span, skip_special_tokens=False)
            canonical += tok(text_of_span, add_special_tokens=False).input_ids if value else span
        assert tok(text, add_special_tokens=False).input_ids == canonical
        # The conversation as the chat template renders it reads exactly as the trajectory, which ends where the
        # last reply ended (ChatML then closes the turn: "<|im_end|>\n", or "\n" after a sampled <|im_end|>).
        rendered = tok.apply_chat_template(episodes.messages[row], tokenize=False)
        assert rendered.startswith(text) and rendered[len(text) :] in ("\n", "<|im_end|>\n")


def test_a_reply_holding_a_special_token_continues_after_its_content(policy) -> None:
    """A weak policy may sample ``<|im_start|>`` inside a reply: the message reads without it, so the template cannot
    render the sampled text, and the continuation is what the template writes after the message's content — in
    ChatML (written out here) the turn's end unless the policy sampled it, the tool message, the next prompt."""
    tok = policy[1]
    messages = [{"role": "user", "content": "1 + 2 ="}]
    for sampled, closing in (("ab<|im_start|>cd<|im_end|>", ""), ("ab<|im_start|>cd", "<|im_end|>")):
        reply = tok.decode(tok(sampled, add_special_tokens=False).input_ids, skip_special_tokens=True)
        assert reply == "abcd"
        ids = continuation_ids(
            tok, [*messages, {"role": "assistant", "content": reply}], [{"role": "tool", "content": "3"}], sampled
        )
        assert tok.decode(ids) == closing + "\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n"
    # A template that renders the reply itself otherwise (here: drops a reasoning block) is still refused.
    thinking = {"role": "assistant", "content": "<think>x</think>3"}
    dropping = SimpleNamespace(
        all_special_tokens=tok.all_special_tokens,
        apply_chat_template=lambda ms, **kw: tok.apply_chat_template(
            [{**m, "content": m["content"].split("</think>")[-1]} if m is not ms[-1] else m for m in ms], **kw
        ),
    )
    with pytest.raises(ValueError, match="renders the conversation differently"):
        continuation_ids(dropping, [*messages, thinking], [{"role": "user", "content": "more"}], thinking["content"])


def test_a_trajectory_does_not_depend_on_its_batch(policy) -> None:
    tok = policy[1]
    engine = _engine(policy)
    items = _items(3)
    sampling = SamplingConfig(n=2, max_new_tokens=6, seed=5)
    together = run_episodes(engine.generate, tok, Feedback(end_after=3), items, sampling, [7, 8, 9]).rollout
    alone = run_episodes(engine.generate, tok, Feedback(end_after=3), items[1:2], sampling, [8]).rollout
    assert together.response_ids[2:4] == alone.response_ids and together.response_masks[2:4] == alone.response_masks
    # The log-probs agree up to float order (another batch pads the rows to another width).
    for a, b in zip(together.logprobs[2:4], alone.logprobs, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5


def test_the_token_budget_and_the_turn_limit_end_trajectories(policy) -> None:
    tok = policy[1]
    engine = _engine(policy)
    sampling = SamplingConfig(n=2, max_new_tokens=8, seed=2)
    cut = run_episodes(engine.generate, tok, Feedback(max_turns=5, end_after=5), _items(2), sampling, [1, 2], 30)
    assert all(len(r) <= 30 for r in cut.rollout.response_ids)
    assert cut.rollout.finish_reasons == ["length"] * 4
    limited = run_episodes(engine.generate, tok, Feedback(max_turns=2, end_after=9), _items(1), sampling, [4], 400)
    assert limited.turns == [2, 2] and limited.rollout.finish_reasons == ["length", "length"]


def test_bad_environments_and_templates_are_refused_with_the_reason(policy) -> None:
    tok = policy[1]
    engine = _engine(policy)
    with pytest.raises(ValueError, match="needs observations"):
        Turn()
    with pytest.raises(ValueError, match="must be finite"):
        Turn(done=True, reward=float("nan"))
    with pytest.raises(TypeError, match="no step method"):
        run_episodes(engine.generate, tok, SimpleNamespace(max_turns=1, start=list), _items(1), SamplingConfig())
    with pytest.raises(ValueError, match="max_turns must be an integer >= 1"):
        run_episodes(engine.generate, tok, Feedback(max_turns=0), _items(1), SamplingConfig())
    # A template that rewrites past replies (here: upper-cases them) cannot be continued by appending tokens.
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "ab"}]
    shouting = SimpleNamespace(
        apply_chat_template=lambda ms, add_generation_prompt, tokenize: "".join(
            m["content"].upper() if m["role"] == "assistant" else m["content"] for m in ms
        )
    )
    with pytest.raises(ValueError, match="renders the conversation differently"):
        continuation_ids(shouting, messages, [{"role": "tool", "content": "x"}], "ab")


def test_the_kl_probe_reads_the_sampled_positions_only(policy) -> None:
    """PredictedKLControl probes the positions whose tokens the policy sampled: for a multi-turn row, not the tool
    message and template tokens between its replies (independently: the flat index of every masked-in column)."""
    from logra_pl.callbacks import PredictedKLControl

    tok = policy[1]
    items = _items(2)
    episodes = run_episodes(
        _engine(policy).generate, tok, Feedback(), items, SamplingConfig(n=2, max_new_tokens=8, seed=0), [3, 4], 200
    )
    rollout = episodes.rollout
    assert any(0 in m for m in rollout.response_masks)  # some row has inserted tokens
    packed = pack_responses(rollout.prompt_ids, rollout.response_ids, tok.pad_token_id, rollout.response_masks)
    ctx = SimpleNamespace(packed=packed, rollout=rollout, items=items)
    control = PredictedKLControl(probe_responses=4, max_probe_tokens=10_000)
    _, flat = control._probe_inputs(ctx, torch.device("cpu"))
    width = packed.input_ids.shape[1]
    expected = [
        row * width + int(packed.starts[row]) + j
        for row in range(4)
        for j, m in enumerate(rollout.response_masks[row])
        if m == 1
    ]
    assert flat.tolist() == expected
    assert len(expected) == rollout.num_response_tokens < sum(len(r) for r in rollout.response_ids)


class Broken(Feedback):
    """Feedback whose ``step`` fails the way a user's environment can: it raises, builds a Turn with a NaN reward,
    or answers with something that is not a Turn."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def step(self, item: dict, messages: list[dict]):
        if self.how == "raises":
            return {"a": 1}["b"]
        if self.how == "nan":
            return Turn(done=True, reward=float("nan"))
        return {"reward": 1.0}


@pytest.mark.parametrize(
    ("how", "said"),
    [
        ("raises", "Broken.step raised KeyError: 'b'"),
        ("nan", "Broken.step raised ValueError: Turn.reward must be finite, got nan"),
        ("dict", "Broken.step returned dict, not a Turn"),
    ],
)
def test_an_environments_first_error_stops_the_run_in_a_few_lines(policy, how: str, said: str) -> None:
    from logra_pl.errors import EnvironmentFailedError

    tok = policy[1]
    items = [dict(item, id="item-0", task="quiz") for item in _items(1)]
    with pytest.raises(EnvironmentFailedError) as info:
        run_episodes(_engine(policy).generate, tok, Broken(how), items, SamplingConfig())
    text = str(info.value)
    assert text.startswith(f"the environment failed: {said}")
    assert "on item 'item-0' (task 'quiz')" in text and len(text.splitlines()) <= 10
    if how != "dict":
        assert info.value.__cause__ is not None  # the environment's own exception, for LOGRA_PL_TRACEBACK=1
