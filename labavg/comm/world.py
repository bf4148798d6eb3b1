"""Opening a communicator: the factory that picks a backend for this process.

Importing this module imports neither mpi4py nor torch.distributed; the backends are imported
only when `open_communicator` asks for them, so `import labavg.comm.world` never initialises MPI.

The "inproc" backend has no entry here: its N workers live in one process as threads, so the
caller hands the per-rank function to `labavg.comm.inproc.run_inproc` / `iterate_inproc`, which
build one communicator per thread (one of them is a one-rank group). Buffer checks are in comm.buffers, launcher detection and
the mpiexec command in comm.launchers, device choice in comm.devices.
"""

from __future__ import annotations

import os

import torch

from labavg.comm.devices import select_device
from labavg.comm.settings import BACKENDS, ElasticConfig
from labavg.base.errors import UserError


def open_communicator(backend: str, *, size: int = 1, device: str | torch.device = "cpu",
                      elastic: ElasticConfig | None = None):
    """Open this process's communicator for `backend` ("mpi" or "torch").

    With `elastic` (a run with on_rank_loss = "continue", started by
    labavg.comm.elastic_launch) the torch backend's worker is a torchft replica group under the
    launcher's lighthouse (labavg.comm.elastic.ElasticCommunicator).

    "mpi" and "torch" take the world (rank, size) from the launcher's environment; `size` > 1
    is the number of ranks the user asked for and must match it (1 means "whatever was
    launched"). `device` ("cpu", "cuda", "auto", "cuda:N") picks gloo or nccl for the torch
    backend. "inproc" cannot be opened
    here: use `labavg.comm.inproc.run_inproc` / `iterate_inproc`.
    """
    if backend not in BACKENDS:
        raise UserError(f"unknown communication backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if size < 1:
        raise UserError(f"number of ranks must be at least 1, got {size}")
    if backend == "inproc":
        raise ValueError(
            "the inproc backend runs its ranks as threads of this process: "
            "call labavg.comm.inproc.run_inproc or iterate_inproc instead of open_communicator"
        )
    if elastic is not None:
        return _open_elastic(size, device, elastic)
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


def _open_elastic(size: int, device: str | torch.device, cfg: ElasticConfig):
    from labavg.comm.elastic import ElasticCommunicator
    from labavg.comm.elastic_launch import JOINING_ENV, LIGHTHOUSE_ENV

    lighthouse = os.environ.get(LIGHTHOUSE_ENV)
    if lighthouse is None:
        raise UserError('on_rank_loss = "continue" runs under labavg\'s elastic launcher '
                        '(labavg train --backend torch starts it); torchrun cannot lose a worker')
    rank, launched = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if size > 1 and launched != size:
        raise UserError(f"{size} ranks were requested but the elastic launcher started {launched}")
    comm = ElasticCommunicator(
        rank, launched, lighthouse, device=select_device(device, int(os.environ.get("LOCAL_RANK", "0"))),
        min_workers=cfg.min_workers, timeout_s=cfg.round_timeout_s,
        quorum_timeout_s=cfg.quorum_timeout_s, joining=os.environ.get(JOINING_ENV) == "1")
    if not comm.joining:
        # Workers start seconds apart (imports, data): every one of them is present at the
        # first round, or the job does not start.
        comm.gather(max(120.0, cfg.quorum_timeout_s))
    return comm
