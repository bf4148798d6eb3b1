"""What a job's launcher and ranks print, read line by line: which lines to show, which to
hold back, and what they say about how the job ended. Pure: lines in, decisions out; the job
process (labavg.jobs.job_run.JobRun) does the reading and the writing.

Hydra (MPICH's mpiexec), torchrun and srun each report a failed job in their own words, at
length and once per rank; labavg replaces what they print with one line naming the lost or
failed rank, and prints once a message every rank printed.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from labavg.jobs.job_outcome import status_of
from labavg.jobs.slurm import SRUN_LINE

# What hydra and MPICH print about a failed job, which labavg's own message replaces.
HYDRA_NOISE = ("=====", "=   ", "This typically refers to a problem", "Please see the FAQ",
               "application called MPI_Abort")
# How a failed rank's line ends under each launcher: the closing line says what happened next.
_ENDING_THE_JOB = re.compile(r"; (exiting so torchrun ends the job|aborting all \d+ MPI ranks)$")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b: ")
_TORCH_LOG = re.compile(r"^\[?[IWEF]\d{4} \d\d:\d\d:\d\d")  # torch's glog-style lines
_TORCHRUN_SIGNALLED = re.compile(r"failed \(exitcode: -\d+\) local_rank: \d+ \(pid: (\d+)\)")
# hydra's own trace lines: "[proxy:0@host] ...", "[mpiexec@host] ...".
_HYDRA_TRACE = re.compile(r"^\[(proxy:\d+|mpiexec)@[^\]]*\] ")
_HYDRA_LOST = re.compile(r"PID (\d+) RUNNING")  # hydra's banner about a lost process
# Exit statuses of a launcher ended by SIGINT or SIGTERM (130/143 from mpiexec and torchrun,
# -2/-15 from Popen when it died of the signal itself): the signal each stands for.
SIGNALLED = {130: 2, 143: 15, -2: 2, -15: 15}


class LauncherOutput:
    """The lines of one job's stdout and stderr, and what they said (`torch`: torchrun's job,
    whose own log lines and closing traceback are held back)."""

    def __init__(self, *, torch: bool = False) -> None:
        self.torch = torch
        self.errors: list[str] = []  # "labavg: error: ..." lines, each once
        self.rank_said: list[str] = []  # why a rank ended the job ("rank R failed: ...")
        self.launcher_lines: list[str] = []  # the launcher's trace, held back
        self.lost_pids: set[int] = set()  # processes the launcher saw lost
        self.raised: str | None = None  # the first exception line of a rank's traceback
        self._in_traceback = False

    def stderr_line(self, line: str) -> str | None:
        """`line` of the job's stderr as it is to be shown, or None when held back."""
        if line.startswith("labavg: error:"):
            # Every rank that met the same error says so: print it once.
            message = re.sub(r"^labavg: error: rank \d+: ", "labavg: error: ", line)
            if message in self.errors:
                return None
            self.errors.append(message)
        elif line.startswith("labavg: rank "):
            # Folded into the job's one closing line, with where each rank got to.
            self.rank_said.append(_ENDING_THE_JOB.sub("", line.strip()[len("labavg: "):]))
            return None
        elif any(mark in line for mark in HYDRA_NOISE):
            return None
        elif line.strip() == "labavg: interrupted":  # a rank's; the launcher says it once
            return None
        elif (_HYDRA_TRACE.match(line) or SRUN_LINE.match(line)
              or (self.torch and self._torchrun_line(line))):
            # torchrun's own log lines and its ChildFailedError traceback too; a worker it saw
            # killed by a signal ("exitcode: -9") is a lost rank.
            self.lost_pids.update(int(p) for p in _TORCHRUN_SIGNALLED.findall(line))
            # Across hosts, the proxies and mpiexec trace how they noticed a lost process;
            # held back, and shown only if labavg cannot say which rank was lost.
            self.launcher_lines.append(line)
            return None
        if _EXCEPTION_LINE.match(line) and self.raised is None:
            self.raised = line.strip()  # a rank's traceback ends with what it raised
        return line

    def _torchrun_line(self, line: str) -> bool:
        """Whether `line` is torchrun's: its log lines, and from a traceback on (its
        ChildFailedError and failure report are the last it prints); a rank's own ends the
        job through labavg's one line instead."""
        self._in_traceback = self._in_traceback or line.startswith("Traceback ")
        return self._in_traceback or bool(_TORCH_LOG.match(line))

    def stdout_line(self, line: str) -> str | None:
        """`line` of the job's stdout as it is to be shown, or None when held back."""
        # Hydra reports a lost process ("PID n RUNNING AT host") in a banner on stdout.
        self.lost_pids.update(int(p) for p in _HYDRA_LOST.findall(line))
        if any(line.startswith(mark) for mark in HYDRA_NOISE) or (
                _HYDRA_TRACE.match(line) and "Ctrl-C" in line):  # told to interrupt
            return None
        return line

    def reported(self, lost: str) -> bool:
        """Whether the job's own lines (or `lost`, the lost ranks named) say why it failed."""
        return bool(lost or self.rank_said or self.errors)

    def interrupted_by(self, code: int, lost: str) -> int | None:
        """The signal that ended a launcher exiting with `code`, when that was all that
        happened (Ctrl-C, or the launcher alone told to stop); None for a failure. srun also
        ends with 143 when it has killed the rest of a step after a rank was lost: then the
        lost rank is the news."""
        return SIGNALLED[code] if code in SIGNALLED and not self.reported(lost) else None

    def closing(self, code: int, lost: str, kind: str,
                last_steps: Callable[[], str]) -> tuple[int, str]:
        """The job's exit status and what to print on stderr as it ends with `code`: the
        launcher's held-back trace where nothing else says why, each rank's word when it
        succeeded, one line naming the failure otherwise. `kind` names the job ("MPI"),
        `last_steps()` where each rank got to (read only for a failure to name)."""
        text = ""
        if code == 0 or not self.reported(lost):
            text += "".join(self.launcher_lines)
        if code != 0 and self.errors:
            # What the ranks said decides: torchrun exits 1, and srun reports the peers it
            # killed (137), whatever status the rank that ended the job chose.
            code = status_of(self.errors)
        if code == 0:
            text += "".join(f"labavg: {said}\n" for said in self.rank_said)
        elif not self.errors:
            said = "".join(f"{s}; " for s in self.rank_said[:1])
            self.errors.append(f"labavg: error: {said}the {kind} job failed "
                               f"(exit status {code}); {lost}{last_steps()}\n")
            text += self.errors[-1]
        return code, text

    def reason(self) -> str | None:
        """Why a failed job failed, in one line: the first error a rank printed is the cause;
        later ones are its peers' consequences."""
        said = [self.raised] + [e.strip().removeprefix("labavg: error: ") for e in self.errors]
        return "; ".join(filter(None, said[:2])) or None
