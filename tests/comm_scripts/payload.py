"""One rank's allgathers and compressed averaging rounds, shared by the inproc, MPI and torch
tests of tests/test_payload.py.

Run as a script under a launcher: `python payload.py BACKEND OUT_DIR`; each rank writes
OUT_DIR/rank{R}.npz for the test to compare. The inproc test imports `exercise` directly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

SEED = 2468
LENGTH = 5003  # not a multiple of the chunk nor even: the last chunk is short, a nibble pads
ROUNDS = 3
# (payload, bits) of the rounds; fp32 is the allreduce path, for comparison.
FORMATS = (("fp32", 8), ("bf16", 8), ("fp16", 8), ("int", 4), ("int", 8), ("int", 16))
GATHER = ((1, np.uint8), (7, np.uint8), (1001, np.float32), (300_007, np.uint8))


def start(length: int = LENGTH) -> np.ndarray:
    """The global model every rank starts from."""
    return np.random.default_rng(SEED).standard_normal(length).astype(np.float32)


def change(rank: int, round_: int, length: int = LENGTH) -> np.ndarray:
    """Rank `rank`'s block update in round `round_`; sizes differ by rank."""
    rng = np.random.default_rng([SEED, rank, round_])
    return (rng.standard_normal(length) * 0.01 * (1 + rank)).astype(np.float32)


def gathered(rank: int, length: int, dtype) -> np.ndarray:
    rng = np.random.default_rng([SEED, 99, rank, length])
    if dtype == np.uint8:
        return rng.integers(0, 256, length, dtype=np.uint8)
    return rng.standard_normal(length).astype(dtype)


def fmt(payload: str, bits: int) -> str:
    return payload if payload != "int" else f"int{bits}"


def exercise(comm) -> dict[str, np.ndarray]:
    """Every gather case, and ROUNDS rounds of every payload, as this rank got them."""
    from labavg.averaging.methods import Averager

    out = {"rank": np.array(comm.rank), "size": np.array(comm.size)}
    for length, dtype in GATHER:
        send = torch.from_numpy(gathered(comm.rank, length, dtype))
        recv = torch.empty(comm.size * length, dtype=send.dtype)
        comm.allgather(send, recv)
        out[f"gather_{length}_{np.dtype(dtype).name}"] = recv.numpy()
    for payload, bits in FORMATS:
        flat = torch.from_numpy(start())
        averager = Averager(flat, comm, payload=payload, bits=bits)
        sent = []
        for round_ in range(ROUNDS):
            flat += torch.from_numpy(change(comm.rank, round_))
            sent.append(averager.round(flat).bytes_sent)
        name = fmt(payload, bits)
        out[f"model_{name}"] = flat.numpy().copy()
        out[f"bytes_{name}"] = np.array(sent)
        if averager.residual is not None:
            out[f"residual_{name}"] = averager.residual.numpy().copy()
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
