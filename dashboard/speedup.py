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
from labavg.costmodel import TEN_GBE, from_summary, predict
from labavg.errors import UserError
from labavg.index import effective_k, training_throughput

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
    predicted: list[tuple[int, float]]  # (ranks, speedup) on PREDICTION_NETWORK
    predicted_from: str  # which run's costs the prediction uses
    note: str  # why there is no measured speedup, or ""


PREDICTION_NETWORK = TEN_GBE


def live_speedup(buffers: RunBuffers, config: dict[str, Any],
                 baseline: dict[str, Any] | None) -> Speedup:
    """The run's throughput against its 1-rank baseline, and the cost model's speedups.

    Speedup = frames/s of this run (all ranks) / frames/s of the baseline, both over training
    time (compute + averaging); the baseline may differ in K, learning rate, schedule and
    epochs (`find_throughput_baseline`), which leave the cost of a frame alone. The
    prediction (`labavg.costmodel.predict`, one rank per machine on PREDICTION_NETWORK) uses
    the baseline's measured costs when there is one, else this run's.
    """
    ranks = int(config.get("ranks", buffers.ranks) or 1)
    minibatch = int(config.get("minibatch") or 1)
    k = effective_k(config)
    fps = buffers.frames_per_second()
    base_fps = training_throughput(baseline) if baseline else None
    base_name = Path(str(baseline.get("config", {}).get("out", "?"))).name if baseline else None
    speedup = fps / base_fps if fps and base_fps else None
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
            measured, source = from_summary(baseline), f"1-rank run {base_name}"
        except UserError:
            pass
    predicted: list[tuple[int, float]] = []
    if measured is not None and k:
        predicted = [(p.ranks, p.speedup) for p in predict(
            measured, PREDICTED_RANKS, Ks=(k,), network=PREDICTION_NETWORK)]
    return Speedup(ranks=ranks, K=k, frames_per_second=fps, baseline_frames_per_second=base_fps,
                   baseline_name=base_name, speedup=speedup,
                   efficiency=speedup / ranks if speedup is not None else None,
                   predicted=predicted, predicted_from=source if predicted else "", note=note)
