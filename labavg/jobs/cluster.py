"""An ipyparallel cluster of MPI engines that runs `labavg.jobs.runs.run_training` on every rank.

Used by notebooks and the dashboard (through labavg.jobs.launch); it never re-implements training.
This is the client side; what runs inside the engines is labavg.jobs.engine. The pieces:

* `Cluster.start(n)` starts an ipyparallel controller and `n` engines under the venv's MPICH
  `mpiexec` (engines="mpi"), all on 127.0.0.1; `Cluster.attach()` connects to a running
  `ipcluster start --engines=mpi`. Every engine reports its MPI rank and binds its device by
  local rank (`labavg.comm.devices.select_device`); `cluster.view` is a DirectView in rank order.
* `start_run(cfg, cluster=cluster)` (labavg.jobs.launch, the one door to a run) calls
  `cluster._submit(cfg)`, which sends the config as a plain dict to every engine, which runs
  `run_training` in a background thread (the engine stays free for `stop()` and `%px`) and
  streams its events back as ipyparallel data messages (datapub). The returned `ClusterRun`
  reassembles them, detects gaps, watches for dead or silent engines, and yields them typed
  (`events()`) until rank 0's summary (`result()`) is in (labavg.jobs.cluster_run, which also
  describes the data messages).
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
import weakref
from typing import Any

from labavg.training.config import TrainConfig
from labavg.base.settings import to_dict
from labavg.jobs import engine
from labavg.jobs.cluster_guard import start_guard
from labavg.jobs.cluster_run import ClusterRun
from labavg.jobs.processes import pid_alive, signal_pids, wait_pids
from labavg.base.errors import UserError
from labavg.base.waiting import wait_until


# The cluster this process started last in each profile: Run All again replaces it (a second
# cluster beside the first doubled the processes, and shutdown() stopped only the second).
_STARTED: dict[str, weakref.ref] = {}


def mpi_launcher_config(extra_args: list[str] | None = None):
    """traitlets Config making ipyparallel's MPI engine launcher run the venv's MPICH locally.

    The options are those of `labavg.comm.launchers.local_mpiexec_args`, without hydra's
    auto-cleanup: when one rank dies the others end when their next collective fails, or hang,
    so the client sees the dead rank go first and can name it (`ClusterRun.kill` ends the rest).
    """
    from traitlets.config import Config

    from labavg.comm.launchers import find_mpiexec, local_mpiexec_args

    mpiexec = find_mpiexec()
    args = local_mpiexec_args(mpiexec, auto_cleanup=False)
    config = Config()
    config.MPIEngineSetLauncher.mpi_cmd = [str(mpiexec)]
    config.MPIEngineSetLauncher.mpi_args = args + list(extra_args or [])
    return config


class Cluster:
    """A client on an ipyparallel cluster of MPI engines, with engines listed in rank order."""

    def __init__(self, ipp_cluster, client, *, device: str = "auto", owned: bool = True,
                 timeout: float = 120.0):
        self._ipp = ipp_cluster
        self.client = client
        self.device = device
        self._owned = owned
        self._timeout = timeout
        self._infos: list[dict[str, Any]] = []
        self._run: ClusterRun | None = None
        self._pids: set[int] = set()  # every process this cluster started (for shutdown checks)
        self._closed = False
        self._quiet_stop = False  # whether shutdown may hide ipyparallel's INFO lines
        self._guard = None  # ends the cluster if this process dies without shutdown()

    # -- starting and attaching

    @classmethod
    def start(cls, n: int, *, profile: str | None = None, device: str = "auto",
              timeout: float = 120.0, **kw) -> Cluster:
        """Start a controller and `n` MPI engines on this machine (127.0.0.1 only).

        A cluster this process started earlier in the same profile is shut down first (a
        notebook's Run All, again). The cluster ends with this process: a guard process ends
        it when this one dies without `shutdown()` (a killed kernel).
        Extra keywords go to `ipyparallel.Cluster` (e.g. `profile_dir`, `log_level`).
        """
        import ipyparallel as ipp

        if n < 1:
            raise UserError(f"number of engines must be at least 1, got {n}")
        if profile is not None:
            kw["profile"] = profile
        key = os.path.realpath(kw["profile_dir"]) if kw.get("profile_dir") else kw.get("profile", "default")
        earlier = _STARTED.pop(key, lambda: None)()
        if earlier is not None:
            earlier.shutdown()
        config = kw.pop("config", None) or mpi_launcher_config()
        ipp_cluster = ipp.Cluster(engines="mpi", n=n, controller_ip="127.0.0.1", config=config, **kw)
        quiet = "log_level" not in kw and "log" not in kw
        if quiet:
            # ipyparallel logs each step at INFO, to stdout in IPython ("Starting 4 engines
            # with <class ...>" under a notebook's cell); warnings still show.
            ipp_cluster.log.setLevel(logging.WARNING)
        ipp_cluster.start_cluster_sync()
        # _bind waits for the engines: no progress bar of ipyparallel's in the cell
        client = ipp_cluster.connect_client_sync()
        cluster = cls(ipp_cluster, client, device=device, owned=True, timeout=timeout)
        cluster._quiet_stop = quiet
        try:
            cluster._bind(n)
            cluster._start_guard()
        except BaseException:
            cluster.shutdown()
            raise
        _STARTED[key] = weakref.ref(cluster)
        return cluster

    @classmethod
    def attach(cls, profile: str = "default", cluster_id: str = "", *, device: str = "auto",
               timeout: float = 120.0, **kw) -> Cluster:
        """Connect to running MPI engines of `profile` / `cluster_id`.

        Started by `ipcluster start --engines=mpi` (its cluster file lets `kill()` restart the
        engines, from the machine that runs ipcluster), or by `ipcontroller` + `srun ipengine
        --mpi` (only the client connection file exists: `kill()` can then signal engines on
        this host but not start new ones). `shutdown()` of an attached cluster only disconnects.
        Extra keywords (e.g. `profile_dir`) go to ipyparallel.
        """
        import ipyparallel as ipp

        ipp_cluster = _cluster_file(profile, cluster_id, timeout, kw)
        if ipp_cluster is not None:
            if "mpi_cmd" not in ipp_cluster.config.MPIEngineSetLauncher:
                # a restart from here starts engines the way Cluster.start does
                ipp_cluster.config.merge(mpi_launcher_config())
            client = ipp_cluster.connect_client_sync()
        else:
            client = ipp.Client(profile=profile, cluster_id=cluster_id or None, **kw)
        cluster = cls(ipp_cluster, client, device=device, owned=False, timeout=timeout)
        cluster._bind(None)
        return cluster

    def _bind(self, n: int | None) -> None:
        """Wait for `n` engines (None: the MPI world's size), bind their devices, order by rank."""
        ids: list[int] = []

        def registered() -> bool:
            nonlocal ids, n
            ids = list(self.client.ids)
            if n is None and ids:
                # binding is collective over COMM_WORLD: wait for every rank of the world
                n = self.client[ids[0]].apply_async(engine.mpi_world_size).get(timeout=self._timeout)
            return n is not None and len(ids) >= n

        if not wait_until(registered, self._timeout):
            raise TimeoutError(
                f"only {len(ids)} of {n or 'the'} engines registered in {self._timeout:.0f} s")
        infos = self.client[ids].apply_async(engine.bind_engine, self.device).get(timeout=self._timeout)
        for engine_id, info in zip(ids, infos):
            info["engine_id"] = engine_id
        self._infos = sorted(infos, key=lambda info: info["rank"])
        ranks = [info["rank"] for info in self._infos]
        if ranks != list(range(len(ranks))) or any(i["size"] != len(ranks) for i in self._infos):
            raise RuntimeError(f"engines are not one MPI world: ranks {ranks}, sizes "
                               f"{[i['size'] for i in self._infos]}")
        self._pids |= set(self.process_ids())

    # -- what the cluster is

    @property
    def closed(self) -> bool:
        """Whether `shutdown()` was called."""
        return self._closed

    @property
    def ranks(self) -> list[int]:
        """MPI ranks of the engines, 0..n-1."""
        return [info["rank"] for info in self._infos]

    @property
    def engine_ids(self) -> list[int]:
        """ipyparallel engine ids, in rank order."""
        return [info["engine_id"] for info in self._infos]

    def check_open(self) -> None:
        """UserError (one line, what to do) once the engines were shut down."""
        if self._closed:
            raise UserError("the engines were shut down (cluster.shutdown()); start them again "
                            "with Cluster.start (rerun that cell), then this one")

    @property
    def view(self):
        """A blocking DirectView on the engines in rank order (`view.activate()` for %px)."""
        self.check_open()
        view = self.client[self.engine_ids]
        view.block = True
        return view

    @property
    def cluster_id(self) -> str | None:
        """The ipyparallel cluster id (for `Cluster.attach`); None when attached without one."""
        return None if self._ipp is None else self._ipp.cluster_id

    @property
    def profile_dir(self) -> str | None:
        """The IPython profile directory holding the connection files."""
        return None if self._ipp is None else self._ipp.profile_dir

    def info(self) -> list[dict[str, Any]]:
        """Per engine, in rank order: rank, size, local_rank, host, pid, device, engine_id."""
        return [dict(info) for info in self._infos]

    def process_ids(self) -> list[int]:
        """Local pids of the controller, mpiexec and its children (engines, hydra proxies)."""
        import psutil

        pids = set()
        launchers = []
        if self._ipp is not None:
            launchers = [self._ipp.controller] if self._ipp.controller else []
            launchers += list(self._ipp.engines.values())
        for launcher in launchers:
            pid = getattr(launcher, "pid", None)
            if not pid or not pid_alive(pid):
                continue
            pids.add(pid)
            try:
                pids |= {child.pid for child in psutil.Process(pid).children(recursive=True)}
            except psutil.NoSuchProcess:
                pass
        host = socket.gethostname()
        pids |= {info["pid"] for info in self._infos if info["host"] == host}
        return sorted(pids)

    # -- runs

    def _submit(self, cfg: TrainConfig, *, resume: bool = False, heartbeat: float = 0.5,
               silence_timeout: float = 15.0) -> ClusterRun:
        """Start `cfg` on all engines (cfg.backend must be "mpi") and return its handle at once.

        `resume` continues cfg.out from its last checkpoint.
        `silence_timeout`: seconds without a heartbeat after which an engine counts as dead.
        """
        self.check_open()
        if cfg.backend != "mpi":
            raise UserError(f"a cluster runs backend 'mpi'; the config has backend {cfg.backend!r}")
        if cfg.ranks not in (1, len(self._infos)):
            raise UserError(
                f"the config asks for ranks={cfg.ranks} but the cluster has {len(self._infos)} engines")
        if self._run is not None:
            self._run.refresh()  # a run that ended unwatched is only known to have ended once looked at
        if self._run is not None and not self._run.done:
            raise RuntimeError("a run is still going on this cluster; result(), stop() or kill() it first")
        run_id = uuid.uuid4().hex[:12]
        cfg_dict = to_dict(cfg)
        results = [self.client[info["engine_id"]].apply_async(engine._launch_on_engine, run_id, cfg_dict,
                                                              heartbeat, resume)
                   for info in self._infos]
        self._run = ClusterRun(self, run_id, results, self.info(), silence_timeout=silence_timeout)
        return self._run

    def request_stop(self, run_id: str) -> None:
        """Set the stop flag of run `run_id` on every engine."""
        self.client[self.engine_ids].apply_async(engine.request_stop, run_id).get(timeout=self._timeout)

    def restart(self) -> None:
        """Hard-stop the engines (SIGTERM, then SIGKILL) and start and bind fresh ones.

        The only way out of a hung run: a rank blocked in an MPI collective ignores SIGINT
        and any request sent to it.
        """
        n = len(self._infos)
        old = set(self.engine_ids)
        host = socket.gethostname()
        signal_pids([info["pid"] for info in self._infos if info["host"] == host])
        if self._ipp is None:
            raise RuntimeError("attached without an ipcluster file, so the engines cannot be restarted "
                               "from here: start new engines (srun ipengine --mpi) and attach again")
        self._ipp.restart_engines_sync()
        # New engines ask for their MPI rank as engine id, so wait until the controller has
        # dropped the old ones (each engine's nanny reports its death at once) before binding.
        wait_until(lambda: not old & set(self.client.ids), self._timeout)
        self._infos = []
        self._bind(n)
        self._start_guard()  # the new mpiexec and engines

    def shutdown(self, *, grace: float = 5.0) -> None:
        """Stop engines and controller (of a cluster this object started) and close the client.

        Idempotent. Afterwards none of the processes the cluster started is left running. A
        normal shutdown prints nothing; an engine that had failed (exited with an error, was
        killed) or does not leave within `grace` seconds of being asked is still reported.
        """
        if self._closed:
            return
        self._closed = True
        pids = set(self.process_ids()) | self._pids
        if not self._owned:
            self._close_client()
            return
        log = self._ipp.log
        if self._quiet_stop and log.name == f"ipyparallel.cluster.cluster.{self._ipp.cluster_id}":
            # ipyparallel logs every step of a stop at INFO, to stdout in IPython; kept raised,
            # as its stop callbacks run on its event loop after this returns. Warnings (an engine
            # set that exited with an error, with its output) still show.
            log.setLevel(max(log.getEffectiveLevel(), logging.WARNING))
        host = socket.gethostname()
        local = {info["pid"] for info in self._infos if info["host"] == host}
        try:
            registered = set(self.client.ids)
            asked = [engine_id for engine_id in self.engine_ids if engine_id in registered]
            if asked:
                self.client[asked].apply_async(engine.exit_engine)
        except Exception:  # noqa: BLE001 - engines that cannot be asked are signalled below
            pass
        # Ending the engines before the controller lets mpiexec exit by itself (status 0 when
        # every engine left by exit_engine); hydra otherwise sits out ipyparallel's 5 s TERM
        # grace period before it is killed.
        stuck = wait_pids(local, grace)
        if stuck:
            log.warning(f"engine processes {sorted(stuck)} did not exit within {grace:g} s of "
                        "being asked (busy in MPI?): killing them")
            signal_pids(sorted(stuck))
        self._close_client()
        self._ipp.stop_cluster_sync()
        signal_pids([pid for pid in pids if pid_alive(pid)])
        self._stop_guard()

    def _start_guard(self) -> None:
        self._stop_guard()
        self._guard = start_guard(os.getpid(), self.process_ids())

    def _stop_guard(self) -> None:
        if self._guard is not None:  # nothing left to guard, or a new guard for new engines
            self._guard.terminate()
            self._guard.wait(10)
            self._guard = None

    def _close_client(self) -> None:
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - a half-closed client must not stop the shutdown
            pass

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _cluster_file(profile: str, cluster_id: str, timeout: float, kw: dict[str, Any]) -> Any:
    """The ipyparallel Cluster of `profile` / `cluster_id`'s cluster file, None when there is
    none. ipcluster creates the file before it writes it: attached at that moment (a notebook
    started as the job came up; once in a CI run) it reads empty, so an unreadable file is
    read again until `timeout` before it is refused."""
    import json

    import ipyparallel as ipp

    found: list[Any] = []
    failure: list[str] = []

    def read() -> bool:
        try:
            found[:] = [ipp.Cluster.from_file(profile=profile, cluster_id=cluster_id, **kw)]
        except FileNotFoundError:
            found[:] = [None]
        except json.JSONDecodeError as exc:
            failure[:] = [str(exc)]
            return False
        return True

    if not wait_until(read, timeout, 0.2):
        path = ipp.Cluster(profile=profile, cluster_id=cluster_id, **kw).cluster_file
        raise UserError(f"{path}: the ipyparallel cluster file is not JSON after {timeout:g} s "
                        f"({failure[0]})")
    return found[0]
