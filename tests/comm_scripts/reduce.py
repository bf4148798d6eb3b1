"""One rank's run of every reduce algorithm, shared by the inproc, MPI and torch tests.

Run as a script under a launcher: `python reduce.py BACKEND OUT_DIR`; each rank writes
OUT_DIR/rank{R}.npz (one array per algorithm and case) for the test to compare. The inproc
test imports `exercise` directly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

SEED = 4321
# (length, dtype): shorter than the ranks (empty chunks), odd lengths, and one of 1.2 MB, past
# MPICH's eager limit, where two blocking sends facing each other would deadlock.
CASES = ((1, np.float32), (6, np.float32), (1001, np.float32), (1001, np.float64),
         (300_007, np.float32))
ALGORITHMS = ("allreduce", "butterfly", "ring")


def contribution(rank: int, length: int, dtype=np.float32) -> np.ndarray:
    """Rank `rank`'s seeded buffer; magnitudes differ by rank so the summation order shows."""
    values = np.random.default_rng(SEED + rank).standard_normal(length) * 10.0 ** (rank % 3)
    return values.astype(dtype)


def key(algorithm: str, length: int, dtype) -> str:
    return f"{algorithm}_{length}_{np.dtype(dtype).name}"


def exercise(comm, cases=CASES) -> dict[str, np.ndarray]:
    """The mean of every case by every algorithm, as this rank got it."""
    from labavg.comm.reduce import reduce_mean

    out = {"rank": np.array(comm.rank), "size": np.array(comm.size)}
    for length, dtype in cases:
        for algorithm in ALGORITHMS:
            buf = torch.from_numpy(contribution(comm.rank, length, dtype))
            reduce_mean(comm, buf, algorithm)
            out[key(algorithm, length, dtype)] = buf.numpy()
    return out


def main(backend: str, out_dir: str) -> None:
    from labavg.comm.world import open_communicator

    comm = open_communicator(backend)
    results = exercise(comm)
    comm.barrier()
    np.savez(Path(out_dir) / f"rank{comm.rank}.npz", **results)
    comm.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
