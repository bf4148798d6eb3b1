""""Measure speedup": short runs of 2 and 4 ranks, each measuring its own speedup in pairs
(labavg.jobs.speedup), beside the cost model's line for as many machines and the cores' bound.

The dashboard's Scaling tab and notebook 07 call `measure_speedup`; the runs are jobs started
through labavg.jobs.launch.start_run (MPI processes), never threads of the caller.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from labavg.base.errors import UserError
from labavg.base.events import Event
from labavg.base.machine import usable_cores
from labavg.base.settings import with_overrides
from labavg.jobs.run_json import RunSummary
from labavg.jobs.speedup import Speedup, measured_speedup, speedup_from_summary
from labavg.studies import costmodel
from labavg.training.config import TrainConfig


@dataclass(frozen=True)
class ScalingPoint:
    """One point of a speedup plot: what was measured at `ranks`, what the cores allow, and the
    cost model's speedup for `ranks` machines of one rank each (from a measured run's costs)."""

    ranks: int
    speedup: Speedup
    bound: float  # min(ranks, cores)
    predicted: float | None  # the cost model, 10 GbE, at this run's K


def measure_speedup(base: TrainConfig, out: str | Path, ranks: Sequence[int] = (2, 4), *,
                    epochs: int = 1, pairs: int = 5, backend: str = "mpi",
                    on_event: Callable[[Event], None] | None = None) -> list[Speedup]:
    """Train `base` for `epochs` at each number of `ranks` under `out`/nN, one after another,
    and return each run's paired speedup, the 1-rank reference first (1.0 by definition).

    A run directory that already holds a finished run is read back, not trained again.
    `on_event` sees each run's events (typed, labavg.base.events) as they arrive.
    """
    from labavg.jobs.launch import start_run

    out = Path(out)
    results = [measured_speedup([], 1, usable_cores())]
    for n in ranks:
        if n < 2:
            raise UserError(f"measure_speedup: ranks must be 2 or more, got {n}")
        run_dir = out / f"n{n}"
        summary = _finished(run_dir)
        if summary is None:
            cfg = with_overrides(base, {"out": str(run_dir), "ranks": n, "backend": backend,
                                        "epochs": epochs, "speedup_pairs": pairs,
                                        "decode_data": None, "tensorboard": False})
            handle = start_run(cfg, resume=run_dir.exists())  # an interrupted one goes on
            for event in handle.events():
                if on_event is not None:
                    on_event(event)
            summary = handle.result()
        speedup = speedup_from_summary(summary) if summary is not None else None
        if speedup is None:
            raise UserError(f"{run_dir}: the run wrote no speedup")
        results.append(speedup)
    return results


def scaling_points(speedups: Sequence[Speedup], run_dirs: Sequence[Path] = ()) -> list[ScalingPoint]:
    """Plot points for `speedups` (measure_speedup's), each with the cores' bound and the cost
    model's prediction taken from the first of `run_dirs` that holds a finished run."""
    costs, k = None, None
    for run_dir in run_dirs:  # the first finished multi-rank run: its costs and its K
        summary = _finished(Path(run_dir))
        if summary is not None and (summary.ranks or 1) > 1:
            costs = costmodel.from_summary(summary)
            k = summary.average_every if isinstance(summary.average_every, int) else None
            break
    points = []
    for s in speedups:
        predicted = None
        if costs is not None:
            predicted = costmodel.predict(costs, [s.ranks], Ks=[k or 10])[0].speedup
        points.append(ScalingPoint(s.ranks, s, s.bound, predicted))
    return points


def _finished(run_dir: Path) -> RunSummary | None:
    from labavg.jobs.summary import load_summary

    if not (run_dir / "summary.json").is_file():
        return None
    return load_summary(run_dir)
