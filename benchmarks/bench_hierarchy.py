"""Hierarchical averaging across emulated nodes: a round within a node against one over all ranks.

    .venv/bin/python benchmarks/bench_hierarchy.py [--rate 1gbit] [--nodes 2] [--per-node 2]
        [--reps 7] [--json out.json]

NODES emulated nodes of PER_NODE MPICH ranks each (scripts/emulated-nodes.sh up NODES RATE:
network namespaces, veth links shaped by tbf; root), so ranks of one node share memory and
ranks of different nodes talk over the shaped links. For float32 buffers of 1, 4 and 16 MB,
every rank times (a) a node round, `labavg.averaging.mean.average_parameters` on the communicator
`averaging.hierarchy.node_size = 0` finds (`labavg.averaging.hierarchy.node_communicator`:
MPI_Comm_split_type, shared memory), and (b) a round over all ranks, what every round of a
flat run is. Each repetition starts at a barrier and lasts for its slowest rank; the tables give
medians after two warm-up repetitions, and what a run averaging within nodes every K1 = 10
minibatches and across them every K2 = 50 spends on rounds per 50 minibatches (4 node rounds + 1
round over all ranks) against the flat run at K = 10 (5 rounds over all ranks). Not a test: one
machine, one run, whatever else it was doing (the load average is recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_network import Emulation, _bad, _mpiexec  # noqa: E402

SIZES = [1 << 20, 4 << 20, 16 << 20]
WARMUP = 2
K1, K2 = 10, 50


def worker(sizes: list[int], reps: int, per_node: int, out: Path) -> None:
    """Time a node round and an all-rank round at every size; rank 0 writes the medians."""
    import torch
    from mpi4py import MPI

    from labavg.averaging.hierarchy import node_communicator
    from labavg.averaging.mean import average_parameters
    from labavg.comm.mpi import MpiCommunicator

    torch.set_num_threads(1)
    comm = MpiCommunicator()
    node = node_communicator(comm, 0)
    world = MPI.COMM_WORLD
    if node.size != per_node:
        raise SystemExit(f"rank {comm.rank}: its node has {node.size} ranks, not {per_node}: "
                         "the hosts did not place the ranks as asked")
    scopes = {"node": node, "all": comm}
    buffers = [torch.ones(n // 4, dtype=torch.float32) for n in sizes]
    walls = {(n, s): [] for n in sizes for s in scopes}
    for rep in range(WARMUP + reps):
        for n, flat in zip(sizes, buffers):
            for scope, group in scopes.items():
                comm.barrier()
                t0 = time.perf_counter()
                average_parameters(flat, group)
                wall = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
                if rep >= WARMUP:
                    walls[(n, scope)].append(wall)
    if world.rank == 0:
        rows = [{"n_bytes": n, **{f"{s}_s": statistics.median(walls[(n, s)]) for s in scopes},
                 **{f"{s}_all_s": walls[(n, s)] for s in scopes}} for n in sizes]
        out.write_text(json.dumps({"ranks": world.size, "node_ranks": node.size, "rows": rows},
                                  indent=1) + "\n")


def table(result: dict, rate: str, nodes: int) -> str:
    """The measured rounds and what K1 = 10 within nodes, K2 = 50 across them saves."""
    lines = [f"{nodes} nodes x {result['node_ranks']} ranks, links {rate}; seconds per round "
             f"(median, slowest rank); per {K2} minibatches: flat K = {K1} ({K2 // K1} rounds "
             f"over all ranks) vs hierarchical K1 = {K1}, K2 = {K2} ({K2 // K1 - 1} node rounds + 1)",
             "",
             "| buffer | node round s | all-rank round s | node / all | flat K=10 s | "
             "hierarchical s | hierarchical / flat |",
             "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        node, every = row["node_s"], row["all_s"]
        flat = K2 // K1 * every
        hier = (K2 // K1 - 1) * node + every
        lines.append(f"| {row['n_bytes'] / 2**20:.0f} MiB | {node:.4f} | {every:.4f} | "
                     f"{node / every:.2f} | {flat:.3f} | {hier:.3f} | {hier / flat:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="1gbit", help="tc rate of every link, or none")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", help="also write what was measured here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(SIZES, args.reps, args.per_node, Path(args.worker_out))
        return
    if os.geteuid() != 0:
        _bad("emulated nodes need root (network namespaces)")
    if args.nodes < 2 or args.per_node < 2 or args.nodes * args.per_node > 16:
        _bad("need at least 2 nodes of at least 2 ranks, 16 ranks at most")
    if args.reps < 3:
        _bad(f"--reps {args.reps}: a median needs at least 3")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-hierarchy-") as tmp:
        out = Path(tmp) / "rounds.json"
        argv = [str(Path(__file__).resolve()), "--worker", "--reps", str(args.reps),
                "--per-node", str(args.per_node), "--worker-out", str(out)]
        with Emulation(args.nodes, args.rate, Path(tmp) / "nodes") as nodes:
            hosts = [f"{h}:{args.per_node}" for h in nodes.hosts]
            _mpiexec(args.nodes * args.per_node, argv, hosts, nodes.env, timeout=1800)
        result = json.loads(out.read_text())
    text = table(result, args.rate, args.nodes)
    machine = {"cpus": os.cpu_count(), "loadavg_before": load_before,
               "loadavg_after": os.getloadavg(), "reps": args.reps}
    print(text)
    print(f"\nload average {load_before[0]:.1f} before, {machine['loadavg_after'][0]:.1f} after, "
          f"{machine['cpus']} CPUs")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "result": result,
                                               "markdown": text}, indent=1) + "\n")


if __name__ == "__main__":
    main()
