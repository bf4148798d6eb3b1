"""Step time of NG-SGD over plain SGD on the default DNN (one CPU thread by default).

Times are CPU seconds of this process (`time.process_time`) by default, which other
processes on a shared machine disturb much less than wall-clock time (`--clock wall`; CUDA
needs wall). A "step" is what the trainer does per minibatch: forward, summed cross-entropy, backward,
optimizer.step(lr). Both optimizers run interleaved in one process, after a warm-up that
covers NG-SGD's first 10 always-updating minibatches; the reported ratio is the median over
repetitions of (NG-SGD time / SGD time) for the same number of steps, printed with its
spread and beside NG-SGD's FLOP floor: (SGD's FLOPs + what preconditioning adds) / SGD's
FLOPs at this model, minibatch and [ngsgd] settings. `--profile STEPS` prints instead where
each step's time goes (torch.profiler, by kind of op; docs/ngsgd.md).

    .venv/bin/python benchmarks/bench_ngsgd.py [--reps 7] [--steps 40] [--threads 1]
    .venv/bin/python benchmarks/bench_ngsgd.py --profile 40
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

from labavg.optim.max_change import find_linears
from labavg.optim.settings import NGConfig

from labavg.training.model import DNN
from labavg.training.settings import ModelConfig
from labavg.optim.factory import make_optimizer
from labavg.training.runner import keep_freed_memory


# FLOPs count a multiply-add as 2 and any other arithmetic op on an element as 1.


def sgd_flops(model: nn.Module, batch: int, num_pdfs: int) -> dict[str, float]:
    """SGD's step on a stack of nn.Linear: forward, dX (not of the first layer: the input
    needs no gradient), dW and the bias gradients, the sigmoids, the loss and the update."""
    linears = find_linears(model)
    gemm = sum(2 * batch * m.in_features * m.out_features * (3 if i else 2) for i, m in enumerate(linears))
    hidden = sum(m.out_features for m in linears[:-1])
    params = sum(p.numel() for p in model.parameters())
    elementwise = (
        2 * batch * linears[0].in_features  # the input transform
        + batch * sum(m.out_features for m in linears) * 2  # bias add, bias gradient
        + batch * hidden * (3 + 3)  # sigmoid forward (exp, add, divide), backward (y (1-y) g)
        + batch * num_pdfs * (5 + 3)  # log-softmax forward and backward, summed NLL
        + 2 * params  # p += -lr g
    )
    return {"gemm": float(gemm), "elementwise": float(elementwise)}


def _side_flops(N: int, D: int, R: int, cfg: NGConfig) -> dict[str, float]:
    """One Fisher estimate's extra work per minibatch, its update amortised over update_period
    (the steady state after the first num_initial_updates minibatches)."""
    R = min(R, D - 1)
    every = {"precondition_gemm": 4.0 * N * D * R,  # H = X W^T, X_hat = X - H W
             "norms": 4.0 * N * D}  # tr(X X^T), the row norms of X_hat
    lk = 2 * (2 * R) * D * R if N > D else 2 * N * R * R + 2 * R * D * R
    update = {"update_gemm": 2.0 * N * D * R + lk + 2 * R * R * D + 2 * R * D,  # J, L and K, A B
              "eigh": 9.0 * R**3,  # symmetric QR with vectors (Golub & Van Loan)
              "rxr": 30.0 * R * R}  # Z_t, A_t and the rest of the R x R algebra
    out = dict(every)
    for k, v in update.items():
        out[k] = v / cfg.update_period
    return out


def ngsgd_extra_flops(model: nn.Module, batch: int, cfg: NGConfig) -> dict[str, float]:
    """What NG-SGD adds to SGD's step: both sides of every layer (the input side with the
    bias's 1), the per-frame max-change; its update GEMM replaces autograd's dW (no extra)."""
    total: dict[str, float] = defaultdict(float)
    for m in find_linears(model):
        for D, R in ((m.in_features + (m.bias is not None), cfg.rank_in), (m.out_features, cfg.rank_out)):
            for k, v in _side_flops(batch, D, R, cfg).items():
                total[k] += v
        total["max_change"] += 4.0 * batch + batch * m.out_features  # and the bias as a GEMV
    return dict(total)


def flop_floor(model: nn.Module, batch: int, num_pdfs: int, cfg: NGConfig) -> tuple[float, dict, dict]:
    """(NG-SGD's FLOPs / SGD's FLOPs, SGD's FLOPs by kind, NG-SGD's extra FLOPs by kind)."""
    sgd = sgd_flops(model, batch, num_pdfs)
    extra = ngsgd_extra_flops(model, batch, cfg)
    return (sum(sgd.values()) + sum(extra.values())) / sum(sgd.values()), sgd, extra


KINDS = ("step GEMMs", "preconditioner GEMMs", "R x R: eigh, cholesky, solves", "N x D passes",
         "copies and allocations", "small ops (R x R, scalars)", "autograd nodes")


def op_kind(name: str, shapes: list, ranks: set[int], big: int) -> str:
    """The kind of one profiled op, from its name and input shapes (`ranks`: the Fisher
    ranks, whose dimension marks a preconditioner GEMM; `big`: numel of an N x D block)."""
    dims = [d for s in shapes if isinstance(s, (list, tuple)) for d in s]
    numel = max((_numel(s) for s in shapes if isinstance(s, (list, tuple))), default=0)
    if name.startswith(("autograd::", "torch::autograd", "SigmoidBackward", "AddmmBackward",
                        "MmBackward", "LogSoftmaxBackward", "NllLossBackward", "Optimizer")):
        return "autograd nodes"
    if name in ("aten::mm", "aten::addmm", "aten::addmm_", "aten::addmv", "aten::addmv_", "aten::mv",
                "aten::matmul", "aten::bmm"):
        return "preconditioner GEMMs" if ranks & set(dims) else "step GEMMs"
    if any(k in name for k in ("eigh", "cholesky", "solve_triangular", "linalg_qr")):
        return "R x R: eigh, cholesky, solves"
    if name in ("aten::copy_", "aten::empty", "aten::empty_strided", "aten::clone", "aten::_to_copy",
                "aten::to", "aten::cat", "aten::stack", "aten::zeros", "aten::ones", "aten::full",
                "aten::resize_", "aten::empty_like", "aten::zeros_like", "aten::ones_like"):
        return "N x D passes" if numel >= big else "copies and allocations"
    return "N x D passes" if numel >= big else "small ops (R x R, scalars)"


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def profile_kinds(step, steps: int, ranks: set[int], big: int, how: str) -> tuple[dict[str, float], int]:
    """Run `step()` `steps` times and attribute its time to kinds of op: (ms a step by kind,
    ops a step). `how`: "torch" takes torch.profiler's self CPU times, which are wall times
    (on a loaded machine they include the time other processes had the core); "cpu" times each
    aten op with this thread's CPU clock through a TorchDispatchMode, which sees the ops
    after autograd (backward's too: on the CPU the engine runs them in this thread)."""
    kinds = dict.fromkeys(KINDS, 0.0)
    count = 0
    if how == "torch":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(steps):
                step()
        for event in prof.key_averages(group_by_input_shape=True):
            kinds[op_kind(event.key, event.input_shapes or [], ranks, big)] += event.self_cpu_time_total / 1e3
            count += event.count
    else:
        from torch.utils._python_dispatch import TorchDispatchMode

        class CpuTimes(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                nonlocal count
                start = time.thread_time_ns()
                out = func(*args, **(kwargs or {}))
                spent = time.thread_time_ns() - start
                shapes = [list(a.shape) for a in args if isinstance(a, torch.Tensor)]
                kinds[op_kind(f"aten::{func.overloadpacket.__name__}", shapes, ranks, big)] += spent / 1e6
                count += 1
                return out

        with CpuTimes():
            for _ in range(steps):
                step()
    return {k: v / steps for k, v in kinds.items()}, count // steps


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


def print_floor(model: nn.Module, batch: int, num_pdfs: int, cfg: NGConfig) -> float:
    """Print the FLOP counts and NG-SGD's FLOP floor over SGD; return the floor."""
    floor, sgd, extra = flop_floor(model, batch, num_pdfs, cfg)
    total = sum(sgd.values())
    print(f"SGD step: {total / 1e6:.1f} MFLOP (GEMMs {sgd['gemm'] / 1e6:.1f}); NG-SGD adds "
          + ", ".join(f"{k} {100 * v / total:.2f} %" for k, v in extra.items()))
    print(f"FLOP floor ratio {floor:.3f} (rank_in {cfg.rank_in}, rank_out {cfg.rank_out}, "
          f"update_period {cfg.update_period})")
    return floor


def print_profile(runs: dict, feats, labels, batch: int, steps: int, cfg: NGConfig, how: str) -> None:
    """Time a step by kind of op, SGD and NG-SGD, and the difference; "outside ops" is the
    step's unprofiled thread CPU time less its ops' (python: ours, the hooks', autograd's)."""
    ranks = {cfg.rank_in, cfg.rank_out}
    big = batch * 100  # an N x D block: N rows of at least 100 columns
    table = {}
    for name, (model, opt) in runs.items():
        counter = [0]

        def step(model=model, opt=opt, counter=counter):
            lo = counter[0] % 16 * batch
            counter[0] += 1
            time_steps(model, opt, feats[lo:lo + 2 * batch], labels[lo:lo + 2 * batch], 1, batch, 0.008,
                       time.process_time)

        plain = []
        for _ in range(5):  # unprofiled, interleaved with nothing: the least of 5 runs
            start = time.thread_time()
            for _ in range(steps):
                step()
            plain.append((time.thread_time() - start) * 1e3 / steps)
        kinds, count = profile_kinds(step, steps, ranks, big, how)
        kinds["outside ops (python)"] = min(plain) - sum(kinds.values()) if how == "cpu" else float("nan")
        table[name] = (kinds, count, min(plain))
    print(f"{'torch.profiler self CPU (wall)' if how == 'torch' else 'thread CPU time of each op'}, "
          f"{steps} steps each, ms a step")
    print(f"{'kind':34s} {'sgd':>8s} {'ngsgd':>8s} {'extra':>8s}")
    for kind in table["sgd"][0]:
        a, b = table["sgd"][0][kind], table["ngsgd"][0][kind]
        print(f"{kind:34s} {a:8.2f} {b:8.2f} {b - a:8.2f}")
    (_, na, ta), (_, nb, tb) = table["sgd"], table["ngsgd"]
    print(f"{'step, unprofiled (least of 5)':34s} {ta:8.2f} {tb:8.2f} {tb - ta:8.2f}")
    print(f"{'ops a step':34s} {na:8d} {nb:8d} {nb - na:8d}")


def quartiles(values: list[float]) -> str:
    """Median, interquartile range and min-max."""
    v = sorted(values)
    q1, _, q3 = statistics.quantiles(v, n=4) if len(v) > 1 else (v[0], v[0], v[0])
    return f"{statistics.median(v):.3f} (IQR {q1:.3f}-{q3:.3f}, min-max {v[0]:.3f}-{v[-1]:.3f}, n={len(v)})"


def main() -> None:
    """Parse arguments, time both optimizers interleaved, print per-rep and median ratios."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="instead of timing, profile STEPS steps of each and print where the time goes")
    ap.add_argument("--profiler", choices=("cpu", "torch"), default="cpu",
                    help="cpu: each op's thread CPU time; torch: torch.profiler (wall times)")
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
    print(f"threads={args.threads} device={device} batch={args.batch} steps/rep={args.steps} clock={clock.__name__}"
          f" load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    floor = print_floor(runs["sgd"][0], args.batch, 120, runs["ngsgd"][1].config)
    if args.profile:
        print_profile(runs, feats, labels, args.batch, args.profile, runs["ngsgd"][1].config, args.profiler)
        return
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ratios, times = [], {"sgd": [], "ngsgd": []}
    for _ in range(args.reps):
        for name in ("sgd", "ngsgd"):
            sync()
            t = time_steps(*runs[name], feats, labels, args.steps, args.batch, 0.008, clock)
            sync()
            times[name].append(t / args.steps)
        ratios.append(times["ngsgd"][-1] / times["sgd"][-1])
    print("sgd   ms/step:", " ".join(f"{1e3 * t:.2f}" for t in times["sgd"]))
    print("ngsgd ms/step:", " ".join(f"{1e3 * t:.2f}" for t in times["ngsgd"]))
    print("ratios:", " ".join(f"{r:.3f}" for r in ratios))
    print(f"median ratio ngsgd/sgd = {quartiles(ratios)}")
    print(f"median ratio / FLOP floor = {statistics.median(ratios) / floor:.3f}"
          f"; load average after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
