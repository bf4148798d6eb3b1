"""One rank's checks of the communicator collectives, shared by the inproc, MPI and torch tests.

Run as a script under a launcher: `python collectives.py BACKEND OUT_DIR`; each rank writes
OUT_DIR/rank{R}.npz for the test to compare. The inproc test imports `exercise` directly.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

LENGTH = 1001
SEED = 1234


def contribution(rank: int, dtype: np.dtype = np.float32) -> np.ndarray:
    """Rank `rank`'s seeded buffer; magnitudes differ by rank so the summation order shows."""
    values = np.random.default_rng(SEED + rank).standard_normal(LENGTH) * 10.0 ** (rank % 3)
    return values.astype(dtype)


def barrier_count(comm, marker_dir: Path) -> int:
    """Markers visible after a barrier; rank 0 writes its marker late, so only a real barrier sees all."""
    if comm.rank == 0:
        time.sleep(0.3)
    (marker_dir / f"marker{comm.rank}").touch()
    comm.barrier()
    return len(list(marker_dir.glob("marker*")))


def exercise(comm, marker_dir: Path) -> dict[str, np.ndarray]:
    """Mean of every rank's contribution (float32 and float64), a broadcast from the last rank, a barrier."""
    mean32 = torch.from_numpy(contribution(comm.rank))
    comm.allreduce_mean(mean32)
    mean64 = torch.from_numpy(contribution(comm.rank, np.float64))
    comm.allreduce_mean(mean64)
    root = comm.size - 1
    bcast = torch.from_numpy(contribution(comm.rank))
    comm.broadcast(bcast, root=root)
    return {
        "rank": np.array(comm.rank),
        "size": np.array(comm.size),
        "local_rank": np.array(comm.local_rank),
        "mean32": mean32.numpy(),
        "mean64": mean64.numpy(),
        "bcast": bcast.numpy(),
        "seen": np.array(barrier_count(comm, marker_dir)),
    }


def main(backend: str, out_dir: str) -> None:
    """Open the launcher's communicator, run the checks, save this rank's results."""
    import labavg.comm.inproc
    import labavg.comm.mpi
    import labavg.comm.torch_dist  # noqa: F401 - importing must not start MPI
    from labavg.comm.launchers import detect_launcher
    from labavg.comm.world import open_communicator

    mpi4py_before_open = "mpi4py" in sys.modules
    comm = open_communicator(backend)
    out = Path(out_dir)
    results = exercise(comm, out)
    results["launcher"] = np.array(detect_launcher() or "")
    results["mpi4py_before_open"] = np.array(mpi4py_before_open)
    results["mpi4py_at_end"] = np.array("mpi4py" in sys.modules)
    np.savez(out / f"rank{comm.rank}.npz", **results)
    comm.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
