"""The item schema: make_item / validate_item / prompt_key / item_task, and reasoning-gym items that follow it."""

from __future__ import annotations

import hashlib

import pytest
import reasoning_gym

from logra_pl.data import ReasoningGymDataModule, item_task, make_item, prompt_key, validate_item
from logra_pl.data.reasoning_gym import _OVERDRAW, _task_seed
from logra_pl.errors import ConfigError

SMALL = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


def test_make_item_copies_and_validates() -> None:
    source = [dict(CHAT[0]), {"role": "user", "content": "What is 2 + 2?", "name": "ignored"}]
    item = make_item(source, "4", "arith", "arith/0", {"level": 1}, question="What is 2 + 2?")
    assert item == {
        "messages": CHAT,
        "answer": "4",
        "task": "arith",
        "id": "arith/0",
        "metadata": {"level": 1},
        "question": "What is 2 + 2?",
    }
    source[1]["content"] = "changed"
    assert item["messages"][1]["content"] == "What is 2 + 2?"  # a copy, not the caller's dicts
    assert make_item(CHAT[1:], "4", "arith", "arith/1")["metadata"] == {}
    assert prompt_key(item) == "What is 2 + 2?"  # the first *user* message, after the system one


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"answer": 4}, r"item 'a/0': 'answer' must be a str, got int 4"),
        ({"task": ""}, r"'task' must be a non-empty string"),
        ({"id": None}, r"item: 'id' must be a str, got NoneType"),
        ({"metadata": []}, r"'metadata' must be a dict, got list"),
        ({"messages": "hi"}, r"'messages' must be a non-empty list"),
        ({"messages": []}, r"'messages' must be a non-empty list"),
        ({"messages": [{"role": "user"}]}, r"'messages'\[0\] must be a dict with 'role' and 'content'"),
        ({"messages": [{"role": "robot", "content": "x"}]}, r"'messages'\[0\] has role 'robot'"),
        ({"messages": [CHAT[1], CHAT[0]]}, r"'messages'\[1\] is a system message; only the first"),
        ({"messages": [{"role": "user", "content": 3}]}, r"'messages'\[0\]\['content'\] must be a str, got int"),
        ({"messages": CHAT[:1]}, r"'messages' has no user message \(roles: \['system'\]\)"),
    ],
)
def test_validate_item_names_the_bad_key(change: dict, message: str) -> None:
    item = {"messages": CHAT, "answer": "4", "task": "a", "id": "a/0", "metadata": {}, **change}
    with pytest.raises(ConfigError, match=message):
        validate_item(item)


def test_validate_item_missing_keys_and_non_dicts() -> None:
    with pytest.raises(ConfigError, match=r"item 'x/1' is missing \['answer', 'task'\] \(it has keys"):
        validate_item({"messages": CHAT, "id": "x/1", "metadata": {}})
    with pytest.raises(ConfigError, match="an item must be a dict"):
        validate_item([("answer", "4")])
    with pytest.raises(ConfigError, match="no user message"):
        prompt_key({"messages": CHAT[:1]})


def _direct_draw(task: str, want: int, split: str, seed: int, exclude: set[str], **config) -> list[dict]:
    """What ReasoningGymDataModule draws, straight from reasoning_gym.create_dataset (dedup, eval excluded)."""
    out, seen = [], set(exclude)
    for entry in reasoning_gym.create_dataset(
        task, size=want * _OVERDRAW, seed=_task_seed(seed, task, split), **config
    ):
        if entry["question"] not in seen:
            seen.add(entry["question"])
            out.append(entry)
        if len(out) == want:
            break
    return out


@pytest.mark.parametrize("system_prompt", [None, "simple"])
def test_reasoning_gym_items_follow_the_schema_and_keep_their_entries(system_prompt: str | None) -> None:
    dm = ReasoningGymDataModule(
        {"chain_sum": {"config": SMALL}},
        train_size=60,
        eval_size=12,
        prompts_per_step=8,
        seed=5,
        system_prompt=system_prompt,
    )
    dm.setup()
    evals = _direct_draw("chain_sum", 12, "eval", 5, set(), **SMALL)
    trains = _direct_draw("chain_sum", 60, "train", 5, {e["question"] for e in evals}, **SMALL)
    system = (
        [] if system_prompt is None else [{"role": "system", "content": reasoning_gym.utils.SYSTEM_PROMPTS["simple"]}]
    )
    for items, entries in ((dm.eval_items, evals), (dm.train_items, trains)):
        assert len(items) == len(entries)
        for item, entry in zip(items, entries, strict=True):
            validate_item(item)
            # reasoning-gym's own keys are untouched (its scorers read the whole entry), messages as before
            assert {k: item[k] for k in entry} == entry
            assert isinstance(entry["answer"], str)  # chain_sum answers are strings: nothing converted
            assert item["messages"] == [*system, {"role": "user", "content": entry["question"]}]
            assert item["task"] == "chain_sum"
            assert item["id"] == f"chain_sum/{entry['metadata']['source_index']}"
            assert prompt_key(item) == entry["question"]
        assert len({it["id"] for it in items}) == len(items)
    assert dm.eval_questions == {e["question"] for e in evals}


def test_reasoning_gym_tasks_without_gold_string_or_index() -> None:
    dm = ReasoningGymDataModule(["propositional_logic", "kakurasu"], train_size=2, eval_size=0, prompts_per_step=1)
    entry = reasoning_gym.create_dataset("propositional_logic", size=1, seed=0)[0]
    assert entry["answer"] is None  # this task has no single gold answer: its scorer reads metadata
    item = dm.to_item(entry)
    validate_item(item)
    assert item["answer"] == "" and item["metadata"]["original_answer"] is None
    assert (
        item["question"] == entry["question"]
        and item["id"] == f"propositional_logic/{entry['metadata']['source_index']}"
    )
    score = reasoning_gym.get_score_answer_fn("propositional_logic")
    for response in (entry["metadata"]["example_answer"], "P", "nonsense"):
        assert score(response, item) == score(response, entry)  # the scorer sees no difference
    assert score(entry["metadata"]["example_answer"], item) == 1.0

    board = reasoning_gym.create_dataset("kakurasu", size=1, seed=0)[0]
    assert "source_index" not in board["metadata"]
    assert dm.to_item(board)["id"] == f"kakurasu/{board['metadata']['source_idx']}"
    del board["metadata"]["source_idx"]
    digest = hashlib.blake2b(board["question"].encode(), digest_size=8).hexdigest()
    assert dm.to_item(board)["id"] == f"kakurasu/{digest}"


@pytest.mark.parametrize(
    ("item", "task"),
    [
        ({"task": "math500", "metadata": {"source_dataset": "chain_sum"}}, "math500"),  # the schema's key first
        ({"metadata": {"source_dataset": "chain_sum"}}, "chain_sum"),  # a reasoning-gym entry
        ({"task": "", "metadata": {}}, "all"),
        ({"answer": "4"}, "all"),
        ({"metadata": "not a dict"}, "all"),
        ("not an item", "all"),  # a verifier may be called with anything: its log line still has a label
        (None, "all"),
    ],
)
def test_item_task(item: object, task: str) -> None:
    """One label for an item's task, used by per-task metrics (module) and by the scoring log lines (bounded)."""
    assert item_task(item) == task
