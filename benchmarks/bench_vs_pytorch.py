"""Time to accuracy: labavg against what a PyTorch user would write instead, in ONE run.

    .venv/bin/python benchmarks/bench_vs_pytorch.py [--hours 1] [--epochs 3] [--cv-every 20]
        [--repeats 2] [--json out.json]

Side by side, on the same built-in corpus and the same DNN (labavg.training.model.DNN, the default
ModelConfig, the same initial parameters and input normalisation):

* ddp-adam: torchrun + DistributedDataParallel (gloo) + torch.optim.Adam(lr 1e-3) on the mean
  cross-entropy, 2 ranks: the usual data-parallel PyTorch loop;
* pma-adam: 2 torchrun ranks + torch.distributed.algorithms.model_averaging.averagers.
  PeriodicModelAverager(period 10) around Adam(lr 1e-3), the pairing a DDP user switching to
  model averaging keeps. No gradient allreduce; at each epoch end the parameters are averaged
  once more so the CV model is one model, as labavg does;
* adam-1: one process, Adam(lr 1e-3): what the two ranks are for;
* pma-sgd (with --methods): PeriodicModelAverager around SGD(lr 0.01, momentum 0.9), the
  pairing of PyTorch's own PostLocalSGD / model-averaging examples;
* labavg: `labavg train --backend mpi --ranks 2 --cv-every N` with its defaults (NG-SGD, K = 10),
  without the speedup pairs (`--speedup-pairs 0`: rank 0 training alone to measure the speedup
  is not training).

The PyTorch ranks read exactly the minibatches labavg's ranks read (labavg.data: split_cv,
FrameBatches with the seed, shard and steps per epoch; cv_batches for CV), so what differs is
training, not data pipelines. Every process runs one torch thread (labavg's default) and glibc's
malloc settings of labavg.training.runner.keep_freed_memory.

Every method checks the CV frame accuracy every N minibatches of a rank and at each epoch end,
as labavg's `cv_every` does: of the model the ranks hold (DDP), or of the mean of the ranks'
models taken on a copy (model averaging, labavg). Time is rank 0's training clock: wall seconds
from the first minibatch, every CV pass left out (labavg: the `cv` events' train_seconds,
labavg.training.cv_check). A method's time to an accuracy is the clock at its first check at
or above it. Reported: each peer's best accuracy and its time to it, labavg's time to each
peer's best, and that time as a ratio to DDP's time to its own best (the issue's goal: at most
0.25) and to the peer's own time. Each repeat r runs every method once with seed r (data order
and initial model), in an order rotated by r, so the methods share the machine's load; a ratio
is taken within a repeat; the medians are shown with their range over the repeats.
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

METHODS = ("ddp-adam", "pma-adam", "adam-1", "pma-sgd", "labavg")
DEFAULT_METHODS = ("ddp-adam", "pma-adam", "adam-1", "labavg")
PEERS = METHODS[:4]
_REPO = Path(__file__).resolve().parent.parent
# Children import this checkout's labavg, wherever the benchmark is started from.
_ENV = {**os.environ, "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(_REPO), os.environ.get("PYTHONPATH")]))}


def _worker(method: str, corpus: str, epochs: int, seed: int, cv_every: int, result: str) -> None:
    """One torchrun rank of a PyTorch peer; rank 0 appends one JSON line per CV check."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from labavg.data.dataset import open_dataset
    from labavg.data.frames import FrameBatches, feature_stats, split_cv, steps_per_epoch
    from labavg.training.config import TrainConfig
    from labavg.training.model import DNN
    from labavg.training.runner import keep_freed_memory

    torch.set_num_threads(1)
    keep_freed_memory()  # labavg's ranks run with it; the comparison is of training, not malloc
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    cfg = TrainConfig(seed=seed)
    source = open_dataset(corpus)
    train_keys, cv_keys = split_cv(source.keys, cfg.data.cv_fraction, seed=cfg.seed)
    num_steps = steps_per_epoch(train_keys, source.num_frames, size, cfg.minibatch)
    batches = FrameBatches(
        source, train_keys, context=cfg.data.context, minibatch=cfg.minibatch,
        buffer_frames=cfg.data.buffer_frames, seed=cfg.seed, rank=rank, size=size,
        num_steps=num_steps)
    # labavg's initial model: the same seed, initialisation and input normalisation.
    input_dim = source.feat_dim * (2 * cfg.data.context + 1)
    model = DNN(input_dim, source.num_pdfs, cfg.model,
                generator=torch.Generator().manual_seed(cfg.seed))
    mean, std = feature_stats(source, train_keys, cfg.data.context)
    model.set_input_transform(torch.from_numpy(mean).float(), torch.from_numpy(std).float())
    net, opt, averager = _peer(method, model)
    check = _Checks(model, source, cv_keys[rank::size], cfg.data.context, averager is not None,
                    rank, result)
    step = 0
    for epoch in range(epochs):
        net.train()
        for x, y in batches.epoch(epoch):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(x), y).backward()
            opt.step()
            if averager is not None:
                averager.average_parameters(net.parameters())
            step += 1
            if step % cv_every == 0 and step % num_steps:
                check(step, epoch + (step % num_steps) / num_steps, epoch_end=False)
        if averager is not None and size > 1:
            from torch.distributed.algorithms.model_averaging import utils

            utils.average_parameters(iter(net.parameters()), dist.group.WORLD)
        check(step, epoch + 1.0, epoch_end=True)
    dist.destroy_process_group()


def _peer(method: str, model):
    """(the module trained, its optimizer, its PeriodicModelAverager or None)."""
    import torch
    import torch.distributed as dist

    if method == "ddp-adam":
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model)
        return net, torch.optim.Adam(net.parameters(), lr=1e-3), None
    if method == "adam-1":
        return model, torch.optim.Adam(model.parameters(), lr=1e-3), None
    from torch.distributed.algorithms.model_averaging import averagers

    for p in model.parameters():  # what DDP would do at construction: rank 0's model
        dist.broadcast(p.data, 0)
    opt = (torch.optim.Adam(model.parameters(), lr=1e-3) if method == "pma-adam"
           else torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    return model, opt, averagers.PeriodicModelAverager(period=10, warmup_steps=0)


class _Checks:
    """The CV checks of one rank and rank 0's training clock, which they stop."""

    def __init__(self, model, source, keys, context: int, mean_of_models: bool, rank: int,
                 result: str) -> None:
        self.model, self.source, self.keys, self.context = model, source, keys, context
        self.mean_of_models, self.rank, self.result = mean_of_models, rank, result
        self.train_seconds, self.mark = 0.0, time.perf_counter()

    def __call__(self, step: int, epochs: float, epoch_end: bool) -> None:
        import torch
        import torch.distributed as dist

        from labavg.data.frames import cv_batches

        now = time.perf_counter()
        self.train_seconds += now - self.mark
        params = list(self.model.parameters())
        saved = [p.detach().clone() for p in params] if self.mean_of_models else None
        with torch.no_grad():
            if saved is not None:  # the ranks' models differ between averagings
                for p in params:
                    dist.all_reduce(p.data)
                    p.data /= dist.get_world_size()
            totals = torch.zeros(2, dtype=torch.float64)
            for x, y in cv_batches(self.source, self.keys, context=self.context):
                totals[0] += (self.model(x).argmax(dim=1) == y).sum().item()
                totals[1] += y.numel()
            dist.all_reduce(totals)
            for p, s in zip(params, saved or ()):
                p.data.copy_(s)
        if self.rank == 0:
            with open(self.result, "a") as f:
                f.write(json.dumps({"step": step, "epochs": epochs, "epoch_end": epoch_end,
                                    "train_seconds": self.train_seconds,
                                    "cv_seconds": time.perf_counter() - now,
                                    "cv_frame_accuracy": float(totals[0] / totals[1])}) + "\n")
        self.mark = time.perf_counter()


def _run_pytorch(method: str, corpus: Path, args: argparse.Namespace, seed: int,
                 work: Path) -> list[dict]:
    result = work / f"{method}-{seed}.jsonl"
    procs = "1" if method == "adam-1" else "2"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           procs, __file__, "--worker", method, "--corpus", str(corpus), "--epochs",
           str(args.epochs), "--seed", str(seed), "--cv-every", str(args.cv_every),
           "--result", str(result)]
    subprocess.run(cmd, check=True, env=_ENV, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in result.read_text().splitlines()]


def _run_labavg(corpus: Path, args: argparse.Namespace, seed: int, work: Path) -> list[dict]:
    run = work / f"labavg-{seed}"
    subprocess.run([sys.executable, "-m", "labavg", "train", "--data", str(corpus), "--epochs",
                    str(args.epochs), "--backend", "mpi", "--ranks", "2", "--no-progress",
                    "--out", str(run), "--seed", str(seed), "--cv-every", str(args.cv_every),
                    "--speedup-pairs", "0", "--set", "tensorboard=false"],
                   check=True, env=_ENV, stdout=subprocess.DEVNULL)
    keys = ("step", "epochs", "epoch_end", "train_seconds", "cv_seconds", "cv_frame_accuracy")
    return [{k: e[k] for k in keys} for e in map(json.loads, (run / "events.jsonl").read_text()
                                                   .splitlines())
            if e.get("type") == "cv" and e.get("rank") == 0]


def time_to(checks: list[dict], accuracy: float) -> float | None:
    """The training clock at the first check at or above `accuracy` (None: never reached)."""
    return next((c["train_seconds"] for c in checks if c["cv_frame_accuracy"] >= accuracy), None)


def best(checks: list[dict]) -> tuple[float, float]:
    """(best accuracy, the clock at the first check reaching it)."""
    top = max(c["cv_frame_accuracy"] for c in checks)
    return top, time_to(checks, top)


def compare(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """One repeat: per peer its best and time to it, labavg's time to that best and the ratios
    to DDP's time to its best and to the peer's own."""
    ddp = best(runs["ddp-adam"])[1] if "ddp-adam" in runs else None
    out = {}
    for peer in (m for m in runs if m != "labavg"):
        accuracy, seconds = best(runs[peer])
        ours = time_to(runs["labavg"], accuracy) if "labavg" in runs else None
        out[peer] = {"best": accuracy, "seconds": seconds, "labavg_seconds": ours,
                     "vs_ddp": None if ours is None or not ddp else ours / ddp,
                     "vs_peer": None if ours is None else ours / seconds}
    return out


def _spread(values: list[float | None], fmt: str) -> str:
    """Median (min-max) of a repeat's values; 'not reached' in any repeat is said."""
    if not values or any(v is None for v in values):
        return "not reached" if values else "-"
    if len(values) == 1:
        return format(values[0], fmt)
    return (f"{format(statistics.median(values), fmt)} "
            f"({format(min(values), fmt)}-{format(max(values), fmt)})")


def report(compared: list[dict[str, dict]], args: argparse.Namespace, load: list) -> str:
    lines = [f"corpus {args.hours} h, {args.epochs} epochs, CV check every {args.cv_every} "
             f"minibatches of a rank and at epoch ends; {len(compared)} repeats (seeds "
             f"0..{len(compared) - 1}), methods interleaved; median (min-max) over repeats; "
             f"load average {' '.join(f'{x:.1f}' for x in load)}",
             f"{'peer':9s} {'best acc %':>18s} {'peer s to best':>18s} "
             f"{'labavg s to it':>18s} {'labavg / DDP best s':>22s} {'labavg / peer s':>18s}"]
    for peer in compared[0]:
        rows = [c[peer] for c in compared]
        acc = [100 * r["best"] for r in rows]
        lines.append(f"{peer:9s} {_spread(acc, '.1f'):>18s} "
                     f"{_spread([r['seconds'] for r in rows], '.1f'):>18s} "
                     f"{_spread([r['labavg_seconds'] for r in rows], '.1f'):>18s} "
                     f"{_spread([r['vs_ddp'] for r in rows], '.3f'):>22s} "
                     f"{_spread([r['vs_peer'] for r in rows], '.3f'):>18s}")
    return "\n".join(lines)


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hours", type=float, default=1.0, help="built-in corpus size (1: the issue's)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--cv-every", type=int, default=20, help="minibatches of a rank between checks")
    ap.add_argument("--repeats", type=int, default=2, help="seeds 0..R-1, methods interleaved")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                    help=f"comma-separated subset of {METHODS}")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--worker", choices=PEERS, help=argparse.SUPPRESS)
    ap.add_argument("--corpus", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        ap.error(f"unknown methods {sorted(unknown)}")
    if args.cv_every < 1 or args.repeats < 1:
        ap.error("--cv-every and --repeats must be >= 1")
    return args


def main() -> None:
    args = _parse()
    if args.worker:
        _worker(args.worker, args.corpus, args.epochs, args.seed, args.cv_every, args.result)
        return
    runs: list[dict[str, list[dict]]] = []
    with tempfile.TemporaryDirectory(prefix="labavg-vs-pytorch-") as tmp:
        work = Path(tmp)
        corpus = work / "corpus"
        subprocess.run([sys.executable, "-m", "labavg", "corpus", "synth", str(corpus), "--hours",
                        str(args.hours)], check=True, stdout=subprocess.DEVNULL, env=_ENV)
        for seed in range(args.repeats):
            shift = seed % len(args.methods)  # each repeat starts with another method
            order = args.methods[shift:] + args.methods[:shift]
            runs.append({})
            for method in order:
                runs[-1][method] = (_run_labavg(corpus, args, seed, work) if method == "labavg"
                                    else _run_pytorch(method, corpus, args, seed, work))
                print(f"seed {seed} {method}: best {100 * best(runs[-1][method])[0]:.1f} % at "
                      f"{best(runs[-1][method])[1]:.1f} s", file=sys.stderr, flush=True)
    load = list(os.getloadavg())
    compared = [compare({m: r[m] for m in args.methods}) for r in runs]
    print(report(compared, args, load))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"hours": args.hours, "epochs": args.epochs, "cv_every": args.cv_every,
             "repeats": args.repeats, "loadavg": load, "compared": compared, "runs": runs},
            indent=2) + "\n")


if __name__ == "__main__":
    main()
