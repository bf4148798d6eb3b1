"""The house's shape, checked on the source: layers import only below them, no import circle,
no room over 450 lines, no function over 80, only comm/ talks to mpi4py or torch.distributed,
and package __init__ files import nothing (docs/architecture.md)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("architecture", REPO / "scripts" / "architecture.py")
architecture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(architecture)

MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 80
_modules, _layer = architecture.modules, architecture.layer


def _imports(path: Path, known) -> set[str]:
    return set(architecture.imports(path, known))


def _graph() -> dict[str, set[str]]:
    return architecture.graph()


def test_every_module_sits_in_a_layer_and_imports_only_below_or_beside_in_its_own():
    upward = []
    for module, targets in _graph().items():
        level, layer = _layer(module)
        for target in targets:
            their_level, their_layer = _layer(target)
            if their_level > level or (their_level == level and their_layer != layer):
                upward.append(f"{module} -> {target}")
    assert not upward, "imports up a layer or across peers:\n" + "\n".join(sorted(upward))


def test_no_import_circle():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_no_file_over_the_limit():
    long = [f"{p.relative_to(REPO)}: {n}" for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert not long, f"files over {MAX_FILE_LINES} lines:\n" + "\n".join(long)


def test_no_function_over_the_limit():
    long = []
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {n}")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


@pytest.mark.parametrize("library", ["mpi4py", "torch.distributed"])
def test_only_comm_talks_to_the_process_group_libraries(library):
    users = []
    for name, path in _modules().items():
        if name.startswith("labavg.comm"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == library or n.startswith(library + ".") for n in names):
                users.append(f"{name}:{node.lineno}")
    assert not users, f"{library} imported outside labavg.comm: {users}"


def test_package_init_files_import_nothing():
    busy = []
    for path in _modules().values():
        if path.name == "__init__.py":
            tree = ast.parse(path.read_text())
            if any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in tree.body):
                busy.append(str(path.relative_to(REPO)))
    assert not busy, f"package __init__ files with imports: {busy}"


def test_the_checks_catch_what_they_are_for(tmp_path):
    """The graph walk finds an upward import and a circle in a made-up pair of modules."""
    (tmp_path / "a.py").write_text("import labavg.jobs.runs\n")
    known = {"labavg.jobs.runs": tmp_path / "a.py", "labavg.base.x": tmp_path / "a.py"}
    assert _imports(tmp_path / "a.py", known) == {"labavg.jobs.runs"}
    assert _layer("labavg.base.x")[0] < _layer("labavg.jobs.runs")[0]
