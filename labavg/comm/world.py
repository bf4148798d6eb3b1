"""Opening a communicator: the factory that picks a backend for this process.

Importing this module imports neither mpi4py nor torch.distributed; the backends are imported
only when `open_communicator` asks for them, so `import labavg.comm.world` never initialises MPI.

The "inproc" backend has no entry here: its N workers live in one process as threads, so the
caller hands the per-rank function to `labavg.comm.inproc.run_inproc` / `iterate_inproc`, which
build one communicator per thread. Buffer checks are in comm.buffers, launcher detection and
the mpiexec command in comm.launchers, device choice in comm.devices.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from labavg.comm.buffers import check_buffer, check_root
from labavg.comm.devices import select_device
from labavg.config import BACKENDS as _TRAINING_BACKENDS
from labavg.errors import UserError

# "single" (one process, no-op collectives) opens without any launcher; the others are the
# training backends of labavg.config.
BACKENDS = ("single", *_TRAINING_BACKENDS)


@dataclass
class SingleCommunicator:
    """One process, no backend: every collective is a no-op."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    def allreduce_mean(self, buf: torch.Tensor) -> None:
        """The mean over one rank is the buffer itself."""
        check_buffer(buf)

    def broadcast(self, buf: torch.Tensor, root: int = 0) -> None:
        """Only rank 0 exists, so there is nothing to copy."""
        check_buffer(buf)
        check_root(root, 1)

    def barrier(self) -> None:
        """Nobody else to wait for."""

    def abort(self, reason: str, code: int = 1, quiet: bool = False) -> None:
        """Nothing to end: one process, no peers waiting."""

    def close(self) -> None:
        """Nothing to release."""


def open_communicator(backend: str, *, size: int = 1, device: str | torch.device = "cpu"):
    """Open this process's communicator for `backend` ("single", "mpi" or "torch").

    "mpi" and "torch" take the world (rank, size) from the launcher's environment; `size` > 1
    is the number of ranks the user asked for and must match it (1 means "whatever was
    launched"). "single" is one process with no-op collectives. `device` ("cpu", "cuda",
    "auto", "cuda:N") picks gloo or nccl for the torch backend. "inproc" cannot be opened
    here: use `labavg.comm.inproc.run_inproc` / `iterate_inproc`.
    """
    if backend not in BACKENDS:
        raise UserError(f"unknown communication backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if size < 1:
        raise UserError(f"number of ranks must be at least 1, got {size}")
    if backend == "single":
        if size != 1:
            raise UserError(f"backend 'single' runs one rank, but {size} ranks were requested")
        return SingleCommunicator()
    if backend == "inproc":
        raise ValueError(
            "the inproc backend runs its ranks as threads of this process: "
            "call labavg.comm.inproc.run_inproc or iterate_inproc instead of open_communicator"
        )
    if backend == "mpi":
        from labavg.comm.mpi import MpiCommunicator

        comm = MpiCommunicator()
    else:
        from labavg.comm.torch_dist import TorchDistCommunicator

        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        comm = TorchDistCommunicator(select_device(device, local_rank))
    if size > 1 and comm.size != size:
        comm.close()
        raise UserError(
            f"{size} ranks were requested but the {backend} launcher started {comm.size}"
        )
    return comm
