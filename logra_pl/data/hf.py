"""``HFPromptDataModule``: RL prompts from any Hugging Face dataset or local data file, as schema items.

Rows become items of :mod:`logra_pl.data.schema`: the prompt column (a string, or a chat list of
``{"role", "content"}``) becomes ``messages``, the answer column (a dotted path into nested dicts allowed, e.g.
``reward_model.ground_truth``) becomes ``answer`` (numbers are written as ``str(value)``), and every other column goes
to ``metadata`` with ``source_row`` (the row's index in the split, from 0; error messages count rows from 1, as a
reader of the file does: row 1 is the first record, after a CSV header). Training uses the same seeded, resumable,
rank-split prompt stream as :class:`~logra_pl.data.reasoning_gym.ReasoningGymDataModule` (its ``PromptSampler`` and
``PromptLoader``, in :mod:`logra_pl.data.loaders`).

Selection, in this order: rows in source order → (``dedup``) the first row of each distinct prompt key (the first user
message's content) → (``first_n``) the first ``first_n`` of those → evaluation prompts removed: either those of the
``eval_path`` dataset (processed the same way, all of its rows after its own dedup) or ``eval_size`` prompts drawn
from this selection with a seeded draw. Training and evaluation never share a prompt key.

The training and evaluation datasets are each an :class:`HFSource` (``HFPromptDataModule.train_source`` and
``eval_source``), read by the same loader; an ``eval_*`` column setting left unset is the training one.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import lightning.pytorch as pl
import pyarrow.parquet as pq
from reasoning_gym.utils import SYSTEM_PROMPTS
from torch.utils.data import DataLoader

from logra_pl.data.loaders import (  # prompt_loader: re-exported
    check_tune_fraction,
    eval_loader,
    prompt_loader,
    tag_eval_subsets,
    trainer_positions,
)
from logra_pl.data.schema import make_item, prompt_key
from logra_pl.errors import ConfigError, check_int

# Local file suffix → datasets' packaged builder (and its extra arguments).
FORMATS: dict[str, tuple[str, dict[str, Any]]] = {
    ".parquet": ("parquet", {}),
    ".jsonl": ("json", {}),
    ".json": ("json", {}),
    ".csv": ("csv", {}),
    ".tsv": ("csv", {"sep": "\t"}),
    ".arrow": ("arrow", {}),
}
_COMPRESSION = (".gz", ".bz2", ".xz", ".zst")
_BATCH = 2048  # rows per Arrow batch when reading a split (whole batches convert ~20x faster than rows)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def _data_suffix(path: Path) -> str | None:
    """The data format suffix of ``path`` (``.jsonl`` for ``x.jsonl.gz``), or None."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in _COMPRESSION:
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes and suffixes[-1] in FORMATS else None


def is_local(path: str) -> bool:
    """Whether ``path`` names a local file or folder (existing or not) rather than a hub id.

    Arguments:
        path: what the user gave as ``path``: an existing path, anything with a data suffix (``.parquet``,
            ``.jsonl``, ``.json``, ``.csv``, ``.tsv``, ``.arrow``, optionally compressed), an absolute or ``./``,
            ``../``, ``~`` path, or anything that is not of the hub's ``owner/name`` form.
    """
    p = Path(path).expanduser()
    if p.exists() or _data_suffix(p) is not None:
        return True
    return path.startswith((".", "/", "~")) or not _HUB_ID.match(path)


def default_task(path: str) -> str:
    """The default ``task`` of a dataset: the hub id itself, or a local file's stem (``train`` for ``train.jsonl.gz``).

    Arguments:
        path: hub id or local path.
    """
    if not is_local(path):
        return path
    p = Path(path).expanduser()
    name = p.name
    for suffix in reversed(p.suffixes):
        if suffix.lower() in _COMPRESSION or suffix.lower() in FORMATS:
            name = name[: -len(suffix)]
        else:
            break
    return name or p.resolve().name


def check_source(path: str, what: str = "data.path") -> None:
    """Refuse a local path that does not exist, or a local file of an unknown format (before anything loads).

    Arguments:
        path: hub id or local path.
        what: the setting's name, for the message.
    """
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{what} must be a hub id or a local file/folder, got {path!r}")
    if not is_local(path):
        return
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(
            f"{what}={path!r}: no such file or folder (resolved to {p.resolve()}); give an existing local file "
            f"({', '.join(FORMATS)}) or folder, or a hub id such as 'owner/name'"
        )
    if p.is_file() and _data_suffix(p) is None:
        raise ConfigError(
            f"{what}={path!r}: unknown file format {''.join(p.suffixes) or '(no suffix)'}; "
            f"use one of {', '.join(FORMATS)} (optionally compressed: {', '.join(_COMPRESSION)})"
        )


def _offline() -> bool:
    return bool(datasets.config.HF_HUB_OFFLINE)


def _cache_hint() -> str:
    home = os.environ.get("HF_HOME", "~/.cache/huggingface")
    return f"HF_HOME={home!r}, HF_DATASETS_CACHE={str(datasets.config.HF_DATASETS_CACHE)!r}"


def load_rows(
    path: str, split: str = "train", name: str | None = None, cache_dir: str | None = None
) -> datasets.Dataset:
    """One split of a hub dataset or local file/folder as a ``datasets.Dataset``; failures as :class:`ConfigError`.

    Local files go through the packaged builder of their suffix (``load_dataset("json", data_files={split: path})``,
    so any ``split`` name works for a single file); a folder written by ``save_to_disk`` through ``load_from_disk``;
    any other folder through ``load_dataset(folder)`` (datasets infers the format and the splits from file names).

    Arguments:
        path: hub id, or local file / folder.
        split: split to load.
        name: dataset configuration (hub datasets and folders with configs only).
        cache_dir: datasets' cache folder (default: ``HF_DATASETS_CACHE``).
    """
    check_source(path)
    kwargs: dict[str, Any] = {"cache_dir": cache_dir}
    if name is not None:
        kwargs["name"] = name
    try:
        if is_local(path):
            p = Path(path).expanduser()
            if p.is_file():
                suffix = _data_suffix(p) or ""
                if p.stat().st_size == 0 or (suffix == ".parquet" and pq.ParquetFile(p).metadata.num_rows == 0):
                    raise _no_rows(path)
                builder, extra = FORMATS[suffix]
                try:
                    return datasets.load_dataset(
                        builder, data_files={split: str(p)}, split=split, cache_dir=cache_dir, **extra
                    )
                except StopIteration as err:  # datasets' json builder on a file without records
                    raise _no_rows(path) from err
            if (p / "dataset_dict.json").is_file():  # a DatasetDict written by save_to_disk
                splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
                if split not in splits:
                    raise ConfigError(f"{path!r} has splits {splits}, not {split!r}: set split")
                p = p / split
            if (p / "state.json").is_file():  # a Dataset written by save_to_disk
                if not json.loads((p / "state.json").read_text()).get("_data_files"):
                    raise _no_rows(path)  # datasets' load_from_disk fails with an IndexError on these
                return datasets.load_from_disk(str(p))
            return datasets.load_dataset(str(p), split=split, **kwargs)
        return datasets.load_dataset(path, split=split, **kwargs)
    except ConfigError:
        raise
    except ConnectionError as err:
        if _offline():
            raise ConfigError(
                f"dataset {path!r} is not in the local cache and HF_HUB_OFFLINE=1 forbids downloading it "
                f"({_cache_hint()}): download it once with network access and the same cache, point HF_HOME / "
                f"HF_DATASETS_CACHE at a cache that holds it, or give a local file (.parquet, .jsonl, .json, .csv, "
                f".arrow) or folder as the path; there is no local file or folder named {path!r}"
            ) from err
        raise ConfigError(
            f"could not reach the Hugging Face hub for dataset {path!r} ({err}); with no network, give a local file "
            f"or folder as the path, or set HF_HUB_OFFLINE=1 to use a cache that holds it ({_cache_hint()})"
        ) from err
    except datasets.exceptions.DatasetNotFoundError as err:
        raise ConfigError(
            f"dataset {path!r} was not found on the Hugging Face hub (a private or gated dataset needs `hf auth "
            f"login`), and there is no local file or folder of that name: {err}"
        ) from err
    except (datasets.exceptions.DatasetsError, FileNotFoundError, ValueError) as err:
        if "corresponds to no data" in str(err):  # datasets' csv builder on a header without rows
            raise _no_rows(path) from err
        cause, root = err, err
        while cause is not None:
            root, cause = cause, cause.__cause__ or cause.__context__
        detail = f"{type(err).__name__}: {err}" + (f" ({type(root).__name__}: {root})" if root is not err else "")
        raise ConfigError(f"could not load split {split!r} of {path!r}: {detail}") from err


def _no_rows(path: str) -> ConfigError:
    return ConfigError(f"{path!r} holds no rows: give a file with at least one record")


def resolve_path(row: Mapping[str, Any], dotted: str, what: str, where: str) -> Any:
    """The value at ``dotted`` (``a.b.c``) inside ``row``; a :class:`ConfigError` names the part that failed.

    Arguments:
        row: one dataset row.
        dotted: column name, or a dotted path into nested dicts.
        what: the setting's name, for the message.
        where: the row's description, for the message.
    """
    value: Any = row
    done: list[str] = []
    for part in dotted.split("."):
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"{what}={dotted!r}: {'.'.join(done)!r} is a {type(value).__name__}, not a dict, so {part!r} cannot "
                f"be looked up in it ({where})"
            )
        if part not in value:
            inside = f"inside {'.'.join(done)!r}" if done else "among the columns"
            raise ConfigError(
                f"{what}={dotted!r}: no key {part!r} {inside} ({where}); available there: {sorted(map(str, value))}"
            )
        value = value[part]
        done.append(part)
    return value


def _check_columns(ds: datasets.Dataset, columns: Mapping[str, str | None], source: str) -> None:
    """Each named column (the first part of a dotted path) exists; nested struct keys are checked from features."""
    available = list(ds.column_names)
    for what, dotted in columns.items():
        if dotted is None:
            continue
        parts = dotted.split(".")
        if parts[0] not in available:
            raise ConfigError(f"{what}={dotted!r}: {source} has no column {parts[0]!r}; available columns: {available}")
        feature: Any = ds.features[parts[0]]
        for i, part in enumerate(parts[1:], start=1):
            if not isinstance(feature, Mapping):
                break  # not a struct the features describe: checked row by row
            if part not in feature:
                raise ConfigError(
                    f"{what}={dotted!r}: no key {part!r} inside {'.'.join(parts[:i])!r} of {source}; available "
                    f"there: {sorted(feature)}"
                )
            feature = feature[part]


def _messages(value: Any, system_prompt: str | None, what: str, where: str) -> list[dict[str, str]]:
    """The chat of one prompt cell: a string → one user message; a chat list → its messages."""
    if isinstance(value, str):
        chat = [{"role": "user", "content": value}]
    elif isinstance(value, Sequence) and value and all(isinstance(m, Mapping) for m in value):
        chat = []
        for i, m in enumerate(value):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ConfigError(
                    f"{what}: message {i} of the chat must have string 'role' and 'content' ({where}), got {dict(m)!r}"
                )
            chat.append({"role": m["role"], "content": m["content"]})
    else:
        raise ConfigError(
            f"{what}: a prompt must be a string or a non-empty chat list of {{'role', 'content'}} ({where}), got "
            f"{type(value).__name__} {value!r:.200}"
        )
    if system_prompt and chat[0]["role"] != "system":
        chat.insert(0, {"role": "system", "content": system_prompt})
    return chat


def _answer(value: Any, what: str, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    got = f"{type(value).__name__} {value!r}"
    raise ConfigError(f"{what}: the answer must be a string or a number ({where}), got {got}")


def build_items(
    ds: datasets.Dataset,
    *,
    source: str,
    prompt_column: str,
    answer_column: str,
    task: str,
    id_column: str | None = None,
    system_prompt: str | None = None,
    dedup: bool = True,
    first_n: int | None = None,
) -> list[dict[str, Any]]:
    """Schema items from the rows of ``ds``, in source order, deduplicated and cut to ``first_n``.

    A bad row is a :class:`ConfigError` naming it as a reader counts: ``row 1`` is the split's first record (its
    ``metadata.source_row`` and default id count from 0).

    Arguments:
        ds: the loaded split.
        source: the dataset's description, for messages.
        prompt_column: column with the prompt (a string, or a chat list of ``{"role", "content"}``).
        answer_column: column (or dotted path into nested dicts) with the gold answer.
        task: the items' ``task``.
        id_column: column (or dotted path) whose value makes the id ``f"{task}/{value}"``; None: the row index.
        system_prompt: system message put first in chats that have none.
        dedup: keep only the first row of each prompt key (first user message's content).
        first_n: stop after this many items (after dedup, in source order); None: all.
    """
    _check_columns(ds, {"prompt_column": prompt_column, "answer_column": answer_column, "id_column": id_column}, source)
    # Pass 1, over the prompt column alone (fast: large sets repeat prompts, and first_n stops early): which rows.
    chats: dict[int, list[dict[str, str]]] = {}
    seen: set[str] = set()
    row_index = 0
    for batch in ds.select_columns([prompt_column]).iter(batch_size=_BATCH):
        for value in batch[prompt_column]:
            where = f"row {row_index + 1} of {source}"
            messages = _messages(value, system_prompt, f"prompt_column={prompt_column!r}", where)
            key = next((m["content"] for m in messages if m["role"] == "user"), None)
            if key is None:
                raise ConfigError(f"prompt_column={prompt_column!r}: the chat has no user message ({where})")
            if not dedup or key not in seen:
                seen.add(key)
                chats[row_index] = messages
            row_index += 1
            if first_n is not None and len(chats) == first_n:
                break
        if first_n is not None and len(chats) == first_n:
            break
    # Pass 2, over the chosen rows: answers, ids, metadata.
    rows = list(chats)
    items: list[dict[str, Any]] = []
    ids: dict[str, int] = {}
    for batch in ds.select(rows).iter(batch_size=_BATCH):
        names = list(batch)
        for values in zip(*(batch[n] for n in names), strict=True):
            row, row_index = dict(zip(names, values, strict=True)), rows[len(items)]
            where = f"row {row_index + 1} of {source}"
            answer = _answer(resolve_path(row, answer_column, "answer_column", where), "answer_column", where)
            suffix = row_index if id_column is None else resolve_path(row, id_column, "id_column", where)
            ident = f"{task}/{suffix}"
            if ident in ids:
                raise ConfigError(
                    f"id_column={id_column!r}: rows {ids[ident] + 1} and {row_index + 1} of {source} both have id "
                    f"{ident!r}; "
                    "ids must be unique: pick another id_column, or leave it unset (the row index)"
                )
            ids[ident] = row_index
            metadata = {k: v for k, v in row.items() if k != prompt_column}
            metadata["source_row"] = row_index
            messages = chats[row_index]
            items.append(
                make_item(messages, answer, task, ident, metadata, question=prompt_key({"messages": messages}))
            )
    return items


@dataclass(frozen=True)
class HFSource:
    """One split of a dataset and how its rows become items: the training or the evaluation side of
    :class:`HFPromptDataModule` (the same loader reads both).

    Arguments:
        path: hub id or local file / folder.
        split: split to read.
        name: dataset configuration (optional).
        prompt_column: column with the prompt (a string, or a chat list of ``{"role", "content"}``).
        answer_column: column (or dotted path into nested dicts) with the gold answer.
        id_column: column (or dotted path) whose value makes ids ``f"{task}/{value}"``; None: the row index.
        task: the items' ``task``.
    """

    path: str
    split: str
    name: str | None
    prompt_column: str
    answer_column: str
    id_column: str | None
    task: str

    def __str__(self) -> str:
        return f"{self.path!r} (split {self.split!r})"


class HFPromptDataModule(pl.LightningDataModule):
    """Prompts from a Hugging Face dataset (hub id) or a local parquet / jsonl / json / csv / arrow file or folder.

    Items follow :mod:`logra_pl.data.schema`; they also carry ``question`` (the prompt key). See the module docstring
    for the selection order. Offline (``HF_HUB_OFFLINE=1``) a hub id that is not in the cache fails at once with a
    message naming the cache and the local-file alternative.

    Arguments:
        path: hub id (``owner/name``) or local file / folder.
        split: split of ``path`` to train on.
        name: dataset configuration of ``path`` (optional).
        prompt_column: column with the prompt: a string (→ one user message) or a chat list of ``{"role", "content"}``.
        answer_column: column with the gold answer; a dotted path reaches into nested dicts
            (``reward_model.ground_truth``).
        task: the items' ``task``; default: the hub id, or the local file's stem.
        id_column: column (or dotted path) whose value makes ids ``f"{task}/{value}"``; default: the source row index.
        system_prompt: system message put first in every chat that has none; a key of
            ``reasoning_gym.utils.SYSTEM_PROMPTS`` is expanded.
        dedup: keep the first row of each distinct first user message, in source order.
        first_n: keep the first ``first_n`` prompts (after dedup, in source order, before the eval prompts are removed).
        eval_path: a separate evaluation dataset (hub id or local), processed the same way; its prompts are removed
            from training. None: ``eval_size`` prompts are held out of this dataset.
        eval_split: split of ``eval_path``.
        eval_name: dataset configuration of ``eval_path``.
        eval_prompt_column: prompt column of ``eval_path`` (default: ``prompt_column``).
        eval_answer_column: answer column of ``eval_path`` (default: ``answer_column``).
        eval_id_column: id column of ``eval_path`` (default: the row index).
        eval_task: ``task`` of the eval items (default: from ``eval_path``, like ``task``).
        eval_size: without ``eval_path``: prompts held out for evaluation by a seeded draw (0: none); ignored with it.
        prompts_per_step: prompts per policy update over all ranks (the training batch size).
        eval_batch_size: prompts per validation batch.
        seed: seed of the held-out draw and of the training shuffle.
        shuffle_seed: seed of the training prompts' order alone; ``None`` (default): ``seed``. Seeds of one experiment
            that should share the held-out draw but each have its own prompt stream set this, not ``seed``.
        num_workers: DataLoader workers (0: in the main process).
        cache_dir: datasets' cache folder (default: ``HF_DATASETS_CACHE``).
        eval_tune_fraction: split the evaluation items into a tuning and a report subset (this share in the tuning
            one, spread evenly: :func:`~logra_pl.data.loaders.tag_eval_subsets`); validation then also logs
            ``val/tune/pass@1`` and ``val/report/pass@1``. 0 (default): no split.
    """

    def __init__(
        self,
        path: str,
        split: str = "train",
        name: str | None = None,
        prompt_column: str = "prompt",
        answer_column: str = "answer",
        task: str | None = None,
        id_column: str | None = None,
        system_prompt: str | None = None,
        dedup: bool = True,
        first_n: int | None = None,
        eval_path: str | None = None,
        eval_split: str = "test",
        eval_name: str | None = None,
        eval_prompt_column: str | None = None,
        eval_answer_column: str | None = None,
        eval_id_column: str | None = None,
        eval_task: str | None = None,
        eval_size: int = 128,
        prompts_per_step: int = 64,
        eval_batch_size: int = 128,
        seed: int = 0,
        num_workers: int = 0,
        cache_dir: str | None = None,
        eval_tune_fraction: float = 0.0,
        shuffle_seed: int | None = None,
    ) -> None:
        super().__init__()
        # Recorded in checkpoints (a resumed run is checked against them), not sent to the logger: the CLI saves the
        # whole config, and Lightning refuses to log a module and a datamodule that share a key (`seed`) with
        # different values.
        self.save_hyperparameters(logger=False)
        check_source(path, "data.path")
        if eval_path is not None:
            check_source(eval_path, "data.eval_path")
        for what, value in (("prompt_column", prompt_column), ("answer_column", answer_column)):
            if not isinstance(value, str) or not value:
                raise ConfigError(f"data.{what} must be a column name, got {value!r}")
        if first_n is not None:
            check_int("data.first_n", first_n, 1)
        check_int("data.eval_size", eval_size, 0)
        check_int("data.prompts_per_step", prompts_per_step, 1)
        check_int("data.eval_batch_size", eval_batch_size, 1)
        check_int("data.seed", seed, 0)
        if shuffle_seed is not None:
            check_int("data.shuffle_seed", shuffle_seed, 0)
        check_int("data.num_workers", num_workers, 0)
        check_tune_fraction("data.eval_tune_fraction", eval_tune_fraction)
        self.path, self.split, self.name = path, split, name
        self.prompt_column, self.answer_column, self.id_column = prompt_column, answer_column, id_column
        self.task = task or default_task(path)
        self.system_prompt = SYSTEM_PROMPTS.get(system_prompt, system_prompt) if system_prompt else None
        self.dedup, self.first_n = dedup, first_n
        self.eval_path, self.eval_split, self.eval_name = eval_path, eval_split, eval_name
        self.eval_prompt_column = eval_prompt_column or prompt_column
        self.eval_answer_column = eval_answer_column or answer_column
        self.eval_id_column = eval_id_column
        self.eval_task = eval_task or (default_task(eval_path) if eval_path is not None else self.task)
        self.eval_size = eval_size
        self.prompts_per_step = prompts_per_step
        self.eval_batch_size = eval_batch_size
        self.seed = seed
        self.shuffle_seed = seed if shuffle_seed is None else shuffle_seed
        self.num_workers = num_workers
        self.cache_dir = cache_dir
        self.eval_tune_fraction = eval_tune_fraction
        self.train_items: list[dict[str, Any]] = []
        self.eval_items: list[dict[str, Any]] = []
        self.removed_for_eval = 0  # training prompts dropped because an eval_path prompt has the same key

    @property
    def train_source(self) -> HFSource:
        """The training dataset: ``path``, ``split``, ``name``, the columns and ``task``."""
        return HFSource(
            self.path, self.split, self.name, self.prompt_column, self.answer_column, self.id_column, self.task
        )

    @property
    def eval_source(self) -> HFSource | None:
        """The ``eval_path`` dataset (None without one): the ``eval_*`` settings, each unset column the training one."""
        if self.eval_path is None:
            return None
        return HFSource(
            self.eval_path,
            self.eval_split,
            self.eval_name,
            self.eval_prompt_column,
            self.eval_answer_column,
            self.eval_id_column,
            self.eval_task,
        )

    def load_source(self, source: HFSource, first_n: int | None = None) -> list[dict[str, Any]]:
        """Items of one source: its rows in order, deduplicated (``dedup``), cut to ``first_n``, ``system_prompt``
        put first."""
        ds = load_rows(source.path, source.split, source.name, self.cache_dir)
        return build_items(
            ds,
            source=str(source),
            prompt_column=source.prompt_column,
            answer_column=source.answer_column,
            task=source.task,
            id_column=source.id_column,
            system_prompt=self.system_prompt,
            dedup=self.dedup,
            first_n=first_n,
        )

    def load_train_pool(self) -> list[dict[str, Any]]:
        """The training dataset's items after dedup and ``first_n``, before the eval prompts are removed."""
        items = self.load_source(self.train_source, self.first_n)
        if not items:
            raise ConfigError(f"{self.train_source} gave no prompts (after dedup and first_n)")
        return items

    def load_eval_items(self) -> list[dict[str, Any]]:
        """The ``eval_path`` dataset's items (all rows, deduplicated like training); requires ``eval_path``."""
        source = self.eval_source
        assert source is not None
        items = self.load_source(source)
        if not items:
            raise ConfigError(f"the eval dataset {source} has no rows")
        return items

    def setup(self, stage: str | None = None) -> None:
        """Load and select both splits (once); every setting error surfaces here, before any training step."""
        if self.train_items:
            return
        pool = self.load_train_pool()
        if self.eval_path is not None:
            self.eval_items = self.load_eval_items()
            held = {prompt_key(it) for it in self.eval_items}
            train = [it for it in pool if prompt_key(it) not in held]
            self.removed_for_eval = len(pool) - len(train)
        else:
            if self.eval_size >= len(pool):
                raise ConfigError(
                    f"data.eval_size={self.eval_size} leaves no training prompts: "
                    f"{self.train_source} has {len(pool)} prompts after dedup and first_n; "
                    "lower eval_size or give eval_path"
                )
            drawn = set(random.Random(self.seed).sample(range(len(pool)), self.eval_size))
            self.eval_items = [it for i, it in enumerate(pool) if i in drawn]
            train = [it for i, it in enumerate(pool) if i not in drawn]
        tag_eval_subsets(self.eval_items, self.eval_tune_fraction)
        if len(train) < self.prompts_per_step:
            raise ConfigError(
                f"only {len(train)} training prompts remain from {self.train_source} (after dedup, "
                f"first_n and removing eval prompts), fewer than prompts_per_step={self.prompts_per_step}: lower "
                "prompts_per_step or eval_size, or raise first_n"
            )
        self.train_items = train

    @property
    def eval_questions(self) -> set[str]:
        """Prompt keys of every evaluation item (kept out of training and of any warm start)."""
        self.setup()
        return {prompt_key(it) for it in self.eval_items}

    def train_dataloader(self) -> DataLoader:
        """Shuffled prompts (seeded), ``prompts_per_step`` per update over all ranks: each rank takes its share."""
        self.setup()
        trainer = self.trainer
        return prompt_loader(
            self.train_items,
            self.prompts_per_step,
            self.shuffle_seed,
            world_size=int(trainer.world_size) if trainer is not None else 1,
            rank=int(trainer.global_rank) if trainer is not None else 0,
            num_workers=self.num_workers,
            **trainer_positions(trainer),
        )

    def val_dataloader(self) -> DataLoader:
        """All eval prompts, in order."""
        self.setup()
        return eval_loader(self.eval_items, self.eval_batch_size, self.num_workers)
