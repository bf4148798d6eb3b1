"""Hierarchical averaging ([averaging.hierarchy], labavg.averaging.hierarchy.HierarchicalAverager):
node rounds every K minibatches, the method's round across all ranks every K2 (its
across_nodes_every); the communicators' `split`.

Real inproc threads, real MPICH ranks (mpiexec started by the CLI), real torchrun/gloo ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from labavg.base import checkpoint
from labavg.averaging.methods import ALL, NODE, Averager, BMUFAverager
from labavg.averaging.hierarchy import HierarchicalAverager, node_communicator
from labavg.averaging.factory import make_averager
from labavg.comm.buffers import split_members
from labavg.comm.inproc import run_inproc
from labavg.comm.inproc_group import tree_sum
from labavg.averaging.registry import BMUFConfig
from labavg.averaging.settings import AveragingConfig, HierarchyConfig
from labavg.training.config import TrainConfig, validate
from labavg.base.settings import with_overrides
from labavg.data.dataset import open_dataset
from labavg.base.errors import UserError
from labavg.base.events import CheckpointSaved
from labavg.jobs.index import read_events
from labavg.jobs.summary import load_summary
from labavg.training.runner import train

from test_train import SMALL, final_params, small_config
from support import cli_refusal

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
U = 2.0**-24  # float32's unit roundoff
# A run's flags for rounds across nodes every 6 minibatches, and nodes of 2 ranks.
ACROSS_6 = ["--set", "averaging.hierarchy.across_nodes_every=6"]
NODES_OF_2 = ["--set", "averaging.hierarchy.node_size=2"]
MINIBATCH = TrainConfig().minibatch  # counts only for averaging.average_every_frames


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _cli(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "labavg", *args], capture_output=True, text=True,
                          timeout=timeout, env=_env())


def _start(rank: int, n: int = 1001) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(100 + rank)) * (1 + rank)


# --- the communicators' split ---------------------------------------------------------------


def test_split_members_number_ranks_as_mpi_comm_split():
    # colors 1, 0, 1, 0, 1 with keys that reverse rank 4 and rank 0 in color 1
    pairs = [(1, 5), (0, 0), (1, 1), (0, 0), (1, 0)]
    assert split_members(pairs) == [[1, 3], [4, 2, 0]]


def test_inproc_split_groups_ranks_and_reduces_within_them():
    def work(comm):
        node = comm.split(comm.rank % 2, -comm.rank)
        buf = torch.tensor([float(comm.rank)])
        node.allreduce_mean(buf)
        return node.size, node.rank, buf.item()

    got = run_inproc(5, work)
    # color 0: ranks 0, 2, 4 ordered by key -rank: 4, 2, 0; color 1: ranks 3, 1
    assert got == [(3, 2, 2.0), (2, 1, 2.0), (3, 1, 2.0), (2, 0, 2.0), (3, 0, 2.0)]


def test_a_failed_rank_releases_the_ranks_waiting_in_a_split_group():
    def work(comm):
        node = comm.split(comm.rank // 2)
        if comm.rank == 1:
            raise RuntimeError("rank 1 broke")
        node.allreduce_mean(torch.zeros(3))  # rank 0 waits for rank 1 here

    with pytest.raises(Exception) as info:
        run_inproc(4, work)
    assert "rank 1 broke" in str(info.value)


# Bitwise equal when the nodes are MPICH's first pairs (node size 2) or pairs of pairs (4):
# a power-of-two node's mean is its sum scaled exactly, in the association the world sum uses.
@pytest.mark.parametrize("size, node_size, same_bits", [(8, 2, True), (6, 2, True), (8, 4, True),
                                                        (6, 3, False), (9, 3, False)])
def test_node_means_then_their_mean_is_the_global_mean_within_rounding(size, node_size, same_bits):

    def work(comm):
        x = _start(comm.rank)
        node = comm.split(comm.rank // node_size, comm.rank)
        across = comm.split(comm.rank % node_size, comm.rank)  # the same rank on every node
        two_level = x.clone()
        node.allreduce_mean(two_level)
        across.allreduce_mean(two_level)
        flat = x.clone()
        comm.allreduce_mean(flat)
        return two_level, flat

    got = run_inproc(size, work)
    xs = torch.stack([_start(r) for r in range(size)]).double()
    exact = xs.mean(0)
    # Any association of N float32 terms is within (N - 1) u sum|x_i| of the exact sum
    # (Higham 2002, eq. 4.4), plus the roundings of the divisions.
    bound = (size + 1) * U * xs.abs().sum(0) / size
    for two_level, flat in got:
        assert torch.equal(two_level, got[0][0]) and torch.equal(flat, got[0][1])
        assert ((two_level.double() - exact).abs() <= bound).all()
        assert ((flat.double() - exact).abs() <= bound).all()
    assert torch.equal(got[0][0], got[0][1]) == same_bits


# --- one averager's rounds ------------------------------------------------------------------


def _hierarchical(comm, flat, inner_cls=Averager, **kw):
    return HierarchicalAverager(inner_cls(flat, comm, 2, **kw), node_communicator(comm, 2), 4)


def test_node_rounds_agree_within_nodes_and_all_rounds_everywhere():
    def work(comm):
        flat = torch.zeros(7)
        averager = _hierarchical(comm, flat)
        scopes = [averager.due(s, False) for s in range(1, 9)] + [averager.due(3, True)]
        flat += _start(comm.rank, 7)
        node_stats = averager.round(flat, scope=NODE)
        after_node = flat.clone()
        flat += _start(10 + comm.rank, 7)
        all_stats = averager.round(flat, scope=ALL)
        return scopes, node_stats.bytes_sent, after_node, all_stats.bytes_sent, flat.clone()

    got = run_inproc(4, work)
    assert got[0][0] == [None, NODE, None, ALL, None, NODE, None, ALL, ALL]
    assert all(r[1] == r[3] == 7 * 4 for r in got)
    nodes = [r[2] for r in got]
    assert torch.equal(nodes[0], nodes[1]) and torch.equal(nodes[2], nodes[3])
    assert not torch.equal(nodes[0], nodes[2])
    assert torch.equal(nodes[0], tree_sum([_start(0, 7), _start(1, 7)]).div_(2))
    # The all round: every rank the mean of all four, the node rounds' averages included.
    assert all(torch.equal(r[4], got[0][4]) for r in got)
    moved = [nodes[r] + _start(10 + r, 7) for r in range(4)]
    assert torch.equal(got[0][4], tree_sum(moved).div_(4))


def test_a_stop_asked_in_a_node_round_waits_for_the_next_all_round():
    def work(comm):
        flat = torch.zeros(3)
        averager = _hierarchical(comm, flat)
        first = averager.round(flat, stop=comm.rank == 3, scope=NODE).stop
        second = averager.round(flat, scope=ALL).stop
        third = averager.round(flat, scope=ALL).stop
        return first, second, third

    assert run_inproc(4, work) == [(False, True, False)] * 4


def test_the_outer_step_happens_at_all_rounds_only():
    # BMUF with η = 0.5: a node round is a plain mean (Δ untouched), and the all round's G is
    # the change since the last all round, over the whole K2 block.
    config = BMUFConfig(momentum=0.5, block_lr=1.0, nesterov=False)

    def work(comm):
        flat = torch.zeros(2)
        averager = _hierarchical(comm, flat, BMUFAverager, config=config)
        flat += torch.tensor([float(comm.rank), 1.0])
        averager.round(flat, scope=NODE)
        delta_after_node = averager.inner.delta.clone()
        flat += torch.tensor([1.0, float(comm.rank)])
        averager.round(flat, scope=ALL)
        return delta_after_node, averager.inner.delta.clone(), flat.clone()

    for delta_node, delta, flat in run_inproc(4, work):
        assert torch.equal(delta_node, torch.zeros(2))
        # average of [r + 1, 1 + r] over r = 0..3: [2.5, 2.5]; G = Δ = that; CBM: W = W̄.
        assert delta.tolist() == [2.5, 2.5] and flat.tolist() == [2.5, 2.5]


# --- training -------------------------------------------------------------------------------


def _trained(cfg: TrainConfig) -> list[torch.Tensor]:
    list(train(cfg, open_dataset(cfg.data.data), Path(cfg.out)))
    return [final_params(Path(cfg.out), rank) for rank in range(cfg.ranks)]


def _config(corpus, out, averaging=None, **changes) -> TrainConfig:
    """small_config with `averaging`'s settings (dotted keys) on top of its own."""
    return validate(with_overrides(small_config(corpus, out, **changes), averaging or {}))


def _hierarchy(across_nodes_every: int, node_size: int) -> dict[str, int]:
    return {"averaging.hierarchy.across_nodes_every": across_nodes_every,
            "averaging.hierarchy.node_size": node_size}


@pytest.mark.slow  # end to end: out of the fast suite's 10 minutes
def test_hierarchy_every_k_and_off_train_the_flat_run_bit_for_bit(corpus, tmp_path):
    def trained(name, averaging=None):
        return _trained(_config(corpus, tmp_path / name, averaging, ranks=4, epochs=1))

    flat = trained("flat")
    assert all(torch.equal(p, flat[0]) for p in flat)
    every_k = trained("every-k", _hierarchy(3, 2))
    off = trained("off", _hierarchy(0, 2))
    one_node = trained("one-node", _hierarchy(6, 4))
    two_nodes = trained("two-nodes", _hierarchy(6, 2))
    for same in (every_k, off, one_node):
        assert all(torch.equal(p, flat[0]) for p in same)
    # Two nodes averaging among themselves in between train another model (the same on all
    # ranks at the end: the epoch ends with an all round).
    assert all(torch.equal(p, two_nodes[0]) for p in two_nodes)
    assert not torch.equal(two_nodes[0], flat[0])


def _until_checkpoint(cfg: TrainConfig, step: int) -> None:
    """Train until the checkpoint of `step` is on disk, then drop the run (a crash)."""
    events = train(cfg, open_dataset(cfg.data.data), Path(cfg.out))
    for event in events:
        if isinstance(event, CheckpointSaved) and event.step == step:
            break
    events.close()


@pytest.mark.slow  # keeps README's fast command under 10 minutes; CI runs it
def test_bmuf_run_resumed_after_a_node_round_matches_uninterrupted(corpus, tmp_path):
    # K = 3, K2 = 9, a checkpoint every 2 rounds: the first is at step 6, after a node round.
    changes = {"averaging.method": "bmuf", "averaging.bmuf.momentum": 0.5, **_hierarchy(9, 2)}
    full = _trained(_config(corpus, tmp_path / "full", changes, ranks=4))
    cfg = _config(corpus, tmp_path / "run", changes, ranks=4)
    _until_checkpoint(cfg, 6)
    assert checkpoint.latest_step(tmp_path / "run") == (6, 4)
    saved = [checkpoint.load_rank_state(tmp_path / "run", 6, r) for r in range(4)]
    params = [s["params"] for s in saved]
    assert torch.equal(params[0], params[1]) and not torch.equal(params[0], params[2])
    # The outer step starts from the global model of the last all round, not the node's.
    assert torch.equal(saved[0]["averager"]["hierarchy_global"],
                       saved[3]["averager"]["hierarchy_global"])
    assert not torch.equal(saved[0]["averager"]["hierarchy_global"], params[0])
    list(train(cfg, open_dataset(cfg.data.data), tmp_path / "run", resume=True))
    for rank in range(4):
        assert torch.equal(final_params(tmp_path / "run", rank), full[rank]), rank


def test_events_and_summary_count_each_scope(corpus, tmp_path):
    out = tmp_path / "run"
    proc = _cli("train", "--data", str(corpus), "--ranks", "4", *SMALL, "--out", str(out),
                *ACROSS_6, *NODES_OF_2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = load_summary(out)
    rounds = [e for e in read_events(out) if e["type"] == "average" and e["rank"] == 0]
    steps = summary.steps
    assert [(e["step"], e["scope"]) for e in rounds] == [
        (s, "all" if s % 6 == 0 or s == steps else "node")
        for s in sorted({*range(3, steps + 1, 3), steps})]
    node = [e for e in rounds if e["scope"] == "node"]
    assert summary.node_rounds == len(node) and summary.all_rounds == len(rounds) - len(node)
    assert summary.node_bytes_sent == len(node) * summary.bytes_per_round
    assert summary.all_bytes_sent == summary.all_rounds * summary.bytes_per_round
    assert summary.bytes_sent == summary.node_bytes_sent + summary.all_bytes_sent
    assert (summary.hierarchy_every, summary.node_ranks) == (6, 2)


@pytest.mark.slow  # keeps README's fast command under 10 minutes; CI runs it
def test_a_lossy_payload_goes_across_nodes_and_node_rounds_send_fp32(corpus, tmp_path):
    from labavg.averaging.payload import payload_bytes

    out = tmp_path / "run"
    proc = _cli("train", "--data", str(corpus), "--ranks", "4", *SMALL, "--out", str(out),
                "--averaging", "bmuf", "--payload", "int", "--payload-bits", "8",
                *ACROSS_6, *NODES_OF_2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = load_summary(out)
    n = summary.num_params
    assert summary.payload == "int8"
    assert summary.bytes_per_round == payload_bytes(n, "int", 8) < 4 * n
    assert summary.node_bytes_sent == summary.node_rounds * 4 * n > 0
    assert summary.all_bytes_sent == summary.all_rounds * summary.bytes_per_round
    params = [final_params(out, rank) for rank in range(4)]
    assert all(torch.equal(p, params[0]) for p in params)  # the last round is across all ranks
    assert 0.0 < summary.cv_frame_accuracy <= 1.0


# --- bad settings ---------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, named", [
    (_hierarchy(25, 2), "averaging.hierarchy.across_nodes_every = 25 is not a multiple of "
     "averaging.average_every = 10"),
    ({**_hierarchy(20, 3), "ranks": 4},
     "averaging.hierarchy.node_size = 3 does not divide the 4 ranks"),
    ({"averaging.hierarchy.across_nodes_every": 20},
     "averaging.hierarchy.node_size = 0 (the hosts' shared-memory groups) cannot"),
    ({"averaging.hierarchy.across_nodes_every": -1},
     "averaging.hierarchy.across_nodes_every must be >= 0; got -1"),
    ({**_hierarchy(3, 1), "averaging.average_every_frames": 512, "minibatch": 256},
     "averaging.hierarchy.across_nodes_every = 3 is not a multiple of K = 2 "
     "(averaging.average_every_frames = 512)"),
])
def test_bad_hierarchy_settings_are_refused_in_one_line(overrides, named):
    with pytest.raises(UserError) as info:
        validate(with_overrides(TrainConfig(), overrides))
    assert named in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("args, named", [
    (["--set", "averaging.hierarchy.across_nodes_every=25"],
     "averaging.hierarchy.across_nodes_every = 25 is not a multiple of "
     "averaging.average_every = 10"),
    (["--ranks", "4", "--set", "averaging.hierarchy.across_nodes_every=20",
      "--set", "averaging.hierarchy.node_size=3"],
     "averaging.hierarchy.node_size = 3 does not divide the 4 ranks"),
    (["--ranks", "4", "--set", "averaging.hierarchy.across_nodes_every=20"],
     "averaging.hierarchy.node_size = 0"),
    (["--backend", "mpi", "--ranks", "3", "--set", "averaging.hierarchy.across_nodes_every=20",
      "--set", "averaging.hierarchy.node_size=2"],
     "averaging.hierarchy.node_size = 2 does not divide the 3 ranks"),
])
def test_cli_bad_hierarchy_settings_exit_2_with_one_line(tmp_path, args, named):
    assert named in cli_refusal(tmp_path, args)


def test_make_averager_wraps_only_with_a_hierarchy():
    def work(comm):
        flat = torch.zeros(4)
        plain = make_averager(AveragingConfig(), MINIBATCH, flat, comm)
        plan = AveragingConfig(average_every=5, hierarchy=HierarchyConfig(20, 2))
        hier = make_averager(plan, MINIBATCH, flat, comm)
        return type(plain), type(hier), hier.node.size, hier.average_every, hier.across_nodes_every

    assert run_inproc(4, work) == [(Averager, HierarchicalAverager, 2, 5, 20)] * 4


def test_averagers_describe_what_the_run_reports():
    """RunStarted's averaging fields come from describe(), the hierarchy's included."""
    def work(comm):
        flat = torch.zeros(10)
        int4 = AveragingConfig(payload="int", payload_bits=4, error_feedback=False)
        plan = AveragingConfig(method="bmuf", average_every=5, hierarchy=HierarchyConfig(20, 2))
        return (make_averager(int4, MINIBATCH, flat, comm).describe(flat),
                make_averager(plan, MINIBATCH, flat, comm).describe(flat))

    plain, hier = run_inproc(4, work)[0]
    assert (plain.averaging, plain.payload, plain.hierarchy_every, plain.node_ranks) == (
        "model", "int4", 0, 0)
    assert 0 < plain.bytes_per_round < 40  # four bits a value and the chunks' scales
    assert (hier.averaging, hier.payload, hier.bytes_per_round) == ("bmuf", "fp32", 40)
    assert (hier.hierarchy_every, hier.node_ranks, hier.overlap) == (20, 2, "none")


# --- process backends -----------------------------------------------------------------------


@pytest.mark.slow
def test_mpi_ranks_by_node_size_and_by_shared_memory(corpus, tmp_path):
    common = ["train", "--data", str(corpus), "--ranks", "4", *SMALL]
    runs = {
        "flat-mpi": ["--backend", "mpi"],
        "two-mpi": ["--backend", "mpi", *ACROSS_6, *NODES_OF_2],
        # One host: its shared memory holds all 4 ranks, one node.
        "host-mpi": ["--backend", "mpi", *ACROSS_6],
        "two-inproc": [*ACROSS_6, *NODES_OF_2],
    }
    for name, flags in runs.items():
        proc = _cli(*common, *flags, "--out", str(tmp_path / name))
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
    assert load_summary(tmp_path / "two-mpi").node_ranks == 2
    assert load_summary(tmp_path / "host-mpi").node_ranks == 4
    node_rounds = {e["rank"] for e in read_events(tmp_path / "host-mpi")
                   if e["type"] == "average" and e["scope"] == "node"}
    assert node_rounds == {0, 1, 2, 3}
    # One node: the node rounds are means over every rank, so plain averaging is the flat run.
    assert torch.equal(final_params(tmp_path / "host-mpi"), final_params(tmp_path / "flat-mpi"))
    torch.testing.assert_close(final_params(tmp_path / "two-mpi"),
                               final_params(tmp_path / "two-inproc"), rtol=1e-5, atol=1e-6)
    assert not torch.equal(final_params(tmp_path / "two-mpi"), final_params(tmp_path / "flat-mpi"))


@pytest.mark.slow
def test_torchrun_ranks_by_node_size_and_by_node(corpus, tmp_path):
    torchrun = Path(PYTHON).parent / "torchrun"
    common = ["--data", str(corpus), "--ranks", "4", "--backend", "torch", *SMALL, *ACROSS_6]
    for i, (name, flags) in enumerate((("two", NODES_OF_2), ("node", []))):
        proc = subprocess.run(
            [str(torchrun), "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
             "--master-port", str(29700 + (os.getpid() + i) % 1000), "-m", "labavg", "train",
             *common, *flags, "--out", str(tmp_path / name)],
            capture_output=True, text=True, timeout=300, env=_env())
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
    inproc = _cli("train", "--data", str(corpus), "--ranks", "4", *SMALL, *ACROSS_6, *NODES_OF_2,
                  "--out", str(tmp_path / "inproc"))
    assert inproc.returncode == 0, inproc.stderr[-3000:]
    assert load_summary(tmp_path / "two").node_ranks == 2
    assert load_summary(tmp_path / "node").node_ranks == 4  # torchrun's one node
    torch.testing.assert_close(final_params(tmp_path / "two"), final_params(tmp_path / "inproc"),
                               rtol=1e-5, atol=1e-6)
