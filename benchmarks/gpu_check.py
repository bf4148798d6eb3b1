"""The GPU paths in one short run: one line per check, for a machine with CUDA (never a timed test).

    .venv/bin/python benchmarks/gpu_check.py [--work DIR] [--timeout 240]

Needs a CUDA build of torch beside labavg's other dependencies (`pip install torch` from
PyTorch's CUDA index, then `pip install -e .`). Checks, each in its own process:

1. cuda: torch sees a CUDA device (name, count, capability);
2. binding: `select_device("cuda", local_rank)` gives each local rank a GPU, round robin;
3. train-1: `labavg train --device cuda` on one GPU finishes and learns;
4. nccl-2: 2 torch.distributed ranks over NCCL (`--backend torch --device cuda`) train and
   finish. With one GPU both ranks share it, which recent NCCL versions refuse ("Duplicate GPU
   detected"): then the line is a FAIL quoting NCCL's own words;
5. mpi-staging-2: 2 MPICH ranks on CUDA tensors (`--backend mpi --device cuda`), which stage
   every allreduce through pinned host memory when the MPI library is not CUDA-aware (PyPI's
   MPICH is not); the models equal the inproc run's to float rounding;
6. step: milliseconds per training step (SGD and NG-SGD, 4 x 512, minibatch 256) on the GPU
   and on one CPU thread, and their ratio.

Each line: `PASS|FAIL|SKIP name: detail`. Exit status 1 when any check fails; on a machine
without CUDA every line is a SKIP saying so, and the status is 0.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TINY = ["--hidden-layers", "1", "--hidden-dim", "64", "--epochs", "1", "--minibatch", "128",
        "--average-every", "5", "--set", "tensorboard=false", "--no-progress"]


def line(status: str, name: str, detail: str) -> bool:
    print(f"{status} {name}: {detail}", flush=True)
    return status != "FAIL"


def labavg(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "labavg", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def last_words(proc: subprocess.CompletedProcess) -> str:
    text = (proc.stderr or proc.stdout or "").strip().splitlines()
    return text[-1] if text else f"exit {proc.returncode}"


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def final_params(run: Path) -> torch.Tensor:
    state = torch.load(run / "final.pt", map_location="cpu", weights_only=False)["state_dict"]
    return torch.cat([v.reshape(-1).float() for v in state.values()])


def step_ms(device: torch.device, optimizer: str, repeats: int = 30) -> float:
    from labavg.training.model import DNN
    from labavg.training.settings import ModelConfig
    from labavg.optim.factory import make_optimizer
    from labavg.training.step import train_step

    torch.manual_seed(0)
    model = DNN(440, 120, ModelConfig(hidden_layers=4, hidden_dim=512)).to(device)
    opt = make_optimizer(optimizer, model)
    x = torch.randn(256, 440, device=device)
    y = torch.randint(0, 120, (256,), device=device)
    for _ in range(5):  # the pure step's time on the device; the runs below go through the CLI
        train_step(model, opt, x, y, 1e-4)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        train_step(model, opt, x, y, 1e-4)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 1e3 * (time.perf_counter() - start) / repeats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, help="folder for the corpus and runs (default: a temporary one)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per training check")
    parser.add_argument("--dry-run-on-cpu", action="store_true",
                        help="run the training checks on the CPU (gloo, plain MPI): the script's own test")
    args = parser.parse_args(argv)

    names = ["cuda", "binding", "train-1", "nccl-2", "mpi-staging-2", "step"]
    if args.dry_run_on_cpu:
        return training_checks(args, "cpu", 0)
    if not torch.cuda.is_available():
        for name in names:
            line("SKIP", name, f"CUDA is not available (torch {torch.__version__}, "
                               f"built for CUDA {torch.version.cuda})")
        return 0

    ok = True
    count = torch.cuda.device_count()
    props = torch.cuda.get_device_properties(0)
    ok &= line("PASS", "cuda", f"{count} device(s); 0: {props.name}, capability "
                               f"{props.major}.{props.minor}, {props.total_memory / 2**30:.0f} GiB")

    from labavg.comm.devices import select_device

    bound = [str(select_device("cuda", r)) for r in range(max(2, count))]
    expected = [f"cuda:{r % count}" for r in range(max(2, count))]
    ok &= line("PASS" if bound == expected else "FAIL", "binding",
               f"local ranks 0..{len(bound) - 1} -> {', '.join(bound)}")
    ok &= training_checks(args, "cuda", count) == 0

    torch.set_num_threads(1)
    times = {(d, o): step_ms(torch.device(d), o) for d in ("cuda", "cpu") for o in ("sgd", "ngsgd")}
    ok &= line("PASS", "step", ", ".join(
        f"{o} {times['cuda', o]:.2f} ms on GPU vs {times['cpu', o]:.1f} ms on 1 CPU thread "
        f"({times['cpu', o] / times['cuda', o]:.0f}x)" for o in ("sgd", "ngsgd"))
        + f"; NG-SGD/SGD on GPU {times['cuda', 'ngsgd'] / times['cuda', 'sgd']:.2f}x")
    return 0 if ok else 1


def training_checks(args: argparse.Namespace, device: str, count: int) -> int:
    """Checks 3-5 on `device`; 0 when all pass."""
    ok = True
    work = args.work or Path(tempfile.mkdtemp(prefix="labavg-gpu-"))
    corpus = work / "corpus"
    if not (corpus / "feats.scp").exists():
        from labavg.data.synth import synthesize

        synthesize(corpus, hours=0.05, seed=0, overwrite=True)
    common = ["--data", str(corpus), *TINY]

    runs = {}
    for name, extra in (("train-1", ["--backend", "inproc", "--ranks", "1"]),
                        ("nccl-2", ["--backend", "torch", "--ranks", "2"]),
                        ("mpi-staging-2", ["--backend", "mpi", "--ranks", "2"]),
                        ("inproc-2", ["--backend", "inproc", "--ranks", "2", "--device", "cpu"])):
        out = work / name
        device_flag = [] if "--device" in extra else ["--device", device]
        try:
            proc = labavg(["train", "--out", str(out), *common, *extra, *device_flag], args.timeout)
        except subprocess.TimeoutExpired:
            runs[name] = f"timed out after {args.timeout:.0f} s"
            continue
        runs[name] = out if proc.returncode == 0 else f"exit {proc.returncode}: {last_words(proc)}"

    def trained(name: str) -> tuple[bool, str]:
        result = runs[name]
        if not isinstance(result, Path):
            return False, result
        s = summary(result)
        return s["cv_frame_accuracy"] > 0.05, (f"CV frame accuracy {100 * s['cv_frame_accuracy']:.1f} % "
                                               f"in {s['wall_seconds']:.1f} s")

    good, text = trained("train-1")
    ok &= line("PASS" if good else "FAIL", "train-1", text)
    good, text = trained("nccl-2")
    ok &= line("PASS" if good else "FAIL", "nccl-2",
               text + (" (both ranks on one GPU)" if good and count == 1 else ""))
    good, text = trained("mpi-staging-2")
    if good and isinstance(runs["inproc-2"], Path):
        # on a GPU the arithmetic differs from the CPU's by rounding, which grows over training:
        # the same accuracy, not the same bits, is the check there (on the CPU it is bitwise)
        diff = (final_params(runs["mpi-staging-2"]) - final_params(runs["inproc-2"])).abs().max().item()
        acc = [summary(runs[n])["cv_frame_accuracy"] for n in ("mpi-staging-2", "inproc-2")]
        good = diff == 0.0 if device == "cpu" else abs(acc[0] - acc[1]) < 0.01
        text += (f"; against inproc on the CPU: max parameter difference {diff:.1e}, "
                 f"CV accuracy {100 * (acc[0] - acc[1]):+.2f} points")
    ok &= line("PASS" if good else "FAIL", "mpi-staging-2", text)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
