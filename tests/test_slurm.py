"""Slurm as a launcher, on a real one-node Slurm (munged, slurmctld, slurmd) started here.

The session fixture brings the daemons up with scripts/slurm-up.sh in a temp directory (its
own munge socket, ports and spool, so no other cluster on the machine is met) and down with
scripts/slurm-down.sh. Every job is bounded in time: a regression fails, it never hangs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from labavg.base import checkpoint
from labavg.jobs.slurm import mpich_env

from support import wait_for
from test_reliability import poisoned_corpus  # noqa: F401 - a fixture
from test_train import SMALL, final_params

# A real Slurm: daemons started for the module, jobs through srun and sbatch (`pytest -m slow`).
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
BINARIES = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scancel", "salloc", "squeue")


@pytest.fixture(scope="session")
def slurm(tmp_path_factory) -> dict[str, str]:
    """The environment (SLURM_CONF, PYTHONPATH) that reaches a private one-node cluster."""
    missing = [b for b in BINARIES if shutil.which(b) is None]
    why = (f"Slurm binaries missing ({', '.join(missing)}): run scripts/install-slurm.sh"
           if missing else "the Slurm daemons need root" if os.geteuid() != 0 else None)
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the Slurm tests: {why}")
        pytest.skip(why)
    state = tmp_path_factory.mktemp("slurm")
    up = subprocess.run(["bash", str(REPO / "scripts/slurm-up.sh"), str(state)],
                        capture_output=True, text=True, timeout=60)
    try:
        assert up.returncode == 0, up.stderr
        env = {**os.environ, "SLURM_CONF": str(state / "slurm.conf"), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                          os.environ.get("PYTHONPATH")]))}
        yield env
    finally:
        subprocess.run(["bash", str(REPO / "scripts/slurm-down.sh"), str(state)], timeout=60)
    assert not state.exists()


def _run(command: list[str], env: dict[str, str], timeout: float = 300,
         cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=cwd)


def _train(corpus: Path, out: Path, ranks: int, *extra: str) -> list[str]:
    return ["-m", "labavg", "train", "--data", str(corpus), "--out", str(out), "--backend", "mpi",
            "--ranks", str(ranks), *SMALL, *extra]


def _mpiexec_run(corpus: Path, out: Path, ranks: int, env, *extra: str) -> Path:
    """labavg's own launcher (mpiexec on this machine): the reference for every Slurm run."""
    done = _run([sys.executable, *_train(corpus, out, ranks, *extra)], env)
    assert done.returncode == 0, done.stderr
    return out


def _same_params(a: Path, b: Path, ranks: int) -> None:
    assert checkpoint.latest_step(a)[0] == checkpoint.latest_step(b)[0]
    for rank in range(ranks):
        assert torch.equal(final_params(a, rank), final_params(b, rank)), f"rank {rank}"


def _processes_of(run_dir: Path) -> list[psutil.Process]:
    """Processes whose command line names the run directory (its ranks, its launcher)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(str(run_dir) in arg for arg in proc.info["cmdline"] or ()):
            found.append(proc)
    return found


def _job_gone(job: str, env) -> bool:
    out = _run(["squeue", "-h", "-j", job, "-o", "%T"], env, timeout=30).stdout.strip()
    return out == "" or out in ("COMPLETED", "CANCELLED", "FAILED")


# -- srun starts the ranks ---------------------------------------------------------------------


@pytest.mark.parametrize("ranks", [2, 4])
def test_srun_ranks_match_labavgs_mpiexec_bitwise(slurm, corpus, tmp_path, ranks):
    reference = _mpiexec_run(corpus, tmp_path / "mpiexec", ranks, slurm)
    # As docs/cluster.md says to run it: libfabric's tcp, not the wheel's default UCX netmod.
    srun = _run(["srun", "--ntasks", str(ranks), "--mpi=pmi2", sys.executable,
                 *_train(corpus, tmp_path / "srun", ranks)], {**slurm, **mpich_env({})})
    assert srun.returncode == 0, srun.stderr
    summary = json.loads((tmp_path / "srun" / "summary.json").read_text())
    assert summary["ranks"] == ranks
    _same_params(tmp_path / "srun", reference, ranks)


def test_launcher_slurm_inside_an_allocation_matches_mpiexec(slurm, corpus, tmp_path):
    reference = _mpiexec_run(corpus, tmp_path / "mpiexec", 2, slurm)
    done = _run(["salloc", "--ntasks", "2", "--quiet", sys.executable,
                 *_train(corpus, tmp_path / "slurm", 2, "--launcher", "slurm")], slurm)
    assert done.returncode == 0, done.stderr
    _same_params(tmp_path / "slurm", reference, 2)
    assert not (tmp_path / "slurm" / ".launch.json").exists()


def test_launcher_slurm_outside_an_allocation_is_one_line(slurm, corpus, tmp_path):
    env = {k: v for k, v in slurm.items() if not k.startswith("SLURM_JOB")}
    done = _run([sys.executable, *_train(corpus, tmp_path / "run", 2, "--launcher", "slurm")], env)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [done.stderr.strip()]
    assert "SLURM_JOB_ID is not set" in done.stderr and "salloc" in done.stderr
    assert not (tmp_path / "run").exists()


def test_launcher_slurm_names_a_lost_rank_and_leaves_none(slurm, corpus, tmp_path):
    out = tmp_path / "run"
    start = time.monotonic()
    done = _run(["salloc", "--ntasks", "2", "--quiet", sys.executable,
                 *_train(corpus, out, 2, "--launcher", "slurm", "--epochs", "3",
                         "--set", 'inject_fault="kill@rank1:step5"')], slurm)
    # Bounded by the machine's load (importing torch took up to 14 s per rank on 2 busy cores).
    assert done.returncode != 0 and time.monotonic() - start < 150
    mine = [line for line in done.stderr.splitlines() if line.startswith("labavg:")]
    assert len(mine) == 1, done.stderr
    assert "rank 1 was lost" in mine[0] and "rank 1 last event at step 5" in mine[0], done.stderr
    assert not any(line.startswith(("srun:", "slurmstepd")) for line in done.stderr.splitlines())
    assert not (out / "summary.json").exists() and not (out / ".launch.json").exists()
    assert _processes_of(out) == []


def test_launcher_slurm_user_error_in_the_data_is_one_line_exit_2(slurm, poisoned_corpus,
                                                                   tmp_path):
    """A NaN in a CV utterance (rank 1's share) is found before training, now that every CV
    utterance is checked first: one line and status 2, not srun's 137, as under mpiexec."""
    data, victim = poisoned_corpus
    done = _run(["salloc", "--ntasks", "2", "--quiet", sys.executable,
                 *_train(data, tmp_path / "run", 2, "--launcher", "slurm")], slurm)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("labavg: error: "), done.stderr
    assert victim in lines[0] and "NaN or Inf" in lines[0]


# -- sbatch: a job script, and scancel in the middle of one -----------------------------------


def _sbatch(script: str, tmp_path: Path, env) -> str:
    path = tmp_path / "job.sh"
    path.write_text("#!/bin/bash\nset -euo pipefail\n" + script)
    done = _run(["sbatch", "--parsable", "--ntasks", "2", "--output", str(tmp_path / "job.log"),
                 str(path)], env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def _job_state(job: str, env) -> str:
    # MinJobAge=30 in slurm-up.sh keeps an ended job in squeue long enough to read its state.
    return _run(["squeue", "-h", "-t", "all", "-j", job, "-o", "%T"], env, timeout=30).stdout.strip()


def test_sbatch_job_script_trains_and_decodes(slurm, corpus, tmp_path):
    out = tmp_path / "run"
    train = " ".join([sys.executable, *_train(corpus, out, 2, "--launcher", "slurm")])
    decode = (f"{sys.executable} -m labavg decode {out} --data {corpus} "
              f"--lexicon {corpus / 'lexicon.txt'}")
    job = _sbatch(f"{train}\n{decode}\n", tmp_path, slurm)
    wait_for(lambda: _job_state(job, slurm) in ("COMPLETED", "FAILED", "CANCELLED"), 300, "the job")
    log = (tmp_path / "job.log").read_text()
    assert _job_state(job, slurm) == "COMPLETED", log
    assert json.loads((out / "summary.json").read_text())["ranks"] == 2
    decoded = json.loads((out / f"decode_{corpus.name}" / "result.json").read_text())
    assert decoded["utterances"] > 0 and 0 <= decoded["wer"] <= 100 and "WER" in log


def test_scancel_mid_run_leaves_no_rank_and_resume_matches(slurm, corpus, tmp_path):
    """scancel ends every rank; `--resume` from the last checkpoint gives the uninterrupted
    run's parameters, bit for bit."""
    common = ("--epochs", "12", "--checkpoint-every", "1")
    reference = _mpiexec_run(corpus, tmp_path / "full", 2, slurm, *common)
    out = tmp_path / "cut"
    train = " ".join([sys.executable, *_train(corpus, out, 2, "--launcher", "slurm", *common)])
    job = _sbatch(f"{train}\n", tmp_path, slurm)
    wait_for(lambda: checkpoint.latest_step(out) is not None, 240,
              "a checkpoint")
    assert not (out / "summary.json").exists(), "the run ended before it could be cancelled"
    cancel = _run(["scancel", job], slurm, timeout=30)
    assert cancel.returncode == 0, cancel.stderr
    wait_for(lambda: _job_gone(job, slurm) and _processes_of(out) == [], 60, "the job to end")
    assert not (out / "summary.json").exists()
    resumed = _run([sys.executable, "-m", "labavg", "train", "--resume", str(out),
                    "--no-progress"], slurm)
    assert resumed.returncode == 0, resumed.stderr
    _same_params(out, reference, 2)


# -- examples/slurm/labavg-cluster.sbatch: engines in a job, a notebook attached -------------


def test_cluster_example_engines_train_for_an_attached_notebook(slurm, corpus, tmp_path,
                                                               monkeypatch):
    """The example as shipped, with CPU settings on the command line (sbatch's flags override
    its #SBATCH lines); the notebook side attaches and trains 2 ranks on its engines, which
    give labavg's own mpiexec job's parameters."""
    from dataclasses import replace

    from labavg.jobs.cluster import Cluster
    from labavg.jobs.launch import start_run
    from test_train import small_config

    env = {**slurm, "IPYTHONDIR": str(tmp_path / "ipython"), "LABAVG_REPO": str(REPO),
           "LABAVG_FI_IFACE": "lo"}
    done = _run(["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0",
                 "--cpus-per-task=1", f"--output={tmp_path / 'cluster.log'}",
                 str(REPO / "examples/slurm/labavg-cluster.sbatch")], env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    job = done.stdout.strip().split(";")[0]
    try:
        security = tmp_path / "ipython" / "profile_labavg" / "security"
        wait_for(lambda: (security / f"cluster-{job}.json").is_file(), 120, "ipcluster")
        monkeypatch.setenv("IPYTHONDIR", env["IPYTHONDIR"])  # where the notebook finds it
        cluster = Cluster.attach(profile="labavg", cluster_id=job, device="cpu", timeout=180)
        cfg = small_config(corpus, tmp_path / "engines", backend="mpi", ranks=2)
        summary = start_run(cfg, cluster=cluster).result(300)
        cluster.shutdown()  # an attached cluster: disconnects, the job's engines stay
        assert summary.ranks == 2
        start_run(replace(cfg, out=str(tmp_path / "mpiexec")), launcher="job").result(300)
        _same_params(tmp_path / "engines", tmp_path / "mpiexec", 2)
    finally:
        _run(["scancel", job], slurm, timeout=30)
    wait_for(lambda: _job_gone(job, slurm) and _processes_of(Path(f"--cluster-id={job}")) == [],
              60, "the cluster job to end")
