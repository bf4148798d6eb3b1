"""labavg plan against runs it did not see: predicted and measured accuracy change and speedup.

    labavg sweep experiments/plan-check.toml --out runs/plan-check
    .venv/bin/python benchmarks/bench_plan.py runs/plan-check [--json benchmarks/results/plan-check.json]

For each multi-worker configuration of the sweep, the plan (labavg.studies.plan, on the
one-worker run's measured costs and the same epochs) predicts the change of CV frame accuracy
against one worker, ± its residual spread, and a speedup on 10 GbE for N machines. The measured
accuracy change is paired by seed against the one-worker run (mean and 95 % t-interval); the
measured speedup is each run's own (labavg.jobs.speedup: paired solo and parallel steps, median
of the pairs), which on this machine cannot exceed its cores: compare the speedup only where N
is at most the cores, and read the accuracy everywhere.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from tabulate import tabulate

from labavg.studies.costmodel import TEN_GBE, from_summary
from labavg.studies.plan import plan
from labavg.studies.plan_accuracy import PLAIN, accuracy_model
from labavg.studies.reproduction.results import RESULTS_FILE, load_runs, paired, select
from labavg.studies.reproduction.verdicts import spread

REPO = Path(__file__).resolve().parents[1]


def _key(run) -> tuple[int, int, str]:
    return (run.get("ranks"), run.get("averaging.average_every") or 10,
            run.get("averaging.method") or PLAIN)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep_dir", type=Path)
    ap.add_argument("--results", type=Path, default=REPO / "experiments" / RESULTS_FILE)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    runs = load_runs(args.sweep_dir)
    ones = select(runs, ranks=1)
    if not ones:
        raise SystemExit(f"{args.sweep_dir}: no finished one-worker run to compare with")
    model = accuracy_model(args.results)
    one = next(iter(ones.values()))
    costs, epochs = from_summary(one.summary), float(one.summary.epochs or 1)
    rows = []
    for key in sorted({_key(r) for r in runs if (r.get("ranks") or 1) > 1}):
        ranks, K, method = key
        these = {r.seed: r for r in runs if _key(r) == key}
        (predicted,) = plan(costs, model, TEN_GBE, ranks=[ranks], Ks=[K], methods=[method],
                            epochs=epochs)
        change = spread(paired(ones, these, "cv_acc_pct"))
        speedups = [r.summary.speedup for r in these.values() if r.summary.speedup is not None]
        inside = change is not None and abs(change.mean - predicted.acc_change) <= 2 * max(
            predicted.acc_sd, 1e-9)
        rows.append({"ranks": ranks, "K": K, "method": method, "seeds": len(these),
                     "predicted_change": predicted.acc_change, "predicted_sd": predicted.acc_sd,
                     "measured_change": change.mean if change else None,
                     "measured_low": change.low if change else None,
                     "measured_high": change.high if change else None,
                     "within_2sd": inside, "predicted_speedup_10gbe": predicted.speedup,
                     "measured_speedup": speedups, "extrapolated": list(predicted.extrapolated)})
    cells = [[r["ranks"], r["K"], r["method"], r["seeds"],
              f"{r['predicted_change']:+.2f} ± {r['predicted_sd']:.2f}",
              "-" if r["measured_change"] is None else
              f"{r['measured_change']:+.2f} [{r['measured_low']:+.2f}, {r['measured_high']:+.2f}]",
              "yes" if r["within_2sd"] else "no", f"{r['predicted_speedup_10gbe']:.2f}",
              ", ".join(f"{s:.2f}" for s in r["measured_speedup"]) or "-",
              "; ".join(r["extrapolated"]) or "no"] for r in rows]
    print(f"cores {os.cpu_count()}, load average {os.getloadavg()[0]:.1f} now; one-worker costs "
          f"from {one.name}")
    print(tabulate(cells, headers=["N", "K", "method", "seeds", "predicted change, points",
                                   "measured change [95 % CI]", "within 2 sd",
                                   "predicted speedup (N machines, 10 GbE)",
                                   "measured speedup here, per seed", "extrapolated"],
                   tablefmt="github", disable_numparse=True))
    if args.json:
        args.json.write_text(json.dumps({"sweep": str(args.sweep_dir), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
