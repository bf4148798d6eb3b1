"""Launchers: which one started this process, the mpiexec command that starts ranks here, and
how a finished rank's process ends quickly.

Imports neither torch nor mpi4py: a launcher only reads the environment and builds commands.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import sys
from collections.abc import Mapping
from pathlib import Path

from labavg.base.errors import UserError

# Environment variables that only a launcher sets. MPICH's hydra (and Slurm's srun --mpi=pmi2)
# set PMI_RANK/PMI_SIZE, PMIx launchers PMIX_RANK, Open MPI's mpirun OMPI_COMM_WORLD_RANK.
_MPI_RANK_VARS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")

# A local MPICH run would otherwise open its netmod listeners on every interface: libfabric's tcp
# provider on the loopback keeps rank traffic on 127.0.0.1 (same-host data moves through shared
# memory anyway).
LOOPBACK_MPICH_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "lo"}
# hydra tells its proxies to connect back to `mpiexec` at this host's name, which may resolve
# to an external address; -localhost makes that connection loopback. It does not move the
# control port's listener: hydra binds it to INADDR_ANY whatever the options (-iface,
# -localhost, HYDRA_IFACE all measured; see docs/cluster.md, "Listening sockets").
LOOPBACK_HYDRA_ARGS = ("-localhost", "127.0.0.1")


def close_inherited_listeners() -> list[int]:
    """Close the listening TCP sockets this process shares with its parent; their fds.

    hydra binds its control port to INADDR_ANY and does not mark it close-on-exec, so its proxy
    and every rank (an ipyparallel MPI engine too) hold the same 0.0.0.0 listener for the run's
    length without using it: the proxy already holds its connection to mpiexec and a rank talks
    PMI over PMI_FD. A rank's copy closed, the port stays open in mpiexec and its proxy only.
    A socket the parent does not hold (this process's own, ZMQ's, libfabric's) is never
    touched; nothing happens where /proc is missing.
    """
    parent = _socket_inodes(f"/proc/{os.getppid()}/fd")
    closed = []
    for fd, inode in _socket_fds("/proc/self/fd").items():
        if inode in parent and _is_tcp_listener(fd):
            os.close(fd)
            closed.append(fd)
    return closed


def _socket_fds(folder: str) -> dict[int, str]:
    """fd -> "socket:[inode]" for the sockets among the fds listed in `folder`."""
    found = {}
    try:
        names = os.listdir(folder)
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"{folder}/{name}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found[int(name)] = target
    return found


def _socket_inodes(folder: str) -> set[str]:
    return set(_socket_fds(folder).values())


def _is_tcp_listener(fd: int) -> bool:
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return False
        with socket.socket(fileno=os.dup(fd)) as sock:  # a duplicate: closing it keeps `fd`
            return (sock.family in (socket.AF_INET, socket.AF_INET6)
                    and sock.type == socket.SOCK_STREAM
                    and bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)))
    except OSError:
        return False


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
    if hosts:
        command += ["-hosts" if _is_hydra(mpiexec) else "--host", hosts]
    else:
        command += local_mpiexec_args(mpiexec)
    return command + [sys.executable, *argv]


def local_mpiexec_args(mpiexec: Path, *, auto_cleanup: bool = True) -> list[str]:
    """mpiexec's options that keep a job on this machine and its traffic on 127.0.0.1 (hydra).

    `-launcher fork` keeps hydra off ssh and off a surrounding Slurm allocation,
    LOOPBACK_HYDRA_ARGS its proxy connection and LOOPBACK_MPICH_ENV the ranks' listeners on the
    loopback. `auto_cleanup=False` (-disable-auto-cleanup): when one rank dies hydra does not
    kill the others at once, so a watcher can see which one went first. Other mpiexecs get
    nothing: their own defaults stay local.
    """
    if not _is_hydra(mpiexec):
        return []
    args = ["-launcher", "fork", *LOOPBACK_HYDRA_ARGS]
    args += [] if auto_cleanup else ["-disable-auto-cleanup"]
    for name, value in LOOPBACK_MPICH_ENV.items():
        args += ["-genv", name, value]
    return args


def torchrun_command(n: int, argv: list[str]) -> list[str]:
    """The command that runs `python *argv` as `n` torch.distributed ranks on this machine.

    torchrun's agent under labavg.comm.torch_launch, which keeps every store of the job (the
    rendezvous's, the workers') on 127.0.0.1: torchrun alone binds its store to every
    interface whatever --master-addr says.
    """
    if n < 1:
        raise UserError(f"number of ranks must be at least 1, got {n}")
    return [sys.executable, "-m", "labavg.comm.torch_launch", "--nproc-per-node", str(n), *argv]


def elastic_command(n: int, argv: list[str], *, min_workers: int, heartbeat_ms: int,
                    join_timeout_ms: int, state_file: str) -> list[str]:
    """The command that runs `python *argv` as `n` elastic workers (labavg.comm.elastic_launch):
    one lost goes unreplaced and the others go on."""
    if n < 1:
        raise UserError(f"number of ranks must be at least 1, got {n}")
    return [sys.executable, "-m", "labavg.comm.elastic_launch", "--nproc", str(n),
            "--min-workers", str(min_workers), "--heartbeat-ms", str(heartbeat_ms),
            "--join-timeout-ms", str(join_timeout_ms), "--state-file", state_file, "--", *argv]


def end_with_parent() -> None:
    """In a child before exec (`preexec_fn`): SIGTERM when its parent dies (Linux
    PR_SET_PDEATHSIG), so a launcher's job ends with it however it ends."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def end_process_now(code: int) -> None:
    """End this process with `code` without the interpreter's teardown, when that is safe: the
    command succeeded and no other non-daemon thread runs (else this returns, for the usual
    exit). Output is flushed, atexit handlers run and MPI is finalized first (mpi4py finalizes
    from the interpreter's own exit hook, which C's exit() does not run); C's exit() then runs
    the libraries' exit handlers as a normal exit does. (os._exit skips those too, and a rank
    that left so had hydra end the job's other ranks, still writing their files, with status 0.)

    With torch loaded, the teardown (freeing every module's objects) took 1.4-3.0 s of a
    2-rank job's end on a busy 2-core machine, against 0.5-1.4 s without it, from the ranks'
    last line to mpiexec's end (docs/architecture.md, "Start-up").
    """
    import atexit
    import ctypes
    import threading

    if code != 0 or any(t.is_alive() and not t.daemon and t is not threading.main_thread()
                        for t in threading.enumerate()):
        return
    try:  # PyDLL: the GIL stays held, so no daemon thread runs Python during the exit
        c_exit = ctypes.PyDLL(None).exit
    except (OSError, AttributeError):  # no C library to call: the usual exit
        return
    _flush()
    atexit._run_exitfuncs()
    mpi = sys.modules.get("mpi4py.MPI")  # never imported here: finalized only if in use
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    _flush()
    c_exit(code)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed, or a pipe whose reader left
            pass
