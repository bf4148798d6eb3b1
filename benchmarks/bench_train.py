"""Training-engine benchmark: ratios measured in one run (never a timed test).

    .venv/bin/python benchmarks/bench_train.py [--hours 0.3] [--json out.json]
        [--mpich MPIR_CVAR_POLLS_BEFORE_YIELD=1 ...] [--mpi-repeats 3] [--no-mpi]

Reports, on the default model with one CPU thread per rank:
1. the training step's FLOP rate (6 x parameters per frame) over this machine's single-thread
   matmul rate (a square matmul of the model's width);
2. the training step's throughput over a minimal hand-written PyTorch loop on the same model;
3. averaging cost at K=10 with 2 MPI ranks: communication seconds / compute seconds, split
   into the transfer and the wait for the slower rank (`wait_split`), per MPICH setting;
4. 2 MPI ranks vs 1 rank: epoch wall-time ratio on a built-in corpus.
Step timings are this thread's CPU time, interleaved between candidates, medians of rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from labavg.training.model import DNN, count_parameters
from labavg.training.settings import ModelConfig
from labavg.optim.factory import make_optimizer
from labavg.training.runner import keep_freed_memory
from labavg.training.step import train_step


def _median_seconds(fn, repeats: int) -> float:
    # CPU time of this thread (torch runs single-threaded here): other processes on a shared
    # machine then shift both sides of a ratio much less than wall-clock time would.
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times)


def step_ratios(minibatch: int, num_pdfs: int, rounds: int = 7, steps: int = 10,
                glibc_defaults: bool = False) -> dict:
    """Step FLOP rate vs matmul peak, and labavg's step vs a minimal loop."""
    torch.set_num_threads(1)
    if not glibc_defaults:
        keep_freed_memory()  # as labavg.training.runner.train does; the minimal loop gets it too
    cfg = ModelConfig()
    x = torch.randn(minibatch, 440)
    y = torch.randint(0, num_pdfs, (minibatch,))
    ours = DNN(440, num_pdfs, cfg)
    opt = make_optimizer("sgd", ours)
    plain = DNN(440, num_pdfs, cfg)
    params = list(plain.parameters())

    def run_ours():
        for _ in range(steps):
            # The pure step alone, against a plain loop: no run is started (runs use start_run).
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

    # The step's own GEMMs on its shapes and fresh operands per layer (forward addmm, dX, dW;
    # no dX for the first layer, whose input needs no gradient): what a step would cost if
    # everything but the GEMMs were free, so step / gemms is the non-GEMM overhead.
    dims = [440] + [cfg.hidden_dim] * cfg.hidden_layers + [num_pdfs]
    shapes = list(zip(dims[:-1], dims[1:]))
    ws = [torch.randn(o, i) for i, o in shapes]
    bs = [torch.randn(o) for _, o in shapes]
    xs = [torch.randn(minibatch, i) for i, _ in shapes]
    dys = [torch.randn(minibatch, o) for _, o in shapes]

    def run_gemms():
        for _ in range(steps):
            for layer, (w, bias, xi, dy) in enumerate(zip(ws, bs, xs, dys)):
                torch.addmm(bias, xi, w.t())
                if layer:
                    dy.mm(w)
                dy.t().mm(xi)

    for fn in (run_ours, run_plain, run_matmul, run_gemms):
        fn()  # warm up
    t_ours, t_plain, t_mm, t_gemms = [], [], [], []
    for _ in range(rounds):
        t_ours.append(_median_seconds(run_ours, 1))
        t_plain.append(_median_seconds(run_plain, 1))
        t_mm.append(_median_seconds(run_matmul, 1))
        t_gemms.append(_median_seconds(run_gemms, 1))
    step_s = statistics.median(t_ours) / steps
    plain_s = statistics.median(t_plain) / steps
    gemms_s = statistics.median(t_gemms) / steps
    ratios_plain = sorted(p / o for p, o in zip(t_plain, t_ours))
    # Per round: (step FLOPs / step seconds) / (matmul FLOPs / matmul seconds), i.e. t_mm / t_ours.
    flop_ratios = sorted(6 * count_parameters(ours) * minibatch * m / (2 * minibatch * cfg.hidden_dim ** 2 * 6 * o)
                         for o, m in zip(t_ours, t_mm))
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
        "vs_plain_loop_per_round_min_max": [ratios_plain[0], ratios_plain[-1]],
        "gemms_ms": 1e3 * gemms_s,
        "gemms_over_step": gemms_s / step_s,
        "gemm_flop_ratio": (6 * n * minibatch / gemms_s) / mm_flops,
        "flop_ratio_per_round_min_max": [flop_ratios[0], flop_ratios[-1]],
    }


def wait_split(events_path: Path) -> dict:
    """Split each averaging round's comm_seconds into transfer and waiting for the slower rank.

    A round's allreduce cannot finish on any rank before the last rank has joined it, so the
    rank that joins last spends only the transfer (and MPI's own synchronisation) in it; every
    other rank also waits for that one. Per round, transfer = min over ranks of comm_seconds and
    each rank's wait = its comm_seconds - that minimum. Sums are over rounds, means over ranks.
    """
    rounds: dict[int, dict[int, tuple[float, float]]] = {}
    for line in events_path.read_text().splitlines():
        e = json.loads(line)
        if e.get("type") == "average":
            rounds.setdefault(e["round"], {})[e["rank"]] = (e["comm_seconds"], e["compute_seconds"])
    complete = [r for r in rounds.values() if len(r) > 1]
    size = max((len(r) for r in complete), default=1)
    comm = sum(c for r in complete for c, _ in r.values()) / size
    compute = sum(t for r in complete for _, t in r.values()) / size
    transfer = sum(min(c for c, _ in r.values()) for r in complete)
    # The part of the wait that the ranks' own compute times explain: train_step's wall time
    # differs between ranks when they share cores with each other and with other processes.
    compute_skew = sum(max(t for _, t in r.values()) - t for r in complete for _, t in r.values()) / size
    return {
        "rounds": len(complete),
        "comm_over_compute": comm / compute if compute else float("nan"),
        "transfer_over_compute": transfer / compute if compute else float("nan"),
        "wait_over_compute": (comm - transfer) / compute if compute else float("nan"),
        "transfer_ms_per_round": 1e3 * transfer / max(len(complete), 1),
        "compute_skew_over_compute": compute_skew / compute if compute else float("nan"),
    }


def data_skew(corpus: Path, size: int = 2, K: int = 10) -> dict:
    """How far the ranks' data loading alone puts them out of step at the averaging rounds.

    The trainer's compute_seconds cover train_step only; filling a rank's shuffle buffer
    (reading and splicing ~buffer_frames frames) happens between steps, at steps that differ
    from rank to rank. Per round of K minibatches this times each rank's FrameBatches (one
    after the other in this process: no contention between them) and sums, over rounds, what
    the slowest rank's loading exceeds each other rank's by: the wait it alone would cause.
    """
    from labavg.training.config import TrainConfig
    from labavg.data.dataset import open_dataset
    from labavg.data.frames import FrameBatches, split_cv, steps_per_epoch

    cfg = TrainConfig()
    source = open_dataset(corpus)
    train_keys, _ = split_cv(source.keys, cfg.data.cv_fraction, seed=cfg.seed)
    num_steps = steps_per_epoch(train_keys, source.num_frames, size, cfg.minibatch)
    per_rank = []
    for rank in range(size):
        batches = FrameBatches(source, train_keys, context=cfg.data.context, minibatch=cfg.minibatch,
                               buffer_frames=cfg.data.buffer_frames, seed=cfg.seed, rank=rank,
                               size=size, num_steps=num_steps)
        times, it = [], iter(batches.epoch(0))
        for _ in range(num_steps):
            t0 = time.perf_counter()
            next(it)
            times.append(time.perf_counter() - t0)
        per_rank.append([sum(times[i:i + K]) for i in range(0, num_steps, K)])
    rounds = list(zip(*per_rank))
    wait = sum(max(r) - t for r in rounds for t in r) / size
    return {"rounds": len(rounds), "load_seconds_per_rank": [sum(r) for r in per_rank],
            "wait_from_loading_seconds_per_rank": wait,
            "rounds_with_a_fill_on_one_rank_only": sum(1 for r in rounds if max(r) > 5 * min(r) + 0.005)}


def _train(labavg: list[str], common: list[str], ranks: int, run: Path, env: dict | None = None) -> dict:
    subprocess.run([*labavg, "train", *common, "--ranks", str(ranks), "--backend", "mpi",
                    "--out", str(run)], check=True, stdout=subprocess.DEVNULL,
                   env=None if env is None else {**os.environ, **env})
    return json.loads((run / "summary.json").read_text())


def mpi_ratios(hours: float, epochs: int, workdir: Path, variants: list[str], repeats: int) -> dict:
    """Averaging cost with 2 MPI ranks at K=10 (split into transfer and wait, under each MPICH
    setting of `variants`, runs interleaved `repeats` times), and the 2-rank vs 1-rank wall ratio."""
    labavg = [sys.executable, "-m", "labavg"]
    corpus = workdir / "corpus"
    subprocess.run([*labavg, "corpus", "synth", str(corpus), "--hours", str(hours)], check=True,
                   stdout=subprocess.DEVNULL)
    common = ["--data", str(corpus), "--epochs", str(epochs), "--average-every", "10",
              "--no-progress", "--set", "tensorboard=false", "--set", "log_every=10"]
    skew = data_skew(corpus)
    one = _train(labavg, common, 1, workdir / "ranks1")
    per_variant: dict[str, list[dict]] = {v or "default": [] for v in variants}
    two = None
    for rep in range(repeats):
        for v in variants:
            env = dict(kv.split("=", 1) for kv in v.split(",") if kv)
            run = workdir / f"ranks2-{len(per_variant[v or 'default'])}-{abs(hash(v))}"
            summary = _train(labavg, common, 2, run, env)
            split = wait_split(run / "events.jsonl")
            split.update(wall_s=summary["wall_seconds"], speedup=summary["speedup"])
            per_variant[v or "default"].append(split)
            if two is None and not v:
                two = summary
    two = two or summary
    return {
        "corpus_hours": hours,
        "epochs": epochs,
        "comm_over_compute_2ranks_K10": two["comm_seconds"] / two["compute_seconds"],
        "wall_1rank_s": one["wall_seconds"],
        "wall_2ranks_s": two["wall_seconds"],
        "speedup_2ranks": two["speedup"],
        "cv_frame_accuracy_1rank": one["cv_frame_accuracy"],
        "cv_frame_accuracy_2ranks": two["cv_frame_accuracy"],
        "mpich_variants": per_variant,
        "data_skew": skew,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=float, default=0.3, help="corpus size for the MPI part")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--minibatch", type=int, default=256)
    parser.add_argument("--mpich", action="append", default=None, metavar="NAME=VALUE[,...]",
                        help="also run the 2-rank part with these MPICH settings (repeatable; "
                             "e.g. MPIR_CVAR_POLLS_BEFORE_YIELD=1)")
    parser.add_argument("--mpi-repeats", type=int, default=1, help="2-rank runs per setting")
    parser.add_argument("--no-mpi", action="store_true", help="only the step ratios")
    parser.add_argument("--glibc-defaults", action="store_true",
                        help="time the steps without labavg.training.runner.keep_freed_memory")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    results = {"loadavg_before": os.getloadavg(), "step": step_ratios(args.minibatch, num_pdfs=120,
                                                                       glibc_defaults=args.glibc_defaults)}
    if not args.no_mpi:
        with tempfile.TemporaryDirectory(prefix="labavg-bench-") as tmp:
            results["mpi"] = mpi_ratios(args.hours, args.epochs, Path(tmp), ["", *(args.mpich or [])],
                                        args.mpi_repeats)
    results["loadavg_after"] = os.getloadavg()
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
