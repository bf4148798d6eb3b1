"""How long an elastic run takes to go on without a killed worker, and to take a joiner in.

    .venv/bin/python benchmarks/bench_elastic_recovery.py --data data/synth [--kills 5] [--ranks 3]

Each trial starts `labavg train --backend torch --set on_rank_loss="continue"` (a small model,
enough epochs to outlast the trial), waits for its rounds, kills the highest rank's process
group (SIGKILL, as a lost machine) and reads the survivors' member_lost events: recovery is the
time from the kill to the first round committed without it (the event's `time`). Then
`labavg.jobs.elastic_join.join` starts a worker in its place: the rejoin time is from the
request to the first round the joiner takes part in (member_joined). The run is then stopped
(SIGTERM to the launching command). Prints each trial, the median and range, cores and load.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _events(run: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()
                if line.endswith("}")]
    except OSError:
        return []


def _wait(predicate, timeout: float, what: str):
    from labavg.base.waiting import wait_until

    found = wait_until(predicate, timeout, 0.05)
    if not found:
        raise SystemExit(f"timed out waiting for {what}")
    return found


def trial(data: str, ranks: int, heartbeat_ms: int, root: Path) -> tuple[float, float]:
    from labavg.jobs.elastic_join import join, lose

    run = root / f"run{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "labavg", "train", "--data", data, "--out", str(run),
           "--backend", "torch", "--ranks", str(ranks), "--epochs", "200", "--hidden-layers", "2",
           "--hidden-dim", "64", "--minibatch", "32", "--average-every", "5", "--no-progress",
           "--speedup-pairs", "0", "--set", 'on_rank_loss="continue"',
           "--set", f"elastic.heartbeat_ms={heartbeat_ms}"]
    job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait(lambda: sum(e["type"] == "average" for e in _events(run)) >= 3 * ranks, 180,
              "the first rounds")
        killed_at = time.time()
        lost = lose(run)
        first = _wait(lambda: [e for e in _events(run) if e["type"] == "member_lost"], 60,
                      "member_lost")
        recovery = min(e["time"] for e in first) - killed_at
        # Where the survivors' time went: the admission round that saw the loss (a round cut
        # short by the kill is run again inside it: the lighthouse waits out the heartbeat).
        print(f"  killed rank {lost}; member_lost admission round "
              f"{max(e['round_seconds'] for e in first):.2f} s", flush=True)
        asked = time.time()
        join(run, timeout=120)
        joined = [e for e in _events(run) if e["type"] == "member_joined" and lost in e["joined"]]
        rejoin = min(e["time"] for e in joined) - asked
        return recovery, rejoin
    finally:
        job.send_signal(signal.SIGTERM)
        job.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--heartbeat-ms", type=int, default=1000)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    recoveries, rejoins = [], []
    with tempfile.TemporaryDirectory(prefix="labavg-recovery-") as root:
        for i in range(args.kills):
            recovery, rejoin = trial(args.data, args.ranks, args.heartbeat_ms, Path(root))
            recoveries.append(recovery)
            rejoins.append(rejoin)
            print(f"trial {i + 1}: recovery {recovery:.2f} s, rejoin {rejoin:.2f} s", flush=True)
    print(f"recovery (kill -> first round without it), heartbeat {args.heartbeat_ms} ms, "
          f"{args.ranks} workers: median {statistics.median(recoveries):.2f} s, range "
          f"{min(recoveries):.2f}-{max(recoveries):.2f} s over {args.kills} kills")
    print(f"rejoin (join asked -> first round with it): median {statistics.median(rejoins):.2f} s,"
          f" range {min(rejoins):.2f}-{max(rejoins):.2f} s")
    print(f"{os.cpu_count()} cores; load (1 min) {load:.2f} at the start, "
          f"{os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
