"""`labavg plan`: predicted speed and accuracy of each (N, K, method) before any training."""

from __future__ import annotations

import argparse
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "experiments" / "reproduction-results.jsonl"


def add_plan_parser(sub) -> None:
    from labavg.studies.plan import DEFAULT_KS, DEFAULT_RANKS, METHODS, NETWORKS

    p = sub.add_parser(
        "plan", help="which workers N, interval K and method to book, predicted before training",
        description="Predict, for each number of workers N, averaging interval K and method, the "
        "epoch time and speedup (the cost model on a run's measured costs and a network) and the "
        "change of CV frame accuracy against one worker (fitted on the runs recorded in "
        "experiments/reproduction-results.jsonl), each with its uncertainty; print the Pareto "
        "front and the fastest point within --max-loss. Nothing is trained.")
    p.add_argument("run_dir", nargs="?", type=Path, metavar="RUN_DIR",
                   help="a finished run whose compute per minibatch, model size and round "
                   "overhead are scaled (default: the reproduction's recorded one-rank MPI run)")
    p.add_argument("--ranks", type=int, nargs="+", default=list(DEFAULT_RANKS), metavar="N",
                   help=f"workers (default: {' '.join(map(str, DEFAULT_RANKS))})")
    p.add_argument("--K", dest="Ks", type=int, nargs="+", default=list(DEFAULT_KS), metavar="K",
                   help=f"averaging intervals, minibatches (default: {' '.join(map(str, DEFAULT_KS))})")
    p.add_argument("--methods", nargs="+", default=list(METHODS), metavar="METHOD",
                   help=f"averaging methods (default: {' '.join(METHODS)})")
    p.add_argument("--network", help=f"{' | '.join(NETWORKS)} (default: 10gbe)")
    p.add_argument("--bandwidth", type=float, metavar="GBIT_S", help="a network's bandwidth, Gbit/s")
    p.add_argument("--latency", type=float, metavar="US", help="its latency, us per message")
    p.add_argument("--max-loss", type=float, default=0.5, metavar="POINTS",
                   help="CV frame accuracy you can spare against one worker (default 0.5)")
    p.add_argument("--epochs", type=float, help="epochs the planned run trains (default: the "
                   "run's own); more epochs mean more updates per worker, and less loss")
    p.add_argument("--results", type=Path, default=RESULTS,
                   help="the recorded runs the accuracy fits read (default: %(default)s)")
    p.add_argument("--all", action="store_true", help="every row, not only the Pareto front")
    p.add_argument("--json", action="store_true", help="every row, the front and the "
                   "recommendation as JSON")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from labavg.base.errors import UserError
    from labavg.base.json_files import strict_json
    from labavg.studies.plan import (format_plan, measured_costs, network_of, pareto, plan,
                                     recommend)
    from labavg.studies.plan_accuracy import accuracy_model

    bad = [f"--ranks {n}" for n in args.ranks if n < 1] + [f"--K {k}" for k in args.Ks if k < 1]
    if bad:
        raise UserError(f"{bad[0]}: must be >= 1")
    network = network_of(args.network, args.bandwidth, args.latency)
    measured, epochs, source = measured_costs(args.run_dir, args.results)
    rows = plan(measured, accuracy_model(args.results), network, ranks=args.ranks, Ks=args.Ks,
                methods=args.methods, epochs=args.epochs if args.epochs is not None else epochs)
    best = recommend(rows, args.max_loss)
    if args.json:
        front = pareto(rows)
        print(strict_json({"source": source, "network": network.name, "max_loss": args.max_loss,
                           "rows": [r.as_dict() for r in rows],
                           "pareto": [r.as_dict() for r in front],
                           "recommended": best.as_dict() if best else None}, indent=2))
    else:
        print(format_plan(rows, best, args.max_loss, network=network, source=source,
                          show_all=args.all))
    return 0
