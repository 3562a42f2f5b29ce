"""Execute the notebooks of ``tutorials/`` top to bottom with a real Jupyter kernel (nbclient).

    python scripts/run_tutorials.py                      # every tutorials/*.ipynb, in place (refreshes outputs)
    python scripts/run_tutorials.py --fast --out /tmp/nb # FAST=1: tiny sizes; executed copies written to /tmp/nb
    python scripts/run_tutorials.py tutorials/01_sketch_core.ipynb

The kernel is ipykernel's ``python3`` running *this* interpreter (``sys.executable``: the project's venv), started
with the working directory ``tutorials/``, as the notebooks expect. ``--fast`` sets ``FAST=1`` in the kernel's
environment; every notebook reads it in its first code cell and shrinks its runs. A notebook that fails is reported
with its cell index, source and traceback, and is not written back in place; the exit status is then 1. The time of
every notebook is printed.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import nbformat
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "tutorials"
KERNEL = "python3"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class NotebookError(RuntimeError):
    """A notebook cell failed (or timed out); the message names the notebook and cell, with source and traceback."""

    def __init__(self, notebook: Path, cell_index: int | None, source: str, detail: str) -> None:
        where = f"cell {cell_index}" if cell_index is not None else "before the first cell"
        self.notebook, self.cell_index = notebook, cell_index
        super().__init__(f"{_rel(notebook)}: {where} failed\n--- source ---\n{source}\n--- error ---\n{detail}")


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def kernel_command() -> list[str]:
    """The command the ``python3`` kernel is started with (jupyter_client maps a bare ``python`` to sys.executable)."""
    return KernelManager(kernel_name=KERNEL).format_kernel_cmd()


def check_kernel() -> None:
    """Refuse to run if the ``python3`` kernel would start another interpreter than this one (the project's venv)."""
    cmd = kernel_command()
    if not cmd or Path(cmd[0]).resolve() != Path(sys.executable).resolve():
        raise SystemExit(
            f"the {KERNEL!r} Jupyter kernel starts {cmd[:1]}, not this interpreter {sys.executable}: remove the "
            f"kernelspec that overrides it (`jupyter kernelspec list`) or run `{sys.executable} -m ipykernel install "
            "--sys-prefix`"
        )


def _error_text(cell: Any) -> str:
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            return _ANSI.sub("", "\n".join(out.get("traceback", [])) or f"{out.get('ename')}: {out.get('evalue')}")
    return ""


def execute(
    notebook: Path,
    out: Path | None = None,
    *,
    fast: bool = False,
    timeout: int = 600,
    env: dict[str, str] | None = None,
) -> float:
    """Run ``notebook`` top to bottom and write the executed copy to ``out`` (default: in place, on success only).

    Arguments:
        notebook: the ``.ipynb`` to execute.
        out: where the executed notebook goes; a failed run is written there too (to inspect), never in place.
        fast: set ``FAST=1`` in the kernel's environment (tiny sizes, few updates).
        timeout: seconds allowed per cell.
        env: the kernel's environment (default: this process's), before ``FAST`` is set.

    Returns the wall seconds. Raises :class:`NotebookError` naming the failing cell.
    """
    notebook = Path(notebook).resolve()
    nb = nbformat.read(notebook, as_version=4)
    kernel_env = dict(os.environ if env is None else env)
    kernel_env["FAST"] = "1" if fast else "0"
    current: dict[str, int] = {}

    def on_cell_start(cell: Any, cell_index: int, **_: Any) -> None:
        current["index"] = cell_index

    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name=KERNEL,
        resources={"metadata": {"path": str(TUTORIALS)}},  # the kernel's cwd: notebooks use paths from tutorials/
        record_timing=False,  # no timestamps in the committed files
        on_cell_start=on_cell_start,
    )
    started = time.perf_counter()
    error: NotebookError | None = None
    try:
        client.execute(env=kernel_env)
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as err:
        index = current.get("index")
        cell = nb.cells[index] if index is not None else {}
        detail = _error_text(cell) or _ANSI.sub("", str(err))
        error = NotebookError(notebook, index, cell.get("source", ""), detail)
    seconds = time.perf_counter() - started
    target = out if out is not None else (None if error else notebook)
    if target is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, target)
    if error is not None:
        raise error
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every tutorials/*.ipynb, sorted")
    parser.add_argument("--fast", action="store_true", help="FAST=1 in the kernel: tiny sizes, few updates")
    parser.add_argument("--out", type=Path, help="write executed copies here instead of in place")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell; default 600")
    args = parser.parse_args(argv)
    check_kernel()
    notebooks = args.notebooks or sorted(TUTORIALS.glob("*.ipynb"))
    if not notebooks:
        print("no notebooks found in tutorials/", file=sys.stderr)
        return 1
    failed: list[str] = []
    total = time.perf_counter()
    mode = "FAST" if args.fast else "full"
    for path in notebooks:
        out = args.out / path.name if args.out else None
        print(f"{_rel(path)} ({mode}) ...", flush=True)
        try:
            seconds = execute(path, out, fast=args.fast, timeout=args.timeout)
        except NotebookError as err:
            print(f"FAILED {err}", file=sys.stderr, flush=True)
            failed.append(f"{_rel(path)} (cell {err.cell_index})")
            continue
        print(f"{_rel(path)}: {seconds:.1f} s -> {_rel(out) if out else 'in place'}", flush=True)
    print(f"{len(notebooks)} notebook(s) in {time.perf_counter() - total:.1f} s ({mode} mode)")
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
