"""One rank of a job that labavg.jobs.job_run.JobRun started (under mpiexec, srun or torchrun):

    python -m labavg.jobs.rank_main LAUNCH_FILE [--no-progress] [--allow-pipes]

LAUNCH_FILE is the run's configuration as start_run checked it (RUN_DIR/.launch.json): a rank
reads it back as untrusted settings (its shape, types and every setting's rule checked again,
labavg.jobs.job_run.rank_config) and never goes through the command line's parser.
`--allow-pipes` comes only from this command line, never from the file, so that no file can
switch it on. A rank ends as `labavg train` would (labavg.jobs.exit_status), which is what
JobRun reads to say once why a job ended.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from labavg.base.errors import PeerFailed, UserError

if TYPE_CHECKING:  # a type only: this module imports the run (and torch) once settings are checked
    from labavg.jobs.run_json import RunSummary


def said_by_rank_0(exc: UserError) -> UserError:
    """`exc` as this process should raise it: every rank of a job reads the same settings and
    meets the same problem, so on a rank other than 0 it ends the rank quietly (PeerFailed)."""
    from labavg.comm.launchers import detect_launcher, launcher_rank

    if detect_launcher() is not None and launcher_rank() > 0:
        return PeerFailed(str(exc))
    return exc


def run_rank(cfg, *, resume: bool = False, progress: bool = True, allow_pipes: bool = False,
             stop_file: str | None = None, since: float | None = None) -> RunSummary | None:
    """This process's part of the run `cfg` (checked by the caller): its events into the run
    directory; rank 0's summary. For a process that mpiexec, srun, torchrun or JobRun started,
    whether JobRun (through this module's `main`) or the user (`mpiexec -n 4 labavg train`).
    `stop_file` appearing stops every rank at the next averaging round. `since`: the Unix time
    the command started (labavg.jobs.runs.run_training)."""
    from labavg.comm.launchers import detect_launcher

    if cfg.backend == "torch" and detect_launcher() == "mpi":
        raise UserError("backend 'torch' runs under torchrun: torchrun --nproc-per-node N -m labavg train ...")
    from labavg.jobs.runs import run_training  # torch: after the settings are checked

    should_stop = None if stop_file is None else (lambda: os.path.exists(stop_file))
    return run_training(cfg, resume=resume, progress=progress, should_stop=should_stop,
                        allow_pipes=allow_pipes, since=since)


def _rank(args: argparse.Namespace) -> int:
    from labavg.jobs.job_run import rank_config

    try:
        cfg, resume, stop_file, since = rank_config(args.launch_file)
    except UserError as exc:
        raise said_by_rank_0(exc) from None
    # The summary is the parent's to print (JobRun reads it from the run directory).
    run_rank(cfg, resume=resume, progress=not args.no_progress, allow_pipes=args.allow_pipes,
             stop_file=stop_file, since=since)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one rank of a job; return its exit status."""
    from labavg.jobs.exit_status import exit_status

    parser = argparse.ArgumentParser(prog="python -m labavg.jobs.rank_main",
                                     description="one rank of a job labavg.jobs.launch started")
    parser.add_argument("launch_file", help="the run's launch file (RUN_DIR/.launch.json)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--allow-pipes", action="store_true",
                        help="let data files and rspecifiers run commands (Kaldi's 'cmd |')")
    args = parser.parse_args(argv)
    return exit_status(lambda: _rank(args))


if __name__ == "__main__":
    from labavg.comm.launchers import end_process_now

    status = main()
    end_process_now(status)  # a finished rank: its launcher learns at once (no teardown)
    sys.exit(status)
