"""The user's documents (README.md, docs/, the folder READMEs): their links resolve, their prose carries no commit
hashes, and every GPU launch command they quote is a command of a paper recipe's header, the one source of truth.

A doc that copies a launch command and then drifts from the recipe (a missing ``--sync-mode shadow``, a bare
``--trainer.strategy logra_fsdp`` that would replace the recipe's strategy block) fails here, naming the file, the
line and the nearest header command.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(
    [
        ROOT / "README.md",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / folder / "README.md" for folder in ("configs", "results", "tutorials", "tests", "benchmarks")),
    ]
)
DOCS = [p for p in DOCS if p.exists()]
RECIPES = sorted((ROOT / "configs" / "paper").rglob("*.yaml"))

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target)
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_CODE = re.compile(r"`[^`\n]*`")
# 7-40 hex digits with at least one digit and one letter: what a commit hash looks like in prose.
_HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where hex strings may be data, not history."""
    return _CODE.sub("", _FENCE.sub("", text))


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_every_relative_link_resolves(doc: Path) -> None:
    broken = []
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        for target in _LINK.findall(line):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):  # https:, mailto:, an anchor in this file
                continue
            path = target.split("#")[0]
            if not (doc.parent / path).exists():
                broken.append(f"{_rel(doc)}:{number}: {target}")
    assert broken == [], "links to files that do not exist:\n" + "\n".join(broken)


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_no_commit_hash_in_prose(doc: Path) -> None:
    found = [f"{_rel(doc)}: {h}" for h in _HASH.findall(_prose(doc.read_text()))]
    assert found == [], "commit hashes belong in git, not in the user's docs:\n" + "\n".join(found)


def test_the_hash_and_link_finders_find_what_they_look_for() -> None:
    """The two finders above, on text where they must fire (a finder that never fires would pass every doc)."""
    assert _HASH.findall(_prose("fixed in 8758e0a and dfd91df, not `1a2b3c4d`; 1048576 bytes")) == [
        "8758e0a",
        "dfd91df",
    ]
    assert _LINK.findall("see [gpu](docs/gpu.md#5-one-gpu) and [web](https://x.org)") == [
        "docs/gpu.md#5-one-gpu",
        "https://x.org",
    ]


def _commands(text: str, comment: bool) -> list[tuple[int, str]]:
    """Each ``logra-pl serve`` / ``logra-pl fit`` command of ``text`` as one line (``\\`` continuations joined,
    trailing comments dropped, whitespace normalised), with its first line's number. ``comment``: the text is a YAML
    header, every line starting with ``#``."""
    out: list[tuple[int, str]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if comment:
            if not line.startswith("#"):
                break
            line = line[1:]
        start = i
        parts = [line]
        while parts[-1].rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            parts.append(lines[i][1:] if comment else lines[i])
        i += 1
        joined = " ".join(re.sub(r"\s#.*$", "", p).rstrip().removesuffix("\\") for p in parts)
        if re.search(r"\blogra-pl (serve|fit)\b", joined):
            out.append((start + 1, " ".join(joined.split())))
    return out


def _quoted_launches(doc: Path) -> list[tuple[int, str]]:
    """The GPU launch commands a doc quotes in its code blocks: a paper recipe's ``fit`` or a ``serve`` of a hub
    model. ``--print_config`` checks and a batch script's ``srun`` wrapper (which adds ``$RESUME``) are not launches
    in the header's form."""
    launches = []
    for block in _FENCE.finditer(doc.read_text()):
        first = doc.read_text()[: block.start()].count("\n")
        for number, command in _commands(block.group(0), comment=False):
            fit = "fit --config configs/paper/" in command
            serve = re.search(r"logra-pl serve --model \S+/", command) is not None
            if (fit or serve) and "--print_config" not in command and "srun" not in command:
                launches.append((first + number, command))
    return launches


def _header_commands() -> set[str]:
    return {command for recipe in RECIPES for _, command in _commands(recipe.read_text(), comment=True)}


def test_every_recipe_header_has_its_launch_commands() -> None:
    """The source the docs are checked against: each recipe and overlay names a ``serve`` and a ``fit``."""
    for recipe in RECIPES:
        if recipe.parent.name == "models":
            continue
        programs = {c.split("logra-pl ")[1].split()[0] for _, c in _commands(recipe.read_text(), comment=True)}
        assert {"serve", "fit"} <= programs, _rel(recipe)


@pytest.mark.parametrize("doc", [d for d in DOCS if "logra-pl" in d.read_text()], ids=_rel)
def test_quoted_launch_commands_are_the_recipe_headers(doc: Path) -> None:
    headers = _header_commands()
    wrong = []
    for number, command in _quoted_launches(doc):
        if command not in headers:
            near = difflib.get_close_matches(command, sorted(headers), n=1, cutoff=0.0)
            wrong.append(f"{_rel(doc)}:{number}:\n  quoted: {command}\n  header: {near[0] if near else '-'}")
    assert wrong == [], "launch commands that differ from every recipe header:\n" + "\n".join(wrong)


def test_the_gpu_guide_and_serving_guide_quote_the_base_recipe() -> None:
    """docs/gpu.md (8 GPUs and one GPU) and docs/serving.md (8 GPUs) quote the base recipe's commands verbatim."""
    base = {c for _, c in _commands((ROOT / "configs/paper/math_1.5b_logra.yaml").read_text(), comment=True)}
    assert len(base) == 3, base  # serve + fit on 8 GPUs, fit on one
    gpu = {c for _, c in _quoted_launches(ROOT / "docs" / "gpu.md")}
    serving = {c for _, c in _quoted_launches(ROOT / "docs" / "serving.md")}
    assert base <= gpu
    assert {c for c in base if "devices 1" not in c} <= serving


def test_a_drifted_command_is_caught(tmp_path: Path) -> None:
    """The check fires on the drift it is for: the serving guide's old 8-GPU launch (no ``--sync-mode``,
    no ``--max-model-len``, a bare strategy name)."""
    doc = tmp_path / "old.md"
    doc.write_text(
        "```bash\n"
        "logra-pl serve --model Qwen/Qwen2.5-Math-1.5B --dtype bfloat16 \\\n"
        "    --data-parallel-size 4 --devices 4,5,6,7 --port 8100\n"
        "CUDA_VISIBLE_DEVICES=0,1,2,3 logra-pl fit --config configs/paper/math_1.5b_logra.yaml \\\n"
        "    --trainer.strategy logra_fsdp   # FSDP2\n"
        "```\n"
    )
    quoted = _quoted_launches(doc)
    assert [n for n, _ in quoted] == [2, 4]
    assert quoted[1][1].endswith("math_1.5b_logra.yaml --trainer.strategy logra_fsdp")
    assert not {c for _, c in quoted} & _header_commands()
