"""What the dashboard shows of a run's speedup: the measured one, beside the cost model's.

The measured speedup is `labavg.jobs.speedup`'s, the one function every screen reads (the
Live tab from the run's events so far, the Runs table, its CSV and the Scaling tab from
summary.json): a paired measurement inside the run, so a run has the same number, interval and
conditions wherever it is shown. Beside it: what the cores here allow (min(N, cores)) and the
cost model's prediction for N machines (`labavg.studies.costmodel`), from this run's own
costs, with rank 0's compute timed alone in the pairs when there are any (no other rank then
shares the cores).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping
from typing import Any

from dashboard.buffers import RunBuffers
from dashboard.membership import Workers
from labavg.base.machine import usable_cores
from labavg.base.errors import UserError
from labavg.jobs.run_json import RunSummary, as_summary
from labavg.jobs.speedup import Speedup, speedup_from_events, speedup_from_summary
from labavg.studies.costmodel import TEN_GBE, MeasuredCosts, from_summary, predict
from labavg.training.config import TrainConfig

# Ranks the cost model predicts a speedup for, beside the run's own.
PREDICTED_RANKS = (1, 2, 4, 8, 16, 32, 64)
PREDICTION_NETWORK = TEN_GBE
THREADS_NOTE = "in-process workers: threads of one process"


@dataclasses.dataclass(frozen=True)
class RunSpeedup:
    """What the Live tab says about the run on screen's speedup."""

    measured: Speedup | None  # labavg.jobs.speedup's reading; None before rank 0 started
    K: int | None
    predicted: list[tuple[int, float]]  # (machines, speedup) on PREDICTION_NETWORK
    note: str  # why there is no measured value yet, or ""


def machine_cores() -> int:
    """The cores this server's runs can use (what bounds a speedup measured here)."""
    return usable_cores()


def shown_text(speedup: Speedup) -> str:
    """THE text of a run's speedup on every screen: labavg.jobs.speedup's, with in-process
    workers said to be threads."""
    text = speedup.text()
    return f"{text} ({THREADS_NOTE})" if speedup.threads and speedup.ranks > 1 else text


def alone(costs: MeasuredCosts, solo_seconds: list[float]) -> MeasuredCosts:
    """`costs` with rank 0's compute per minibatch as timed alone in the pairs (median), the
    compute of one rank per machine; unchanged without pairs."""
    if not solo_seconds:
        return costs
    return dataclasses.replace(costs, compute_per_minibatch_s=statistics.median(solo_seconds))


def prediction(costs: MeasuredCosts | None, k: int | None,
               ranks: tuple[int, ...] = PREDICTED_RANKS) -> list[tuple[int, float]]:
    """The cost model's speedup at `ranks` machines (one rank each), or []."""
    if costs is None or not k:
        return []
    return [(p.ranks, p.speedup) for p in predict(costs, sorted(set(ranks)), Ks=(k,),
                                                   network=PREDICTION_NETWORK)]


def summary_costs(summary: RunSummary | Mapping[str, Any]) -> MeasuredCosts | None:
    """A finished run's costs for the cost model (None when its summary cannot give them)."""
    try:
        summary = as_summary(summary)
        costs = from_summary(summary)
    except UserError:
        return None
    solo = [p[0] for p in summary.speedup_pairs or [] if p and p[0] > 0]
    return alone(costs, solo)


def live_speedup(buffers: RunBuffers, config: TrainConfig | None,
                 summary: RunSummary | Mapping[str, Any] | None = None) -> RunSpeedup:
    """The run's measured speedup (its summary's once it has one, else its events' so far:
    the same function reads both) and the cost model's for N machines; `config` is None
    before the run's settings are known."""
    k = None if config is None else config.effective_average_every()
    if summary:
        measured = speedup_from_summary(summary)
        costs = summary_costs(summary)
    else:
        measured = speedup_from_events(buffers.speedup_events())
        costs = buffers.measured_costs(1 if config is None else config.minibatch)
        if costs is not None:
            costs = alone(costs, [p.solo_step_seconds for p in buffers.pairs])
    note = ""
    if measured is None:
        note = "Measuring: the run has not started training yet."
    elif measured.value is None and summary:
        note = ("Not measured: the run ended before its first pair (the pairs are spread over "
                "the run as planned, so a run stopped early may have none).")
    elif measured.value is None:
        note = ("Measuring: rank 0 trains a few minibatches alone at a few averaging rounds "
                "spread over the run; the first pair gives the speedup.")
    return RunSpeedup(measured=measured, K=k, predicted=prediction(costs, k), note=note)


def elastic_text(workers: Workers) -> str:
    """The speedup line of an elastic run: how N changed, and why there is no speedup (no
    speedup pairs are taken in an elastic run: labavg.training.rank)."""
    why = ("speedup pairs are not taken in elastic runs (a pair times rank 0 alone against a "
           "step of all N workers, and N may change between the two); runs of fixed N measure it.")
    if workers.changes:
        return f"**{workers.text()}**: {why}"
    n = workers.size if workers.size is not None else workers.launch
    return f"**Speedup: -** {n} workers so far, N changes if one is lost or joins: {why}"


def speedup_note(summary: RunSummary | None) -> str | None:
    """The runs table's (and CSV's) line of a run's measured speedup, from its summary."""
    speedup = speedup_from_summary(summary) if summary else None
    return None if speedup is None else shown_text(speedup)


def scaling_point(name: str, k: int | None, summary: RunSummary) -> dict[str, Any] | None:
    """One point of the Scaling tab (a finished run with a measured speedup), else None."""
    speedup = speedup_from_summary(summary)
    return speedup_point(name, k, speedup) if speedup is not None else None


def speedup_point(name: str, k: int | None, speedup: Speedup) -> dict[str, Any] | None:
    """A plot point of a measured `speedup` (value, pairs' range, efficiency %, conditions)."""
    if speedup.value is None:
        return None
    return {"ranks": speedup.ranks, "speedup": speedup.value, "low": speedup.low,
            "high": speedup.high, "efficiency": 100 * speedup.efficiency, "K": k, "run": name,
            "cores": speedup.cores, "bound": speedup.bound, "threads": speedup.threads,
            "text": shown_text(speedup)}


def oversubscribed_note(point: dict[str, Any], predicted: dict[int, float]) -> str | None:
    """"N ranks on C cores: at most C x here", beside the cost model's N machines."""
    n, cores = point["ranks"], point["cores"]
    if not cores or n <= cores:
        return None
    what = "threads" if point["threads"] else "ranks"
    model = (f"; the cost model predicts {predicted[n]:.1f}x for {n} machines"
             if n in predicted else "")
    return f"{point['run']}: {n} {what} on {cores} cores: at most {cores}x here{model}"
