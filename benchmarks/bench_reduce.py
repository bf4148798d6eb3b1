"""Reduce algorithms on MPICH: seconds per round against the alpha-beta cost model.

    .venv/bin/python benchmarks/bench_reduce.py [--ranks 2,3,4] [--sizes 65536,...,16777216]
                                                [--reps 9] [--jobs 3] [--json OUT.json]

For each rank count the script starts itself under mpiexec (labavg's local command,
`labavg.comm.launchers.mpiexec_command`). Each rank then times `reduce_mean` of a float32
buffer of every size with every algorithm (allreduce: MPICH's MPI_Allreduce; butterfly and
ring: labavg.comm.reduce over MPI_Sendrecv): a barrier, the reduce, this rank's seconds; the
round's time is the slowest rank's; the figure is the median over `--reps` rounds after two
warm-up rounds. The buffer is refilled before each round, as training rewrites the
parameters between rounds. With `--jobs J` every rank count is launched J times, the jobs
interleaved (2, 3, 4, 2, 3, 4, ...) so that a burst of load on a shared machine does not fall
on one rank count alone, and each figure is the median over the jobs (the JSON keeps them all).

The cost model's alpha (s per message) and beta (s per byte) are fitted on the 2-rank job:
ranks 0 and 1 swap messages of 8 B .. 16 MiB with MPI_Sendrecv, the very step the
algorithms are made of; alpha from the small messages, beta from the large ones
(`fit_alpha_beta`). Not `costfit.fit_network`, which fits them to allreduce times: fitted
to one of the algorithms compared, that algorithm's ratio would be 1 by construction. Predictions are `costmodel.allreduce_seconds` with formula
"rabenseifner" for allreduce (MPICH's choice for messages over 2 KiB) and butterfly, "ring"
for ring. The model has no reduction term and knows nothing of oversubscription: with more
ranks than cores the ratio measured / predicted shows what that costs.

Prints a Markdown table (docs/averaging.md, "Reduce algorithms").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

ALGORITHMS = ("allreduce", "butterfly", "ring")
DEFAULT_SIZES = (65_536, 262_144, 1_048_576, 4_194_304, 16_777_216)
EXCHANGE_SIZES = (8, 64, 512, 4096, 32_768, 262_144, 1_048_576, 4_194_304, 16_777_216)
WARMUP = 2
LATENCY_BYTES = 4096  # exchanges this small give alpha
BANDWIDTH_BYTES = 1_048_576  # exchanges this large give beta


# --------------------------------------------------------------------------- one rank


def _slowest(comm, seconds: float) -> float:
    """The largest of every rank's `seconds` (through the backend's own allreduce)."""
    import torch

    slots = torch.zeros(comm.size, dtype=torch.float64)
    slots[comm.rank] = seconds * comm.size
    comm.allreduce_mean(slots)  # each slot now holds its rank's seconds
    return float(slots.max())


def _timed(comm, fn, refill, reps: int) -> float:
    """Median over `reps` rounds (after WARMUP) of the slowest rank's seconds in `fn()`."""
    rounds = []
    for i in range(WARMUP + reps):
        refill()
        comm.barrier()
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        if i >= WARMUP:
            rounds.append(_slowest(comm, took))
    return statistics.median(rounds)


def worker(sizes: list[int], reps: int, exchange: bool, out: Path) -> None:
    import torch

    from labavg.comm.reduce import reduce_mean
    from labavg.comm.world import open_communicator

    torch.set_num_threads(1)
    comm = open_communicator("mpi")
    result = {"ranks": comm.size, "rounds": {}, "exchange": {}}
    gen = torch.Generator().manual_seed(comm.rank)
    for size in sizes:
        source = torch.randn(size // 4, generator=gen)
        buf = torch.empty_like(source)
        for algorithm in ALGORITHMS:
            result["rounds"][f"{algorithm}/{size}"] = _timed(
                comm, lambda a=algorithm, b=buf: reduce_mean(comm, b, a),
                lambda b=buf, s=source: b.copy_(s), reps)
    if exchange and comm.size >= 2:
        for size in EXCHANGE_SIZES:
            send = torch.randn(max(size // 4, 2), generator=gen)
            recv = torch.empty_like(send)
            peer = 1 - comm.rank

            def swap(send=send, recv=recv, peer=peer):
                if comm.rank < 2:
                    comm.sendrecv(send, peer, recv, peer)

            result["exchange"][str(send.numel() * 4)] = _timed(comm, swap, lambda: None,
                                                              max(reps, 15))
    comm.barrier()
    if comm.rank == 0:
        out.write_text(json.dumps(result))
    comm.close()


# --------------------------------------------------------------------------- the driver


def fit_alpha_beta(exchange: dict[str, float]) -> tuple[float, float]:
    """alpha, beta of t = alpha + beta m: alpha the median time of the messages up to 4 KiB
    (where m beta is noise), beta the least-squares slope of t - alpha over those of 1 MiB and
    more. One line through all sizes fits neither end: on one host a message that stays in
    the caches moves 2-3 times faster per byte than one of 16 MiB, and the algorithms' steps
    are of the large kind (n / 2 .. n / p of a buffer of 64 KiB .. 16 MiB)."""
    sizes = {int(k): t for k, t in exchange.items()}
    alpha = statistics.median(t for m, t in sizes.items() if m <= LATENCY_BYTES)
    large = [(m, t - alpha) for m, t in sizes.items() if m >= BANDWIDTH_BYTES]
    beta = sum(m * t for m, t in large) / sum(m * m for m, _ in large)
    return alpha, max(beta, 0.0)


def run_job(ranks: int, sizes: list[int], reps: int, exchange: bool) -> dict:
    from labavg.comm.launchers import mpiexec_command

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        argv = [str(Path(__file__).resolve()), "--worker", "--sizes",
                ",".join(map(str, sizes)), "--reps", str(reps), "--out", str(out)]
        if exchange:
            argv.append("--exchange")
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        subprocess.run(mpiexec_command(ranks, argv), check=True, env=env, timeout=3600)
        return json.loads(out.read_text())


def median_job(runs: list[dict]) -> dict:
    """One job's figures, each the median of the same figure over `runs`."""
    def median_of(part: str) -> dict[str, float]:
        return {k: statistics.median(r[part][k] for r in runs) for k in runs[0][part]}

    return {"ranks": runs[0]["ranks"], "rounds": median_of("rounds"),
            "exchange": median_of("exchange")}


def _size_text(n: int) -> str:
    return f"{n // 1_048_576} MiB" if n >= 1_048_576 else f"{n // 1024} KiB"


def table(jobs: list[dict], alpha: float, beta: float) -> str:
    from labavg.comm.reduce import COST_MODEL
    from labavg.studies.costmodel import allreduce_seconds

    lines = ["| ranks | buffer | " + " | ".join(f"{a} ms (x model)" for a in ALGORITHMS) + " |",
             "|---|---|" + "---|" * len(ALGORITHMS)]
    for job in jobs:
        p = job["ranks"]
        sizes = sorted({int(k.split("/")[1]) for k in job["rounds"]})
        for n in sizes:
            cells = []
            for algorithm in ALGORITHMS:
                measured = job["rounds"][f"{algorithm}/{n}"]
                predicted = allreduce_seconds(p, n, alpha, beta, COST_MODEL[algorithm])
                cells.append(f"{1e3 * measured:.2f} ({measured / predicted:.1f})")
            lines.append(f"| {p} | {_size_text(n)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,3,4", help="rank counts, comma-separated")
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)),
                        help="buffer bytes, comma-separated (multiples of 4)")
    parser.add_argument("--reps", type=int, default=9, help="timed rounds per figure")
    parser.add_argument("--jobs", type=int, default=1, help="mpiexec jobs per rank count")
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--exchange", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.worker:
        worker(sizes, args.reps, args.exchange, args.out)
        return
    ranks = [int(r) for r in args.ranks.split(",")]
    if 2 not in ranks:
        raise SystemExit("bench_reduce: --ranks must include 2 (alpha and beta are fitted there)")
    load_before = os.getloadavg()
    runs = [run_job(p, sizes, args.reps, exchange=p == 2)
            for _ in range(args.jobs) for p in ranks]
    jobs = [median_job([r for r in runs if r["ranks"] == p]) for p in ranks]
    alpha, beta = fit_alpha_beta(next(j for j in jobs if j["ranks"] == 2)["exchange"])
    print(f"{platform.node()}: {os.cpu_count()} cores, load average {load_before[0]:.1f} before "
          f"and {os.getloadavg()[0]:.1f} after; median of {args.reps} rounds per job, "
          f"of {args.jobs} job(s) per rank count")
    print(f"fitted on the 2-rank MPI_Sendrecv exchange: alpha = {1e6 * alpha:.1f} us, "
          f"beta = {1e9 * beta:.3f} ns/B ({1e-9 / beta:.2f} GB/s)" if beta else
          f"fitted: alpha = {1e6 * alpha:.1f} us, beta = 0")
    exchange = next(j for j in jobs if j["ranks"] == 2)["exchange"]
    print("exchange ms: " + ", ".join(f"{_size_text(int(m)) if int(m) >= 1024 else m + ' B'} "
                                      f"{1e3 * t:.3f}" for m, t in exchange.items()))
    print(table(jobs, alpha, beta))
    if args.json:
        args.json.write_text(json.dumps({"alpha": alpha, "beta": beta, "jobs": runs,
                                         "load_average": [load_before, os.getloadavg()]},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
