"""Smaller payloads on MPICH: bytes and seconds per averaging round for each payload.

    .venv/bin/python benchmarks/bench_payload.py [--ranks 2] [--params 2500000] [--reps 9]
                                                 [--json OUT.json]

The script starts itself under mpiexec (`labavg.comm.launchers.mpiexec_command`). Each rank
holds a float32 parameter buffer of `--params` values and, for each payload (fp32, bf16,
fp16, int16, int8, int4; labavg.averaging.payload), runs plain-averaging rounds (`Averager.round`):
before each round the buffer gets a fresh small change, as a block of training would give it;
then a barrier, the round, this rank's seconds. A round's time is the slowest rank's; the
figure is the median over `--reps` rounds after two warm-up rounds, the payloads interleaved
round by round so that a burst of load on a shared machine does not fall on one of them.
`bytes_sent` is what the round reports (this rank's share of the collective); the ratios are
to fp32 in the same job. Prints a Markdown table (docs/averaging.md, "Smaller payloads").
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
FORMATS = (("fp32", 8), ("bf16", 8), ("fp16", 8), ("int", 16), ("int", 8), ("int", 4))


def name(payload: str, bits: int) -> str:
    return payload if payload != "int" else f"int{bits}"


def worker(params: int, reps: int, out: Path) -> None:
    import torch

    from labavg.averaging.methods import Averager
    from labavg.comm.world import open_communicator

    torch.set_num_threads(1)
    comm = open_communicator("mpi")
    gen = torch.Generator().manual_seed(1 + comm.rank)
    start = torch.randn(params, generator=torch.Generator().manual_seed(0))
    runs = {}
    for payload, bits in FORMATS:
        flat = start.clone()
        runs[name(payload, bits)] = (flat, Averager(flat, comm, payload=payload, bits=bits))
    seconds = {k: [] for k in runs}
    sent = {}
    for rep in range(reps + 2):
        for key, (flat, averager) in runs.items():
            flat.add_(torch.randn(params, generator=gen), alpha=1e-3)
            comm.barrier()
            t0 = time.perf_counter()
            stats = averager.round(flat)
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            # The round takes as long as its slowest rank; the seam has no max-allreduce.
            gathered = torch.empty(comm.size, dtype=torch.float64)
            comm.allgather(elapsed, gathered)
            if rep >= 2:
                seconds[key].append(gathered.max().item())
            sent[key] = stats.bytes_sent
    if comm.rank == 0:
        out.write_text(json.dumps({
            "ranks": comm.size, "params": params, "reps": reps,
            "seconds": {k: statistics.median(v) for k, v in seconds.items()},
            "all_seconds": seconds, "bytes_sent": sent}))
    comm.barrier()
    comm.close()


def run_job(ranks: int, params: int, reps: int) -> dict:
    from labavg.comm.launchers import mpiexec_command

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        argv = [str(Path(__file__).resolve()), "--worker", "--params", str(params), "--reps",
                str(reps), "--out", str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        subprocess.run(mpiexec_command(ranks, argv), check=True, env=env, timeout=3600)
        return json.loads(out.read_text())


def table(result: dict) -> str:
    base_s, base_b = result["seconds"]["fp32"], result["bytes_sent"]["fp32"]
    lines = [f"{result['ranks']} MPICH ranks, {result['params']:,} parameters, median of "
             f"{result['reps']} rounds", "",
             "| payload | bytes per round | / fp32 | seconds per round | / fp32 |",
             "|---|---|---|---|---|"]
    for key, seconds in result["seconds"].items():
        sent = result["bytes_sent"][key]
        lines.append(f"| {key} | {sent:,} | {sent / base_b:.3f} | {seconds:.4f} | "
                     f"{seconds / base_s:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--params", type=int, default=2_500_000)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.params, args.reps, args.out)
        return
    result = run_job(args.ranks, args.params, args.reps)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))


if __name__ == "__main__":
    sys.exit(main())
