"""Adding a worker to a running elastic job (`labavg train --join RUN_DIR`), or losing one on
purpose (the dashboard's "Lose a worker").

The job's launcher (labavg.comm.elastic_launch) keeps RUN_DIR/.elastic.json while it runs: its
lighthouse, the pid of every worker and its join socket. A join asks the launcher for a worker in
the place of the lowest launch rank not running; the worker heals at the survivors' next round
(labavg.training.membership) and trains from the round after. It takes the job's own settings:
there are no others to give.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import psutil

from labavg.base.errors import UserError
from labavg.base.events import MemberJoined, event_from_dict
from labavg.base.waiting import wait_until
from labavg.comm.elastic_launch import request_join
from labavg.jobs.index import CONFIG, EVENTS, SUMMARY, EventTail
from labavg.jobs.job_run import ELASTIC_STATE


@dataclass(frozen=True)
class Joined:
    rank: int
    pid: int


def elastic_state(run_dir: str | Path) -> dict:
    """The running elastic job's state file, or UserError saying why there is no job to join."""
    run_dir = Path(run_dir)
    path = run_dir / ELASTIC_STATE
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(_why_no_job(run_dir)) from None
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path}: {exc}") from None
    if not isinstance(state, dict) or not isinstance(state.get("workers"), dict):
        raise UserError(f"{path}: not an elastic job's state file")
    launcher = state.get("launcher")
    # A launcher killed with SIGKILL leaves its state file behind; its pids may be reused since.
    if not isinstance(launcher, int) or not _is_running(launcher):
        raise UserError(f"{run_dir}: the elastic job's launcher (pid {launcher}) has ended: "
                        f"there is nothing to join")
    return state


def _is_running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _why_no_job(run_dir: Path) -> str:
    if (run_dir / SUMMARY).is_file():
        return f"{run_dir} has finished: there is no job to join"
    if not (run_dir / CONFIG).is_file():
        return f"{run_dir} is not a labavg run directory"
    return (f"{run_dir} is not running as an elastic job (on_rank_loss = \"continue\", "
            f"backend torch): there is nothing to join")


def join(run_dir: str | Path, *, timeout: float = 120.0) -> Joined:
    """Start a worker in the running elastic job of `run_dir`; return once it has taken part in
    a round (a member_joined event names it), or UserError."""
    run_dir = Path(run_dir)
    state = elastic_state(run_dir)
    tail = EventTail(run_dir / EVENTS)
    while tail.read():  # only what happens from now on counts
        pass
    try:
        answer = request_join(state["join_socket"], timeout=30.0)
    except (OSError, TypeError) as exc:
        raise UserError(f"{run_dir}: the job's launcher did not answer ({exc}); has it ended?") \
            from None
    if "error" in answer:
        raise UserError(f"{run_dir}: {answer['error']}")
    joined = Joined(int(answer["rank"]), int(answer["pid"]))

    def took_part() -> bool:
        if any(isinstance(e, MemberJoined) and joined.rank in e.joined
               for e in filter(None, map(event_from_dict, tail.read()))):
            return True
        if not psutil.pid_exists(joined.pid):
            raise UserError(f"{run_dir}: the worker started for rank {joined.rank} "
                            f"(pid {joined.pid}) ended before it joined: see the job's output")
        return False

    if wait_until(took_part, timeout, 0.2):
        return joined
    raise UserError(f"{run_dir}: rank {joined.rank} (pid {joined.pid}) did not join within "
                    f"{timeout:.0f} s")


def lose(run_dir: str | Path, rank: int | None = None) -> int:
    """Kill one worker of the running elastic job (the highest rank unless `rank` is given),
    as a lost machine would be: SIGKILL to its session. Returns the rank."""
    state = elastic_state(run_dir)
    workers = {int(r): int(p) for r, p in state["workers"].items()}
    if not workers:
        raise UserError(f"{run_dir}: no worker is running")
    rank = max(workers) if rank is None else rank
    if rank not in workers:
        raise UserError(f"{run_dir}: rank {rank} is not running (running: {sorted(workers)})")
    try:
        # The launcher's child, or a process that took the pid of one that ended since.
        if psutil.Process(workers[rank]).ppid() == state["launcher"]:
            os.killpg(workers[rank], signal.SIGKILL)
    except (psutil.NoSuchProcess, ProcessLookupError):
        pass  # it ended on its own meanwhile
    return rank

