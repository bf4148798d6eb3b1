"""benchmarks/gpu_check.py, the script a GPU machine runs: its plumbing, checked here on the CPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: run the script itself")
def test_without_cuda_every_check_is_skipped_with_the_reason():
    proc = _run()
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stderr
    assert [line.split(":")[0] for line in lines] == [
        "SKIP cuda", "SKIP binding", "SKIP train-1", "SKIP nccl-2", "SKIP mpi-staging-2", "SKIP step"]
    assert all("CUDA is not available" in line for line in lines)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_training_checks_pass_on_the_cpu(tmp_path):
    # the same commands the GPU machine runs, with --device cpu: gloo for torch, MPICH for mpi
    proc = _run("--dry-run-on-cpu", "--work", str(tmp_path))
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [line.split(":")[0] for line in lines] == ["PASS train-1", "PASS nccl-2", "PASS mpi-staging-2"]
    assert "max parameter difference 0.0e+00" in lines[-1], lines[-1]
