"""The one signal policy of labavg's long commands (train, sweep, decode, reproduce, corpus
synth and prepare): SIGINT ends one with status 130 and SIGTERM with 143, in one line that
says which signal and what to run to go on, every run it started ended first (its threads
joined, its jobs' processes gone, its run directories' locks released), nothing half-written.

The signal becomes an `Interrupted` exception in the main thread, so every `finally` on the way
out runs as for Ctrl-C; what runs on other threads or in other processes is ended by
labavg.jobs.launch.end_runs, which every started run is known to. A second signal while that
happens is ignored: the ending must not be cut short (SIGKILL still ends everything).
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def answer_signals(rerun: Callable[[], str], work: Callable[[], int]) -> int:
    """`work()`'s status, or 128 + the signal once SIGINT or SIGTERM has ended it; `rerun()` is
    the command that goes on from where it stopped, named in the one line then printed."""
    from labavg.jobs.job_run import interrupts_said_by_caller
    from labavg.jobs.launch import Interrupted, end_runs, importing, signal_of

    caught: list[int] = []

    def on_signal(signum, frame):
        if importing(frame):  # raised there, it would leave a module half made: soon again
            threading.Timer(0.05, os.kill, (os.getpid(), signum)).start()
            return
        caught.append(signum)
        for s in SIGNALS:  # the ending below must not be cut short by a second signal
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(signum)

    before = {s: signal.signal(s, on_signal) for s in SIGNALS}
    said = interrupts_said_by_caller.set(True)  # one line, this one, not each job's
    try:
        try:
            return work()
        except KeyboardInterrupt as exc:
            # The signal caught here; a run's thread re-raises a plain KeyboardInterrupt.
            signum = caught[0] if caught else signal_of(exc)
        except Exception:
            if not caught:
                raise
            # A run that saw the same signal first (its process group's Ctrl-C) failed with it.
            signum = caught[0]
        end_runs(signum)
        name = signal.Signals(signum).name
        print(f"labavg: interrupted ({name}): rerun `{rerun()}` to go on", file=sys.stderr,
              flush=True)
        if _left_running():
            # A rank thread that end_runs could not stop in time (deep in one long torch call):
            # left to interpreter shutdown, it would end the process with SIGABRT ("terminate
            # called without an active exception"). Every file labavg writes is written
            # atomically, and the threads that write them have ended: end the process here.
            sys.stdout.flush()
            os._exit(128 + signum)
        return 128 + signum
    finally:
        interrupts_said_by_caller.reset(said)
        if not caught:  # once interrupted, the process is ending: a late signal stays ignored
            for s, handler in before.items():
                signal.signal(s, handler)


def command_line(argv: list[str]) -> str:
    """`labavg ARGV` as a shell would take it back."""
    return shlex.join(["labavg", *argv])


def train_rerun(argv: list[str], run_dir: str | None, resumed: bool) -> str:
    """What goes on with an interrupted `labavg train`: `--resume RUN` once the run has a
    checkpoint. Before its first, a new run has nothing to resume and its first files would
    make the same command refuse the directory: they are removed (as a sweep does before it
    starts such a point again), and the same command starts it afresh."""
    import shutil

    from labavg.base.checkpoint import latest_step

    if run_dir is None:
        return command_line(argv)
    run = Path(run_dir)
    if latest_step(run) is not None:
        return command_line(["train", "--resume", run_dir])
    from labavg.comm.launchers import detect_launcher

    # A rank of a job the user's own mpiexec/torchrun started does not own the directory: the
    # launcher ends it for a peer's failure too, and what it logged says where the job got to.
    if not resumed and not (run / "summary.json").exists() and detect_launcher() is None:
        for name in ("events.jsonl", "config.json"):
            (run / name).unlink(missing_ok=True)
        shutil.rmtree(run / "tensorboard", ignore_errors=True)
    return command_line(argv)


def _left_running() -> list[threading.Thread]:
    """Threads still running besides this one (a deferred signal's timer aside)."""
    return [t for t in threading.enumerate() if t is not threading.current_thread()
            and t.is_alive() and not isinstance(t, threading.Timer)]
