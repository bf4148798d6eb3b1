"""The engine side of labavg.jobs.cluster: what runs inside each ipyparallel MPI engine.

The client (labavg.jobs.cluster) sends these functions by reference (labavg is importable on the
engines); their state lives in the engine's user namespace, like a %px variable.

`_launch_on_engine` runs `labavg.jobs.runs.run_training` in a background thread (the engine
stays free for `request_stop` and %px) and streams the events back as ipyparallel data
messages: each batch under its own key `<run>/<seq>` (the client keeps only the latest value
per key), and `<run>/alive`, a heartbeat the publisher thread refreshes every `heartbeat`
seconds even while training is stuck in a collective.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import traceback
from typing import Any

ALIVE = "alive"
_RUNS_KEY = "_labavg_runs"  # name of the engine-namespace dict holding an engine's runs


def _engine_namespace() -> dict[str, Any]:
    from IPython import get_ipython

    return get_ipython().user_ns


def bind_engine(device: str) -> dict[str, Any]:
    """On an engine: MPI rank, local rank and the bound device (collective over COMM_WORLD).

    Also sets `rank`, `size`, `local_rank` and `device` in the engine's namespace for %px cells.
    """
    import torch

    from labavg.comm.devices import select_device
    from labavg.comm.mpi import MpiCommunicator

    comm = MpiCommunicator()
    bound = select_device(device, comm.local_rank)
    if bound.type == "cuda":
        torch.cuda.set_device(bound)
    _engine_namespace().update(rank=comm.rank, size=comm.size, local_rank=comm.local_rank, device=bound)
    return {"rank": comm.rank, "size": comm.size, "local_rank": comm.local_rank,
            "host": socket.gethostname(), "pid": os.getpid(), "device": str(bound)}


def mpi_world_size() -> int:
    """On an engine: the size of MPI_COMM_WORLD (not collective)."""
    from labavg.comm.mpi import world_rank_size

    return world_rank_size()[1]


class EngineRun:
    """One engine's part of a run: a training thread and a publisher thread.

    The publisher sends `ZMQDataPublisher.publish_data` messages (what
    `ipyparallel.datapub.publish_data` sends) with the parent header of the submitting request
    pinned: the shell's own publisher re-parents to whatever request the engine handles next
    (a stop, a %px cell), which would file later events under that request instead.
    """

    def __init__(self, run_id: str, cfg_dict: dict[str, Any], rank: int, heartbeat: float,
                 resume: bool = False):
        from ipyparallel.engine.datapub import ZMQDataPublisher
        from IPython import get_ipython

        kernel = get_ipython().kernel
        self.run_id, self.rank, self.heartbeat = run_id, rank, heartbeat
        self.cfg_dict = cfg_dict
        self.resume = resume
        self.stop_requested = threading.Event()
        self._publisher = ZMQDataPublisher(session=kernel.session, pub_socket=kernel.iopub_socket)
        self._publisher.set_parent(kernel.get_parent("shell"))
        self._cond = threading.Condition()
        self._pending: list[dict[str, Any]] = []
        self._final: dict[str, Any] | None = None
        self._threads = [
            threading.Thread(target=self._train, name=f"labavg-train-{run_id}", daemon=True),
            threading.Thread(target=self._publish, name=f"labavg-publish-{run_id}", daemon=True),
        ]

    def start(self) -> None:
        """Start training and publishing."""
        for thread in self._threads:
            thread.start()

    def alive(self) -> bool:
        """Whether the run's threads are still going."""
        return any(thread.is_alive() for thread in self._threads)

    def _on_event(self, event) -> None:
        record = event.to_dict()
        record["t_created"] = time.time()
        with self._cond:
            self._pending.append(record)
            self._cond.notify()

    def _train(self) -> None:
        from labavg.training.config import config_from_dict
        from labavg.jobs.runs import run_training

        try:
            cfg = config_from_dict(self.cfg_dict, "submitted config")
            summary = run_training(cfg, resume=self.resume, progress=False, on_event=self._on_event,
                                   should_stop=self.stop_requested.is_set)
            # summary.json's object: plain data on the wire, as the events are
            final = {"status": "done", "summary": None if summary is None else summary.to_dict()}
        except BaseException as exc:  # noqa: BLE001 - reported to the client, which raises it
            final = {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                     "traceback": traceback.format_exc()}
        with self._cond:
            self._final = final
            self._cond.notify()

    def _publish(self) -> None:
        seq = beat = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._final is not None, self.heartbeat)
                events, self._pending = self._pending, []
                final = self._final
            beat += 1
            data: dict[str, Any] = {
                f"{self.run_id}/{ALIVE}": {"rank": self.rank, "beat": beat, "seq": seq, "t": time.time()}
            }
            if events or final is not None:
                data[f"{self.run_id}/{seq:09d}"] = {"rank": self.rank, "seq": seq, "events": events,
                                                    "final": final, "t_sent": time.time()}
                seq += 1
            self._publisher.publish_data(data)
            if final is not None:
                return


def _launch_on_engine(run_id: str, cfg_dict: dict[str, Any], heartbeat: float,
                     resume: bool = False) -> dict[str, Any]:
    """On an engine: start this rank's part of run `run_id` in the background and return at once."""
    from labavg.comm.mpi import world_rank_size

    runs = _engine_namespace().setdefault(_RUNS_KEY, {})
    busy = [rid for rid, run in runs.items() if run.alive()]
    if busy:
        raise RuntimeError(f"run {busy[0]} is still running on this engine")
    rank = world_rank_size()[0]
    run = runs[run_id] = EngineRun(run_id, cfg_dict, rank, heartbeat, resume)
    run.start()
    return {"rank": rank, "pid": os.getpid(), "run_id": run_id}


def request_stop(run_id: str) -> bool:
    """On an engine: ask run `run_id` to stop at its next averaging point; False if unknown."""
    run = _engine_namespace().get(_RUNS_KEY, {}).get(run_id)
    if run is None:
        return False
    run.stop_requested.set()
    return True


def exit_engine(delay: float = 0.1) -> int:
    """On an engine: leave the process with status 0 `delay` seconds from now; returns its pid.

    ipengine (ipyparallel 9 on ipykernel 7) exits with status 1 and a traceback ("Event loop
    stopped before Future completed") on SIGTERM and on a shutdown request alike, so mpiexec
    fails and ipyparallel prints every engine's log as if the job had crashed. os._exit skips
    MPI_Finalize, which could block on a rank still in a collective; hydra takes status 0
    without it. The delay lets this call's reply go out first.
    """
    threading.Timer(delay, os._exit, (0,)).start()
    return os.getpid()
