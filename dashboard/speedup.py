"""The speedup of a run against its 1-rank baseline: one number, computed here only.

The live view and the runs table both call `measured_speedup`, so a run has the same speedup
on every screen: frames per second over training time (compute + averaging, Su & Chen's
epoch time), against the named 1-rank run of the same model, data, minibatch and optimizer.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from dashboard.buffers import RunBuffers
from labavg.studies.costmodel import TEN_GBE, from_summary, predict
from labavg.base.errors import UserError
from labavg.jobs.index import effective_k, training_throughput

# Ranks the cost model predicts a speedup for, beside the run's own.
PREDICTED_RANKS = (1, 2, 4, 8, 16, 32, 64)


@dataclasses.dataclass(frozen=True)
class Speedup:
    """What the Live tab says about the run's speedup: measured, and the cost model's."""

    ranks: int
    K: int | None
    frames_per_second: float | None  # this run, all ranks
    baseline_frames_per_second: float | None
    baseline_name: str | None
    speedup: float | None
    efficiency: float | None
    warning: str  # Measured.warning: the run and its baseline ran under different load
    predicted: list[tuple[int, float]]  # (ranks, speedup) on PREDICTION_NETWORK
    predicted_from: str  # which run's costs the prediction uses
    note: str  # why there is no measured speedup, or ""


PREDICTION_NETWORK = TEN_GBE
# Load averages (1 minute, at each run's start) further apart than this, in busy cores, and
# the two runs' frames/s do not compare: the ranks shared the cores with other work.
LOAD_DIFFERENCE = 1.0
# Above this parallel efficiency the baseline, not the averaging, explains the speedup.
SUPERLINEAR = 1.1


@dataclasses.dataclass(frozen=True)
class Measured:
    """A run's speedup against its named 1-rank baseline, and whether to trust it."""

    speedup: float | None
    efficiency: float | None
    baseline_name: str | None
    warning: str  # "" unless the two ran under different load, or efficiency > 100 %


def run_name(summary: dict[str, Any]) -> str:
    """The run directory's name of a summary (its config's `out`)."""
    return Path(str(summary.get("config", {}).get("out", "?"))).name


def start_load(summary: dict[str, Any] | None) -> float | None:
    """The load average when the run started (`labavg.jobs.runs` records it), None for older runs."""
    return ((summary or {}).get("load_average") or {}).get("start")


def load_warning(load: float | None, baseline: dict[str, Any] | None) -> str:
    """Why the speedup is suspect: the run and its baseline started under different loads."""
    base = start_load(baseline)
    if load is None or base is None or abs(load - base) <= LOAD_DIFFERENCE:
        return ""
    return (f"⚠ different load: load average {load:.1f} when this run started, {base:.1f} when "
            f"{run_name(baseline)} did; the speedup is not the averaging's alone")


def measured_speedup(frames_per_second: float | None, ranks: int,
                     baseline: dict[str, Any] | None, load: float | None = None) -> Measured:
    """THE speedup of a run (live view, runs table and Scaling tab all call this): its frames/s
    (all ranks, training time) over its 1-rank baseline's (`training_throughput`)."""
    base_fps = training_throughput(baseline) if baseline else None
    name = run_name(baseline) if baseline else None
    if not frames_per_second or not base_fps:
        return Measured(None, None, name, "")
    speedup = frames_per_second / base_fps
    warnings = [load_warning(load, baseline), superlinear_warning(speedup / ranks, baseline)]
    return Measured(speedup, speedup / ranks, name, " ".join(w for w in warnings if w))


def superlinear_warning(efficiency: float, baseline: dict[str, Any] | None) -> str:
    """Why an efficiency above 100 % is not the averaging's: N ranks cannot train each frame
    faster than one rank does, so the 1-rank run was held back (other load, a cold start)."""
    if efficiency <= SUPERLINEAR or baseline is None:
        return ""
    return (f"⚠ efficiency {100 * efficiency:.0f} % is above 100 %: {run_name(baseline)} "
            f"trained slower per frame than these ranks do (other load or a cold start); "
            f"train the 1-rank run again beside this one")


def live_speedup(buffers: RunBuffers, config: dict[str, Any], baseline: dict[str, Any] | None,
                 summary: dict[str, Any] | None = None, load: float | None = None) -> Speedup:
    """The run's throughput against its 1-rank baseline, and the cost model's speedups.

    Speedup = `measured_speedup`: while the run trains, of the frames/s its events show so
    far; once it has a summary, of the summary's (the runs table's number, to the digit). The
    baseline may differ in K, learning rate, schedule and epochs (`find_throughput_baseline`),
    which leave the cost of a frame alone. The prediction (`labavg.studies.costmodel.predict`, one
    rank per machine on PREDICTION_NETWORK) uses the baseline's measured costs when there is
    one, else this run's.
    """
    ranks = int(config.get("ranks", buffers.ranks) or 1)
    minibatch = int(config.get("minibatch") or 1)
    k = effective_k(config)
    fps = (training_throughput(summary) if summary else None) or buffers.frames_per_second()
    if summary and start_load(summary) is not None:
        load = start_load(summary)
    measured_now = measured_speedup(fps, ranks, baseline, load)
    note = ""
    if baseline is None:
        note = ("This 1-rank run is the baseline: runs of this model and data with more ranks "
                "(any K) will be measured against it." if ranks == 1 else
                "No speedup yet: no finished 1-rank run of this model, data, minibatch and "
                "optimizer in the runs directory. Run one with ranks = 1 (any K) to measure it.")
    elif fps is None:
        note = "Measuring: the first averaging round gives the run's frames/s."
    # The baseline's costs when there is one: one rank alone on the machine, so neither its
    # compute nor its per-round overhead includes waiting for ranks that share the cores.
    measured, source = buffers.measured_costs(minibatch), "this run"
    if baseline is not None:
        try:
            measured, source = from_summary(baseline), f"1-rank run {measured_now.baseline_name}"
        except UserError:
            pass
    predicted: list[tuple[int, float]] = []
    if measured is not None and k:
        predicted = [(p.ranks, p.speedup) for p in predict(
            measured, PREDICTED_RANKS, Ks=(k,), network=PREDICTION_NETWORK)]
    return Speedup(ranks=ranks, K=k, frames_per_second=fps,
                   baseline_frames_per_second=training_throughput(baseline) if baseline else None,
                   baseline_name=measured_now.baseline_name, speedup=measured_now.speedup,
                   efficiency=measured_now.efficiency, warning=measured_now.warning,
                   predicted=predicted, predicted_from=source if predicted else "", note=note)
