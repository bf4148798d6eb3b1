"""The runs a dashboard server started: what every page of it finds, whatever page started them.

Sessions come and go (a reload is a new session); a run started from a page goes on in its
job process and its worker thread. So the pages of one server share one `JobRegistry`, held
by the server (`server_jobs`: Panel's `pn.state.cache`, one per process) or passed in by
whoever builds the pages (a test, a notebook), and never a module global: two dashboards in
one process with registries of their own do not see each other's runs.
"""

from __future__ import annotations

import threading

from dashboard.workers import Job

CACHE_KEY = "labavg-dashboard-jobs"


class JobRegistry:
    """The server's runs in progress, by run directory, and the run it started last.

    `started` counts the runs started so far: a page that sees it change puts a run another
    page started on its own screen. (A count the page reads, not a watcher the registry
    calls: the registry outlives the pages, and would keep every closed page alive.)
    """

    def __init__(self) -> None:
        self.started = 0  # runs started so far
        self._lock = threading.Lock()
        self._active: dict[str, Job] = {}
        self._last: Job | None = None

    def add(self, job: Job) -> bool:
        """Register a starting run; False (nothing changed) while another is in progress: Start
        anywhere must see a run in progress before a second one starts beside it."""
        with self._lock:
            if self._active:
                return False
            self._active[job.run_dir] = job
            self._last = job
            self.started += 1
        return True

    def remove(self, job: Job) -> None:
        """The run has ended (its worker is done with it)."""
        with self._lock:
            self._active.pop(job.run_dir, None)

    def active(self) -> Job | None:
        """A run in progress on this server, if any."""
        with self._lock:
            return next(iter(self._active.values()), None)

    def last(self) -> Job | None:
        """The run started last on this server (in progress or ended), if any."""
        with self._lock:
            return self._last


def server_jobs() -> JobRegistry:
    """The registry of this server process (Panel's per-process cache), made on first use."""
    import panel as pn

    return pn.state.as_cached(CACHE_KEY, JobRegistry)
