"""One rank's check of the non-blocking mean against the blocking one, for tests/test_overlap.py.

Run under a launcher: `python overlap.py BACKEND OUT_DIR`; each rank writes OUT_DIR/rank{R}.npz.
The inproc test imports `exercise` directly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

LENGTH = 100_003  # odd and large enough that a collective is chunked


def contribution(rank: int, dtype: np.dtype = np.float32) -> np.ndarray:
    """Seeded values whose magnitudes differ by rank, so that the summation order shows."""
    values = np.random.default_rng(77 + rank).standard_normal(LENGTH) * 10.0 ** (rank % 3)
    return values.astype(dtype)


def exercise(comm) -> dict[str, np.ndarray]:
    """Blocking and non-blocking means of the same buffers, float32 and float64; the
    non-blocking ones are waited for after work on other memory and a blocking collective."""
    out = {"rank": np.array(comm.rank), "size": np.array(comm.size)}
    for name, dtype in (("32", np.float32), ("64", np.float64)):
        blocking = torch.from_numpy(contribution(comm.rank, dtype))
        comm.allreduce_mean(blocking)
        pending_buf = torch.from_numpy(contribution(comm.rank, dtype))
        pending = comm.iallreduce_mean(pending_buf)
        busy = torch.randn(300, 300) @ torch.randn(300, 300)  # compute while it is in flight
        pending.wait()
        out["blocking" + name] = blocking.numpy()
        out["nonblocking" + name] = pending_buf.numpy()
        out["busy" + name] = np.array(float(busy.sum()))
    return out


def main(backend: str, out_dir: str) -> None:
    from labavg.comm.world import open_communicator

    comm = open_communicator(backend)
    np.savez(Path(out_dir) / f"rank{comm.rank}.npz", **exercise(comm))
    comm.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
