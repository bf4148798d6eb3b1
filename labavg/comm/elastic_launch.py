"""The elastic job's launcher: `python -m labavg.comm.elastic_launch --nproc N [...] -- ARGV`.

torchrun ends every worker when one fails (or restarts them all); an elastic job must do neither.
This launcher starts the job's lighthouse (labavg.comm.elastic) and N workers running
`python ARGV`, each in a session of its own so that a signal meant for one reaches no other.
A worker that ends with an error is reported in one line and the others go on; the job ends when
no worker is left, with 0 if any of them finished. SIGINT or SIGTERM to the launcher ends every
worker (SIGTERM, then SIGKILL after a grace) and the lighthouse, and exits 130 or 143.

A worker can be added to the running job (`labavg train --join`): a request on the launcher's
Unix socket (`--join-socket`, a file beside the run, so no network listener) starts a worker for
the lowest launch rank no longer running; it heals from a survivor at its first round. The
launcher keeps `--state-file` (JSON: lighthouse, launcher pid, every running worker's pid) up to
date, for the dashboard's "Lose a worker" and for joins.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from labavg.comm.launchers import end_with_parent

# What tells a worker it is elastic, and where its lighthouse is (read by labavg.comm.world).
LIGHTHOUSE_ENV = "LABAVG_LIGHTHOUSE"
MIN_WORKERS_ENV = "LABAVG_MIN_WORKERS"
JOINING_ENV = "LABAVG_JOINING"  # "1" in a worker started by a join: it heals, it does not gather
STATE_ENV = "LABAVG_ELASTIC_STATE"  # the launcher's state file, where a worker reads "finished"
GRACE_SECONDS = 10.0


class ElasticJob:
    """The workers of one elastic job, and what happens to them."""

    def __init__(self, nproc: int, argv: list[str], lighthouse: str, *, min_workers: int,
                 state_file: Path | None, join_socket: Path | None = None):
        self.nproc, self.argv, self.lighthouse = nproc, argv, lighthouse
        self.min_workers, self.state_file, self.join_socket = min_workers, state_file, join_socket
        self.running: dict[int, subprocess.Popen] = {}
        self.ended: dict[int, int] = {}  # launch rank -> exit status of its last worker
        self.finished = False  # a worker ended with 0: the job's training is done
        self.inbox: queue.Queue = queue.Queue()
        self.interrupted: int | None = None

    def start(self, rank: int, joining: bool = False, announce: bool = True
              ) -> subprocess.Popen:
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(self.nproc),
               "LOCAL_RANK": str(rank), LIGHTHOUSE_ENV: self.lighthouse,
               MIN_WORKERS_ENV: str(self.min_workers), JOINING_ENV: "1" if joining else "0",
               STATE_ENV: "" if self.state_file is None else str(self.state_file)}
        proc = subprocess.Popen([sys.executable, *self.argv], env=env, start_new_session=True,
                                preexec_fn=end_with_parent if sys.platform == "linux" else None)
        self.running[rank] = proc
        threading.Thread(target=lambda: self.inbox.put(("exit", rank, proc.wait())),
                         daemon=True, name=f"labavg-worker-{rank}").start()
        if announce:
            self._write_state()
        return proc

    def run(self) -> int:
        for rank in range(self.nproc):
            self.start(rank, announce=False)
        self._write_state()  # once, with every worker: a reader never sees a job half started
        while self.running:
            kind, *what = self.inbox.get()
            if kind == "exit":
                self._ended(*what)
            elif kind == "join":
                self._join(*what)
            elif kind == "signal" and self.interrupted is None:
                self.interrupted = what[0]
                self._end_all()
        self._write_state()
        if self.interrupted is not None:
            return 128 + self.interrupted
        if self.finished:
            return 0
        codes = [128 - c if c < 0 else c for c in self.ended.values()]  # killed: 128 + signal
        return 2 if codes and all(c == 2 for c in codes) else next(
            (c for c in codes if c != 0), 1)

    def _ended(self, rank: int, code: int) -> None:
        self.running.pop(rank, None)
        self.ended[rank] = code
        if code == 0:
            self.finished = True
        elif self.interrupted is None and code != 2 and self.running:
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
            left = len(self.running)
            print(f"labavg: rank {rank} left the job ({how}); "
                  f"{left} {'worker goes' if left == 1 else 'workers go'} on",
                  file=sys.stderr, flush=True)
        self._write_state()

    def _join(self, conn: socket.socket) -> None:
        free = [r for r in range(self.nproc) if r not in self.running]
        if self.finished or self.interrupted is not None:
            answer = {"error": "the job is ending: there is nothing to join"}
        elif not free:
            answer = {"error": f"all {self.nproc} workers are running: a join takes the place "
                               f"of a lost one"}
        else:
            proc = self.start(free[0], joining=True)
            answer = {"rank": free[0], "pid": proc.pid}
        with conn:
            conn.sendall((json.dumps(answer) + "\n").encode())

    def _end_all(self) -> None:
        for proc in self.running.values():
            _signal(proc, signal.SIGTERM)
            _signal(proc, signal.SIGCONT)  # a stopped worker's SIGTERM waits until it runs
        # A daemon: once the workers have ended, nothing is left to kill and the launcher exits.
        timer = threading.Timer(GRACE_SECONDS, self.kill_all)
        timer.daemon = True
        timer.start()

    def kill_all(self) -> None:
        for proc in list(self.running.values()):
            _signal(proc, signal.SIGKILL)

    def _write_state(self) -> None:
        if self.state_file is None:
            return
        state = {"lighthouse": self.lighthouse, "launcher": os.getpid(),
                 "workers": {str(r): p.pid for r, p in sorted(self.running.items())},
                 "size": self.nproc,
                 "join_socket": None if self.join_socket is None else str(self.join_socket),
                 "finished": self.finished}
        tmp = self.state_file.with_name(self.state_file.name + ".tmp")
        tmp.write_text(json.dumps(state) + "\n", encoding="utf-8")
        os.replace(tmp, self.state_file)


def _signal(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)  # the worker's session: its data threads' children too
    except ProcessLookupError:
        pass


def _serve_joins(path: Path, inbox: queue.Queue) -> socket.socket:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path.unlink(missing_ok=True)
    server.bind(str(path))
    os.chmod(path, 0o600)  # only this user can add workers to the job
    server.listen()

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return  # closed: the job has ended
            inbox.put(("join", conn))

    threading.Thread(target=accept, daemon=True, name="labavg-joins").start()
    return server


def request_join(path: str | Path, timeout: float = 30.0) -> dict:
    """Ask the launcher listening on `path` for one more worker: {"rank", "pid"} or {"error"}."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        conn.connect(str(path))
        answer = conn.makefile().readline()
    return json.loads(answer) if answer else {"error": "the launcher closed the connection"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labavg.comm.elastic_launch")
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--min-workers", type=int, default=1)
    parser.add_argument("--heartbeat-ms", type=int, default=1000)
    parser.add_argument("--join-timeout-ms", type=int, default=30_000)
    parser.add_argument("--lighthouse-port", type=int, default=0,
                        help="where the lighthouse listens on 127.0.0.1 (0: a free port)")
    parser.add_argument("--state-file", type=Path)
    parser.add_argument("--join-socket", type=Path)
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    worker_argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    from labavg.base.errors import UserError
    from labavg.comm.elastic import Lighthouse

    private = None
    if args.join_socket is None:
        # A Unix socket's path must be short (108 bytes), so not under a deep run directory;
        # mkdtemp's folder is this user's alone (mode 0700).
        private = Path(tempfile.mkdtemp(prefix="labavg-join-"))
        args.join_socket = private / "join.sock"
    server = lighthouse = job = None
    try:
        lighthouse = Lighthouse(min_workers=args.min_workers, heartbeat_ms=args.heartbeat_ms,
                                join_timeout_ms=args.join_timeout_ms, port=args.lighthouse_port)
        job = ElasticJob(args.nproc, worker_argv, lighthouse.address,
                         min_workers=args.min_workers, state_file=args.state_file,
                         join_socket=args.join_socket)
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda s, _f: job.inbox.put(("signal", s)))
        try:
            server = _serve_joins(args.join_socket, job.inbox)
        except OSError as exc:
            raise UserError(f"--join-socket {args.join_socket}: cannot listen there: "
                            f"{exc.strerror or exc}") from None
        return job.run()
    except UserError as exc:  # before any worker started: nothing to end but what is here
        flag = f"--lighthouse-port {args.lighthouse_port}: " if lighthouse is None else ""
        print(f"labavg: error: {flag}{exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        if job is not None:  # ending on an exception (a closed stderr): no worker outlives it
            job.kill_all()
        if server is not None:
            server.close()
            args.join_socket.unlink(missing_ok=True)
        if private is not None:
            private.rmdir()
        if args.state_file is not None:
            args.state_file.unlink(missing_ok=True)
        if lighthouse is not None:
            lighthouse.close()


if __name__ == "__main__":
    sys.exit(main())
