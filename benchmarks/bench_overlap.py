"""Overlap (labavg.averaging.overlap) on MPICH: the seconds a round holds a rank, blocking vs eager vs
streaming, with and without MPICH's asynchronous progress thread.

    .venv/bin/python benchmarks/bench_overlap.py [--params 2500000] [--rounds 12] [--k 5]
                                                 [--passes 2] [--json OUT.json]

The script starts itself twice under mpiexec with 2 ranks (labavg's local command), once
as it is and once with MPIR_CVAR_ASYNC_PROGRESS=1 (MPICH advances a non-blocking collective
only inside MPI calls unless a progress thread does it). Each rank holds a float32 buffer of
`--params` values cut into 8 parameter tensors (4 layers' weights and biases), and between
two rounds computes K "minibatches": a fixed matmul workload, the stand-in for train_step,
that also writes into the buffer as SGD would. A round is the real averager's round:
Averager.round (none), OverlapAverager.round in eager and in streaming (4 fragments) mode.
Modes are run one after the other, `--passes` times (none, eager, streaming, none, ...);
every figure is the median over all rounds of rank 0, after two warm-up rounds per pass.

Reported per mode: blocked s/round (the round's comm_seconds: what the rank waited, the
control allreduce and the start of the next mean included), the wait alone, compute s/round,
bytes per round, and
    hidden share = 1 - (blocked s per byte) / (blocked s per byte of `none` in the same job):
the share of the blocking round's communication per byte that the rank no longer waits for.
Prints a Markdown table (docs/averaging.md, "Overlap").
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

MODES = ("none", "eager", "streaming")
FRAGMENTS = 4
WARMUP = 2


def _sizes(params: int) -> list[int]:
    """8 tensors: 4 layers' weights and (small) biases, adding up to `params`."""
    bias = 512
    weight = (params - 4 * bias) // 4
    sizes = [weight, bias] * 4
    sizes[-2] += params - sum(sizes)
    return sizes


def _compute(flat, work):
    """One stand-in minibatch: fixed matmuls, and an SGD-like write into the parameters."""
    import torch

    a, b = work
    for _ in range(4):
        a = torch.tanh(a @ b)
    flat.add_(a.mean() * 1e-7)


def _rank(args) -> None:
    import torch

    from labavg.averaging.methods import ALL, Averager
    from labavg.comm.world import open_communicator
    from labavg.averaging.overlap import OVERLAP, OverlapAverager, fragment_bounds

    torch.set_num_threads(1)
    comm = open_communicator("mpi")
    sizes = _sizes(args.params)
    gen = torch.Generator().manual_seed(comm.rank)
    work = (torch.randn(256, 512, generator=gen), torch.randn(512, 512, generator=gen) / 23)
    rows = {mode: [] for mode in MODES}
    for _ in range(args.passes):
        for mode in MODES:
            flat = torch.randn(args.params, generator=torch.Generator().manual_seed(7))
            if mode == "none":
                averager, scope = Averager(flat, comm), ALL
            else:
                fragments = 1 if mode == "eager" else FRAGMENTS
                bounds = fragment_bounds(sizes, fragments)
                averager = OverlapAverager([Averager(flat[a:b], comm) for a, b in bounds],
                                           bounds, comm, mode)
                scope = OVERLAP
            comm.barrier()
            for r in range(WARMUP + args.rounds):
                t0 = time.perf_counter()
                for _ in range(args.k):
                    _compute(flat, work)
                compute = time.perf_counter() - t0
                stats = averager.round(flat, scope=scope)
                if r >= WARMUP:
                    rows[mode].append({"blocked": stats.comm_seconds, "compute": compute,
                                       "wait": getattr(stats, "wait_seconds", stats.comm_seconds),
                                       "bytes": stats.bytes_sent})
            if mode != "none":
                averager.round(flat, scope=ALL)  # finish the mean in flight
    if comm.rank == 0:
        Path(args.out).write_text(json.dumps(rows))
    comm.close()


def _summarise(rows) -> dict[str, dict[str, float]]:
    med = {m: {k: statistics.median(r[k] for r in rows[m]) for k in rows[m][0]} for m in rows}
    base = med["none"]["blocked"] / med["none"]["bytes"]
    for m in med:
        med[m]["hidden"] = 1.0 - (med[m]["blocked"] / med[m]["bytes"]) / base
    return med


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=2_500_000)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--json")
    parser.add_argument("--rank-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_out:
        args.out = args.rank_out
        _rank(args)
        return
    from labavg.comm.launchers import mpiexec_command

    results = {}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for label, extra in (("default", {}), ("async progress", {"MPIR_CVAR_ASYNC_PROGRESS": "1"})):
            out = Path(tmp) / "rows.json"
            command = mpiexec_command(2, [str(Path(__file__).resolve()), "--params",
                                          str(args.params), "--rounds", str(args.rounds), "--k",
                                          str(args.k), "--passes", str(args.passes),
                                          "--rank-out", str(out)])
            env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
            subprocess.run(command, check=True, env=env, timeout=900)
            results[label] = json.loads(out.read_text())
    load_after = os.getloadavg()
    print(f"2 MPICH ranks, {args.params} float32 parameters, K = {args.k}, {args.rounds} rounds "
          f"x {args.passes} passes per mode; {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}; "
          f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after\n")
    print("| MPICH | overlap | bytes/round | compute s/round | blocked s/round | of which wait "
          "| hidden share |")
    print("|---|---|---|---|---|---|---|")
    summary = {}
    for label, rows in results.items():
        med = summary[label] = _summarise(rows)
        for mode in MODES:
            m = med[mode]
            print(f"| {label} | {mode} | {int(m['bytes'])} | {m['compute']:.4f} | "
                  f"{m['blocked']:.4f} | {m['wait']:.4f} | {m['hidden']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"raw": results, "median": summary,
                                               "load": [load_before, load_after]}, indent=1))


if __name__ == "__main__":
    main()
