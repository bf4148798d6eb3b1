"""What an elastic round costs beside the torch backend's plain allreduce, paired.

    .venv/bin/python benchmarks/bench_elastic.py [--workers 2] [--rounds 100] [--params 107128 1075320]

Every worker holds both a plain gloo group (torch.distributed, as `--backend torch` uses) and an
elastic communicator (labavg.comm.elastic: torchft quorum, allreduce, should_commit) and runs
their means alternately on the same buffer, each after a plain barrier, so each pair is taken
under the same load; then the elastic mean again after an admission round, as a trainer's
averaging round runs it. 107128 floats is the 40-256-256-120 MLP of the issue's check; 1075320 is
labavg's default DNN. Prints the median of each, the median of the paired differences with its
interquartile range, the cores and the load.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, size: int, port: int, lighthouse: str, rounds: int, params: list[int],
            out: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    from labavg.comm.elastic import ElasticCommunicator

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    elastic = ElasticCommunicator(rank, size, lighthouse, timeout_s=30, quorum_timeout_s=60)
    elastic.gather(60)
    result = {}
    for n in params:
        buf = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        plain, ft, admitted = [], [], []
        for i in range(rounds + 5):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            buf.div_(size)
            t1 = time.perf_counter()
            dist.barrier()
            t2 = time.perf_counter()
            elastic.allreduce_mean(buf)
            t3 = time.perf_counter()
            dist.barrier()
            # A trainer's averaging round: the admission round that opens it, then the mean.
            t4 = time.perf_counter()
            elastic.admit()
            elastic.allreduce_mean(buf)
            t5 = time.perf_counter()
            if i >= 5:
                plain.append(t1 - t0)
                ft.append(t3 - t2)
                admitted.append(t5 - t4)
        result[n] = (plain, ft, admitted)
    out.put((rank, result))
    elastic.close()
    dist.destroy_process_group()


def _paired(plain: list[float], other: list[float]) -> tuple[float, list[float]]:
    """Median and interquartile range of the paired differences, in ms."""
    diff = sorted(b - a for a, b in zip(plain, other))
    return 1e3 * statistics.median(diff), [1e3 * diff[len(diff) // 4],
                                           1e3 * diff[3 * len(diff) // 4]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--params", type=int, nargs="+", default=[107128, 1075320])
    args = parser.parse_args()
    from labavg.comm.elastic import Lighthouse

    lighthouse = Lighthouse(heartbeat_ms=1000)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    load = os.getloadavg()[0]
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.workers, port, lighthouse.address,
                                               args.rounds, args.params, out))
             for r in range(args.workers)]
    for p in procs:
        p.start()
    results = dict(out.get() for _ in procs)
    for p in procs:
        p.join()
    lighthouse.close()
    rows = []
    for n in args.params:
        plain, ft, admitted = results[0][n]  # rank 0's clock
        (extra, iqr), (extra_admit, iqr_admit) = _paired(plain, ft), _paired(plain, admitted)
        rows.append({"params": n, "plain_ms": 1e3 * statistics.median(plain),
                     "elastic_ms": 1e3 * statistics.median(ft), "extra_ms": extra,
                     "extra_iqr_ms": iqr, "averaging_round_ms": 1e3 * statistics.median(admitted),
                     "averaging_extra_ms": extra_admit, "averaging_extra_iqr_ms": iqr_admit})
        print(f"{n:>9} floats x {args.workers} workers: plain allreduce "
              f"{rows[-1]['plain_ms']:.2f} ms, elastic round {rows[-1]['elastic_ms']:.2f} ms "
              f"(paired extra {extra:.2f} ms, IQR {iqr[0]:.2f} to {iqr[1]:.2f}); with its "
              f"admission round {rows[-1]['averaging_round_ms']:.2f} ms (paired extra "
              f"{extra_admit:.2f} ms, IQR {iqr_admit[0]:.2f} to {iqr_admit[1]:.2f}); "
              f"{args.rounds} pairs")
    print(f"{os.cpu_count()} cores; load (1 min) {load:.2f} at the start, "
          f"{os.getloadavg()[0]:.2f} at the end")
    print(json.dumps({"workers": args.workers, "rounds": args.rounds, "rows": rows,
                      "cores": os.cpu_count(), "load": [load, os.getloadavg()[0]]}))


if __name__ == "__main__":
    main()
