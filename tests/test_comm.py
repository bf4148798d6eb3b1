"""Communicator backends: inproc threads, real mpiexec (MPICH) and torchrun (gloo) runs."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from labavg.comm.inproc import RankFailed, iterate_inproc, run_inproc
from labavg.comm.inproc_group import CollectiveMismatch, GroupAborted, tree_sum
from labavg.comm.devices import select_device
from labavg.comm.launchers import detect_launcher, find_mpiexec, mpiexec_command
from labavg.comm.world import open_communicator
from labavg.base.errors import UserError
from support import free_port as _free_port, launch, load_ranks as _load_ranks, load_script

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "comm_scripts" / "collectives.py"
LAUNCH_TIMEOUT_S = 60


collectives = load_script(SCRIPT, "comm_collectives")


def _launch(command: list[str]) -> None:
    launch(command, LAUNCH_TIMEOUT_S)


def _inproc_results(size: int, tmp_path: Path) -> list[dict[str, np.ndarray]]:
    """The helper's checks run as `size` threads."""
    markers = tmp_path / f"inproc{size}"
    markers.mkdir(parents=True)
    return run_inproc(size, collectives.exercise, markers)


def _check_ranks(ranks: list[dict[str, np.ndarray]], size: int) -> None:
    """Results every backend must produce: identical means, the right broadcast, a real barrier."""
    contributions32 = [collectives.contribution(r) for r in range(size)]
    contributions64 = [collectives.contribution(r, np.float64) for r in range(size)]
    expected32 = np.mean(np.array(contributions32, dtype=np.float64), axis=0)
    expected64 = np.mean(np.array(contributions64), axis=0)
    for rank, result in enumerate(ranks):
        assert int(result["rank"]) == rank and int(result["size"]) == size
        assert int(result["local_rank"]) == rank  # one host: local rank is the rank
        assert result["mean32"].dtype == np.float32
        np.testing.assert_array_equal(result["mean32"], ranks[0]["mean32"])
        np.testing.assert_array_equal(result["mean64"], ranks[0]["mean64"])
        np.testing.assert_allclose(result["mean32"], expected32, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(result["mean64"], expected64, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(result["bcast"], contributions32[size - 1])
        assert int(result["seen"]) == size


def _within(seconds: float, fn, *args):
    """Call fn(*args) in a thread; fail instead of hanging the test run if it takes too long."""
    box: dict[str, object] = {}

    def call():
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            box["error"] = exc

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn.__name__} still running after {seconds} s (hang)"
    if "error" in box:
        raise box["error"]
    return box["value"]


# --- single process, factory, devices, launcher detection ---------------------------------


def _one_rank():
    from labavg.comm.inproc import InProcCommunicator
    from labavg.comm.inproc_group import InProcGroup

    return InProcCommunicator(InProcGroup(1), 0)


def test_one_rank_collectives_are_no_ops():
    comm = _one_rank()
    assert (comm.rank, comm.size, comm.local_rank) == (0, 1, 0)
    buf = torch.tensor([1.5, -2.0, 3.25])
    comm.allreduce_mean(buf)
    comm.broadcast(buf, root=0)
    comm.barrier()
    assert buf.tolist() == [1.5, -2.0, 3.25]
    with pytest.raises(ValueError, match="root 1"):
        comm.broadcast(buf, root=1)


def test_unknown_backend_names_value_and_choices():
    with pytest.raises(UserError) as info:
        open_communicator("nccl2")
    message = str(info.value)
    assert "'nccl2'" in message
    for choice in ("inproc", "mpi", "torch"):
        assert choice in message
    with pytest.raises(ValueError, match="run_inproc"):
        open_communicator("inproc", size=2)


def test_buffers_must_be_flat_contiguous_floats():
    comm = _one_rank()
    with pytest.raises(ValueError, match="flat"):
        comm.allreduce_mean(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="contiguous"):
        comm.allreduce_mean(torch.zeros(6)[::2])
    with pytest.raises(TypeError, match="int64"):
        comm.allreduce_mean(torch.zeros(3, dtype=torch.int64))


def test_select_device_on_this_machine():
    assert select_device("cpu", 3) == torch.device("cpu")
    expected_auto = "cuda" if torch.cuda.is_available() else "cpu"
    assert select_device("auto", 0).type == expected_auto
    with pytest.raises(UserError, match="'gpu'"):
        select_device("gpu", 0)
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="CUDA is not available"):
            select_device("cuda", 0)
    else:
        count = torch.cuda.device_count()
        assert select_device("cuda", count + 1) == torch.device("cuda", (count + 1) % count)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"PMI_RANK": "0", "PMI_SIZE": "2"}, "mpi"),
        ({"OMPI_COMM_WORLD_RANK": "1"}, "mpi"),
        ({"PMIX_RANK": "0", "SLURM_PROCID": "0"}, "mpi"),
        ({"SLURM_PROCID": "0"}, None),
        ({"LOCAL_RANK": "0"}, None),
        ({"LOCAL_RANK": "1", "WORLD_SIZE": "2", "RANK": "1"}, "torch"),
        ({"TORCHELASTIC_RUN_ID": "x", "PMI_RANK": "0"}, "torch"),
    ],
)
def test_detect_launcher(env, expected):
    assert detect_launcher(env) == expected


def test_mpiexec_command_local_and_hosts():
    local = mpiexec_command(4, ["-m", "labavg", "train"])
    assert Path(local[0]) == find_mpiexec() == Path(sys.executable).parent / "mpiexec"
    assert local[1:3] == ["-n", "4"]
    assert local[3:5] == ["-launcher", "fork"]
    assert local[-4:] == [sys.executable, "-m", "labavg", "train"]
    remote = mpiexec_command(2, ["-m", "labavg"], hosts="node1,node2")
    assert remote[3:5] == ["-hosts", "node1,node2"] and "-launcher" not in remote
    with pytest.raises(UserError, match="at least 1"):
        mpiexec_command(0, [])


# --- inproc ----------------------------------------------------------------------------------


def test_tree_sum_uses_mpich_association():
    bufs = [torch.tensor([float(10.0 ** (3 * r)), 1.0 / (r + 3)]) for r in range(5)]
    # 5 ranks: rank 0 folds into rank 1, then recursive doubling over 4: {0+1, 2} and {3, 4}.
    expected = ((bufs[0] + bufs[1]) + bufs[2]) + (bufs[3] + bufs[4])
    assert torch.equal(tree_sum(bufs), expected)
    a, b, c = (torch.tensor([x], dtype=torch.float32) for x in (1e8, 1.0, -1e8))
    # Non-associativity made visible: the rank-order pairs decide the rounding.
    assert tree_sum([a, b, c, b]).item() == ((a + b) + (c + b)).item()


@pytest.mark.parametrize("size", [1, 3, 4])
def test_inproc_collectives_are_deterministic(size, tmp_path):
    first = _within(20, _inproc_results, size, tmp_path / "a")
    _check_ranks(first, size)
    again = _within(20, _inproc_results, size, tmp_path / "b")
    for one, two in zip(first, again):
        np.testing.assert_array_equal(one["mean32"], two["mean32"])


def _fail_on_rank(comm, bad_rank):
    """Rank `bad_rank` raises while the others wait in an allreduce."""
    buf = torch.ones(4)
    comm.allreduce_mean(buf)
    if comm.rank == bad_rank:
        time.sleep(0.05)
        raise ValueError(f"bad frames on rank {comm.rank}")
    comm.allreduce_mean(buf)
    return buf


def test_run_inproc_names_failed_rank_and_aborts_others():
    with pytest.raises(RankFailed) as info:
        _within(10, run_inproc, 3, _fail_on_rank, 1)
    assert info.value.rank == 1
    assert isinstance(info.value.exc, ValueError)
    assert "rank 1 failed: ValueError: bad frames on rank 1" == str(info.value)
    assert isinstance(info.value.__cause__, ValueError)


def _leave_early(comm):
    """Rank 0 returns while rank 1 still calls a collective."""
    if comm.rank == 1:
        time.sleep(0.05)
        comm.barrier()


def _mismatched_shapes(comm):
    comm.allreduce_mean(torch.zeros(3 + comm.rank))


def test_inproc_detects_mismatched_collectives_instead_of_hanging():
    with pytest.raises(RankFailed) as info:
        _within(10, run_inproc, 2, _leave_early)
    assert info.value.rank == 1 and isinstance(info.value.exc, CollectiveMismatch)
    assert "had finished" in str(info.value)
    with pytest.raises(RankFailed) as info:
        _within(10, run_inproc, 2, _mismatched_shapes)
    assert isinstance(info.value.exc, CollectiveMismatch)
    assert "numel=3" in str(info.value) and "numel=4" in str(info.value)


def _steps(comm, num_steps, closed, fail_at=None):
    """A generator worker: averages a per-rank value each step and yields (rank, step, mean)."""
    try:
        buf = torch.full((2,), float(comm.rank))
        for step in range(num_steps):
            if fail_at == (comm.rank, step):
                raise RuntimeError(f"diverged at step {step}")
            comm.allreduce_mean(buf)
            yield comm.rank, step, buf[0].item()
            buf += comm.rank
    finally:
        closed.append(comm.rank)


def test_iterate_inproc_streams_every_item():
    closed: list[int] = []
    items = _within(20, lambda: list(iterate_inproc(3, _steps, 4, closed, max_queued=2)))
    assert sorted((rank, step) for rank, step, _ in items) == [(r, s) for r in range(3) for s in range(4)]
    # Step s averages rank + s*rank over ranks 0..2: (1 + s) * 1.0.
    for _, step, mean in items:
        assert mean == pytest.approx(1.0 + step)
    assert sorted(closed) == [0, 1, 2]


def _consume_then_close(size, take, closed):
    stream = iterate_inproc(size, _steps, 1000, closed, max_queued=2)
    taken = [next(stream) for _ in range(take)]
    stream.close()
    return taken


def test_iterate_inproc_early_close_stops_workers():
    closed: list[int] = []
    before = {t.name for t in threading.enumerate()}
    taken = _within(20, _consume_then_close, 3, 5, closed)
    assert len(taken) == 5
    assert sorted(closed) == [0, 1, 2]  # every worker's finally ran
    alive = {t.name for t in threading.enumerate()} - before
    assert not any(name.startswith("labavg-rank") for name in alive)


def test_iterate_inproc_propagates_worker_failure():
    closed: list[int] = []
    stream = iterate_inproc(3, _steps, 50, closed, (2, 3))
    with pytest.raises(RankFailed) as info:
        _within(20, lambda: list(stream))
    assert info.value.rank == 2 and "diverged at step 3" in str(info.value)
    assert sorted(closed) == [0, 1, 2]


def test_aborted_group_raises_group_aborted():
    def abort_then_call(comm):
        if comm.rank == 0:
            comm.group.abort("stopped by test")
        time.sleep(0.05)
        comm.barrier()

    with pytest.raises(RankFailed) as info:
        _within(10, run_inproc, 2, abort_then_call)
    assert isinstance(info.value.exc, GroupAborted) and "stopped by test" in str(info.value)


# --- real launchers ---------------------------------------------------------------------------


@pytest.mark.slow  # end to end: out of the fast suite's 10 minutes
@pytest.mark.parametrize("size", [2, 4])
def test_mpiexec_ranks_match_inproc_bitwise(size, tmp_path):
    out = tmp_path / "mpi"
    out.mkdir()
    _launch(mpiexec_command(size, [str(SCRIPT), "mpi", str(out)]))
    ranks = _load_ranks(out, size)
    _check_ranks(ranks, size)
    assert all(str(r["launcher"]) == "mpi" for r in ranks)
    # Importing every labavg.comm module left MPI alone until the mpi backend was opened.
    assert not any(bool(r["mpi4py_before_open"]) for r in ranks)
    assert all(bool(r["mpi4py_at_end"]) for r in ranks)
    inproc = _inproc_results(size, tmp_path)
    np.testing.assert_array_equal(ranks[0]["mean32"], inproc[0]["mean32"])
    np.testing.assert_array_equal(ranks[0]["mean64"], inproc[0]["mean64"])


@pytest.mark.slow  # keeps README's fast command under 10 minutes; CI runs it
def test_torchrun_gloo_ranks_match_inproc(tmp_path):
    torchrun = Path(sys.executable).parent / "torchrun"
    out = tmp_path / "torch"
    out.mkdir()
    _launch(
        [
            str(torchrun),
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(_free_port()),
            str(SCRIPT),
            "torch",
            str(out),
        ]
    )
    ranks = _load_ranks(out, 2)
    _check_ranks(ranks, 2)
    assert all(str(r["launcher"]) == "torch" for r in ranks)
    assert not any(bool(r["mpi4py_at_end"]) for r in ranks)  # a torch run never loads mpi4py
    inproc = _inproc_results(2, tmp_path)
    np.testing.assert_allclose(ranks[0]["mean32"], inproc[0]["mean32"], rtol=1e-6, atol=1e-6)


def test_only_comm_imports_mpi4py_and_torch_distributed():
    import ast

    doors = ("mpi4py", "torch.distributed")
    found = []
    for path in sorted([*(REPO / "labavg").rglob("*.py"), *(REPO / "dashboard").rglob("*.py")]):
        if (REPO / "labavg" / "comm") in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value]  # `python -m torch.distributed.run` is a door too
            found += [f"{path.relative_to(REPO)}:{node.lineno}: {n}" for n in names
                      if any(n == d or n.startswith(d + ".") for d in doors)]
    assert found == []


def test_comm_modules_import_without_a_loop():
    """No cycle among comm/'s modules, counting imports inside functions."""
    import ast

    graph = {}
    for path in (REPO / "labavg" / "comm").glob("*.py"):
        name = f"labavg.comm.{path.stem}"
        graph[name] = {node.module for node in ast.walk(ast.parse(path.read_text()))
                       if isinstance(node, ast.ImportFrom) and node.module
                       and node.module.startswith("labavg.comm.")}

    def reaches(start, goal, seen=()):
        return any(nxt == goal or (nxt not in seen and reaches(nxt, goal, (*seen, nxt)))
                   for nxt in graph.get(start, ()))

    assert [m for m in graph if reaches(m, m)] == []
