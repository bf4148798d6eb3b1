"""Interleaved A/B of the training step: this checkout's max-change / update code against a git ref's.

    .venv/bin/python benchmarks/bench_step_ab.py [--ref main] [--optimizer sgd] [--rounds 15]

Both sides run `labavg.training.step.train_step` on the default model in one process, one thread;
only `apply_updates` (labavg/optim/max_change.py, where the per-step bookkeeping of both
optimizers lives) is swapped between rounds, so machine load shifts both sides alike. Reports
the per-round ratio old / new of CPU seconds (> 1: the new code is faster) and its spread.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import labavg.optim.ngsgd as ngsgd_module
import labavg.optim.sgd as sgd_module
from labavg.training.model import DNN
from labavg.training.settings import ModelConfig
from labavg.optim.factory import make_optimizer
from labavg.training.step import train_step


def _module_at(ref: str, path: str, name: str):
    source = subprocess.run(["git", "show", f"{ref}:{path}"], check=True, capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent.parent).stdout
    tmp = Path(tempfile.mkdtemp()) / f"{name}.py"
    tmp.write_text(source)
    spec = importlib.util.spec_from_file_location(name, tmp)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", default="main")
    ap.add_argument("--optimizer", choices=("sgd", "ngsgd"), default="sgd")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    old = _module_at(args.ref, "labavg/optim/max_change.py", "old_max_change").apply_updates
    new = sgd_module.apply_updates
    target = sgd_module if args.optimizer == "sgd" else ngsgd_module
    gen = torch.Generator().manual_seed(0)
    feats = torch.randn(4096, 440, generator=gen)
    labels = torch.randint(0, 120, (4096,), generator=gen)
    sides = {}
    for name in ("old", "new"):
        torch.manual_seed(0)
        model = DNN(440, 120, ModelConfig())
        sides[name] = (model, make_optimizer(args.optimizer, model), old if name == "old" else new)

    def run(name: str) -> float:
        model, opt, fn = sides[name]
        target.apply_updates = fn
        t0 = time.thread_time()
        for s in range(args.steps):
            lo = (s * 256) % (4096 - 256)
            train_step(model, opt, feats[lo:lo + 256], labels[lo:lo + 256], 0.008)
        return (time.thread_time() - t0) / args.steps

    for name in ("old", "new"):
        for _ in range(2):
            run(name)  # warm-up (and NG-SGD's first always-updating minibatches)
    t_old, t_new = [], []
    for _ in range(args.rounds):
        t_old.append(run("old"))
        t_new.append(run("new"))
    target.apply_updates = new
    ratios = sorted(o / n for o, n in zip(t_old, t_new))
    q = statistics.quantiles(ratios, n=4)
    print(f"{args.optimizer}: old {1e3 * statistics.median(t_old):.2f} ms/step, new "
          f"{1e3 * statistics.median(t_new):.2f} ms/step; old/new median {statistics.median(ratios):.3f} "
          f"(quartiles {q[0]:.3f}-{q[2]:.3f}, min {ratios[0]:.3f}, max {ratios[-1]:.3f}, {args.rounds} rounds)")


if __name__ == "__main__":
    main()
