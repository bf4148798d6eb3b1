"""Opening a communicator: backend choice, launcher detection, device binding, mpiexec command.

Importing this module imports neither mpi4py nor torch.distributed; the backends are imported
only when `open_communicator` asks for them, so `import labavg.comm.world` never initialises MPI.

The "inproc" backend has no entry here: its N workers live in one process as threads, so the
caller hands the per-rank function to `labavg.comm.inproc.run_inproc` / `iterate_inproc`, which
build one communicator per thread.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from labavg.errors import UserError

BACKENDS = ("single", "inproc", "mpi", "torch")

# Environment variables that only a launcher sets. MPICH's hydra (and Slurm's srun --mpi=pmi2)
# set PMI_RANK/PMI_SIZE, PMIx launchers PMIX_RANK, Open MPI's mpirun OMPI_COMM_WORLD_RANK.
_MPI_RANK_VARS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")
_FLOAT_DTYPES = (torch.float32, torch.float64)

# A local MPICH run would otherwise open its netmod listeners on every interface: libfabric's tcp
# provider on the loopback keeps rank traffic on 127.0.0.1 (same-host data moves through shared
# memory anyway).
LOOPBACK_MPICH_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "lo"}
# hydra tells its proxies to connect back to `mpiexec` at this host's name, which may resolve
# to an external address; -localhost makes that connection loopback. It does not move the
# control port's listener: hydra binds it to INADDR_ANY whatever the options (-iface,
# -localhost, HYDRA_IFACE all measured; see docs/cluster.md, "Listening sockets").
LOOPBACK_HYDRA_ARGS = ("-localhost", "127.0.0.1")


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


def check_buffer(buf: torch.Tensor) -> None:
    """Raise TypeError/ValueError unless `buf` is a flat contiguous float32/float64 tensor.

    The collectives write into the buffer's memory directly (numpy views for MPI), so a strided
    view or a copy would silently not update the caller's parameters.
    """
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"collective buffer must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"collective buffer must be float32 or float64, got {buf.dtype}")
    if buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(
            f"collective buffer must be flat (1-D) and contiguous, got shape {tuple(buf.shape)}"
            f" contiguous={buf.is_contiguous()}"
        )


def check_root(root: int, size: int) -> None:
    """Raise ValueError unless `root` is a rank of a group of `size`."""
    if not 0 <= root < size:
        raise ValueError(f"broadcast root {root} is not a rank of a group of {size}")


def detect_launcher(env: Mapping[str, str] | None = None) -> str | None:
    """Which launcher started this process: "torch" (torchrun), "mpi" (mpiexec/srun), or None.

    torchrun is checked first because a torchrun started inside an MPI/Slurm job inherits the
    job's PMI variables, while the converse does not happen.
    """
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" in env or all(k in env for k in ("LOCAL_RANK", "WORLD_SIZE", "RANK")):
        return "torch"
    if any(k in env for k in _MPI_RANK_VARS):
        return "mpi"
    return None


def launcher_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's rank as its launcher set it in the environment (0 outside a launcher)."""
    env = os.environ if env is None else env
    for name in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "RANK"):
        if env.get(name, "").isdigit():
            return int(env[name])
    return 0


def select_device(requested: str | torch.device, local_rank: int) -> torch.device:
    """The device for this rank: "cpu", "cuda" (one GPU per local rank, round robin), "cuda:N", "auto".

    Raises UserError when CUDA is requested but this machine has none.
    """
    name = str(requested)
    if name == "cpu":
        return torch.device("cpu")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
        if name == "cpu":
            return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UserError(f"device {name!r} requested but CUDA is not available on this machine")
        if name == "cuda":
            return torch.device("cuda", local_rank % count)
        index = torch.device(name).index
        if index is None or index >= count:
            raise UserError(f"device {name!r} requested but this machine has {count} CUDA device(s)")
        return torch.device(name)
    raise UserError(f"unknown device {name!r}; choose one of 'cpu', 'cuda', 'cuda:N', 'auto'")


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


def find_mpiexec() -> Path:
    """The mpiexec of the venv's MPICH wheel (beside sys.executable), else the first on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("mpiexec")
    if found is None:
        raise UserError(
            f"mpiexec not found beside {sys.executable} nor on PATH; install the 'mpich' wheel"
        )
    return Path(found)


def _is_hydra(mpiexec: Path) -> bool:
    """MPICH's hydra ships hydra_pmi_proxy beside mpiexec; Open MPI's mpirun does not."""
    return (mpiexec.parent / "hydra_pmi_proxy").exists()


def mpiexec_command(n: int, argv: list[str], *, hosts: str | None = None) -> list[str]:
    """The command that runs `python *argv` as `n` MPI ranks, e.g. argv=["-m", "labavg", "train", ...].

    `hosts` is a comma-separated host list ("h1,h2"; hydra also takes "h1:4,h2:4"). Without it the run
    stays on this machine: for hydra we pass `-launcher fork` so that it neither tries ssh nor
    picks up a surrounding Slurm allocation (hydra already forks for the local host, but being
    explicit keeps a local run local), LOOPBACK_HYDRA_ARGS so its proxy connects back over
    127.0.0.1, and LOOPBACK_MPICH_ENV so the ranks listen on 127.0.0.1 only. hydra's own control
    port still binds 0.0.0.0 for the run's duration, and the ranks inherit that socket (no
    option moves it; MPICH's gforker, which has no such port, loses a killed rank's exit status
    and waits forever on a rank that exits early, so it is no substitute).
    """
    if n < 1:
        raise UserError(f"number of ranks must be at least 1, got {n}")
    mpiexec = find_mpiexec()
    command = [str(mpiexec), "-n", str(n)]
    hydra = _is_hydra(mpiexec)
    if hosts:
        command += ["-hosts" if hydra else "--host", hosts]
    elif hydra:
        command += ["-launcher", "fork", *LOOPBACK_HYDRA_ARGS]
        for name, value in LOOPBACK_MPICH_ENV.items():
            command += ["-genv", name, value]
    return command + [sys.executable, *argv]
