"""`labavg plan`: which workers N, interval K and method to book, before any training.

Speed comes from labavg.studies.costmodel.predict on a run's own measured costs and a network;
its uncertainty is the cost model's largest leave-one-out error on the paper's timing table
(`speed_error`). Accuracy comes from labavg.studies.plan_accuracy, fitted on the runs recorded
in experiments/reproduction-results.jsonl. The table has one row per (N, K, method); the Pareto
front keeps the rows no other row beats on both speedup and accuracy, and the recommendation is
the fastest row the fits cover whose predicted accuracy change is within the budget.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Sequence

from tabulate import tabulate

from labavg.base.errors import UserError
from labavg.jobs.summary import load_summary
from labavg.studies.costfit import PAPER_SETUP, PAPER_TABLE, fit_table, fitted_speedup
from labavg.studies.costmodel import (INFINIBAND, TEN_GBE, MeasuredCosts, Network, from_summary,
                                      predict)
from labavg.studies.plan_accuracy import PLAIN, AccuracyModel
from labavg.studies.reproduction.results import read_results_file

DEFAULT_RANKS = (2, 4, 8, 16, 32)
DEFAULT_KS = (1, 2, 5, 10, 20, 50, 100, 200)
METHODS = (PLAIN, "bmuf", "diloco")


@lru_cache(maxsize=1)
def speed_error() -> float:
    """The cost model's largest relative speedup error predicting a row of the paper's table
    from the others (REPRODUCTION.md, "Speedup")."""
    worst = 0.0
    for held in (r for r in PAPER_TABLE if r.ranks > 1):
        fit = fit_table([r for r in PAPER_TABLE if r is not held], PAPER_SETUP)
        one = next(r for r in PAPER_TABLE if r.ranks == 1)
        measured = one.train_min / held.train_min
        worst = max(worst, abs(fitted_speedup(fit, held.ranks) / measured - 1.0))
    return worst


@dataclass(frozen=True)
class PlanRow:
    """One (N, K, method): predicted epoch time, speedup, bytes and accuracy change."""

    ranks: int
    K: int
    method: str
    epoch_s: float
    speedup: float
    speedup_sd: float
    bytes_per_epoch: float  # sent by one worker
    acc_change: float  # points of CV frame accuracy against one worker; negative = lost
    acc_sd: float
    extrapolated: tuple[str, ...]

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "extrapolated": list(self.extrapolated)}


def bytes_per_epoch(ranks: int, rounds: float, n_bytes: float) -> float:
    """Bytes one worker sends in an epoch: a bandwidth-optimal allreduce (ring, Rabenseifner)
    sends 2 (p - 1) / p of the buffer per round."""
    return 0.0 if ranks == 1 else rounds * 2.0 * (ranks - 1) / ranks * n_bytes


def plan(measured: MeasuredCosts, accuracy: AccuracyModel, network: Network, *,
         ranks: Sequence[int] = DEFAULT_RANKS, Ks: Sequence[int] = DEFAULT_KS,
         methods: Sequence[str] = METHODS, epochs: float = 1.0) -> list[PlanRow]:
    """Every (N, K, method) row. `epochs` sets the updates per worker the accuracy model sees
    (frames per epoch x epochs / (N x minibatch))."""
    bad = [m for m in methods if m != PLAIN and m not in accuracy.methods]
    if bad:
        known = ", ".join([PLAIN, *accuracy.methods])
        raise UserError(f"method {bad[0]!r}: no recorded runs measure it (known: {known})")
    if epochs <= 0:
        raise UserError(f"epochs must be > 0, got {epochs}")
    err = speed_error()
    rows = []
    for p in predict(measured, list(ranks), Ks=list(Ks), network=network):
        updates = measured.frames_per_epoch * epochs / (p.ranks * measured.minibatch)
        rounds = updates / epochs / p.K
        for method in (methods if p.ranks > 1 else (PLAIN,)):
            acc = accuracy.predict(p.ranks, updates, p.K, method)
            rows.append(PlanRow(p.ranks, p.K, method, p.total_s, p.speedup, p.speedup * err,
                                bytes_per_epoch(p.ranks, rounds, measured.n_bytes),
                                acc.change, acc.sd, acc.extrapolated))
    unique = {(r.ranks, r.K if r.ranks > 1 else 0, r.method): r for r in rows}
    return sorted(unique.values(), key=lambda r: (r.ranks, r.method != PLAIN, r.method, r.K))


def pareto(rows: Sequence[PlanRow]) -> list[PlanRow]:
    """The rows no other row beats on both predicted speedup and accuracy, fastest first."""
    front = [r for r in rows
             if not any(o.speedup >= r.speedup and o.acc_change >= r.acc_change
                        and (o.speedup > r.speedup or o.acc_change > r.acc_change) for o in rows)]
    return sorted(front, key=lambda r: -r.speedup)


def recommend(rows: Sequence[PlanRow], max_loss: float, *,
              covered_only: bool = True) -> PlanRow | None:
    """The fastest row whose predicted accuracy change is within `max_loss` points, among the
    rows no fit extrapolates (all rows with `covered_only=False`): an offset measured at 16
    workers carried down to 2 is drawn, never recommended, so a larger budget never gives a
    slower recommendation."""
    if not math.isfinite(max_loss) or max_loss < 0:
        raise UserError(f"--max-loss must be a number of points >= 0, got {max_loss}")
    within = [r for r in rows if r.acc_change >= -max_loss
              and not (covered_only and r.extrapolated)]
    return max(within, key=lambda r: (r.speedup, r.acc_change)) if within else None


# --------------------------------------------------------------------------- inputs and output

NETWORKS = {"10gbe": TEN_GBE, "infiniband": INFINIBAND}


def network_of(name: str | None, bandwidth_gbit: float | None, latency_us: float | None) -> Network:
    """A named network, or one given by its bandwidth (Gbit/s) and latency (us per message)."""
    if bandwidth_gbit is not None or latency_us is not None:
        if bandwidth_gbit is None or latency_us is None:
            raise UserError("--bandwidth and --latency go together (Gbit/s and us per message)")
        if not (math.isfinite(bandwidth_gbit) and bandwidth_gbit > 0 and math.isfinite(latency_us)
                and latency_us >= 0):
            raise UserError(f"--bandwidth must be > 0 Gbit/s and --latency >= 0 us, got "
                            f"{bandwidth_gbit:g} and {latency_us:g}")
        return Network(f"{bandwidth_gbit:g} Gbit/s, {latency_us:g} us", latency_us * 1e-6,
                       8.0 / (bandwidth_gbit * 1e9))
    key = (name or "10gbe").lower()
    if key not in NETWORKS:
        raise UserError(f"--network {name!r}: one of {', '.join(NETWORKS)} (or --bandwidth and "
                        "--latency)")
    return NETWORKS[key]


def measured_costs(run_dir: Path | None, results: Path) -> tuple[MeasuredCosts, float, str]:
    """The costs `plan` scales, the run's epochs and where they come from: a finished run's
    summary.json, or without one the reproduction's one-rank run measured on MPI (the 'mpi'
    sweep of the results file)."""
    if run_dir is not None:
        summary = load_summary(run_dir)
        return from_summary(summary), float(summary.epochs or 1), str(run_dir)
    one = [r for r in read_results_file(results).get("mpi", []) if r.get("ranks") == 1]
    if not one:
        raise UserError(f"{results} has no one-rank 'mpi' run to take the costs from: name a run "
                        "directory (labavg plan RUN_DIR)")
    return (from_summary(one[0].summary), float(one[0].summary.epochs or 1),
            f"{results} (run {one[0].name}, MPI, one rank)")


def _row_cells(r: PlanRow, mark: str) -> list[str]:
    return [mark, str(r.ranks), "-" if r.ranks == 1 else str(r.K), r.method,
            f"{r.epoch_s:,.1f}", f"{r.speedup:.2f} ± {r.speedup_sd:.2f}",
            f"{r.bytes_per_epoch / 1e6:,.1f}", f"{r.acc_change:+.2f} ± {r.acc_sd:.2f}",
            "; ".join(r.extrapolated)]


def format_plan(rows: Sequence[PlanRow], best: PlanRow | None, max_loss: float, *,
                network: Network, source: str, show_all: bool = False) -> str:
    """The Pareto front (or every row) as a table, and the recommendation in words."""
    shown = list(rows) if show_all else pareto(rows)
    cells = [_row_cells(r, "*" if r is best else "") for r in shown]
    table = tabulate(cells, headers=["", "N", "K", "method", "epoch s", "speedup",
                                     "MB / worker / epoch", "CV acc change, points",
                                     "extrapolated"], tablefmt="github", disable_numparse=True)
    what = "every (N, K, method)" if show_all else "the Pareto front (speedup against accuracy)"
    lines = [f"Predicted on {network.name} from the costs of {source}: {what}.",
             f"Speedup ± the cost model's largest leave-one-out error ({100 * speed_error():.1f} %); "
             "accuracy change against one worker ± the fits' residual spread.", "", table, ""]
    if best is None:
        lines.append(f"No row the fits cover is predicted to lose at most {max_loss:g} points: "
                     "raise --max-loss or plan fewer workers.")
        outside = recommend(rows, max_loss, covered_only=False)
        if outside is not None:
            lines.append(f"Outside what the fits saw, N = {outside.ranks}, K = {outside.K}, "
                         f"{outside.method} is predicted within it ({outside.acc_change:+.2f} ± "
                         f"{outside.acc_sd:.2f} points): " + "; ".join(outside.extrapolated) + ".")
    else:
        lines.append(f"Recommended for at most {max_loss:g} points lost: N = {best.ranks}, "
                     f"K = {best.K}, {best.method} (speedup {best.speedup:.2f}, accuracy "
                     f"{best.acc_change:+.2f} ± {best.acc_sd:.2f} points).")
        if best.extrapolated:
            lines.append("It lies outside what the fits saw: " + "; ".join(best.extrapolated) + ".")
    return "\n".join(lines)
