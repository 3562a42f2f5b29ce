"""The supervised warm start on an environment's demonstrations (``warm_start.demonstrations``): which tokens are
taught, that they are the tokens a rollout samples, the calculator's demonstration, and clear refusals."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import torch

from logra_pl.envs import CalculatorEnv, parse_tool_calls
from logra_pl.envs.calculator import calculate
from logra_pl.errors import ConfigError
from logra_pl.models import load_policy
from logra_pl.models.load import resolve_source
from logra_pl.train.warm_start import (
    WarmStart,
    check_demonstrations,
    conversation_labels,
    example_conversation,
    warm_start_key,
    warm_start_policy,
)

CONVERSATION = [
    {"role": "system", "content": "Use the tool."},
    {"role": "user", "content": "What is 3 + 4?"},
    {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "calculate", "arguments": {"expression": "3 + 4"}}\n</tool_call>',
    },
    {"role": "tool", "content": "7"},
    {"role": "assistant", "content": "7"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_policy(tiny_model_dir)[1]


@pytest.fixture()
def env():
    calculator = CalculatorEnv()
    yield calculator
    calculator.close()


def test_labels_are_each_reply_and_its_end_of_turn_token(tokenizer) -> None:
    """Independently: the labelled tokens, run by run, are each assistant message's content followed by the end-of-
    turn token, tokenised alone (as the engine samples it); the ids read as the rendered conversation (ChatML's
    trailing newline after the last turn is not the policy's)."""
    ids, labels = conversation_labels(tokenizer, CONVERSATION)
    assert len(ids) == len(labels)
    runs, current = [], []
    for token, label in zip(ids, labels, strict=True):
        if label != -100:
            assert label == token
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    runs.append(current)
    expected = [
        tokenizer(m["content"] + tokenizer.eos_token, add_special_tokens=False).input_ids
        for m in CONVERSATION
        if m["role"] == "assistant"
    ]
    assert runs == expected
    rendered = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert tokenizer.decode(ids) == rendered.removesuffix("\n")
    assert labels[: len(tokenizer(rendered.split("<|im_start|>assistant\n")[0]).input_ids)] == [-100] * len(
        tokenizer(rendered.split("<|im_start|>assistant\n")[0]).input_ids
    )


def test_a_conversation_must_end_with_the_policys_reply(tokenizer) -> None:
    with pytest.raises(ValueError, match="must end with the policy's"):
        conversation_labels(tokenizer, CONVERSATION[:-1])


def test_the_calculators_demonstration_calls_on_the_items_expression(env) -> None:
    item = {
        "messages": [{"role": "user", "content": "State the final answer: 4 - 1 - 7 ="}],
        "answer": "-4",
        "metadata": {"expression": "4 - 1 - 7"},
    }
    shown = env.demonstration(item)
    assert shown[: len(env.start(item))] == env.start(item)
    call, tool, answer = shown[len(env.start(item)) :]
    calls, errors = parse_tool_calls(call["content"])
    assert not errors and [(c.name, c.arguments) for c in calls] == [("calculate", {"expression": "4 - 1 - 7"})]
    assert tool == {"role": "tool", "content": calculate("4 - 1 - 7")} and tool["content"] == "-4"
    assert answer == {"role": "assistant", "content": "-4"}
    assert env.step(item, shown[:-2]).observations == [tool]  # what the environment itself answers to that call
    assert env.demonstration({**item, "metadata": {}}) is None
    assert env.demonstration({**item, "metadata": {"expression": "__import__('os')"}}) is None
    # Without a demonstration the example is the first messages and the gold answer.
    assert example_conversation(env, {**item, "metadata": {}}, True) == [*env.start(item), answer]


def test_demonstrations_need_an_environment_that_can_demonstrate() -> None:
    with pytest.raises(ValueError, match="demonstrations"):
        WarmStart(demonstrations=1.5)
    with pytest.raises(ConfigError, match=r"needs a multi-turn environment \(model.env\)"):
        check_demonstrations(WarmStart(demonstrations=0.5), None)

    class Mute:
        max_turns = 1

    with pytest.raises(ConfigError, match="Mute has no demonstration"):
        check_demonstrations(WarmStart(demonstrations=0.5), Mute())
    check_demonstrations(WarmStart(), None)


def test_answers_only_keys_are_those_of_before_and_an_environment_changes_them(env) -> None:
    """The default (no environment, demonstrations 0) keeps every cached warm start's key: computed here the way
    it was before the option existed."""
    settings = WarmStart(steps=3)
    old = dataclasses.asdict(settings)
    del old["demonstrations"]
    blob = json.dumps(
        {
            "source": resolve_source("tiny").location,
            "settings": old,
            "exclude": hashlib.sha256(b"").hexdigest(),
            "system": None,
        },
        sort_keys=True,
    )
    assert warm_start_key("tiny", settings, (), None) == hashlib.sha256(blob.encode()).hexdigest()[:16]
    with_env = warm_start_key("tiny", settings, (), None, env)
    assert with_env != warm_start_key("tiny", settings, (), None)
    assert with_env != warm_start_key("tiny", dataclasses.replace(settings, demonstrations=0.5), (), None, env)


def test_a_warm_start_on_demonstrations_trains_and_is_cached(tmp_path: Path, tiny_model_dir, env) -> None:
    settings = WarmStart(steps=2, batch_size=4, demonstrations=1.0)
    folder = warm_start_policy(str(tiny_model_dir), settings, cache_dir=tmp_path, env=env)
    record = json.loads((folder / "logra_warm_start.json").read_text())
    assert record["demonstrations"] == 1.0 and torch.isfinite(torch.tensor(record["final_loss"]))
    assert warm_start_policy(str(tiny_model_dir), settings, cache_dir=tmp_path, env=env) == folder
    assert len(list(tmp_path.iterdir())) == 1
