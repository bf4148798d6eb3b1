"""What several test modules share: launching real MPICH / torchrun jobs of a helper script
and reading their per-rank results, and the CLI's one-line refusal of a bad setting."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


def child_env() -> dict[str, str]:
    """Environment for launched ranks: the repo importable, one torch thread per rank."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    return env


def load_script(path: Path, name: str) -> ModuleType:
    """A helper script as a module, so inproc runs the very code the launchers run."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launch(command: list[str], timeout: float = 120) -> None:
    """Run a launcher; fail with its output if it fails or hangs."""
    try:
        done = subprocess.run(command, env=child_env(), capture_output=True, text=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{command[0]} hung for {timeout} s: {exc.stdout} {exc.stderr}")
    assert done.returncode == 0, f"{command}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"


def load_ranks(out: Path, size: int) -> list[dict[str, np.ndarray]]:
    """Every rank's saved results (OUT/rank<r>.npz), in rank order."""
    ranks = []
    for rank in range(size):
        with np.load(out / f"rank{rank}.npz") as saved:
            ranks.append({key: saved[key] for key in saved.files})
    return ranks


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cli_refusal(tmp_path: Path, args: list[str]) -> str:
    """`labavg train ARGS` with a bad setting: exit status 2, one line on stderr, nothing
    written; returns that line."""
    proc = subprocess.run(
        [PYTHON, "-m", "labavg", "train", "--data", str(tmp_path / "nodata"), "--out",
         str(tmp_path / "run"), *args], capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env=child_env())
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("labavg: error: "), lines
    assert list(tmp_path.iterdir()) == []
    return lines[0]


def stopped_then_resumed(cfg, at_step: int = 4) -> tuple[dict, dict]:
    """Train `cfg`, stop it once a rank reports step `at_step` (every rank stops at the next
    round, with a checkpoint), then resume it to the end: (stopped summary, resumed summary)."""
    from labavg.jobs.runs import run_training

    flag = threading.Event()

    def on_event(event):
        if getattr(event, "step", 0) >= at_step:
            flag.set()

    stopped = run_training(cfg, progress=False, on_event=on_event, should_stop=flag.is_set)
    (Path(cfg.out) / "summary.json").unlink()
    return stopped, run_training(cfg, resume=True, progress=False)


def wait_for(predicate, timeout: float, what: str, poll: float = 0.1):
    """`predicate()`'s first true value; fail the test naming `what` after `timeout` seconds."""
    from labavg.base.waiting import wait_until

    value = wait_until(predicate, timeout, poll)
    if not value:
        raise AssertionError(f"timed out after {timeout} s waiting for {what}")
    return value


def stop_at_first_round(handle, timeout: float = 120) -> list:
    """Follow a started run to its first averaging round, ask it to stop there, and return the
    events seen so far; fails if the run had already ended (it would prove nothing)."""
    from labavg.base.events import Averaged

    events = []
    for event in handle.events(timeout=timeout):
        events.append(event)
        if isinstance(event, Averaged):
            handle.stop()
            break
    assert not handle.done(), "the run ended before its first averaging round"
    return events


def processes_naming(path: Path) -> list[str]:
    """The command lines of running processes that name `path` (a run directory: its
    `labavg train`, launcher and workers), to check that nothing of a job is left."""
    import psutil

    left = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if str(path) in " ".join(p.info["cmdline"] or ()) and p.info["status"] != "zombie":
                left.append(" ".join(p.info["cmdline"]))
        except psutil.Error:
            pass
    return left


def running(pids) -> list[int]:
    """Which of `pids` still run (a zombie has ended)."""
    import psutil

    left = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            pass
    return left
