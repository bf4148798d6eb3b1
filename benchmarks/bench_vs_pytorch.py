"""Time to accuracy: labavg against what a PyTorch user would write instead, in ONE run.

    .venv/bin/python benchmarks/bench_vs_pytorch.py [--hours 1] [--epochs 3] [--json out.json]

Side by side, on the same built-in corpus and the same DNN (labavg.training.model.DNN, the default
ModelConfig, the same initial parameters and input normalisation), 2 ranks each:

* ddp-adam: torchrun + DistributedDataParallel (gloo) + torch.optim.Adam(lr 1e-3) on the mean
  cross-entropy: the usual data-parallel PyTorch loop;
* pma-adam / pma-sgd: torchrun + torch.distributed.algorithms.model_averaging.averagers.
  PeriodicModelAverager(period 10) around a local optimizer: Adam(lr 1e-3), the pairing a DDP
  user switching to model averaging keeps, and SGD(lr 0.01, momentum 0.9), the pairing of
  PyTorch's own PostLocalSGD / model-averaging examples. No gradient allreduce; at each epoch
  end the parameters are averaged once more so the CV model is one model, as labavg does;
* labavg: `labavg train --backend mpi --ranks 2` with its defaults (NG-SGD, K = 10).

The PyTorch ranks read exactly the minibatches labavg's ranks read (labavg.data: split_cv,
FrameBatches with labavg's seed, shard and steps per epoch; cv_batches for CV), so what differs
is training, not data pipelines. Every process runs one torch thread (labavg's default) and
glibc's malloc settings of labavg.training.runner.keep_freed_memory.
Reported per epoch: wall seconds (training plus the CV pass, as labavg's EpochDone.seconds)
and the CV frame accuracy of the averaged / synchronised model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

METHODS = ("ddp-adam", "pma-adam", "pma-sgd", "labavg")
_REPO = Path(__file__).resolve().parent.parent
# Children import this checkout's labavg, wherever the benchmark is started from.
_ENV = {**os.environ, "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(_REPO), os.environ.get("PYTHONPATH")]))}


def _worker(method: str, corpus: str, epochs: int, result: str) -> None:
    """One torchrun rank of a PyTorch baseline; rank 0 appends one JSON line per epoch."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from labavg.training.config import TrainConfig
    from labavg.data.dataset import open_dataset
    from labavg.data.frames import FrameBatches, cv_batches, feature_stats, split_cv, steps_per_epoch
    from labavg.training.model import DNN
    from labavg.training.runner import keep_freed_memory

    torch.set_num_threads(1)
    keep_freed_memory()  # labavg's ranks run with it; the comparison is of training, not malloc
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    cfg = TrainConfig()
    source = open_dataset(corpus)
    train_keys, cv_keys = split_cv(source.keys, cfg.data.cv_fraction, seed=cfg.seed)
    num_steps = steps_per_epoch(train_keys, source.num_frames, size, cfg.minibatch)
    batches = FrameBatches(
        source, train_keys, context=cfg.data.context, minibatch=cfg.minibatch,
        buffer_frames=cfg.data.buffer_frames, seed=cfg.seed, rank=rank, size=size, num_steps=num_steps,
    )
    # labavg's initial model: the same seed, initialisation and input normalisation.
    input_dim = source.feat_dim * (2 * cfg.data.context + 1)
    model = DNN(input_dim, source.num_pdfs, cfg.model, generator=torch.Generator().manual_seed(cfg.seed))
    mean, std = feature_stats(source, train_keys, cfg.data.context)
    model.set_input_transform(torch.from_numpy(mean).float(), torch.from_numpy(std).float())

    if method == "ddp-adam":
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model)
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)
        averager = None
    else:
        from torch.distributed.algorithms.model_averaging import averagers, utils

        for p in model.parameters():  # what DDP would do at construction: rank 0's model
            dist.broadcast(p.data, 0)
        net = model
        if method == "pma-adam":
            opt = torch.optim.Adam(net.parameters(), lr=1e-3)
        else:
            opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        averager = averagers.PeriodicModelAverager(period=10, warmup_steps=0)

    for epoch in range(epochs):
        start = time.perf_counter()
        net.train()
        for x, y in batches.epoch(epoch):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(x), y).backward()
            opt.step()
            if averager is not None:
                averager.average_parameters(net.parameters())
        if averager is not None:
            utils.average_parameters(iter(net.parameters()), dist.group.WORLD)
        train_seconds = time.perf_counter() - start
        # CV of the (identical) model over every rank's share of the CV set, as labavg does.
        totals = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad():
            for x, y in cv_batches(source, cv_keys[rank::size], context=cfg.data.context):
                totals[0] += (model(x).argmax(dim=1) == y).sum().item()
                totals[1] += y.numel()
        dist.all_reduce(totals)
        seconds = time.perf_counter() - start
        if rank == 0:
            with open(result, "a") as f:
                f.write(json.dumps({"epoch": epoch, "seconds": seconds, "train_seconds": train_seconds,
                                    "cv_frame_accuracy": float(totals[0] / totals[1])}) + "\n")
    dist.destroy_process_group()


def _run_pytorch(method: str, corpus: Path, epochs: int, work: Path) -> list[dict]:
    result = work / f"{method}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           __file__, "--worker", method, "--corpus", str(corpus), "--epochs", str(epochs),
           "--result", str(result)]
    subprocess.run(cmd, check=True, env=_ENV, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in result.read_text().splitlines()]


def _run_labavg(corpus: Path, epochs: int, work: Path) -> list[dict]:
    run = work / "labavg"
    subprocess.run([sys.executable, "-m", "labavg", "train", "--data", str(corpus), "--epochs", str(epochs),
                    "--backend", "mpi", "--ranks", "2", "--no-progress", "--out", str(run),
                    "--set", "tensorboard=false"], check=True, env=_ENV, stdout=subprocess.DEVNULL)
    out = []
    for line in (run / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e.get("type") == "epoch" and e.get("rank", 0) == 0:
            out.append({"epoch": e["epoch"], "seconds": e["seconds"],
                        "cv_frame_accuracy": e["cv_frame_accuracy"]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hours", type=float, default=1.0, help="built-in corpus size (1: the issue's)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {METHODS}")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--worker", choices=METHODS[:3], help=argparse.SUPPRESS)
    ap.add_argument("--corpus", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args.worker, args.corpus, args.epochs, args.result)
        return
    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if unknown:
        ap.error(f"unknown methods {sorted(unknown)}")
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="labavg-vs-pytorch-") as tmp:
        work = Path(tmp)
        corpus = work / "corpus"
        subprocess.run([sys.executable, "-m", "labavg", "corpus", "synth", str(corpus), "--hours",
                        str(args.hours)], check=True, stdout=subprocess.DEVNULL)
        for method in methods:
            if method == "labavg":
                results[method] = _run_labavg(corpus, args.epochs, work)
            else:
                results[method] = _run_pytorch(method, corpus, args.epochs, work)
    load = os.getloadavg()
    print(f"corpus {args.hours} h, {args.epochs} epochs, 2 ranks each; load average "
          f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print(f"{'method':10s} " + " ".join(f"ep{e + 1} s/acc%".rjust(14) for e in range(args.epochs)))
    for method, rows in results.items():
        cells = [f"{r['seconds']:6.1f}/{100 * r['cv_frame_accuracy']:5.1f}".rjust(14) for r in rows]
        print(f"{method:10s} " + " ".join(cells))
    if args.json:
        Path(args.json).write_text(json.dumps({"hours": args.hours, "epochs": args.epochs,
                                               "loadavg": load, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
