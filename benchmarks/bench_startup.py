"""How soon each `labavg` command answers, against the interpreter starting (`python -c pass`).

    .venv/bin/python benchmarks/bench_startup.py [--repeats 9]

Runs each command `--repeats` times as its own process (`python -m labavg ...`, as mpiexec
starts ranks), interleaved so that a change in the machine's load falls on all of them, and
prints the median wall time of each, the median less `python -c pass`'s, and whether torch was
imported (`import torch` alone is timed for scale). `labavg info RUNS` reads one small
finished run this script writes to a temporary folder; `labavg train --set lr=-1` is a refused
setting (exit status 2).
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


def commands(runs: Path) -> dict[str, list[str]]:
    labavg = [sys.executable, "-m", "labavg"]
    return {
        "python -c pass": [sys.executable, "-c", "pass"],
        "python -c 'import torch'": [sys.executable, "-c", "import torch"],
        "labavg --help": [*labavg, "--help"],
        "labavg train --help": [*labavg, "train", "--help"],
        "labavg info --help": [*labavg, "info", "--help"],
        "labavg info RUNS": [*labavg, "info", str(runs)],
        "labavg corpus synth --help": [*labavg, "corpus", "synth", "--help"],
        "labavg train --set lr=-1": [*labavg, "train", "--set", "lr=-1"],
    }


def _time(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def _imports_torch(argv: list[str]) -> bool | None:
    if argv[1:3] != ["-m", "labavg"]:
        return None
    proc = subprocess.run([sys.executable, "-c", TORCH_CHECK, *argv[3:]], cwd=REPO,
                          capture_output=True, text=True)
    return proc.stderr.rstrip().endswith("torch=True")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=9, help="runs of each command (default 9)")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "runs" / "k10"
        run.mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps(
            {"ranks": 2, "backend": "inproc", "averaging": "model", "average_every": 10}))
        todo = commands(run.parent)
        seconds: dict[str, list[float]] = {name: [] for name in todo}
        _time(todo["labavg --help"])  # warm the file cache (.pyc, shared libraries) first
        for _ in range(args.repeats):
            for name, argv in todo.items():
                seconds[name].append(_time(argv))
        torch_loaded = {name: _imports_torch(argv) for name, argv in todo.items()}
    base = statistics.median(seconds["python -c pass"])
    rows = []
    print(f"{'command':30} {'median s':>9} {'- python':>9} {'range s':>13}  torch")
    for name, times in seconds.items():
        median = statistics.median(times)
        loaded = {None: "", True: "imported", False: "no"}[torch_loaded[name]]
        print(f"{name:30} {median:9.3f} {median - base:9.3f} {min(times):6.3f}-{max(times):<6.3f}  "
              f"{loaded}")
        rows.append({"command": name, "median_s": median, "over_python_s": median - base,
                     "min_s": min(times), "max_s": max(times), "torch": torch_loaded[name]})
    print(f"{args.repeats} runs each, interleaved; load average {os.getloadavg()[0]:.1f} at the end")
    if args.json:
        Path(args.json).write_text(json.dumps({"repeats": args.repeats, "rows": rows,
                                               "loadavg": os.getloadavg()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
