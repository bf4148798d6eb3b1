"""Averaging methods side by side: the cost of a round, and CV accuracy on a small corpus.

    .venv/bin/python benchmarks/bench_averagers.py cost [--params 2500000] [--ranks 2]
    .venv/bin/python benchmarks/bench_averagers.py accuracy DATA OUT_DIR [--seed 0]

`cost` times `Averager.round` (one allreduce, divergence, the method's outer update) on a
random buffer with inproc ranks: the median over 15 rounds, per method. `accuracy` trains the
three methods, each with lr_scaling linear and none, 4 ranks, K = 10, 2 epochs, a 2 x 128 DNN
on DATA, one run directory each under OUT_DIR, and prints one JSON line per run
(docs/averaging.md shows the figures).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def round_cost(numel: int, size: int, rounds: int = 15) -> dict[str, dict]:
    from labavg.averaging.registry import methods
    from labavg.comm.inproc import run_inproc

    out = {}
    for name, method in methods().items():
        cls = method.averager_class()
        def work(comm, cls=cls):
            gen = torch.Generator().manual_seed(comm.rank)
            flat = torch.randn(numel, generator=gen)
            averager = cls(flat, comm)
            seconds, sent = [], set()
            for _ in range(rounds):
                flat += 1e-3 * torch.randn(numel, generator=gen)
                stats = averager.round(flat)
                seconds.append(stats.comm_seconds)
                sent.add(stats.bytes_sent)
            return statistics.median(seconds), sorted(sent)

        # One round's cost alone, not a run's: ranks of a bare averager, not start_run.
        results = run_inproc(size, work)
        out[name] = {"median_round_seconds": max(r[0] for r in results),
                     "bytes_sent": results[0][1]}
    return out


RUNS = [
    ("model-linear", {}),
    ("model-none", {"lr_scaling": "none"}),
    ("bmuf-linear", {"averaging.method": "bmuf"}),
    ("bmuf-none", {"averaging.method": "bmuf", "lr_scaling": "none"}),
    ("bmuf0.75-none", {"averaging.method": "bmuf", "lr_scaling": "none",
                       "averaging.bmuf.momentum": 0.75}),
    ("diloco-linear", {"averaging.method": "diloco"}),
    ("diloco-none", {"averaging.method": "diloco", "lr_scaling": "none"}),
]


def accuracy(data: str, out_root: Path, seed: int) -> list[dict]:
    from labavg.training.config import TrainConfig
    from labavg.base.settings import with_overrides
    from labavg.jobs.launch import start_run

    base = {"data.data": data, "ranks": 4, "averaging.average_every": 10, "epochs": 2,
            "seed": seed, "model.hidden_layers": 2, "model.hidden_dim": 128,
            "tensorboard": False}
    rows = []
    for name, extra in RUNS:
        cfg = with_overrides(TrainConfig(), {**base, **extra, "out": str(out_root / name)})
        start = time.perf_counter()
        summary = start_run(cfg).result()
        rows.append({"run": name, "seed": seed, "cv_frame_accuracy": summary.cv_frame_accuracy,
                     "cv_loss": summary.cv_loss, "rounds": summary.averaging_rounds,
                     "bytes_per_round": summary.bytes_per_round,
                     "bytes_sent": summary.bytes_sent, "comm_seconds": summary.comm_seconds,
                     "wall_seconds": time.perf_counter() - start})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    cost = sub.add_parser("cost")
    cost.add_argument("--params", type=int, default=2_500_000)
    cost.add_argument("--ranks", type=int, default=2)
    acc = sub.add_parser("accuracy")
    acc.add_argument("data")
    acc.add_argument("out_dir")
    acc.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.what == "cost":
        print(json.dumps(round_cost(args.params, args.ranks), indent=1))
    else:
        accuracy(args.data, Path(args.out_dir), args.seed)


if __name__ == "__main__":
    main()
