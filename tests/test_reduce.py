"""Reduce algorithms (labavg.comm.reduce): butterfly and ring against allreduce.

Tolerance. A float sum of N terms in any association is within (N - 1) u sum|x_i| of the exact
sum, u the unit roundoff (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed.,
eq. 4.4), and the division by N adds u |mean|; so every algorithm's mean lies within
u sum|x_i| (times 1 + O(N u)) of the exact one, elementwise, and two algorithms within twice
that of each other. The test computes the exact mean in float64 (float32 inputs are exact
there) and asserts that bound with u = 2^-24 (float32) or 2^-53 (float64). It is tight: a
contribution left out or added twice is off by |x_r| / N, orders of magnitude more.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from labavg.averaging.methods import Averager

from labavg.averaging.factory import make_averager
from labavg.averaging.mean import average_parameters, finite_norm
from labavg.comm.inproc import InProcCommunicator, RankFailed, run_inproc
from labavg.comm.inproc_group import CollectiveMismatch, CollectiveTimeout, InProcGroup
from labavg.comm.launchers import mpiexec_command
from labavg.comm.reduce import bounds, reduce_mean
from labavg.comm.settings import REDUCE
from labavg.training.config import TrainConfig, load_config, validate
from labavg.base.settings import with_overrides
from labavg.base.errors import UserError
from labavg.jobs.index import read_events
from labavg.jobs.runs import run_training
from labavg.jobs.summary import load_summary

from test_train import SMALL, final_params, small_config
from support import (child_env as _env, free_port as _free_port, launch,
                     load_ranks as _load_ranks, load_script)

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "comm_scripts" / "reduce.py"
PYTHON = sys.executable
LAUNCH_TIMEOUT_S = 120
UNIT_ROUNDOFF = {np.float32: 2.0**-24, np.float64: 2.0**-53}


script = load_script(SCRIPT, "comm_reduce")


def _launch(command: list[str]) -> None:
    launch(command, LAUNCH_TIMEOUT_S)


def _rounding_bound(size: int, length: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(exact mean, bound on any algorithm's error) of the script's contributions."""
    x = np.array([script.contribution(r, length, dtype) for r in range(size)], dtype=np.float64)
    u = UNIT_ROUNDOFF[dtype]
    return x.mean(axis=0), u * np.abs(x).sum(axis=0) * (1.0 + 4 * size * u)


def _check_algorithms(ranks: list[dict[str, np.ndarray]], size: int, cases=script.CASES,
                      allreduce_ranks: list[dict[str, np.ndarray]] | None = None) -> None:
    """Every rank holds bitwise the same mean, within float rounding of the exact mean and of
    the backend's allreduce (`allreduce_ranks`' when given: another backend's)."""
    reference = allreduce_ranks or ranks
    for length, dtype in cases:
        exact, bound = _rounding_bound(size, length, dtype)
        allreduce = reference[0][script.key("allreduce", length, dtype)]
        for algorithm in script.ALGORITHMS:
            name = script.key(algorithm, length, dtype)
            mean = ranks[0][name]
            assert mean.dtype == dtype and mean.shape == (length,), name
            for other in ranks[1:]:
                np.testing.assert_array_equal(other[name], mean, err_msg=name)
            err = np.abs(mean.astype(np.float64) - exact)
            worst = int(np.argmax(err - bound)) if length else 0
            assert np.all(err <= bound), (f"{name} on {size} ranks: element {worst} is off by "
                                          f"{err[worst]:.3g}, bound {bound[worst]:.3g}")
            assert np.all(np.abs(mean.astype(np.float64) - allreduce) <= 2 * bound), name


def test_bounds_cut_evenly():
    assert bounds(10, 4) == [0, 3, 6, 8, 10]
    assert bounds(2, 4) == [0, 1, 2, 2, 2]
    assert bounds(0, 3) == [0, 0, 0, 0]


# --- inproc: 2..8 ranks -------------------------------------------------------------------------

INPROC_CASES = ((0, np.float32), (1, np.float32), (7, np.float32), (1001, np.float32),
                (1001, np.float64), (65_539, np.float32))


@pytest.mark.parametrize("size", [2, 3, 4, 5, 6, 7, 8])
def test_algorithms_equal_allreduce_to_rounding_inproc(size):
    ranks = run_inproc(size, script.exercise, INPROC_CASES)
    _check_algorithms(ranks, size, INPROC_CASES)
    for length, dtype in INPROC_CASES:
        # The butterfly adds in inproc's own association (pairs, then pairs of pairs):
        # bitwise equal. The ring adds around the ring: different roundings (once the sum
        # has more than two terms).
        allreduce = ranks[0][script.key("allreduce", length, dtype)]
        np.testing.assert_array_equal(ranks[0][script.key("butterfly", length, dtype)], allreduce)
        if size > 2 and length > 100:
            assert not np.array_equal(ranks[0][script.key("ring", length, dtype)], allreduce)


def test_one_rank_is_a_no_op():
    comm = InProcCommunicator(InProcGroup(1), 0)
    for algorithm in REDUCE:
        buf = torch.tensor([1.5, -2.0])
        reduce_mean(comm, buf, algorithm)
        assert buf.tolist() == [1.5, -2.0]


def test_unknown_algorithm_and_bad_buffers_are_refused():
    comm = InProcCommunicator(InProcGroup(1), 0)
    with pytest.raises(ValueError, match="'rign'.*allreduce, butterfly, ring"):
        reduce_mean(comm, torch.zeros(3), "rign")
    with pytest.raises(ValueError, match="contiguous"):
        reduce_mean(comm, torch.zeros(6)[::2], "ring")
    with pytest.raises(ValueError, match="'rign'"):
        Averager(torch.zeros(3), comm, reduce="rign")


# --- inproc's point-to-point messages: failures end the wait ------------------------------------


def _receive_from_zero(comm, sender_fails: bool):
    if comm.rank == 0:
        if sender_fails:
            time.sleep(0.2)
            raise ValueError("rank 0 diverged")
        return  # finishes without sending
    comm.sendrecv(None, -1, torch.zeros(4), 0)


@pytest.mark.parametrize("sender_fails, expected", [(True, ValueError), (False, CollectiveMismatch)])
def test_a_receiver_is_not_left_waiting(sender_fails, expected):
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_inproc(2, _receive_from_zero, sender_fails)
    assert isinstance(info.value.exc, expected)
    if expected is CollectiveMismatch:
        assert "rank 1 waits for a message from rank 0, which had finished" in str(info.value)
    assert time.monotonic() - start < 5


def test_messages_of_another_length_are_refused():
    def work(comm):
        buf = torch.zeros(3 + comm.rank)
        comm.sendrecv(buf, 1 - comm.rank, torch.zeros_like(buf), 1 - comm.rank)

    with pytest.raises(RankFailed) as info:
        run_inproc(2, work)
    assert isinstance(info.value.exc, CollectiveMismatch)
    assert "expected 3 x torch.float32 from rank 1 but got 4" in str(info.value) or \
        "expected 4 x torch.float32 from rank 0 but got 3" in str(info.value)


def test_the_watchdog_ends_a_receive_that_never_comes():
    group = InProcGroup(2, timeout=0.3)
    comm = InProcCommunicator(group, 1)
    with pytest.raises(CollectiveTimeout, match="rank 1 waited .* from rank 0"):
        comm.sendrecv(None, -1, torch.zeros(2), 0)
    assert group.aborted


# --- real MPICH ranks and torchrun (gloo) ranks -----------------------------------------------


@pytest.mark.slow  # keeps README's fast command under 10 minutes; CI runs it
@pytest.mark.parametrize("size", [2, 3])
def test_algorithms_equal_allreduce_to_rounding_on_mpich(size, tmp_path):
    _launch(mpiexec_command(size, [str(SCRIPT), "mpi", str(tmp_path)]))
    ranks = _load_ranks(tmp_path, size)
    assert [int(r["rank"]) for r in ranks] == list(range(size))
    _check_algorithms(ranks, size)
    # The same algorithms over threads give the same bits: the exchanges, not the transport,
    # decide the result.
    inproc = run_inproc(size, script.exercise)
    for name in ranks[0]:
        if name.startswith(("butterfly", "ring")):
            np.testing.assert_array_equal(ranks[0][name], inproc[0][name], err_msg=name)
    # MPICH's own allreduce adds in the butterfly's association too (measured with MPICH 5.0.2
    # for every case here, as labavg.comm.inproc says of short messages).
    for length, dtype in script.CASES:
        np.testing.assert_array_equal(ranks[0][script.key("butterfly", length, dtype)],
                                      ranks[0][script.key("allreduce", length, dtype)])


# 3 torchrun ranks take the same path as 2 with a third process on 2 cores: slow suite.
@pytest.mark.parametrize("size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_algorithms_equal_allreduce_to_rounding_on_torchrun(size, tmp_path):
    torchrun = Path(PYTHON).parent / "torchrun"
    _launch([str(torchrun), "--nproc-per-node", str(size), "--master-addr", "127.0.0.1",
             "--master-port", str(_free_port()), str(SCRIPT), "torch", str(tmp_path)])
    ranks = _load_ranks(tmp_path, size)
    _check_algorithms(ranks, size)
    inproc = run_inproc(size, script.exercise)
    for name in ranks[0]:
        if name.startswith(("butterfly", "ring")):
            np.testing.assert_array_equal(ranks[0][name], inproc[0][name], err_msg=name)


# --- averaging rounds and training --------------------------------------------------------------


def test_non_finite_ranks_are_left_out_by_every_algorithm():
    steps = [torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), torch.full((5,), float("nan")),
             torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])]

    def work(comm, algorithm):
        flat = steps[comm.rank].clone()
        stats = average_parameters(flat, comm, reduce=algorithm)
        return stats, flat

    for algorithm in REDUCE:
        for rank, (stats, flat) in enumerate(run_inproc(3, work, algorithm)):
            assert (stats.finite, stats.dropped) == (rank != 1, 1), algorithm
            assert flat.tolist() == [2.0, 2.0, 2.0, 2.0, 2.0], algorithm


def _old_divergence(before: torch.Tensor, average: torch.Tensor) -> float:
    """The formula rounds used before issue 45: this rank's distance from the average over the
    average's norm, from a clone of its parameters (in float64 here, the reference)."""
    before, average = before.double(), average.double()
    return float(torch.linalg.vector_norm(before - average) / torch.linalg.vector_norm(average))


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("spread", [1e-1, 1e-2, 1e-3])
def test_divergence_is_the_rms_of_the_old_formula(size, spread):
    # 50,000 values: rows of NORM_ROW and a tail. With two ranks each one's own distance.
    base = torch.randn(50_000, generator=torch.Generator().manual_seed(0))
    starts = [base + spread * torch.randn(50_000, generator=torch.Generator().manual_seed(r + 1))
              for r in range(size)]

    def work(comm, algorithm):
        flat = starts[comm.rank].clone()
        return average_parameters(flat, comm, reduce=algorithm), flat

    for algorithm in REDUCE:
        ranks = run_inproc(size, work, algorithm)
        average = ranks[0][1]
        old = [_old_divergence(start, average) for start in starts]
        rms = (sum(d * d for d in old) / size) ** 0.5
        for stats, _ in ranks:
            assert stats.divergence == ranks[0][0].divergence  # one value, agreed
            assert stats.divergence == pytest.approx(rms, rel=1e-2), algorithm
        if size == 2:
            assert old[0] == pytest.approx(old[1], rel=1e-5)


def test_divergence_of_the_default_model_size_to_half_a_percent():
    # The precision docs/averaging.md states: about 2e-3 relative at a divergence of 7e-4.
    n = 1_075_320
    base = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 0.05
    starts = [base + 5e-5 * torch.randn(n, generator=torch.Generator().manual_seed(r + 1))
              for r in range(2)]

    def work(comm):
        flat = starts[comm.rank].clone()
        return average_parameters(flat, comm), flat

    (stats, average), _ = run_inproc(2, work)
    old = _old_divergence(starts[0], average)
    assert 5e-4 < old < 2e-3
    assert stats.divergence == pytest.approx(old, rel=5e-3)


def test_divergence_leaves_out_the_non_finite_rank():
    starts = [torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([3.0, 2.0, 1.0, 0.0]),
              torch.tensor([1.0, float("inf"), 1.0, 1.0])]

    def work(comm, algorithm):
        flat = starts[comm.rank].clone()
        return average_parameters(flat, comm, reduce=algorithm), flat

    for algorithm in REDUCE:
        ranks = run_inproc(3, work, algorithm)
        average = ranks[0][1]
        assert average.tolist() == [2.0, 2.0, 2.0, 2.0]
        old = _old_divergence(starts[0], average)  # ranks 0 and 1 are as far from it
        assert [s.divergence for s, _ in ranks] == pytest.approx([old, old, 0.0], rel=1e-6)


@pytest.mark.parametrize("asks", [(), (0,), (1, 2)])
def test_stop_is_agreed_by_every_algorithm(asks):
    def work(comm, algorithm):
        flat = torch.full((5,), float(comm.rank))
        return average_parameters(flat, comm, stop=comm.rank in asks, reduce=algorithm)

    for algorithm in REDUCE:
        assert [s.stop for s in run_inproc(3, work, algorithm)] == [bool(asks)] * 3, algorithm


def test_no_rank_finite_restores_the_fallback_or_raises_on_every_rank():
    def work(comm, algorithm, fallback):
        flat = torch.full((5,), float("nan"))
        try:
            stats = average_parameters(flat, comm, reduce=algorithm, fallback=fallback)
        except FloatingPointError as exc:
            return str(exc)
        return stats.dropped, flat.tolist()

    for algorithm in REDUCE:
        assert run_inproc(2, work, algorithm, torch.ones(5)) == [(2, [1.0] * 5)] * 2
        assert run_inproc(2, work, algorithm, None) == [
            "the parameters of every rank are non-finite"] * 2


def test_finite_norm_is_the_finiteness_check():
    assert finite_norm(torch.tensor([3.0, 4.0])) == (True, 25.0)
    # A square beyond float32 is not a non-finite value: the exact check says so.
    assert finite_norm(torch.full((3000,), 1e30))[0]
    for bad in (float("nan"), float("inf"), -float("inf")):
        values = torch.ones(5000)
        values[4321] = bad
        assert not finite_norm(values)[0]
        values = torch.ones(5000)
        values[17] = bad  # in a row, not the tail
        assert not finite_norm(values)[0]


ALLOCATIONS = """
import sys, json
import torch
from torch.profiler import ProfilerActivity, profile
from labavg.averaging.mean import average_parameters, finite_norm
from labavg.comm.mpi import MpiCommunicator

comm = MpiCommunicator()
flat = torch.randn(1_075_320, generator=torch.Generator().manual_seed(comm.rank))
average_parameters(flat, comm)  # warm up
flat += 0.01 * torch.randn(flat.numel(), generator=torch.Generator().manual_seed(comm.rank))
with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
    stats = average_parameters(flat, comm, stop=comm.rank == 1)
largest = max((e.cpu_memory_usage for e in prof.events()), default=0)
with open(sys.argv[1] + f"/{comm.rank}.json", "w") as out:
    json.dump({"largest": largest, "stop": stats.stop, "divergence": stats.divergence}, out)
"""


@pytest.mark.slow  # end to end: out of the fast suite's 10 minutes
def test_a_round_allocates_nothing_of_the_buffers_size(tmp_path):
    # MPICH reduces in place in the numpy view: whatever torch allocates is the round's own.
    script_path = tmp_path / "allocations.py"
    script_path.write_text(ALLOCATIONS)
    _launch(mpiexec_command(2, [str(script_path), str(tmp_path)]))
    for rank in range(2):
        seen = json.loads((tmp_path / f"{rank}.json").read_text())
        assert seen["stop"] and seen["divergence"] > 0
        # A clone would be 4.3 MB, isfinite's mask 1 MB; the row norms are 67 KB in float64.
        assert seen["largest"] < 1_075_320 * 4 // 20, seen


def _train(corpus, out, reduce=None):
    cfg = small_config(corpus, out, ranks=3, epochs=1)
    if reduce is not None:
        cfg = validate(with_overrides(cfg, {"averaging.reduce": reduce}))
    summary = run_training(cfg, progress=False)
    return summary, [final_params(out, rank) for rank in range(3)]


@pytest.mark.slow  # keeps README's fast command under 10 minutes; CI runs it
def test_ring_and_butterfly_train_like_allreduce_on_3_inproc_ranks(corpus, tmp_path):
    plain, plain_params = _train(corpus, tmp_path / "allreduce")
    ring, ring_params = _train(corpus, tmp_path / "ring", reduce="ring")
    butterfly, butterfly_params = _train(corpus, tmp_path / "butterfly", reduce="butterfly")
    assert (plain.reduce, ring.reduce, butterfly.reduce) == ("allreduce", "ring",
                                                                       "butterfly")
    assert all(torch.equal(p, ring_params[0]) for p in ring_params)
    # The ring's other roundings reach the model (it really ran), and stay roundings: the
    # accuracy on 20 k CV frames agrees to a few frames.
    assert not torch.equal(ring_params[0], plain_params[0])
    torch.testing.assert_close(ring_params[0], plain_params[0], rtol=1e-3, atol=1e-4)
    assert abs(ring.cv_frame_accuracy - plain.cv_frame_accuracy) < 1e-3
    assert abs(ring.cv_loss - plain.cv_loss) < 1e-3
    # inproc's allreduce adds in the butterfly's association: the same model, bit for bit.
    assert torch.equal(butterfly_params[0], plain_params[0])
    assert ring.bytes_sent == plain.bytes_sent


@pytest.mark.slow  # keeps README's fast command under 10 minutes; CI runs it
def test_mpi_training_with_the_reduce_flag(corpus, tmp_path):
    proc = subprocess.run(
        [PYTHON, "-m", "labavg", "train", "--data", str(corpus), "--ranks", "2", "--backend",
         "mpi", *SMALL, "--reduce", "ring", "--out", str(tmp_path / "ring")],
        capture_output=True, text=True, timeout=300, env=_env(), check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert torch.equal(final_params(tmp_path / "ring", 0), final_params(tmp_path / "ring", 1))
    assert load_summary(tmp_path / "ring").reduce == "ring"
    started = [e for e in read_events(tmp_path / "ring") if e["type"] == "run_started"]
    assert {e["reduce"] for e in started} == {"ring"} and len(started) == 2
    info = subprocess.run([PYTHON, "-m", "labavg", "info", str(tmp_path / "ring")],
                          capture_output=True, text=True, timeout=60, env=_env(), check=False)
    table = " ".join(info.stdout.split())  # without the padding that aligns the columns
    assert info.returncode == 0 and "| method | reduce |" in table
    assert "| model | ring |" in table


def test_make_averager_takes_the_setting():
    comm = InProcCommunicator(InProcGroup(1), 0)
    for method in ("model", "bmuf", "diloco"):
        cfg = with_overrides(TrainConfig(), {"averaging.method": method,
                                             "averaging.reduce": "butterfly"})
        averager = make_averager(cfg.averaging, cfg.minibatch, torch.zeros(2), comm)
        assert averager.reduce == "butterfly"
    cfg = TrainConfig()
    assert make_averager(cfg.averaging, cfg.minibatch, torch.zeros(2), comm).reduce == "allreduce"


# --- settings -----------------------------------------------------------------------------------


def test_reduce_setting_in_toml_and_default(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[averaging]\nreduce = "butterfly"\n')
    assert load_config(path).averaging.reduce == "butterfly"
    assert TrainConfig().averaging.reduce == "allreduce"  # MPI_Allreduce, as the paper averages
    with pytest.raises(UserError) as info:
        validate(with_overrides(TrainConfig(), {"averaging.reduce": "rign"}))
    assert str(info.value).endswith(
        "averaging.reduce must be one of allreduce, butterfly, ring; got 'rign'")


@pytest.mark.parametrize("how", ["flag", "toml"])
def test_cli_unknown_reduce_exits_2_with_one_line(tmp_path, how):
    if how == "flag":
        args = ["--data", str(tmp_path / "nodata"), "--reduce", "rign"]
    else:
        (tmp_path / "c.toml").write_text('[averaging]\nreduce = "rign"\n')
        args = [str(tmp_path / "c.toml"), "--data", str(tmp_path / "nodata")]
    proc = subprocess.run([PYTHON, "-m", "labavg", "train", *args, "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120, env=_env(),
                          check=False)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("labavg: error: "), lines
    assert "averaging.reduce must be one of allreduce, butterfly, ring; got 'rign'" in lines[0]
    assert not (tmp_path / "run").exists()


def test_sweep_grid_of_algorithms(tmp_path):
    from labavg.studies.sweep import load_sweep

    spec = tmp_path / "s.toml"
    spec.write_text('[base]\nranks = 2\n[grid]\n"averaging.reduce" = ["allreduce", "ring"]\n')
    assert [n for n, _ in load_sweep(spec).points()] == ["reduce_allreduce", "reduce_ring"]
    spec.write_text('[base]\nranks = 2\n[grid]\n"averaging.reduce" = ["ring", "rign"]\n')
    with pytest.raises(UserError, match="grid point reduce_rign: averaging.reduce must be one of"):
        load_sweep(spec)
