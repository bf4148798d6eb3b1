"""How long a `labavg train` job spends outside its training loop: the whole command's wall
time less the summary's `wall_seconds` (the loop's wall, labavg.training.rank), for 1 rank
(the default backend) and 2 MPI ranks (`--backend mpi --ranks 2`), on a tiny corpus.

    .venv/bin/python benchmarks/bench_job_startup.py [--repeats 7] [--against DIR] [--json F]

The corpus is synthesised once (0.02 h, seed 3, as tests/conftest.py's) to a temporary folder
and every run trains on it with the tiny settings of tests/test_train.py. The runs are
interleaved (1 rank, 2 ranks, then the same of `--against`, round after round), so that a
change in the machine's load falls on all of them. Reported per kind of run: the median of
(whole wall - loop wall) with its min-max, the whole wall, and the CPU seconds of the process
tree (user + sys of the command and everything it waited for: mpiexec, the ranks), which a
busy machine inflates less than the wall. `--against DIR` runs the same commands from another
copy of the source (`git worktree add DIR COMMIT`), its own `python -m labavg` found there.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = ["--minibatch", "64", "--epochs", "1", "--hidden-layers", "1", "--hidden-dim", "32",
        "--context", "2", "--average-every", "3", "--no-progress", "--set", "tensorboard=false",
        "--set", "data.buffer_frames=2048"]
KINDS = {"1 rank": [], "2 MPI ranks": ["--backend", "mpi", "--ranks", "2"]}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(source: Path, corpus: Path, out: Path, extra: list[str]) -> dict[str, float]:
    """One `labavg train` from `source`: its whole wall, the loop's wall, the tree's CPU s."""
    argv = [sys.executable, "-m", "labavg", "train", "--data", str(corpus), "--out", str(out),
            *TINY, *extra]
    env = {**os.environ, "PYTHONPATH": str(source)}
    cpu = _children_cpu()
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=source, env=env, capture_output=True, text=True)
    whole = time.perf_counter() - start
    cpu = _children_cpu() - cpu
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    loop = summary["wall_seconds"]
    return {"whole_s": whole, "loop_s": loop, "outside_s": whole - loop, "cpu_s": cpu,
            "process_s": summary.get("process_seconds") or float("nan")}


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7, help="runs of each kind (default 7)")
    ap.add_argument("--against", type=Path, help="another copy of the source, run alike")
    ap.add_argument("--corpus", type=Path, help="a corpus to use instead of synthesising one")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    sources = {"": REPO} | ({f" [{args.against.name}]": args.against.resolve()}
                            if args.against else {})
    with tempfile.TemporaryDirectory() as tmp:
        corpus = args.corpus
        if corpus is None:
            corpus = Path(tmp) / "corpus"
            subprocess.run([sys.executable, "-m", "labavg", "corpus", "synth", str(corpus),
                            "--hours", "0.02", "--seed", "3", "--dev-hours", "0.01",
                            "--test-hours", "0.01"], cwd=REPO, check=True,
                           stdout=subprocess.DEVNULL)
        todo = {kind + tag: (source, extra) for kind, extra in KINDS.items()
                for tag, source in sources.items()}
        results: dict[str, list[dict[str, float]]] = {name: [] for name in todo}
        for i, (source, extra) in enumerate(todo.values()):  # warm the file cache first
            run_once(source, corpus, Path(tmp) / f"warm{i}", extra)
        for rep in range(args.repeats):
            for i, (name, (source, extra)) in enumerate(todo.items()):
                results[name].append(run_once(source, corpus, Path(tmp) / f"r{rep}-{i}", extra))
    rows = []
    print(f"{'run':28} {'outside loop s (min-max)':>26} {'whole wall s':>13} {'loop s':>7} "
          f"{'tree CPU s':>11}")
    for name, runs in results.items():
        row = {"run": name, "repeats": len(runs),
               **{key: _spread([r[key] for r in runs])
                  for key in ("outside_s", "whole_s", "loop_s", "cpu_s")}}
        rows.append(row)
        o = row["outside_s"]
        print(f"{name:28} {o['median']:9.2f} ({o['min']:.2f}-{o['max']:.2f}){'':>5} "
              f"{row['whole_s']['median']:13.2f} {row['loop_s']['median']:7.2f} "
              f"{row['cpu_s']['median']:11.2f}")
    load = os.getloadavg()
    print(f"{args.repeats} runs each, interleaved; medians (min-max); load average "
          f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at the end; {os.cpu_count()} cores")
    if args.json:
        Path(args.json).write_text(json.dumps({"repeats": args.repeats, "rows": rows,
                                               "loadavg": load, "cores": os.cpu_count()},
                                              indent=2) + "\n")


if __name__ == "__main__":
    main()
