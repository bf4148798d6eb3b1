"""Overlapped averaging (labavg.averaging.overlap): the non-blocking mean on every backend, eager and
streaming rounds against hand computations, resume, training, settings.

Real inproc threads, real MPICH ranks (mpiexec), real torchrun/gloo ranks.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from labavg.averaging.methods import ALL, Averager, BMUFAverager

from labavg.averaging.factory import make_averager
from labavg.comm.inproc import run_inproc
from labavg.comm.launchers import mpiexec_command
from labavg.averaging.registry import BMUFConfig
from labavg.averaging.settings import AveragingConfig
from labavg.training.config import TrainConfig, validate
from labavg.base.settings import with_overrides
from labavg.base.errors import UserError
from labavg.averaging.overlap import OVERLAP, OverlapAverager, fragment_bounds
from labavg.jobs.index import read_events
from labavg.jobs.runs import run_training

from test_train import final_params, small_config
from support import cli_refusal, load_ranks

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
SCRIPT = REPO / "tests" / "comm_scripts" / "overlap.py"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _script():
    spec = importlib.util.spec_from_file_location("comm_overlap", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_same_bits(ranks: list[dict[str, np.ndarray]], size: int) -> None:
    for result in ranks:
        assert int(result["size"]) == size
        for name in ("32", "64"):
            np.testing.assert_array_equal(result["nonblocking" + name], result["blocking" + name])
            np.testing.assert_array_equal(result["nonblocking" + name], ranks[0]["blocking" + name])
    # and it is the mean (not, say, the rank's own buffer left alone)
    script = _script()
    expected = np.mean([script.contribution(r, np.float64) for r in range(size)], axis=0)
    np.testing.assert_allclose(ranks[0]["nonblocking64"], expected, rtol=1e-12, atol=1e-12)


# --- the non-blocking mean ----------------------------------------------------------------------


@pytest.mark.parametrize("size", [2, 3, 4])
def test_nonblocking_mean_is_the_blocking_mean_bitwise_inproc(size):
    _check_same_bits(run_inproc(size, _script().exercise), size)


@pytest.mark.slow  # end to end: out of the fast suite's 10 minutes
@pytest.mark.parametrize("size", [2, 3, 4])
def test_nonblocking_mean_is_the_blocking_mean_bitwise_on_mpich(size, tmp_path):
    proc = subprocess.run(mpiexec_command(size, [str(SCRIPT), "mpi", str(tmp_path)]),
                          capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    mpi = load_ranks(tmp_path, size)
    _check_same_bits(mpi, size)
    # and the same bits as the inproc backend, which reproduces MPICH's summation order
    inproc = run_inproc(size, _script().exercise)
    np.testing.assert_array_equal(mpi[0]["nonblocking32"], inproc[0]["nonblocking32"])


# 3 torchrun ranks take the same path as 2 with a third process on 2 cores: slow suite.
@pytest.mark.parametrize("size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_nonblocking_mean_is_the_blocking_mean_bitwise_on_torchrun(size, tmp_path):
    torchrun = Path(PYTHON).parent / "torchrun"
    proc = subprocess.run(
        [str(torchrun), "--nproc-per-node", str(size), "--master-addr", "127.0.0.1",
         "--master-port", str(29700 + (os.getpid() + size) % 1000), str(SCRIPT), "torch",
         str(tmp_path)], capture_output=True, text=True, timeout=180, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_same_bits(load_ranks(tmp_path, size), size)


def test_the_watchdog_wrapper_forwards_the_nonblocking_mean():
    from labavg.comm.watchdog import Watchdog, WatchedCommunicator

    def work(comm):
        watched = WatchedCommunicator(comm, Watchdog(comm, 60.0))
        return _script().exercise(watched)

    _check_same_bits(run_inproc(3, work), 3)


# --- eager rounds against a hand computation ------------------------------------------------------


def _overlapped(size, blocks, make_inner=Averager, sizes=None, fragments=1, scopes=None):
    """Every rank's parameters after each round: each rank adds blocks[t][rank] to its model
    before round t (scope OVERLAP unless `scopes` says ALL)."""
    n = blocks[0][0].numel()
    sizes = sizes or [n]

    def work(comm):
        flat = torch.zeros(n)
        bounds = fragment_bounds(sizes, fragments)
        averager = OverlapAverager([make_inner(flat[a:b], comm) for a, b in bounds], bounds,
                                   comm, "eager" if fragments == 1 else "streaming")
        seen, stats = [], []
        for t, block in enumerate(blocks):
            flat += block[comm.rank]
            stats.append(averager.round(flat, scope=(scopes or {}).get(t, OVERLAP)))
            seen.append(flat.clone())
        return seen, stats

    return run_inproc(size, work)


def _progress(size, rounds, n=3):
    # Rank r moves by (r + 1) (t + 1) [1, 2, 3, ...] before round t: distinct per rank and round.
    return [[torch.arange(1.0, n + 1) * (r + 1) * (t + 1) for r in range(size)]
            for t in range(rounds)]


@pytest.mark.parametrize("size", [2, 3])
def test_eager_rounds_take_the_delayed_mean_plus_own_progress(size):
    blocks = _progress(size, 4)
    ranks = _overlapped(size, blocks)
    # By hand, in float64: W <- mean(S_{t-1}) + (W - S_{t-1}); the first round has no mean yet.
    w = [torch.zeros(3, dtype=torch.float64) for _ in range(size)]
    snap = None
    for t, block in enumerate(blocks):
        for r in range(size):
            w[r] = w[r] + block[r].double()
        if snap is not None:
            mean = torch.stack(snap).mean(0)
            w = [mean + (w[r] - snap[r]) for r in range(size)]
        snap = [x.clone() for x in w]
        for r in range(size):
            torch.testing.assert_close(ranks[r][0][t].double(), w[r], rtol=0, atol=1e-5)
    # ranks differ between rounds by their own progress only
    assert not torch.equal(ranks[0][0][-1], ranks[1][0][-1])
    # round 0 sent the whole buffer without waiting; later rounds waited for one mean each
    stats = ranks[0][1]
    assert all(s.bytes_sent == 12 and s.overlap_bytes == 12 for s in stats)
    assert stats[0].wait_seconds == 0.0 and all(s.in_flight_seconds > 0 for s in stats[1:])


def test_eager_bmuf_filters_the_delayed_block():
    # Two ranks, BMUF with η = 0.5, ζ = 1, Nesterov. Round 0 snapshots S_0 = [1], [3]
    # (no mean yet). Round 1: the ranks moved on to 1 + 1 = 2 and 3 + 3 = 6; S̄_0 = 2,
    # G = 2 - 0 = 2, Δ = 2, W = 2, W_g = W + η Δ = 3; rank 0: 3 + (2 - 1) = 4,
    # rank 1: 3 + (6 - 3) = 6.
    blocks = [[torch.tensor([1.0]), torch.tensor([3.0])],
              [torch.tensor([1.0]), torch.tensor([3.0])]]
    config = BMUFConfig(momentum=0.5, block_lr=1.0, nesterov=True)
    ranks = _overlapped(2, blocks, lambda f, c: BMUFAverager(f, c, config=config))
    assert [ranks[r][0][1].item() for r in range(2)] == [4.0, 6.0]


@pytest.mark.parametrize("size", [2, 3])
def test_an_epoch_end_round_finishes_the_mean_and_averages_everything(size):
    blocks = _progress(size, 4)
    ranks = _overlapped(size, blocks, scopes={3: ALL})
    final = [ranks[r][0][3] for r in range(size)]
    assert all(torch.equal(f, final[0]) for f in final)
    # = the blocking mean of (delayed mean of round 2's snapshots + own progress)
    before = [ranks[r][0][2] + blocks[3][r] for r in range(size)]
    snaps = [ranks[r][0][2] for r in range(size)]
    mean2 = torch.stack([s.double() for s in snaps]).mean(0)
    expected = torch.stack([mean2 + (b.double() - s.double()) for b, s in zip(before, snaps)]).mean(0)
    torch.testing.assert_close(final[0].double(), expected, rtol=0, atol=1e-5)
    assert ranks[0][1][3].overlap_bytes == 0 and ranks[0][1][3].bytes_sent == 12


def test_a_rank_that_diverges_is_left_out_and_restarts_from_the_global_model():
    def work(comm):
        flat = torch.zeros(2)
        averager = OverlapAverager([Averager(flat, comm)], [(0, 2)], comm, "eager")
        flat += torch.tensor([1.0, 1.0]) * (comm.rank + 1)
        averager.round(flat)  # S_0 = [1, 1], [2, 2], [3, 3]
        flat += 1.0
        if comm.rank == 1:
            flat[0] = float("nan")  # diverges while the mean is in flight
        first = averager.round(flat)  # merge: 2 + own progress; rank 1 restarts from 2
        after = flat.clone()
        flat += 1.0
        second = averager.round(flat)  # rank 1 was left out of the mean started in `first`
        return first, after, second, flat.clone()

    ranks = run_inproc(3, work)
    assert [r[0].finite for r in ranks] == [True, False, True]
    assert ranks[0][0].dropped == 1
    assert ranks[1][1].tolist() == [2.0, 2.0]  # the delayed mean, none of its own progress
    assert ranks[0][1].tolist() == [3.0, 3.0]
    # the second mean is over ranks 0 and 2 only, (3 + 3) / 2 = 3 (with rank 1's snapshot it
    # would be 8 / 3), plus each rank's progress of 1
    assert [r[3].tolist() for r in ranks] == [[4.0, 4.0], [4.0, 4.0], [4.0, 4.0]]


# --- streaming --------------------------------------------------------------------------------


def test_fragments_are_contiguous_whole_tensors_near_equal_shares():
    assert fragment_bounds([10, 2, 10, 2], 2) == [(0, 12), (12, 24)]
    assert fragment_bounds([5, 5, 5, 5, 5], 3) == [(0, 10), (10, 15), (15, 25)]
    assert fragment_bounds([100, 1, 1, 1], 4) == [(0, 100), (100, 101), (101, 102), (102, 103)]
    assert fragment_bounds([7], 1) == [(0, 7)]
    with pytest.raises(ValueError):
        fragment_bounds([1, 2], 3)


def test_streaming_syncs_each_fragment_once_in_p_rounds():
    size, sizes, fragments = 2, [2, 1, 3, 2], 3
    bounds = fragment_bounds(sizes, fragments)
    assert bounds == [(0, 3), (3, 6), (6, 8)]  # cuts nearest 8/3 and 16/3
    blocks = _progress(size, 7, n=8)
    ranks = _overlapped(size, blocks, sizes=sizes, fragments=fragments)
    stats = ranks[0][1]
    # round t starts fragment t mod P: bytes are that fragment's
    assert [s.bytes_sent for s in stats] == [4 * (b - a) for a, b in
                                             (bounds[t % fragments] for t in range(7))]
    # by hand: round t merges fragment (t-1) mod P (delayed mean + own progress) and leaves
    # the others alone
    w = [torch.zeros(8, dtype=torch.float64) for _ in range(size)]
    pending = None
    synced = []
    for t, block in enumerate(blocks):
        for r in range(size):
            w[r] = w[r] + block[r].double()
        if pending is not None:
            (a, b), snap = pending
            mean = torch.stack(snap).mean(0)
            for r in range(size):
                w[r][a:b] = mean + (w[r][a:b] - snap[r])
            synced.append((a, b))
        a, b = bounds[t % fragments]
        pending = ((a, b), [x[a:b].clone() for x in w])
        for r in range(size):
            torch.testing.assert_close(ranks[r][0][t].double(), w[r], rtol=0, atol=1e-4)
    assert sorted(synced[:fragments]) == bounds  # after P merges, every fragment once


# --- training ---------------------------------------------------------------------------------


def _config(corpus, out, averaging=None, **changes):
    """small_config with `averaging`'s settings (dotted keys) on top of its own."""
    return validate(with_overrides(small_config(corpus, out, **changes), averaging or {}))


def _run(corpus, out, averaging=None, **changes):
    cfg = _config(corpus, out, averaging, **changes)
    return cfg, run_training(cfg, progress=False)


def test_overlap_none_trains_the_blocking_run_bit_for_bit(corpus, tmp_path):
    _, plain = _run(corpus, tmp_path / "plain", epochs=1)
    _, none = _run(corpus, tmp_path / "none", {"averaging.overlap": "none",
                                               "averaging.streaming_fragments": 2}, epochs=1)
    assert torch.equal(final_params(tmp_path / "plain"), final_params(tmp_path / "none"))
    assert none.overlap == "none" and none.comm_hidden_fraction is None
    assert none.overlap_bytes_sent == 0 and none.bytes_sent == plain.bytes_sent
    cfg = TrainConfig()
    assert type(make_averager(cfg.averaging, cfg.minibatch, torch.zeros(4), None)) is Averager


def test_overlap_averager_describes_its_fragments():
    """RunStarted's overlap and fragment bytes come from describe()."""
    cfg = TrainConfig(ranks=2, averaging=AveragingConfig(method="diloco", overlap="streaming",
                                                         streaming_fragments=2))

    def work(comm):
        flat = torch.zeros(10)
        averager = make_averager(cfg.averaging, cfg.minibatch, flat, comm, sizes=[4, 6])
        return averager.describe(flat)

    info = run_inproc(2, work)[0]
    assert (info.averaging, info.payload, info.overlap) == ("diloco", "fp32", "streaming")
    assert (info.bytes_per_round, info.fragment_bytes) == (40, (16, 24))
    assert (info.hierarchy_every, info.node_ranks) == (0, 0)


@pytest.mark.slow  # keeps README's fast command under 10 minutes; CI runs it
@pytest.mark.parametrize("overlap, fragments", [("eager", 1), ("streaming", 3)])
def test_overlapped_training_is_close_to_blocking_and_counts_true_bytes(corpus, tmp_path,
                                                                        overlap, fragments):
    _, blocking = _run(corpus, tmp_path / "blocking")
    cfg, summary = _run(corpus, tmp_path / overlap, {"averaging.overlap": overlap,
                                                     "averaging.streaming_fragments": fragments})
    # Measured here: 0.071 CV frame accuracy for none, eager and streaming (2 epochs of the
    # tiny corpus); a delayed round may cost a little, the test allows 3 points.
    assert abs(summary.cv_frame_accuracy - blocking.cv_frame_accuracy) <= 0.03
    for rank in range(1, cfg.ranks):  # every epoch ends with the same model on every rank
        assert torch.equal(final_params(tmp_path / overlap, rank), final_params(tmp_path / overlap))
    rounds = [e for e in read_events(tmp_path / overlap) if e["type"] == "average"
              and e["rank"] == 0]
    frag = summary.fragment_bytes
    assert len(frag) == fragments and sum(frag) == 4 * summary.num_params
    overlapped = [e for e in rounds if e["scope"] == OVERLAP]
    full = [e for e in rounds if e["scope"] == "all"]
    assert len(full) == cfg.epochs and {e["bytes_sent"] for e in full} == {4 * summary.num_params}
    # the overlapped rounds cycle through the fragments (restarting nowhere: one count per run)
    assert [e["bytes_sent"] for e in overlapped] == [frag[i % fragments]
                                                     for i in range(len(overlapped))]
    assert summary.overlap_bytes_sent == sum(e["bytes_sent"] for e in overlapped)
    assert summary.bytes_sent == sum(e["bytes_sent"] for e in rounds)
    assert isinstance(summary.comm_hidden_fraction, float)
    assert summary.comm_wait_seconds <= summary.comm_seconds


@pytest.mark.slow  # keeps README's fast command under 10 minutes; CI runs it
@pytest.mark.parametrize("overlap, method", [("eager", "model"), ("streaming", "bmuf")])
def test_stopped_and_resumed_overlap_run_matches_uninterrupted(corpus, tmp_path, overlap, method):
    changes = {"averaging.overlap": overlap, "averaging.method": method,
               "averaging.streaming_fragments": 3, "averaging.bmuf.momentum": 0.5}
    full = _config(corpus, tmp_path / "full", changes)
    summary = run_training(full, progress=False)
    cfg = _config(corpus, tmp_path / "run", changes)
    flag = threading.Event()

    def on_event(event):
        if getattr(event, "step", 0) >= 7:  # after a mid-epoch checkpoint, a mean in flight
            flag.set()

    stopped = run_training(cfg, progress=False, on_event=on_event, should_stop=flag.is_set)
    assert stopped.stopped is True and 0 < stopped.steps < summary.steps
    (tmp_path / "run" / "summary.json").unlink()
    resumed = run_training(cfg, resume=True, progress=False)
    for rank in range(cfg.ranks):
        assert torch.equal(final_params(tmp_path / "run", rank), final_params(tmp_path / "full", rank))
    assert resumed.bytes_sent == summary.bytes_sent
    assert resumed.overlap_bytes_sent == summary.overlap_bytes_sent


# --- settings ---------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, named", [
    ({"averaging.overlap": "eagr"},
     "averaging.overlap must be one of none, eager, streaming; got 'eagr'"),
    ({"averaging.overlap": "streaming", "averaging.streaming_fragments": 0},
     "averaging.streaming_fragments must be positive"),
    ({"averaging.overlap": "streaming", "averaging.streaming_fragments": 11,
      "model.hidden_layers": 4},
     "averaging.streaming_fragments = 11 exceeds the 10 parameter tensors"),
    ({"averaging.overlap": "eager", "averaging.hierarchy.across_nodes_every": 20,
      "averaging.hierarchy.node_size": 1},
     "averaging.overlap = eager does not combine with "
     "averaging.hierarchy.across_nodes_every > 0 yet"),
    ({"averaging.overlap": "streaming", "averaging.reduce": "ring"},
     "averaging.overlap = streaming needs reduce = allreduce"),
    ({"averaging.overlap": "eager", "averaging.payload": "int"},
     "averaging.overlap = eager does not combine with payload = 'int' yet"),
])
def test_bad_overlap_settings_are_refused_in_one_line(overrides, named):
    with pytest.raises(UserError) as info:
        validate(with_overrides(TrainConfig(), overrides))
    assert named in str(info.value) and "\n" not in str(info.value)


def test_fragments_up_to_the_tensors_and_other_methods_are_accepted():
    for method in ("model", "bmuf", "diloco"):
        validate(with_overrides(TrainConfig(), {"averaging.overlap": "streaming",
                                                "averaging.method": method,
                                                "averaging.streaming_fragments": 10}))


@pytest.mark.parametrize("args, named", [
    (["--overlap", "eagr"], "averaging.overlap must be one of none, eager, streaming; got 'eagr'"),
    (["--overlap", "streaming", "--hidden-layers", "1", "--set",
      "averaging.streaming_fragments=5"],
     "averaging.streaming_fragments = 5 exceeds the 4 parameter tensors"),
    (["--overlap", "eager", "--set", "averaging.hierarchy.across_nodes_every=20", "--set",
      "averaging.hierarchy.node_size=1"],
     "averaging.overlap = eager does not combine with "
     "averaging.hierarchy.across_nodes_every > 0 yet"),
    (["--overlap", "eager", "--reduce", "butterfly"],
     "averaging.overlap = eager needs reduce = allreduce"),
    (["--overlap", "streaming", "--payload", "bf16"],
     "averaging.overlap = streaming does not combine with payload = 'bf16' yet"),
])
def test_cli_bad_overlap_settings_exit_2_with_one_line(tmp_path, args, named):
    assert named in cli_refusal(tmp_path, args)
