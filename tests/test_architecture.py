"""The house's shape, checked on the source: layers import only below them, no import circle,
no room over 450 lines, no function over 80, only comm/ talks to mpi4py or torch.distributed,
package __init__ files import nothing, runs start only through start_run, no process of labavg
starts outside jobs/ and comm/, no loop polls outside them, and one place builds averagers
(docs/architecture.md)."""

from __future__ import annotations

import ast
import importlib.util
import json
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


# What starts runs from outside labavg.jobs, and the names behind start_run they must not call:
# a run's consumer, its rank loop, a rank's entry and the in-process ranks, the engines' start.
STARTERS = ("notebooks/*.ipynb", "dashboard/*.py", "benchmarks/*.py", "examples/*.py",
            "labavg/studies/**/*.py")
BEHIND_THE_DOOR = {"run_training", "train_rank", "run_rank", "iterate_inproc", "launch_on_engine",
                   "submit"}
RANK_ENTRY = "labavg.jobs.rank_main"


def _python_of(path: Path) -> str:
    """A file's Python: a notebook's code cells, their IPython magic lines blanked."""
    if path.suffix != ".ipynb":
        return path.read_text()
    cells = json.loads(path.read_text())["cells"]
    return "\n".join("".join("\n" if line.lstrip().startswith(("%", "!")) else line
                             for line in cell["source"])
                     for cell in cells if cell["cell_type"] == "code")


def doors_around(source: str) -> list[str]:
    """Where `source` starts training some way other than start_run ("line: name")."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
            if node.module == "labavg.training.runner" and "train" in names:
                names.append("labavg.training.runner.train")
            names += [node.module] if node.module == RANK_ENTRY else []
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name in (RANK_ENTRY, "labavg.training.runner")]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [RANK_ENTRY] if RANK_ENTRY in node.value else []  # `python -m` it
        found += [f"{node.lineno}: {name}" for name in names
                  if name in BEHIND_THE_DOOR or name in (RANK_ENTRY, "labavg.training.runner",
                                                         "labavg.training.runner.train")]
    return found


def test_notebooks_dashboard_benchmarks_and_studies_start_runs_only_through_start_run():
    paths = sorted({p for pattern in STARTERS for p in REPO.glob(pattern)})
    assert any(p.suffix == ".ipynb" for p in paths) and any(p.parts[-2] == "dashboard" for p in paths)
    around = [f"{p.relative_to(REPO)}:{where}" for p in paths for where in doors_around(_python_of(p))]
    assert not around, ("training started other than through labavg.jobs.launch.start_run:\n"
                        + "\n".join(around))


def test_the_start_scan_catches_what_it_is_for(tmp_path):
    """A run started behind start_run's back is found in a module and in a notebook's cells."""
    assert doors_around("from labavg.jobs.runs import run_training\nrun_training(cfg)\n") == [
        "1: run_training", "2: run_training"]
    assert doors_around("from labavg.training.runner import keep_freed_memory, train\n") == [
        "1: labavg.training.runner.train"]
    assert doors_around("handle = cluster.submit(cfg)\n") == ["1: submit"]
    assert doors_around('subprocess.run([sys.executable, "-m", "labavg.jobs.rank_main", f])\n') == [
        "1: labavg.jobs.rank_main"]
    notebook = tmp_path / "n.ipynb"
    notebook.write_text(json.dumps({"cells": [
        {"cell_type": "markdown", "source": ["run_training(cfg) in prose is no call\n"]},
        {"cell_type": "code", "source": ["%%px\n", "from labavg.training.rank import train_rank\n"]},
    ]}))
    assert doors_around(_python_of(notebook)) == ["2: train_rank"]
    assert doors_around("from labavg.jobs.launch import start_run\nstart_run(cfg).result()\n") == []


# A run read back is typed (labavg.jobs.index.read_run: its TrainConfig and RunSummary): no
# module of these layers picks a field of a run's config or summary out of a dict by name.
RUN_READERS = ("labavg/jobs/", "labavg/studies/", "dashboard/")
RUN_NAMES = {"config", "cfg", "summary"}  # a variable holding a run's config or summary
RUN_ATTRIBUTES = {"config", "summary"}  # record.config, run.summary
# The one reader: it turns config.json's and summary.json's objects into the typed values.
RUN_DICT_EXEMPT = {"labavg/jobs/run_json.py"}


def _run_dict_reads(source: str) -> list[int]:
    """Lines where a run's config or summary is read as a dict: x["key"] or x.get("key")."""
    def is_run(node: ast.AST) -> bool:
        return ((isinstance(node, ast.Name) and node.id in RUN_NAMES)
                or (isinstance(node, ast.Attribute) and node.attr in RUN_ATTRIBUTES))

    def is_text(node: ast.AST) -> bool:
        return isinstance(node, ast.Constant) and isinstance(node.value, str)

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript) and is_run(node.value) and is_text(node.slice):
            lines.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "get" and is_run(node.func.value) and node.args
              and is_text(node.args[0])):
            lines.append(node.lineno)
    return lines


def test_no_run_is_read_as_a_dict_above_its_reader():
    found = []
    for path in _modules().values():
        where = str(path.relative_to(REPO))
        if where.startswith(RUN_READERS) and where not in RUN_DICT_EXEMPT:
            found += [f"{where}:{n}" for n in _run_dict_reads(path.read_text())]
    assert not found, ("a run's config or summary read as a dict (read it typed: "
                       "labavg.jobs.index.read_run, labavg.jobs.run_json.as_summary):\n"
                       + "\n".join(found))


def test_the_run_dict_check_catches_what_it_is_for():
    planted = ('k = summary.get("average_every")\n'
               'lr = record.config["lr"]\n'
               'wer = run.summary.get("wer", 0)\n'
               'ok = summary.average_every, cfg.effective_average_every(), events["type"]\n'
               'also = config.get(key)\n')
    assert _run_dict_reads(planted) == [1, 2, 3]


# -- no second door: the library never re-enters the command line, and one place builds
# averagers. Neither shows in the import graph: a `python -m labavg` is a string, and building
# an averager needs only its class.

# Where processes are started on purpose: a job's launcher and its ranks (labavg/jobs/), the
# process groups' own launchers (labavg/comm/).
PROCESS_OWNERS = ("labavg/jobs/", "labavg/comm/")
SOURCES = ("labavg/**/*.py", "dashboard/**/*.py")
# The calls that start a process with an argument list or a command line.
PROCESS_CALLS = {"Popen", "run", "call", "check_call", "check_output", "getoutput",
                 "getstatusoutput", "system", "popen", "create_subprocess_exec",
                 "create_subprocess_shell", "execv", "execve", "execvp", "execvpe", "execl",
                 "execlp", "spawnv", "spawnvp", "spawnl", "spawnlp"}


def _texts(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)]


def _names_labavg(texts: list[str]) -> bool:
    """Whether an argument list or command line runs labavg: its console script (`labavg`, as
    argv[0] or a command line's first word) or its modules (`-m labavg`, `-m labavg.x`)."""
    words = [w for text in texts for w in text.split()]
    modules = any(a == "-m" and b.split(".")[0] == "labavg" for a, b in zip(words, words[1:]))
    return modules or any(text.split()[:1] == ["labavg"] for text in texts)


def labavg_subprocesses(source: str) -> list[int]:
    """Lines of `source` that start a process running labavg. An argument list held in a
    variable counts with what the module assigns to that name."""
    tree = ast.parse(source)
    assigned: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and node.value is not None:
                    assigned.setdefault(target.id, []).extend(_texts(node.value))
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name not in PROCESS_CALLS:
            continue
        argv = [*node.args, *(k.value for k in node.keywords if k.arg in ("args", "cmd"))]
        texts = [t for a in argv for t in _texts(a)]
        texts += [t for a in argv for n in ast.walk(a) if isinstance(n, ast.Name)
                  for t in assigned.get(n.id, [])]
        if _names_labavg(texts):
            lines.append(node.lineno)
    return sorted(lines)


def _source_files(root: Path) -> list[Path]:
    return sorted({p for pattern in SOURCES for p in root.glob(pattern)})


def _hits(finder, exempt) -> list[str]:
    """`where:hit` for each hit `finder(text)` names in a source file `exempt(where)` is false of."""
    return [f"{where}:{hit}" for path in _source_files(REPO)
            if not exempt(where := str(path.relative_to(REPO)))
            for hit in finder(path.read_text())]


def test_no_subprocess_of_labavg_outside_jobs_and_comm():
    found = _hits(labavg_subprocesses, lambda where: where.startswith(PROCESS_OWNERS))
    assert not found, ("a process of labavg started outside labavg/jobs and labavg/comm (call "
                       "the library, or start a run through labavg.jobs.launch.start_run):\n"
                       + "\n".join(found))


def test_the_subprocess_check_catches_what_it_is_for():
    # the reproduction's sweeps before issue 42, as labavg/studies/reproduction/pipeline.py had them
    assert labavg_subprocesses(
        'proc = subprocess.Popen([sys.executable, "-m", "labavg", "sweep", str(file.resolve()),\n'
        '                         "--out", str(out.resolve()), *recorded], cwd=cwd, stdout=log,\n'
        '                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)\n') == [1]
    assert labavg_subprocesses('cmd = [sys.executable, "-m", "labavg.cli.main", "train"]\n'
                               'x = 1\n'
                               'subprocess.run(cmd, check=True)\n') == [3]
    assert labavg_subprocesses('os.system("labavg info runs")\n'
                               'subprocess.check_output(["labavg", "info"])\n') == [1, 2]
    assert labavg_subprocesses('subprocess.run(command, shell=True)\n'  # a Kaldi pipe
                               'subprocess.run(["python", "-m", "labavgx"])\n'
                               'print("labavg sweep")\n') == []


# Builds a run's averager, and the RBM pretraining's: nowhere else in the library.
AVERAGER_FACTORY = "labavg/averaging/factory.py"


def _averager_classes() -> set[str]:
    """Every averager class: the classes of labavg/averaging/ named *Averager, and each
    declared method's class (registry.methods()'s `where`, "module:Class")."""
    from labavg.averaging.registry import methods

    names = {node.name for path in (REPO / "labavg" / "averaging").glob("*.py")
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.ClassDef) and node.name.endswith("Averager")}
    for method in methods().values():
        where = method.where if isinstance(method.where, str) else method.where.__name__
        names.add(where.rpartition(":")[2])
    return names


def averagers_built(source: str, classes: set[str]) -> list[str]:
    """Where `source` builds an averager: calls one of `classes`, or a method's
    `averager_class()` ("line: name")."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in classes or name == "averager_class":
                found.append((node.lineno, name))
    return [f"{line}: {name}" for line, name in sorted(found)]


def test_one_place_builds_averagers():
    classes = _averager_classes()
    assert {"Averager", "BMUFAverager", "DiLoCoAverager", "HierarchicalAverager",
            "OverlapAverager"} <= classes
    found = _hits(lambda text: averagers_built(text, classes),
                  lambda where: where == AVERAGER_FACTORY)
    assert not found, (f"an averager built outside {AVERAGER_FACTORY} (make_averager, "
                       "make_pretraining_averager):\n" + "\n".join(found))


def test_the_averager_check_catches_what_it_is_for():
    classes = _averager_classes()
    planted = ("from labavg.averaging.methods import Averager\n"
               "averager = Averager(flat, comm, every, restore=False)\n"
               "other = methods()['bmuf'].averager_class()(flat, comm, 4)\n"
               "wrapped = hierarchy.HierarchicalAverager(averager, node, 8)\n"
               "fine = make_averager(plan, 64, flat, comm)\n"
               "class Mine(Averager):\n"
               "    def __init__(self, *a):\n"
               "        super().__init__(*a)\n")
    assert averagers_built(planted, classes) == [
        "2: Averager", "3: averager_class", "4: HierarchicalAverager"]


# Where waiting in a loop belongs: following a run (labavg/jobs/: a handle's events(), a
# followed directory), watching processes and peers (labavg/comm/). The injected hang of a
# fault (labavg/base/faults.py) sleeps in a loop on purpose.
WAITERS = ("labavg/jobs/", "labavg/comm/", "labavg/base/faults.py")


def poll_loops(source: str) -> list[int]:
    """Lines of loops in `source` that poll: a loop around a sleep, a `.poll()` or a timed
    `.wait(...)` (an Event's or a Condition's, as a loop's pause)."""
    lines = set()
    for loop in ast.walk(ast.parse(source)):
        if not isinstance(loop, (ast.While, ast.For)):
            continue
        for node in ast.walk(loop):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if name in ("sleep", "poll") or (name == "wait" and (node.args or node.keywords)):
                    lines.add(loop.lineno)
    return sorted(lines)


def test_no_poll_loop_outside_jobs_and_comm():
    found = _hits(poll_loops, lambda where: where.startswith(WAITERS))
    assert not found, ("a loop that polls outside labavg/jobs and labavg/comm (follow a run "
                       "through its handle's events() and result(), or "
                       "labavg.jobs.followed.FollowedRun):\n" + "\n".join(found))


def test_the_poll_loop_check_catches_what_it_is_for():
    # studies/speedup_study.py before issue 42, and a follower of a run directory
    planted = ("while not handle.done():\n"
               "    for event in handle.poll():\n"
               "        on_event(event)\n"
               "    time.sleep(0.2)\n"
               "while not quit.is_set():\n"
               "    quit.wait(0.2)\n"
               "for event in handle.events():\n"
               "    put(event)\n"
               "done.wait()\n")
    assert poll_loops(planted) == [1, 2, 5]
