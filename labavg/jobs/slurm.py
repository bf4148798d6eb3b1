"""Slurm as a launcher: the srun command that starts a job's ranks inside an allocation.

`labavg train --launcher slurm` (labavg.jobs.job_run.JobRun with launcher "slurm") runs where
SLURM_JOB_ID is set (inside `salloc` or an `sbatch` script) and starts its ranks with Slurm's
own srun, as the mpiexec path starts them with MPICH's hydra: the same launch file, run-directory
lock, and one-line errors. Slurm is never imitated: without an allocation this refuses.

Imports neither mpi4py nor torch: launching only builds commands and reads srun's words.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Mapping

from labavg.base.errors import UserError

# srun's own account of a step's end ("srun: error: node: task 1: Killed", "srun: Job step
# aborted: ..."): held back like hydra's trace and shown only when labavg cannot name the rank.
SRUN_LINE = re.compile(r"^(srun: |slurmstepd(-\S+)?: )")
# Once srun or slurmstepd says it is ending the step, the tasks it reports were ended by it:
# consequences, not the cause.
_ENDING = re.compile(r"Job step aborted|_step_signal: Terminating|\*\*\* STEP .* CANCELLED")
_TASK_ENDED = re.compile(r"^srun: error: \S+: tasks? ([\d,\-]+): (Killed|Terminated|"
                         r"Segmentation fault|Aborted|Exited with exit code \d+)")


def allocation(env: Mapping[str, str] | None = None) -> str:
    """The id of the Slurm job this process runs in; UserError when it runs in none."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID", "")
    if not job:
        raise UserError("--launcher slurm starts the ranks with srun inside a Slurm allocation, "
                        "and SLURM_JOB_ID is not set: run it in `salloc -n N` or an sbatch "
                        "script, or run `srun -n N --mpi=pmi2 labavg train --backend mpi ...`")
    return job


def srun_command(n: int, argv: list[str], *, backend: str,
                 env: Mapping[str, str] | None = None) -> list[str]:
    """The srun command that runs `python *argv` as `n` MPI ranks of this allocation.

    --mpi=pmi2: MPICH's wheel talks PMI-2 to srun (no hydra). --kill-on-bad-exit: a rank that
    exits non-zero (an MPI_Abort, a lost process) ends the whole step instead of leaving the
    others in their next collective until the watchdog notices.
    """
    if backend != "mpi":
        raise UserError(f"--launcher slurm runs the mpi backend (srun --mpi=pmi2), not "
                        f"{backend!r}; for torch, run torchrun under srun yourself")
    if n < 1:
        raise UserError(f"number of ranks must be at least 1, got {n}")
    allocation(env)
    srun = shutil.which("srun")
    if srun is None:
        raise UserError("srun not found on PATH, though SLURM_JOB_ID is set")
    netmod = ",".join(f"{k}={v}" for k, v in mpich_env(env).items())
    return [srun, "--ntasks", str(n), "--mpi=pmi2", "--kill-on-bad-exit=1",
            f"--export=ALL,{netmod}", sys.executable, *argv]


def mpich_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """MPICH's network settings for ranks srun starts, where the user has not set their own.

    The same libfabric tcp provider as labavg's mpiexec path (LOOPBACK_MPICH_ENV: within one
    node its listeners stay on the loopback, docs/cluster.md "Listening sockets"), instead of
    the wheel's default UCX netmod, so that srun's ranks talk as mpiexec's do.
    """
    from labavg.comm.launchers import LOOPBACK_MPICH_ENV

    env = os.environ if env is None else env
    wanted = dict(LOOPBACK_MPICH_ENV)
    if env.get("SLURM_JOB_NUM_NODES", "1") != "1":
        del wanted["FI_TCP_IFACE"]  # several nodes: the user's interface, or libfabric's pick
    return {k: v for k, v in wanted.items() if k not in env}


def ended_tasks(lines: list[str]) -> list[int]:
    """The ranks srun reported as ended badly (killed, signalled, non-zero) before it began
    ending the step itself, in its order."""
    ranks: list[int] = []
    for line in lines:
        if _ENDING.search(line):
            break
        match = _TASK_ENDED.match(line)
        if match is None or "exit code 0" in match[2]:
            continue
        for part in match[1].split(","):
            lo, _, hi = part.partition("-")
            ranks += [r for r in range(int(lo), int(hi or lo) + 1) if r not in ranks]
    return ranks
