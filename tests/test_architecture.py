"""The layout rules of docs/architecture.md, checked against the code: the lifecycle tables in the
docs are the code's, imports run one way, every module says what it owns, only the lifecycle
writes a request's state, and the state sets are declared once."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
PACKAGE = SRC / "kvbudget"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """Every kvbudget module ``name`` imports anywhere (top level, functions, TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in MODULES)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                head = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(head + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in MODULES:
                    found.add(full)
                elif base in MODULES:
                    found.add(base)
    found.discard(name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_docs_render_the_lifecycle_tables_of_the_code() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "render_docs.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_import_cycle_anywhere_in_the_package() -> None:
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    assert _cycles(graph) == []


def test_the_cycle_check_sees_a_cycle() -> None:
    # the check itself, on a planted graph: type-only and function-local edges count too
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_says_what_it_owns(name: str) -> None:
    tree = ast.parse(MODULES[name].read_text())
    doc = ast.get_docstring(tree)
    assert doc and len(doc) > 20, f"{name} has no module docstring"


def _attribute_writes(path: pathlib.Path, attrs: set[str]) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr in attrs:
                lines.append(t.lineno)
    return lines


def test_only_the_lifecycle_writes_a_requests_state_and_outcome() -> None:
    writers = {
        name: lines
        for name, path in MODULES.items()
        if name.startswith("kvbudget.core.") and name != "kvbudget.core.lifecycle"
        if (lines := _attribute_writes(path, {"state", "outcome"}))
    }
    assert writers == {}


def _state_members(node: ast.expr) -> frozenset[str] | None:
    """The ``State.X`` names of a tuple/set/list literal made only of them (two or more)."""
    if not isinstance(node, ast.Tuple | ast.Set | ast.List) or len(node.elts) < 2:
        return None
    names = []
    for e in node.elts:
        if not (isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name)):
            return None
        if e.value.id not in ("State", "S"):
            return None
        names.append(e.attr)
    return frozenset(names)


def _named_sets() -> set[frozenset[str]]:
    from kvbudget.core import lifecycle

    sets = (
        lifecycle.LIVE_STATES,
        lifecycle.STOPPING_STATES,
        lifecycle.QUEUED_STATES,
        lifecycle.HOLDING_STATES,
        lifecycle.TERMINAL_STATES,
    )
    return {frozenset(s.name for s in states) for states in sets}


def _state_sets(path: pathlib.Path) -> list[int]:
    """Lines that declare a set of states (a module-level name bound to a literal of them) or
    spell one of the lifecycle's sets out again in a membership test."""
    named = _named_sets()
    tree = ast.parse(path.read_text())
    lines = []
    for node in tree.body:
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        if value is not None and _state_members(value) is not None:
            lines.append(node.lineno)
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for op, right in zip(node.ops, node.comparators, strict=True):
                if isinstance(op, ast.In | ast.NotIn) and _state_members(right) in named:
                    lines.append(node.lineno)
    return lines


def test_the_state_sets_are_declared_once() -> None:
    redeclared = {
        name: lines
        for name, path in MODULES.items()
        if name != "kvbudget.core.lifecycle" and (lines := _state_sets(path))
    }
    assert redeclared == {}
