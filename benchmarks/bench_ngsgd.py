"""Step time of NG-SGD over plain SGD on the default DNN (one CPU thread by default).

Times are CPU seconds of this process (`time.process_time`) by default, which other
processes on a shared machine disturb much less than wall-clock time (`--clock wall`; CUDA
needs wall). A "step" is what the trainer does per minibatch: forward, summed cross-entropy, backward,
optimizer.step(lr). Both optimizers run interleaved in one process, after a warm-up that
covers NG-SGD's first 10 always-updating minibatches; the reported ratio is the median over
repetitions of (NG-SGD time / SGD time) for the same number of steps.

    .venv/bin/python benchmarks/bench_ngsgd.py [--reps 7] [--steps 40] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from labavg.training.model import DNN
from labavg.training.settings import ModelConfig
from labavg.optim.factory import make_optimizer
from labavg.training.runner import keep_freed_memory


def time_steps(model, optimizer, feats, labels, steps: int, batch: int, lr: float, clock) -> float:
    """Seconds (of `clock`) for `steps` training steps on consecutive minibatches."""
    n = feats.shape[0]
    start = clock()
    for s in range(steps):
        lo = (s * batch) % (n - batch)
        loss = F.cross_entropy(model(feats[lo : lo + batch]), labels[lo : lo + batch], reduction="sum")
        loss.backward()
        optimizer.step(lr)
    return clock() - start


def main() -> None:
    """Parse arguments, time both optimizers interleaved, print per-rep and median ratios."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as labavg.training.runner.train does
    device = torch.device(args.device)
    clock = time.perf_counter if args.clock == "wall" or device.type == "cuda" else time.process_time
    gen = torch.Generator().manual_seed(0)
    feats = torch.randn(8192, 440, generator=gen).to(device)
    labels = torch.randint(0, 120, (8192,), generator=gen).to(device)
    runs = {}
    for name in ("sgd", "ngsgd"):
        torch.manual_seed(0)
        model = DNN(440, 120, ModelConfig()).to(device)
        opt = make_optimizer(name, model)
        time_steps(model, opt, feats, labels, 20, args.batch, 0.008, clock)  # warm-up / NG init
        runs[name] = (model, opt)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ratios, times = [], {"sgd": [], "ngsgd": []}
    for _ in range(args.reps):
        for name in ("sgd", "ngsgd"):
            sync()
            t = time_steps(*runs[name], feats, labels, args.steps, args.batch, 0.008, clock)
            sync()
            times[name].append(t / args.steps)
        ratios.append(times["ngsgd"][-1] / times["sgd"][-1])
    print(f"threads={args.threads} device={device} batch={args.batch} steps/rep={args.steps} clock={clock.__name__}")
    print("sgd   ms/step:", " ".join(f"{1e3 * t:.2f}" for t in times["sgd"]))
    print("ngsgd ms/step:", " ".join(f"{1e3 * t:.2f}" for t in times["ngsgd"]))
    print("ratios:", " ".join(f"{r:.3f}" for r in ratios))
    print(f"median ratio ngsgd/sgd = {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
