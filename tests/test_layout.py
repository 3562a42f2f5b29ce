"""The house keeps its shape: no import circles, a thin ``module.py``, few modules loose at the top of the package, and
every deprecated name and old module path defined under ``logra_pl/_graveyard`` alone.

The import graph is read from the source (``ast``), counting imports inside functions as well as at module level, so
a circle hidden in a lazy import fails here too. The limits are the ones the package was regrouped to: the next
feature goes to its wing, and growing the hub or the top level is a decision this test makes visible.
"""

from __future__ import annotations

import ast
import importlib
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "logra_pl"
MODULE_MAX_LINES = 320
MAX_LOOSE_MODULES = 12


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources(root: Path, base: Path) -> dict[str, Path]:
    return {_module_name(base, p): p for p in sorted(root.rglob("*.py")) if "__pycache__" not in p.parts}


def _imported(name: str, module: str, is_package: bool, node: ast.AST) -> Iterator[str]:
    """The dotted names an import statement of ``module`` refers to (relative imports resolved)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = module.split(".") if is_package else module.split(".")[:-1]
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join([*parts, *([node.module] if node.module else [])])
        for alias in node.names:
            yield f"{base}.{alias.name}"  # a submodule, or a name of the module ``base``
        yield base


def import_graph(sources: dict[str, Path], local: dict[str, str] | None = None) -> dict[str, dict[str, int]]:
    """``module -> {imported module: line}`` among ``sources`` (every import statement, wherever it stands).

    ``local`` maps a bare import name to a module of ``sources`` (the benchmarks import each other by file name).
    """
    graph: dict[str, dict[str, int]] = {}
    for module, path in sources.items():
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for target in _imported(module, module, path.name == "__init__.py", node):
                if local is not None:
                    target = local.get(target.split(".")[0], target)
                while target and target not in sources:  # a name of a module: the module
                    target = target.rpartition(".")[0]
                if target and target != module:
                    edges.setdefault(target, node.lineno)
        graph[module] = edges
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def _describe(graph: dict[str, dict[str, int]], circle: list[str]) -> str:
    ties = [f"{a} -> {b} (line {graph[a][b]})" for a in circle for b in circle if b in graph[a]]
    return "; ".join(ties)


def test_the_circle_finder_finds_a_circle_through_a_function_level_import(tmp_path: Path) -> None:
    """The checker itself: a lazy import that closes a loop is a circle; a one-way import is not."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n    return a\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    graph = import_graph(_sources(pkg, tmp_path))
    assert circles(graph) == [["pkg.a", "pkg.b"]]
    assert graph["pkg.b"]["pkg.a"] == 2 and graph["pkg.c"] == {"pkg.a": 1}


def test_the_package_has_no_import_circle() -> None:
    graph = import_graph(_sources(PACKAGE, ROOT))
    found = circles(graph)
    assert not found, "import circles: " + " | ".join(_describe(graph, c) for c in found)


def test_the_benchmarks_have_no_import_circle() -> None:
    """``benchmarks/`` scripts import each other by file name (``grid.py`` holds what they share)."""
    folder = ROOT / "benchmarks"
    sources = {p.stem: p for p in folder.glob("*.py")}
    graph = import_graph(sources, local={name: name for name in sources})
    found = circles(graph)
    assert not found, "import circles: " + " | ".join(_describe(graph, c) for c in found)
    assert "grid" in graph["ablate"] and "grid" in graph["parity"]


def test_module_py_stays_a_thin_recipe() -> None:
    """Lightning hooks and orchestration only: at most 320 lines, and no method that only forwards to another
    object (one ``return`` or expression statement calling an attribute of ``self``'s parts)."""
    path = PACKAGE / "module.py"
    lines = len(path.read_text().splitlines())
    assert lines <= MODULE_MAX_LINES, f"logra_pl/module.py has {lines} lines (at most {MODULE_MAX_LINES})"
    tree = ast.parse(path.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LoGRAPolicyModule"]
    forwards = []
    for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
        body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        if len(body) != 1:
            continue
        value = body[0].value if isinstance(body[0], ast.Return | ast.Expr) else None
        call = value if isinstance(value, ast.Call) else None
        target = call.func if call is not None else None
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Attribute):
            owner = target.value
            if isinstance(owner.value, ast.Name) and owner.value.id == "self":
                forwards.append(f"{fn.name} -> self.{owner.attr}.{target.attr}")
    assert not forwards, f"methods of LoGRAPolicyModule that only forward to another object: {forwards}"


def test_few_modules_stand_loose_at_the_top() -> None:
    """The top level shows the design card (module, strategy, cli, config, errors, smoke); the rest has a wing."""
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= MAX_LOOSE_MODULES, f"{len(loose)} modules loose at the top of logra_pl/: {loose}"
    assert {"module.py", "strategy.py", "cli.py", "config.py"} <= set(loose)


def _warns_deprecation(node: ast.AST) -> bool:
    """A ``warnings.warn(..., DeprecationWarning|FutureWarning)`` call (an announcement of something deprecated)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "warn"):
        return False
    named = [a for a in [*node.args, *(k.value for k in node.keywords)] if isinstance(a, ast.Name)]
    return any(a.id in ("DeprecationWarning", "FutureWarning") for a in named)


def test_deprecated_names_and_old_paths_live_in_the_graveyard_only() -> None:
    """Nothing outside ``logra_pl/_graveyard`` announces a deprecation; a live module's deprecated names are not
    defined in it (its ``__getattr__`` finds them in the graveyard); no old module path exists as a file, and each one
    still imports (with a ``DeprecationWarning``) and resolves its names."""
    from logra_pl import _graveyard

    graveyard = PACKAGE / "_graveyard"
    outside = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in PACKAGE.rglob("*.py")
        if graveyard not in path.parents
        for node in ast.walk(ast.parse(path.read_text()))
        if _warns_deprecation(node)
    ]
    assert not outside, f"deprecations announced outside logra_pl/_graveyard: {outside}"
    for (module, name), home in _graveyard.DEPRECATED.items():
        path = PACKAGE.joinpath(*module.split(".")[1:]).with_suffix(".py")
        path = path if path.exists() else path.with_suffix("") / "__init__.py"
        tree = ast.parse(path.read_text())
        defined = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        defined |= {n.name for n in tree.body if isinstance(n, ast.ClassDef | ast.FunctionDef)}
        assert name not in defined, f"{module}.{name} is deprecated but defined in {path.relative_to(ROOT)}"
        assert getattr(importlib.import_module(module), name) is getattr(importlib.import_module(home), name)
    for old, homes in _graveyard.OLD_PATHS.items():
        assert not PACKAGE.joinpath(*old.split(".")[1:]).with_suffix(".py").exists(), f"{old} is a file again"
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=f"{old} is an old module path"):
            stand_in = importlib.import_module(old)
        first = importlib.import_module(homes[0])
        public = [n for n in getattr(first, "__all__", dir(first)) if not n.startswith("_")][:3]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            assert all(getattr(stand_in, n) is getattr(first, n) for n in public), old


def test_the_strategy_names_no_update_method() -> None:
    """``strategy.py`` asks an optimizer what it can do (the protocols of ``methods/base.py``), never what it is: it
    imports nothing from a method's own module and names none of their classes."""
    path = PACKAGE / "strategy.py"
    tree = ast.parse(path.read_text())
    from_methods = [
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("logra_pl.methods")
    ]
    assert from_methods and set(from_methods) == {"logra_pl.methods.base"}, from_methods
    method_classes = {
        node.name
        for module in (PACKAGE / "methods").glob("*.py")
        if module.name != "base.py"
        for node in ast.walk(ast.parse(module.read_text()))
        if isinstance(node, ast.ClassDef)
    }
    named = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    named |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert method_classes and not (named & method_classes), sorted(named & method_classes)


# The wings from the bottom of the house to the top: a module may import from its own wing and from the wings below
# it, never from one above (the loose top-level modules count as wings of their own). ``_graveyard`` stands outside
# the order: it attaches itself to the live code from outside and may import any of it.
WING_ORDER = (
    ("errors", "config"),
    ("runtime",),
    ("models",),
    ("data",),
    ("sketch",),
    ("losses",),
    ("rewards",),
    ("methods",),
    ("runs",),
    ("rollout",),
    ("envs",),
    ("train",),
    ("callbacks",),
    ("strategy",),
    ("smoke", "module"),
    ("cli",),
)


def _wing(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "<root>"


def test_no_import_runs_from_a_lower_wing_to_a_higher_one() -> None:
    """Every import between wings goes down the house (:data:`WING_ORDER`); a wing that is not in the order fails
    too, so a new wing is placed on purpose."""
    level = {wing: i for i, wings in enumerate(WING_ORDER) for wing in wings}
    graph = import_graph(_sources(PACKAGE, ROOT))
    wings = {_wing(m) for m in graph} - {"<root>", "_graveyard"}
    assert not wings - set(level), f"wings missing from WING_ORDER: {sorted(wings - set(level))}"
    upward = [
        f"{module} -> {target} (line {line})"
        for module, edges in graph.items()
        if _wing(module) in level
        for target, line in edges.items()
        if _wing(target) in level and level[_wing(target)] > level[_wing(module)]
    ]
    assert not upward, "imports from a lower wing to a higher one: " + "; ".join(upward)
    into_graveyard = [
        f"{module} (line {edges[target]})"
        for module, edges in graph.items()
        if _wing(module) != "_graveyard"
        for target in edges
        if _wing(target) == "_graveyard"
    ]
    # The package's root imports it once, last, so that it attaches (as Lightning's does); nothing else names it.
    assert [entry.split()[0] for entry in into_graveyard] == ["logra_pl"], f"imports of the graveyard: {into_graveyard}"


def test_one_table_of_dtype_names() -> None:
    """Dtype names map to ``torch`` dtypes in ``runtime/dtypes.py`` alone; every other setting takes a subset of it."""
    home = PACKAGE / "runtime" / "dtypes.py"
    tables = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in PACKAGE.rglob("*.py")
        if path != home
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Dict)
        and any(isinstance(k, ast.Constant) and k.value in ("bfloat16", "float16", "float32") for k in node.keys)
        and any(isinstance(v, ast.Attribute) and v.attr in ("bfloat16", "float16", "float32") for v in node.values)
    ]
    assert not tables, f"dtype-name tables outside logra_pl/runtime/dtypes.py: {tables}"


def test_one_sender_of_engine_updates() -> None:
    """Weights reach the engine through ``EngineLink.send`` alone, called from ``engine_link.py`` only: each step's
    changes (``updated``) and full syncs (``sync_full``). ``PolicySync`` configures and measures, and sends nothing."""
    callers = sorted(
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("send", "changes", "apply_payload", "load_weights")
        and not path.is_relative_to(PACKAGE / "rollout")  # the engines themselves (a served engine's client)
    )
    assert callers and all(c.startswith("logra_pl/train/engine_link.py") for c in callers), callers


# What stays at the top of tests/: the tests of the top-level modules (module.py, cli.py, smoke.py, config.py and
# configs/) and of the house as a whole (docs, tutorials, layout, behaviour records, old checkpoints).
TOP_LEVEL_TESTS = {
    "conftest.py",
    "test_behaviour.py",
    "test_cli.py",
    "test_configs.py",
    "test_docs.py",
    "test_extending.py",
    "test_layout.py",
    "test_legacy_checkpoints.py",
    "test_module.py",
    "test_paper_recipe_run.py",
    "test_paper_recipes.py",
    "test_smoke.py",
    "test_tutorials.py",
}


def test_the_tests_mirror_the_wings() -> None:
    """A test of a wing lies in ``tests/<wing>/``; only :data:`TOP_LEVEL_TESTS` stand at the top, and every folder of
    tests is a wing of the package or a helper of the tests."""
    tests = ROOT / "tests"
    loose = {p.name for p in tests.glob("*.py")} - TOP_LEVEL_TESTS
    assert not loose, f"tests loose at the top of tests/ (move each into its wing's folder): {sorted(loose)}"
    wings = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    wings |= {p.stem for p in PACKAGE.glob("*.py")}  # a top-level module with tests of many files (strategy.py)
    folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    strays = folders - wings - {"helpers", "behaviour", "benchmarks"}
    assert not strays, f"test folders that mirror no wing: {sorted(strays)}"
