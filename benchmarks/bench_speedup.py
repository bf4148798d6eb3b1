"""Does a speedup measured twice, minutes apart, come out the same? (issue: speedup a class can
trust). Never a timed test: a benchmark whose figures go into README.

    .venv/bin/python benchmarks/bench_speedup.py [--hours 0.3] [--ranks 2] [--repeats 3]
        [--gap 120] [--load-in 2] [--json benchmarks/results/speedup-repeat.json]

Each repeat trains the same configuration (default model, K = 10, 1 epoch) once on 1 MPI rank
and once on `--ranks` MPI ranks, through labavg.jobs.launch.start_run, then waits `--gap`
seconds. Two figures per repeat:

  paired   the N-rank run's own speedup (labavg.jobs.speedup: rank 0 alone, then all ranks,
           back to back, several times in the run), median and range over its pairs;
  unpaired the old way: the 1-rank run's training seconds (compute + averaging) over the N-rank
           run's, the 1-rank run taken from the *previous* repeat (minutes earlier), as a run
           found beside another one was paired before.

`--load-in R` runs two busy processes (a 2-core load) beside repeat R only: how each method
reacts to the load changing between the measurements. The spread between repeats of each
figure is the answer: the paired one should agree within 10 %.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from labavg.base.settings import with_overrides
from labavg.data.synth import synthesize
from labavg.jobs.launch import start_run
from labavg.jobs.run_json import RunSummary
from labavg.jobs.speedup import speedup_from_summary
from labavg.training.config import TrainConfig


def _busy(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def _train(base: TrainConfig, out: Path, ranks: int) -> RunSummary:
    return start_run(with_overrides(base, {"out": str(out), "ranks": ranks})).result()


def _training_seconds(summary: RunSummary) -> float:
    return summary.compute_seconds + summary.comm_seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=float, default=0.3)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gap", type=float, default=120.0, help="seconds between repeats")
    ap.add_argument("--load-in", type=int, default=0, help="repeat (1-based) with a 2-core load")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-speedup-"))
    corpus = work / "corpus"
    synthesize(corpus, hours=args.hours, seed=0)
    base = with_overrides(TrainConfig(), {
        "data": {"data": str(corpus)}, "out": str(work / "x"), "backend": "mpi", "epochs": 1,
        "averaging.average_every": 10, "tensorboard": False})
    rows = []
    for i in range(1, args.repeats + 1):
        stop = multiprocessing.Event()
        busy = [multiprocessing.Process(target=_busy, args=(stop,)) for _ in range(2)] \
            if i == args.load_in else []
        for p in busy:
            p.start()
        load = os.getloadavg()[0]
        one = _train(base, work / f"r{i}-n1", 1)
        many = _train(base, work / f"r{i}-n{args.ranks}", args.ranks)
        stop.set()
        for p in busy:
            p.join()
        paired = speedup_from_summary(many)
        unpaired = (_training_seconds(rows[-1]["one"]) / _training_seconds(many)) if rows else None
        rows.append({"repeat": i, "time": time.strftime("%H:%M:%S"), "load_before": load,
                     "loaded": bool(busy), "paired": paired.value, "paired_low": paired.low,
                     "paired_high": paired.high, "pairs": paired.pairs, "cores": paired.cores,
                     "unpaired": unpaired, "one": one, "many": many, "text": paired.text()})
        print(f"repeat {i} at {rows[-1]['time']}{' (2-core load beside it)' if busy else ''}: "
              f"paired {paired.text()}; unpaired "
              f"{'-' if unpaired is None else f'{unpaired:.2f}x'}", flush=True)
        if i < args.repeats:
            time.sleep(args.gap)
    _report(rows, args)
    return 0


def _spread(values: list[float]) -> str:
    if len(values) < 2:
        return "-"
    mid = statistics.median(values)
    return f"{min(values):.2f}-{max(values):.2f}x, {100 * (max(values) - min(values)) / mid:.1f} % of the median"


def _report(rows: list[dict], args) -> None:
    paired = [r["paired"] for r in rows if r["paired"] is not None]
    unpaired = [r["unpaired"] for r in rows if r["unpaired"] is not None]
    quiet = [r["paired"] for r in rows if r["paired"] is not None and not r["loaded"]]
    print(f"paired over {len(paired)} repeats: {_spread(paired)}"
          + (f" (without the loaded repeat: {_spread(quiet)})" if len(quiet) < len(paired) else ""))
    print(f"unpaired over {len(unpaired)} repeats: {_spread(unpaired)}")
    if args.json is not None:
        slim = [{k: v for k, v in r.items() if k not in ("one", "many")} for r in rows]
        args.json.write_text(json.dumps({
            "argv": sys.argv[1:], "cores": os.cpu_count(), "rows": slim,
            "paired_spread": _spread(paired), "unpaired_spread": _spread(unpaired)}, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
