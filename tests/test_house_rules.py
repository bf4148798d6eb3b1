"""The house rules of docs/architecture.md that tests/test_architecture.py does not already
check, on the source: nothing from a user's file is exec'd or unpickled, one function reads
summary.json, the models and the pure step know nothing about ranks. Each check has a test that
it catches what it is for."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCE = [p for top in ("labavg", "dashboard") for p in sorted((REPO / top).rglob("*.py"))]


def _name(node: ast.AST) -> str:
    """`pickle.load`, `torch.load`, `exec` for a call's function."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    return ""


def _keyword_true(call: ast.Call, name: str) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is True
               for k in call.keywords)


def unsafe_loads(text: str) -> list[int]:
    """Lines that run or unpickle what they read: exec/eval, pickle's and marshal's loads,
    torch.load without weights_only=True, numpy's loads with allow_pickle=True."""
    lines = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.Call):
            continue
        name = _name(node.func)
        if name in ("exec", "eval", "compile") or name.startswith(("pickle.", "marshal.",
                                                                    "dill.", "cloudpickle.")):
            lines.append(node.lineno)
        elif name == "torch.load" and not _keyword_true(node, "weights_only"):
            lines.append(node.lineno)
        elif name in ("np.load", "numpy.load") and _keyword_true(node, "allow_pickle"):
            lines.append(node.lineno)
    return lines


def test_nothing_is_execd_or_unpickled():
    found = [f"{p.relative_to(REPO)}:{line}" for p in SOURCE
             for line in unsafe_loads(p.read_text())]
    assert found == []


def test_the_load_check_catches_what_it_is_for():
    assert unsafe_loads("import torch\nstate = torch.load(path)\n") == [2]
    assert unsafe_loads("exec(open(f).read())\n") == [1]
    assert unsafe_loads("import pickle\nx = pickle.loads(b)\n") == [2]
    assert unsafe_loads("import numpy as np\nx = np.load(f, allow_pickle=True)\n") == [2]
    assert unsafe_loads("import torch\nstate = torch.load(path, weights_only=True)\n") == []


_JSON_READS = {"json.load", "json.loads", "load_json", "check_fields"}


def summary_readers(text: str) -> list[str]:
    """Functions that name summary.json (SUMMARY or the literal) and parse JSON."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        names = {_name(n) for n in ast.walk(node) if isinstance(n, (ast.Name, ast.Attribute))}
        literal = any(isinstance(n, ast.Constant) and n.value == "summary.json"
                      for n in ast.walk(node))
        calls = {_name(n.func) for n in ast.walk(node) if isinstance(n, ast.Call)}
        if ("SUMMARY" in names or literal) and calls & _JSON_READS:
            found.append(node.name)
    return found


def test_one_function_reads_summary_json():
    readers = {f"{p.relative_to(REPO)}:{name}" for p in SOURCE
               for name in summary_readers(p.read_text())}
    assert readers == {"labavg/jobs/summary.py:load_summary"}


def test_the_reader_check_catches_what_it_is_for():
    raw = ("import json\ndef wait(run_dir):\n"
           "    return json.loads((run_dir / SUMMARY).read_text())\n")
    assert summary_readers(raw) == ["wait"]
    literal = "def info(d):\n    return load_json(d / 'summary.json')\n"
    assert summary_readers(literal) == ["info"]
    assert summary_readers("def write(d, s):\n    (d / SUMMARY).write_text(s)\n") == []


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


# The model and the pure step: a minibatch in, an update out, whatever the number of ranks.
_RANKLESS = ("labavg/training/model.py", "labavg/training/step.py", "labavg/optim")


def test_models_and_the_step_know_nothing_about_ranks():
    paths = [p for item in _RANKLESS for p in ([REPO / item] if item.endswith(".py")
                                               else sorted((REPO / item).glob("*.py")))]
    assert len(paths) > 3
    talking = {f"{p.relative_to(REPO)}: {m}" for p in paths for m in imports_of(p)
               if m.startswith(("labavg.comm", "labavg.averaging", "labavg.jobs"))
               and m != "labavg.comm.settings"}
    assert talking == set()


def test_the_rankless_check_catches_what_it_is_for(tmp_path):
    model = tmp_path / "model.py"
    model.write_text("from labavg.comm.base import Communicator\n")
    assert "labavg.comm.base" in imports_of(model)


def wired_state(text: str) -> list[int]:
    """Lines where a dashboard module keeps state outside its Parameterized objects or wires a
    watcher by hand: `.param.watch(...)`, a `global` statement, a module-level empty container
    or lock (a registry of jobs every page would share by accident)."""
    tree = ast.parse(text)
    lines = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Global)
             or (isinstance(n, ast.Call) and _name(n.func).endswith("param.watch"))]
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        empty = (isinstance(value, (ast.Dict, ast.List, ast.Set)) and not getattr(
            value, "keys", getattr(value, "elts", None)))
        made = isinstance(value, ast.Call) and _name(value.func).split(".")[-1] in (
            "dict", "list", "set", "Lock", "RLock", "deque", "defaultdict")
        if empty or made:
            lines.append(node.lineno)
    return lines


# Filled once, as its class is declared (each `control(...)` of RunSettings names its setting),
# and only read after that: a declaration, not state.
_DECLARED_AT_IMPORT = {"dashboard/settings.py: CONTROLS: dict[str, str] = {}"}


def test_the_dashboard_is_declarative():
    found = set()
    for path in sorted((REPO / "dashboard").glob("*.py")):
        text = path.read_text()
        found |= {f"{path.relative_to(REPO)}: {text.splitlines()[line - 1].strip()}"
                  for line in wired_state(text)}
    assert found == _DECLARED_AT_IMPORT


def test_the_declarative_check_catches_what_it_is_for():
    assert wired_state("_JOBS: dict = {}\n_LOCK = threading.Lock()\n") == [1, 2]
    assert wired_state("def f(live):\n    live.param.watch(g, 'running')\n") == [2]
    assert wired_state("def f():\n    global _LAST\n") == [2]
    assert wired_state("STYLE = {'color': 'red'}\n") == []
