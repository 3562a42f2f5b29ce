"""HFPromptDataModule and the paper recipes on real local files (jsonl, parquet, csv, arrow, saved folders)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import datasets
import lightning.pytorch as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from jsonargparse import ArgumentParser

from logra_pl.data import (
    DapoMath7_5kDataModule,
    HFPromptDataModule,
    Math500DataModule,
    ReasoningGymDataModule,
    prompt_key,
    validate_item,
)
from logra_pl.data.hf import is_local, prompt_loader, resolve_path
from logra_pl.errors import ConfigError

# Rows 7 and 19 repeat row 2's problem (with other answers): dedup keeps row 2.
NAMES = ["Ana", "Ben", "Cai", "Dov", "Eli", "Fay", "Gus", "Hal", "Ivy", "Jo"]


def word_problem(i: int) -> dict:
    j = 2 if i in (7, 19) else i
    name = NAMES[j % 10]
    return {"question": f"{name} has {j + 3} apples and buys {2 * j} more. How many apples now?", "answer": 3 * j + 3}


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """datasets writes its Arrow cache of local files under the test's folder, not the user's cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets-cache"))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def word_problems(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "word_problems.jsonl", [word_problem(i) for i in range(40)])


def test_jsonl_items_dedup_first_n_and_held_out_eval(word_problems: Path) -> None:
    dm = HFPromptDataModule(str(word_problems), prompt_column="question", eval_size=6, prompts_per_step=8, seed=3)
    dm.setup()
    pool = dm.train_items + dm.eval_items
    assert len(pool) == 38  # 40 rows, two repeats
    for item in pool:
        validate_item(item)
        assert item["task"] == "word_problems" and item["question"] == prompt_key(item)
    ids = {it["id"] for it in pool}
    assert "word_problems/7" not in ids and "word_problems/19" not in ids and "word_problems/2" in ids
    first = next(it for it in pool if it["id"] == "word_problems/2")
    assert first["answer"] == "9" and first["metadata"] == {"answer": 9, "source_row": 2}  # the first occurrence's
    assert first["messages"] == [{"role": "user", "content": word_problem(2)["question"]}]
    # held out: 6 prompts, disjoint from training, train in source order, the draw is seeded
    assert len(dm.eval_items) == 6 and not dm.eval_questions & {prompt_key(it) for it in dm.train_items}
    rows = [it["metadata"]["source_row"] for it in dm.train_items]
    assert rows == sorted(rows)
    again = HFPromptDataModule(str(word_problems), prompt_column="question", eval_size=6, prompts_per_step=8, seed=3)
    other = HFPromptDataModule(str(word_problems), prompt_column="question", eval_size=6, prompts_per_step=8, seed=4)
    assert again.eval_questions == dm.eval_questions != other.eval_questions

    cut = HFPromptDataModule(
        str(word_problems), prompt_column="question", first_n=10, eval_size=0, prompts_per_step=2, task="wp"
    )
    cut.setup()
    assert [it["id"] for it in cut.train_items] == [f"wp/{i}" for i in (0, 1, 2, 3, 4, 5, 6, 8, 9, 10)]
    assert cut.eval_items == [] and cut.hparams["first_n"] == 10 and cut.hparams["path"] == str(word_problems)
    with pytest.raises(ConfigError, match="eval_size is 0: there is nothing to validate on"):
        cut.val_dataloader()
    system = HFPromptDataModule(
        str(word_problems), prompt_column="question", system_prompt="Be brief.", eval_size=0, prompts_per_step=2
    )
    system.setup()
    assert system.train_items[0]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert all(a["question"] == b["question"] for a, b in zip(system.train_items, cut.train_items, strict=False))


def test_prompt_stream_matches_reasoning_gym_semantics(word_problems: Path) -> None:
    dm = HFPromptDataModule(str(word_problems), prompt_column="question", eval_size=6, prompts_per_step=8, seed=1)
    dm.setup()
    one = [[it["id"] for it in batch] for batch in dm.train_dataloader()]
    assert len(one) == 32 // 8 and all(len(b) == 8 for b in one)
    assert sorted(i for b in one for i in b) == sorted(it["id"] for it in dm.train_items)  # an epoch: each once
    # ReasoningGymDataModule's loader over the same items gives the same stream
    rg = ReasoningGymDataModule(["chain_sum"], prompts_per_step=8, seed=1)
    rg.train_items = dm.train_items
    assert [[it["id"] for it in batch] for batch in rg.train_dataloader()] == one
    # two ranks: rank r takes every 2nd prompt of the same global step batch
    ranks = [
        [[it["id"] for it in b] for b in prompt_loader(dm.train_items, 8, 1, world_size=2, rank=r)] for r in (0, 1)
    ]
    for step, batch in enumerate(one):
        assert ranks[0][step] == batch[0::2] and ranks[1][step] == batch[1::2]
    # resumable: two batches done → the stream continues at the third; the state records the data identity
    resumed = prompt_loader(dm.train_items, 8, 1, batches_done=lambda: 2, position=lambda: 2)
    assert [[it["id"] for it in b] for b in resumed] == one[2:]
    state = resumed.state_dict()
    assert state["batches_done"] == 2 and state["num_prompts"] == 32
    with pytest.raises(ConfigError, match="not divisible by the 3 data-parallel ranks"):
        prompt_loader(dm.train_items, 8, 1, world_size=3)


def dapo_rows() -> list[dict]:
    """DAPO-Math-17k's schema; problems repeat (as in the real set, where each problem appears many times)."""
    order = [0, 1, 0, 2, 1, 3, 0, 4, 2, 5, 6, 3, 7, 8, 9]
    return [
        {
            "data_source": "math_dapo",
            "prompt": [{"content": f"Solve step by step. Problem {p}: compute {p} * {p + 1}.", "role": "user"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": str(p * (p + 1)), "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": f"uid-{row:03d}"},
        }
        for row, p in enumerate(order)
    ]


def math500_rows(n: int = 6) -> list[dict]:
    subjects = ["Algebra", "Geometry", "Precalculus"]
    return [
        {
            "problem": f"Find $x$ if $x + {i} = {2 * i}$.",
            "answer": str(i),
            "solution": f"Subtract {i}: $x = {i}$.",
            "subject": subjects[i % 3],
            "level": 1 + i % 5,
            "unique_id": f"test/{subjects[i % 3].lower()}/{100 + i}.json",
        }
        for i in range(n)
    ]


def test_dapo_recipe_first_unique_prompts_and_math500_eval(tmp_path: Path) -> None:
    pq.write_table(pa.Table.from_pylist(dapo_rows()), tmp_path / "dapo.parquet")
    math500 = write_jsonl(tmp_path / "math500.jsonl", math500_rows())
    dm = DapoMath7_5kDataModule(
        path=str(tmp_path / "dapo.parquet"), first_n=5, eval_path=str(math500), prompts_per_step=4
    )
    dm.setup()
    # the first 5 distinct problems in source order are 0, 1, 2, 3, 4, at rows 0, 1, 3, 5, 7
    assert [it["id"] for it in dm.train_items] == [f"dapo_math/uid-{r:03d}" for r in (0, 1, 3, 5, 7)]
    first = dm.train_items[2]
    assert first["messages"] == dapo_rows()[3]["prompt"] and first["answer"] == "6" and first["task"] == "dapo_math"
    assert first["metadata"]["ability"] == "MATH" and first["metadata"]["extra_info"] == {"index": "uid-003"}
    assert dm.hparams["answer_column"] == "reward_model.ground_truth" and dm.hparams["first_n"] == 5
    assert [it["id"] for it in dm.eval_items] == [f"math500/{r['unique_id']}" for r in math500_rows()]
    ev = dm.eval_items[4]
    assert ev["messages"] == [{"role": "user", "content": "Find $x$ if $x + 4 = 8$."}] and ev["answer"] == "4"
    assert {k: ev["metadata"][k] for k in ("solution", "subject", "level", "unique_id")} == {
        k: math500_rows()[4][k] for k in ("solution", "subject", "level", "unique_id")
    }
    for item in dm.train_items + dm.eval_items:
        validate_item(item)
    assert len(next(iter(dm.val_dataloader()))) == 6

    # an eval problem that is also a training prompt leaves training (the selection itself is not refilled)
    twin = {**math500_rows()[0], "problem": dapo_rows()[1]["prompt"][0]["content"], "unique_id": "x"}
    overlap = [*math500_rows(), twin]
    both = DapoMath7_5kDataModule(
        path=str(tmp_path / "dapo.parquet"),
        first_n=5,
        eval_path=str(write_jsonl(tmp_path / "overlap.jsonl", overlap)),
        prompts_per_step=4,
    )
    both.setup()
    assert [it["id"] for it in both.train_items] == [f"dapo_math/uid-{r:03d}" for r in (0, 3, 5, 7)]
    assert both.removed_for_eval == 1 and not both.eval_questions & {prompt_key(it) for it in both.train_items}


def test_math500_is_evaluation_only(tmp_path: Path) -> None:
    dm = Math500DataModule(path=str(write_jsonl(tmp_path / "m.jsonl", math500_rows(5))), eval_batch_size=2)
    assert [len(b) for b in dm.val_dataloader()] == [2, 2, 1]
    assert [it["id"] for it in dm.eval_items] == [f"math500/{r['unique_id']}" for r in math500_rows(5)]
    assert dm.eval_items[1]["metadata"]["subject"] == "Geometry" and dm.eval_items[1]["task"] == "math500"
    assert dm.eval_questions == {r["problem"] for r in math500_rows(5)}
    with pytest.raises(ConfigError, match="for evaluation only"):
        dm.train_dataloader()


def test_csv_arrow_folders_and_dotted_answers(tmp_path: Path) -> None:
    rows = [{"q": f"What is {i} squared?", "gold": i * i, "meta": {"check": {"value": str(i * i)}}} for i in range(9)]
    with (tmp_path / "sq.csv").open("w") as f:
        f.write("q,gold\n" + "".join(f'"{r["q"]}",{r["gold"]}\n' for r in rows))
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(tmp_path / "sq.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    write_jsonl(tmp_path / "nested.jsonl", rows)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    splits = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows[:2]), "test": datasets.Dataset.from_list(rows)}
    )
    splits.save_to_disk(str(tmp_path / "saved_dict"))
    (tmp_path / "files").mkdir()
    write_jsonl(tmp_path / "files" / "train.jsonl", rows[:3])
    write_jsonl(tmp_path / "files" / "test.jsonl", rows)
    cases = {
        "sq.csv": ("gold", "train"),
        "sq.arrow": ("meta.check.value", "train"),
        "nested.jsonl": ("meta.check.value", "validation"),  # one file: any split name
        "saved": ("gold", "train"),
        "saved_dict": ("gold", "test"),
        "files": ("meta.check.value", "test"),  # a folder of data files: splits from the file names
    }
    for name, (answer_column, split) in cases.items():
        dm = HFPromptDataModule(
            str(tmp_path / name),
            split=split,
            prompt_column="q",
            answer_column=answer_column,
            eval_size=2,
            prompts_per_step=7,
        )
        dm.setup()
        items = sorted(dm.train_items + dm.eval_items, key=lambda it: it["metadata"]["source_row"])
        assert [it["answer"] for it in items] == [str(i * i) for i in range(9)], name
        assert [prompt_key(it) for it in items] == [r["q"] for r in rows], name
    assert dm.task == "files" and HFPromptDataModule(str(tmp_path / "sq.arrow"), prompt_column="q").task == "sq"
    with pytest.raises(ConfigError, match=r"'.*saved_dict' has splits \['train', 'test'\], not 'dev': set split"):
        HFPromptDataModule(str(tmp_path / "saved_dict"), split="dev", prompt_column="q").setup()
    with pytest.raises(ConfigError, match=r"could not load split 'dev' of '.*files': .*dev"):
        HFPromptDataModule(str(tmp_path / "files"), split="dev", prompt_column="q").setup()
    assert is_local("data/train.jsonl") and is_local("./data/train") and is_local("/abs/x") and is_local("a/b/c")
    assert not is_local("HuggingFaceH4/MATH-500") and not is_local("gsm8k")


def test_recipes_from_the_command_line(tmp_path: Path) -> None:
    pq.write_table(pa.Table.from_pylist(dapo_rows()), tmp_path / "dapo.parquet")
    math500 = write_jsonl(tmp_path / "math500.jsonl", math500_rows())
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(pl.LightningDataModule, "data")
    args = [
        "--data.class_path=logra_pl.data.DapoMath7_5kDataModule",
        f"--data.init_args.path={tmp_path / 'dapo.parquet'}",
        f"--data.init_args.eval_path={math500}",
        "--data.init_args.first_n=3",
        "--data.init_args.prompts_per_step=2",
    ]
    dm = parser.instantiate(parser.parse_args(args)).data
    assert isinstance(dm, DapoMath7_5kDataModule) and dm.first_n == 3
    dm.setup()
    assert [it["id"] for it in dm.train_items] == [f"dapo_math/uid-{r:03d}" for r in (0, 1, 3)]
    assert dm.eval_path == str(math500) and len(dm.eval_items) == 6


def test_chat_prompts_ids_and_question_keys(tmp_path: Path) -> None:
    chat = [{"role": "system", "content": "You are exact."}, {"role": "user", "content": "1+1?"}]
    rows = [
        {"messages": chat, "answer": "2", "uid": "a"},
        {"messages": [{"role": "user", "content": "2+2?"}], "answer": "4", "uid": "b"},
    ]
    dm = HFPromptDataModule(
        str(write_jsonl(tmp_path / "chat.jsonl", rows)),
        prompt_column="messages",
        id_column="uid",
        system_prompt="Other.",
        eval_size=0,
        prompts_per_step=2,
    )
    dm.setup()
    assert dm.train_items[0]["messages"] == chat  # a chat with its own system message keeps it
    assert dm.train_items[1]["messages"][0] == {"role": "system", "content": "Other."}
    assert [it["id"] for it in dm.train_items] == ["chat/a", "chat/b"] and "messages" not in dm.train_items[0][
        "metadata"
    ]


def _raises(match: str, tmp_path: Path, rows: list[dict] | None = None, setup: bool = True, **kwargs) -> None:
    path = kwargs.pop("path", None) or str(
        write_jsonl(tmp_path / "bad.jsonl", rows or [word_problem(i) for i in range(4)])
    )
    kwargs = {"prompt_column": "question", "eval_size": 0, "prompts_per_step": 2, **kwargs}
    with pytest.raises(ConfigError, match=match):
        dm = HFPromptDataModule(path, **kwargs)
        if setup:
            dm.setup()


def test_rows_in_messages_count_from_one(tmp_path: Path) -> None:
    """A bad row is named as a reader counts it: row 1 is the first record (in a CSV, the line after the header),
    while ``metadata.source_row`` (and the default id) keep counting from 0."""
    csv = tmp_path / "problems.csv"
    csv.write_text("question,answer\nq1,1\nq2,2\n,3\nq4,4\n")  # the third record has no question
    with pytest.raises(ConfigError, match=r"a prompt must be .*\(row 3 of '.*problems.csv' \(split 'train'\)\), got"):
        HFPromptDataModule(str(csv), prompt_column="question", eval_size=0, prompts_per_step=1).setup()
    rows = write_jsonl(tmp_path / "good.jsonl", [word_problem(i) for i in range(3)])
    good = HFPromptDataModule(str(rows), prompt_column="question", task="t", eval_size=0, prompts_per_step=1)
    good.setup()
    assert [it["metadata"]["source_row"] for it in good.train_items] == [0, 1, 2]
    assert sorted(it["id"] for it in good.train_items) == ["t/0", "t/1", "t/2"]


def test_bad_inputs_have_clear_messages(tmp_path: Path) -> None:
    cols = r"available columns: \['question', 'answer'\]"
    _raises(r"prompt_column='prompt': .* has no column 'prompt'; " + cols, tmp_path, prompt_column="prompt")
    _raises(r"answer_column='solution': .* has no column 'solution'; " + cols, tmp_path, answer_column="solution")
    _raises(r"id_column='uid': .* has no column 'uid'", tmp_path, id_column="uid")
    _raises(
        r"answer_column='answer.value': 'answer' is a int, not a dict, so 'value' cannot",
        tmp_path,
        answer_column="answer.value",
    )
    pq.write_table(pa.Table.from_pylist(dapo_rows()), tmp_path / "dapo.parquet")
    _raises(
        r"no key 'gold' inside 'reward_model' of .*; available there: \['ground_truth', 'style'\]",
        tmp_path,
        path=str(tmp_path / "dapo.parquet"),
        prompt_column="prompt",
        answer_column="reward_model.gold",
    )
    with pytest.raises(
        ConfigError, match=r"answer_column='meta.a.b': no key 'b' inside 'meta.a' \(row 1\); available "
    ):
        resolve_path({"question": "q", "meta": {"a": {"c": "2"}}}, "meta.a.b", "answer_column", "row 1")
    ragged = [{"question": "q1", "meta": {"a": {"b": "1"}}}, {"question": "q2", "meta": {"a": {"c": "2"}}}]
    # a key that only some rows have fails at the first row without it, naming the row and the keys there
    _raises(
        r"no key 'b' inside 'meta.a' \(row 2 of .*\); available there: \['c'\]",
        tmp_path,
        rows=ragged,
        answer_column="meta.a.b",
    )
    _raises(
        r"the answer must be a string or a number \(row 2 of .*\), got NoneType None",
        tmp_path,
        rows=[{"question": "a", "answer": "1"}, {"question": "b", "answer": None}],
    )
    _raises(
        r"prompt_column='question': a prompt must be a string or a non-empty chat list .*\(row 1 of .*got int 5",
        tmp_path,
        rows=[{"question": 5, "answer": "1"}],
    )
    _raises(
        r"rows 1 and 2 of .* both have id 'bad/x'",
        tmp_path,
        rows=[{"question": "a", "answer": "1", "k": "x"}, {"question": "b", "answer": "2", "k": "x"}],
        id_column="k",
    )
    _raises(r"only 3 training prompts remain .* fewer than prompts_per_step=8", tmp_path, first_n=3, prompts_per_step=8)
    _raises(r"eval_size=4 leaves no training prompts: .* has 4 prompts", tmp_path, eval_size=4)
    _raises(r"no such file or folder", tmp_path, path=str(tmp_path / "missing.parquet"), setup=False)
    _raises(r"no such file or folder", tmp_path, path="./data/train", setup=False)
    _raises(r"data.eval_path='nowhere.jsonl': no such file", tmp_path, eval_path="nowhere.jsonl", setup=False)
    (tmp_path / "notes.txt").write_text("hello")
    _raises(r"unknown file format \.txt; use one of \.parquet", tmp_path, path=str(tmp_path / "notes.txt"), setup=False)
    (tmp_path / "empty.jsonl").write_text("")
    _raises(r"'.*empty.jsonl' holds no rows", tmp_path, path=str(tmp_path / "empty.jsonl"))
    (tmp_path / "header.csv").write_text("question,answer\n")
    _raises(r"'.*header.csv' holds no rows", tmp_path, path=str(tmp_path / "header.csv"))
    pq.write_table(
        pa.table({"question": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), tmp_path / "e.parquet"
    )
    _raises(r"'.*e.parquet' holds no rows", tmp_path, path=str(tmp_path / "e.parquet"))
    datasets.Dataset.from_dict({"question": [], "answer": []}).save_to_disk(str(tmp_path / "empty_saved"))
    _raises(r"'.*empty_saved' holds no rows", tmp_path, path=str(tmp_path / "empty_saved"))
    _raises(r"data.first_n must be an integer >= 1, got 0", tmp_path, first_n=0, setup=False)


OFFLINE_CHILD = """
import time, sys
from logra_pl.data import HFPromptDataModule
from logra_pl.errors import ConfigError
dm = HFPromptDataModule("nobody-here/made-up-math-prompts-xyz", prompt_column="problem")
start = time.perf_counter()
try:
    dm.setup()
except ConfigError as err:
    print(f"{time.perf_counter() - start:.2f}")
    print(err)
    sys.exit(0)
sys.exit("no error")
"""


def test_offline_uncached_hub_id_fails_at_once(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    env.pop("HF_DATASETS_CACHE", None)
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(OFFLINE_CHILD)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    seconds, message = out.stdout.split("\n", 1)
    assert float(seconds) < 5, message  # no retries against an unreachable hub
    assert "'nobody-here/made-up-math-prompts-xyz' is not in the local cache and HF_HUB_OFFLINE=1" in message
    assert f"HF_HOME='{tmp_path / 'hf-home'}'" in message and "HF_DATASETS_CACHE=" in message
    assert "give a local file (.parquet, .jsonl" in message
    assert time.perf_counter() - started < 60
