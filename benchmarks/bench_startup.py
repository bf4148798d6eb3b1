"""How soon each `labavg` command answers, against the interpreter starting (`python -c pass`).

    .venv/bin/python benchmarks/bench_startup.py [--repeats 9] [--against DIR]

Runs each command `--repeats` times as its own process (`python -m labavg ...`, as mpiexec
starts ranks), interleaved so that a change in the machine's load falls on all of them, and
prints the median wall time of each, the median less `python -c pass`'s, and whether torch was
imported (`import torch` alone is timed for scale). `labavg info RUNS` reads one small
finished run this script writes to a temporary folder; `labavg train --set lr=-1` is a refused
setting (exit status 2). `--against DIR` also runs the labavg commands in DIR, another copy of
the source (`git archive COMMIT labavg | tar -x -C DIR`), in the same rounds, so that both
columns are measured under the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCH_CHECK = ("import runpy, sys\n"
               "sys.argv = ['labavg', *sys.argv[1:]]\n"
               "try:\n    runpy.run_module('labavg', run_name='__main__')\n"
               "except SystemExit as exc:\n    code = exc.code\n"
               "sys.stderr.write('torch=%s\\n' % ('torch' in sys.modules))\n")


def commands(runs: Path, against: Path | None) -> dict[str, tuple[list[str], Path]]:
    """name -> (argv, the folder it runs in: `-m labavg` imports the labavg found there)."""
    labavg = [sys.executable, "-m", "labavg"]
    todo = {"python -c pass": ([sys.executable, "-c", "pass"], REPO),
            "python -c 'import torch'": ([sys.executable, "-c", "import torch"], REPO)}
    for name, args in (("--help", ["--help"]), ("train --help", ["train", "--help"]),
                       ("info --help", ["info", "--help"]), ("info RUNS", ["info", str(runs)]),
                       ("corpus synth --help", ["corpus", "synth", "--help"]),
                       ("train --set lr=-1", ["train", "--set", "lr=-1"])):
        todo[f"labavg {name}"] = ([*labavg, *args], REPO)
        if against is not None:
            todo[f"labavg {name} [{against.name}]"] = ([*labavg, *args], against)
    return todo


def _time(argv: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    subprocess.run(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def _imports_torch(argv: list[str], cwd: Path) -> bool | None:
    if argv[1:3] != ["-m", "labavg"]:
        return None
    proc = subprocess.run([sys.executable, "-c", TORCH_CHECK, *argv[3:]], cwd=cwd,
                          capture_output=True, text=True)
    return proc.stderr.rstrip().endswith("torch=True")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=9, help="runs of each command (default 9)")
    ap.add_argument("--against", type=Path, help="another copy of the source to time too")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "runs" / "k10"
        run.mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps(
            {"ranks": 2, "backend": "inproc", "averaging": "model", "average_every": 10}))
        todo = commands(run.parent, args.against and args.against.resolve())
        seconds: dict[str, list[float]] = {name: [] for name in todo}
        for name, (argv, cwd) in todo.items():
            _time(argv, cwd)  # warm the file cache (.pyc, shared libraries) first
        for _ in range(args.repeats):
            for name, (argv, cwd) in todo.items():
                seconds[name].append(_time(argv, cwd))
        torch_loaded = {name: _imports_torch(argv, cwd) for name, (argv, cwd) in todo.items()}
    base = statistics.median(seconds["python -c pass"])
    rows = []
    print(f"{'command':42} {'median s':>9} {'- python':>9} {'range s':>13}  torch")
    for name, times in seconds.items():
        median = statistics.median(times)
        loaded = {None: "", True: "imported", False: "no"}[torch_loaded[name]]
        print(f"{name:42} {median:9.3f} {median - base:9.3f} {min(times):6.3f}-{max(times):<6.3f}  "
              f"{loaded}")
        rows.append({"command": name, "median_s": median, "over_python_s": median - base,
                     "min_s": min(times), "max_s": max(times), "torch": torch_loaded[name]})
    print(f"{args.repeats} runs each, interleaved; load average {os.getloadavg()[0]:.1f} at the end")
    if args.json:
        Path(args.json).write_text(json.dumps({"repeats": args.repeats, "rows": rows,
                                               "loadavg": os.getloadavg()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
