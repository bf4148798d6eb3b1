"""What one averaging round costs between MPI ranks that arrive together: the bare mean of the
flat parameter buffer against the whole `average_parameters` round (the finiteness and stop
agreement, the squared norms for the divergence: docs/averaging.md, "What a round costs").
Issue 45 asks for the round at most 1.5x the bare mean.

    .venv/bin/python benchmarks/bench_round.py [--ranks 2] [--rounds 50] [--params 1075320]

Each timed round starts right after a barrier, so no rank waits for a slower one: the
numbers are the transfer and the bookkeeping, which bench_train's `wait_split` cannot
separate from each other. MPICH settings are read from the environment (MPIR_CVAR_*).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time


def _rank(rounds: int, params: int) -> None:
    import torch

    from labavg.averaging.mean import average_parameters
    from labavg.comm.mpi import MpiCommunicator

    torch.set_num_threads(1)
    comm = MpiCommunicator()
    flat = torch.randn(params, generator=torch.Generator().manual_seed(comm.rank))
    bare, whole = [], []
    for i in range(rounds + 10):
        comm.barrier()
        t0 = time.perf_counter()
        comm.allreduce_mean(flat)
        t1 = time.perf_counter()
        comm.barrier()
        t2 = time.perf_counter()
        average_parameters(flat, comm)
        t3 = time.perf_counter()
        if i >= 10:
            bare.append(t1 - t0)
            whole.append(t3 - t2)
    if comm.rank == 0:
        def q(x):
            quart = statistics.quantiles(x, n=4)
            return (f"median {1e3 * statistics.median(x):.2f} ms (IQR {1e3 * quart[0]:.2f}-"
                    f"{1e3 * quart[2]:.2f}, min {1e3 * min(x):.2f}, max {1e3 * max(x):.2f})")
        print(f"{comm.size} ranks, {params} float32 parameters ({4 * params / 1e6:.1f} MB), {rounds} rounds")
        print("allreduce_mean       ", q(bare))
        print("average_parameters   ", q(whole))
        # Paired: each round beside the bare mean timed just before it.
        ratios = [w / b for w, b in zip(whole, bare)]
        print(f"ratio per pair        median {statistics.median(ratios):.2f} "
              f"(IQR {statistics.quantiles(ratios, n=4)[0]:.2f}-{statistics.quantiles(ratios, n=4)[2]:.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--params", type=int, default=1075320, help="default: the default DNN's")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank:
        _rank(args.rounds, args.params)
        return
    from labavg.comm.launchers import mpiexec_command

    cmd = mpiexec_command(args.ranks, [__file__, "--rank", "--rounds", str(args.rounds),
                                       "--params", str(args.params)])
    subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
