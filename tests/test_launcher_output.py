"""labavg.jobs.launcher_output on lines as hydra, torchrun, srun and the ranks print them: what
is shown, what is held back, and the one line a failed job ends with."""

from __future__ import annotations

from labavg.jobs.launcher_output import LauncherOutput

# What MPICH's hydra prints when a rank is killed: a banner on stdout, trace lines on stderr.
HYDRA_BANNER = [
    "\n",
    "===================================================================================\n",
    "=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n",
    "=   PID 4242 RUNNING AT node1\n",
    "=   KILLED BY SIGNAL: 9 (Killed)\n",
    "===================================================================================\n",
]


def _shown(output: LauncherOutput, lines: list[str], stream: str = "stderr") -> list[str]:
    read = output.stderr_line if stream == "stderr" else output.stdout_line
    return [shown for shown in map(read, lines) if shown is not None]


def test_an_error_every_rank_printed_is_shown_once():
    out = LauncherOutput()
    lines = ["labavg: error: rank 0: data/train: no such directory\n",
             "labavg: error: rank 1: data/train: no such directory\n",
             "a rank's own line\n"]
    assert _shown(out, lines) == ["labavg: error: rank 0: data/train: no such directory\n",
                                  "a rank's own line\n"]
    assert out.errors == ["labavg: error: data/train: no such directory\n"]


def test_hydra_banner_is_held_back_and_names_the_lost_process():
    out = LauncherOutput()
    assert _shown(out, HYDRA_BANNER, "stdout") == ["\n"]
    assert out.lost_pids == {4242}
    trace = ["[proxy:0@node1] HYDU_sock_write: write error (Bad file descriptor)\n",
             "[mpiexec@node0] Sending Ctrl-C to processes as requested\n"]
    assert _shown(out, trace) == [] and out.launcher_lines == trace
    assert _shown(LauncherOutput(), trace[1:], "stdout") == []  # told to interrupt


def test_a_rank_that_ended_the_job_is_folded_into_the_closing_line():
    out = LauncherOutput()
    said = "labavg: rank 1 failed: injected fault at step 2; aborting all 2 MPI ranks\n"
    assert _shown(out, [said, "application called MPI_Abort(MPI_COMM_WORLD, 1)\n",
                        "labavg: interrupted\n"]) == []
    assert out.rank_said == ["rank 1 failed: injected fault at step 2"]
    code, text = out.closing(1, "", "MPI", lambda: "rank 0 at step 2")
    assert code == 1 and text == ("labavg: error: rank 1 failed: injected fault at step 2; the "
                                  "MPI job failed (exit status 1); rank 0 at step 2\n")
    assert out.reason() == ("rank 1 failed: injected fault at step 2; the MPI job failed "
                            "(exit status 1); rank 0 at step 2")


def test_what_a_rank_raised_is_the_reason_and_the_ranks_status_decides():
    out = LauncherOutput(torch=True)
    lines = ["Traceback (most recent call last):\n", '  File "x.py", line 1\n',
             "ValueError: bad value\n"]
    # torchrun's job: from a traceback on, its lines are torchrun's own (held back)
    assert _shown(out, lines) == [] and out.raised is None
    out = LauncherOutput()
    assert _shown(out, lines) == lines and out.raised == "ValueError: bad value"
    _shown(out, ["labavg: error: watchdog: rank 1 silent for 30 s\n"])
    code, text = out.closing(1, "", "torchrun", lambda: "")
    assert code == 3 and text == ""  # the watchdog's status; its line was shown as it came
    assert out.reason() == "ValueError: bad value; watchdog: rank 1 silent for 30 s"


def test_torchrun_names_a_worker_killed_by_a_signal():
    out = LauncherOutput(torch=True)
    lines = ["[W1205 02:00:00.000000 123 torch/distributed/elastic/x.py:1] Sending process 77 "
             "closing signal SIGTERM\n",
             "[1]:\n", "  time : 2026-12-05_02:00:00\n",
             "Traceback (most recent call last):\n",
             "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n",
             "  error_file: <N/A>\n",
             "  failed (exitcode: -9) local_rank: 1 (pid: 78) of binary: python\n"]
    shown = _shown(out, lines)
    assert shown == ["[1]:\n", "  time : 2026-12-05_02:00:00\n"]  # before its traceback
    assert out.lost_pids == {78}
    assert out.interrupted_by(1, "rank 1 (pid 78) was lost; ") is None


def test_srun_lines_are_held_back_and_shown_when_nothing_else_says_why():
    out = LauncherOutput()
    lines = ["srun: error: node1: task 1: Killed\n", "srun: Job step aborted: Waiting up to 32 "
             "seconds for job step to finish.\n", "slurmstepd: error: *** STEP 7.0 CANCELLED\n"]
    assert _shown(out, lines) == [] and out.launcher_lines == lines
    code, text = out.closing(137, "", "MPI", lambda: "")
    assert code == 137 and text.startswith("".join(lines))
    assert text.endswith("labavg: error: the MPI job failed (exit status 137); \n")


def test_a_signal_alone_is_an_interruption_a_reported_failure_is_not():
    out = LauncherOutput()
    assert out.interrupted_by(130, "") == 2 and out.interrupted_by(-15, "") == 15
    assert out.interrupted_by(1, "") is None
    assert out.interrupted_by(143, "rank 1 (pid 9) was lost; ") is None  # srun after a loss
    _shown(out, ["labavg: error: rank 0: out of memory\n"])
    assert out.interrupted_by(130, "") is None


def test_a_job_that_succeeded_says_what_its_ranks_said_and_the_launchers_trace():
    out = LauncherOutput()
    _shown(out, ["labavg: rank 0 stopped on request at step 9\n",
                 "[mpiexec@node0] some trace\n"])
    code, text = out.closing(0, "", "MPI", lambda: "never read")
    assert code == 0
    assert text == "[mpiexec@node0] some trace\nlabavg: rank 0 stopped on request at step 9\n"
    assert out.reason() is None
