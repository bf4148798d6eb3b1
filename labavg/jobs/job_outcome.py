"""What a job of processes (labavg.jobs.job_run.JobRun) left behind that its closing line
reports: which ranks were lost, where each got to, the exit status its ranks' messages mean,
and the error a failed job raises."""

from __future__ import annotations

from pathlib import Path


class JobFailed(RuntimeError):
    """A job's processes ended with a non-zero exit status. `reason` is the one line the job
    printed on stderr (without "labavg: error: "), so that a caller without a terminal (the
    dashboard) can show it too."""

    def __init__(self, run_dir: Path, code: int, reason: str | None = None):
        super().__init__(reason or f"the job writing {run_dir} failed (exit status {code})")
        self.run_dir = run_dir
        self.code = code
        self.reason = reason


def lost_ranks(run_dir: Path, pids: set[int]) -> str:
    """'rank R (pid P) was lost; ' for each pid the launcher reported, from the run's log."""
    from labavg.jobs.index import EVENTS, read_events

    if not pids or not (run_dir / EVENTS).is_file():
        return ""
    ranks = {e["pid"]: e["rank"] for e in read_events(run_dir) if e["type"] == "run_started"}
    return "".join(f"rank {ranks[p]} (pid {p}) was lost; " for p in sorted(pids) if p in ranks)


def status_of(errors: list[str]) -> int:
    """Exit status of a job whose ranks printed `errors`: 3 (the watchdog), else 2 (a user
    error: every other 'labavg: error:' line a rank prints is one)."""
    from labavg.comm.watchdog import EXIT_WATCHDOG

    return EXIT_WATCHDOG if any(e.startswith("labavg: error: watchdog:") for e in errors) else 2


def srun_lost(lines: list[str]) -> str:
    """'rank R was lost; ' for each task srun reported ended badly (none under mpiexec)."""
    from labavg.jobs.slurm import ended_tasks

    return "".join(f"rank {r} was lost; " for r in ended_tasks(lines))


def last_steps(run_dir: Path) -> str:
    """Where each rank got to, from the events it logged (to find a lost or failed rank)."""
    from labavg.jobs.index import EVENTS, read_events

    if not (run_dir / EVENTS).is_file():
        return "no rank logged any event"
    last: dict[int, int] = {}
    for event in read_events(run_dir):
        if "step" in event:
            last[event["rank"]] = max(last.get(event["rank"], 0), event["step"])
    return ", ".join(f"rank {r} last event at step {s}" for r, s in sorted(last.items()))
