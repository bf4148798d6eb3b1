"""Training-engine benchmark: ratios measured in one run (never a timed test).

    .venv/bin/python benchmarks/bench_train.py [--hours 0.3] [--json out.json]

Reports, on the default model with one CPU thread per rank:
1. the training step's FLOP rate (6 x parameters per frame) over this machine's single-thread
   matmul rate (a square matmul of the model's width);
2. the training step's throughput over a minimal hand-written PyTorch loop on the same model;
3. averaging cost at K=10 with 2 MPI ranks: communication seconds / compute seconds;
4. 2 MPI ranks vs 1 rank: epoch wall-time ratio on a built-in corpus.
Step timings are this thread's CPU time, interleaved between candidates, medians of rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from labavg.model import DNN, ModelConfig, count_parameters
from labavg.optim.factory import make_optimizer
from labavg.train import train_step


def _median_seconds(fn, repeats: int) -> float:
    # CPU time of this thread (torch runs single-threaded here): other processes on a shared
    # machine then shift both sides of a ratio much less than wall-clock time would.
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times)


def step_ratios(minibatch: int, num_pdfs: int, rounds: int = 7, steps: int = 10) -> dict:
    """Step FLOP rate vs matmul peak, and labavg's step vs a minimal loop."""
    torch.set_num_threads(1)
    cfg = ModelConfig()
    x = torch.randn(minibatch, 440)
    y = torch.randint(0, num_pdfs, (minibatch,))
    ours = DNN(440, num_pdfs, cfg)
    opt = make_optimizer("sgd", ours)
    plain = DNN(440, num_pdfs, cfg)
    params = list(plain.parameters())

    def run_ours():
        for _ in range(steps):
            train_step(ours, opt, x, y, 1e-4)

    def run_plain():
        for _ in range(steps):
            loss = F.cross_entropy(plain(x), y, reduction="sum")
            loss.backward()
            with torch.no_grad():
                for p in params:
                    p.add_(p.grad, alpha=-1e-4)
                    p.grad = None

    a = torch.randn(minibatch, cfg.hidden_dim)
    b = torch.randn(cfg.hidden_dim, cfg.hidden_dim)

    def run_matmul():
        for _ in range(steps * 6):
            torch.mm(a, b)

    for fn in (run_ours, run_plain, run_matmul):
        fn()  # warm up
    t_ours, t_plain, t_mm = [], [], []
    for _ in range(rounds):
        t_ours.append(_median_seconds(run_ours, 1))
        t_plain.append(_median_seconds(run_plain, 1))
        t_mm.append(_median_seconds(run_matmul, 1))
    step_s = statistics.median(t_ours) / steps
    plain_s = statistics.median(t_plain) / steps
    mm_flops = 2 * minibatch * cfg.hidden_dim ** 2 * steps * 6 / statistics.median(t_mm)
    n = count_parameters(ours)
    step_flops = 6 * n * minibatch / step_s
    return {
        "num_params": n,
        "minibatch": minibatch,
        "step_ms": 1e3 * step_s,
        "plain_step_ms": 1e3 * plain_s,
        "frames_per_second": minibatch / step_s,
        "step_gflops": step_flops / 1e9,
        "matmul_gflops": mm_flops / 1e9,
        "flop_ratio": step_flops / mm_flops,
        "vs_plain_loop": plain_s / step_s,
    }


def mpi_ratios(hours: float, epochs: int, workdir: Path) -> dict:
    """Averaging cost with 2 MPI ranks at K=10, and the 2-rank vs 1-rank wall ratio."""
    labavg = [sys.executable, "-m", "labavg"]
    corpus = workdir / "corpus"
    subprocess.run([*labavg, "corpus", "synth", str(corpus), "--hours", str(hours)], check=True,
                   stdout=subprocess.DEVNULL)
    common = ["--data", str(corpus), "--epochs", str(epochs), "--average-every", "10",
              "--no-progress", "--set", "tensorboard=false", "--set", "log_every=10"]
    out = {}
    for ranks in (1, 2):
        run = workdir / f"ranks{ranks}"
        subprocess.run([*labavg, "train", *common, "--ranks", str(ranks), "--backend", "mpi",
                        "--out", str(run)], check=True, stdout=subprocess.DEVNULL)
        out[ranks] = json.loads((run / "summary.json").read_text())
    two = out[2]
    return {
        "corpus_hours": hours,
        "epochs": epochs,
        "comm_over_compute_2ranks_K10": two["comm_seconds"] / two["compute_seconds"],
        "wall_1rank_s": out[1]["wall_seconds"],
        "wall_2ranks_s": two["wall_seconds"],
        "speedup_2ranks": two["speedup"],
        "cv_frame_accuracy_1rank": out[1]["cv_frame_accuracy"],
        "cv_frame_accuracy_2ranks": two["cv_frame_accuracy"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=float, default=0.3, help="corpus size for the MPI part")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--minibatch", type=int, default=256)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    results = {"step": step_ratios(args.minibatch, num_pdfs=120)}
    with tempfile.TemporaryDirectory(prefix="labavg-bench-") as tmp:
        results["mpi"] = mpi_ratios(args.hours, args.epochs, Path(tmp))
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
