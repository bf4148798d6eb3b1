"""The elastic communicator on real torchft: real worker processes, a real lighthouse, real kills.

Each worker (tests/elastic_worker.py) moves its own state between rounds and averages it every
round; one line per committed round says who took part.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from labavg.comm.elastic import ElasticCommunicator, ElasticUnsupported, Lighthouse

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
WORKER = [sys.executable, str(ROOT / "tests" / "elastic_worker.py")]
ENV = dict(os.environ)


def _start(rank: int, size: int, lighthouse: Lighthouse, rounds: int, *extra: str):
    return subprocess.Popen([*WORKER, str(rounds), "--rank", str(rank), "--size", str(size),
                             "--lighthouse", lighthouse.address, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                            cwd=ROOT)


def _rounds(proc: subprocess.Popen, timeout: float = 180) -> tuple[dict[int, dict], str]:
    out, err = proc.communicate(timeout=timeout)
    return {d["round"]: d for d in map(json.loads, out.splitlines())}, err


@pytest.fixture
def lighthouse():
    lh = Lighthouse(heartbeat_ms=1000)  # the default join_timeout_ms, as a job runs it
    yield lh
    lh.close()


def test_survivors_go_on_without_a_lost_worker_and_a_joiner_heals(lighthouse):
    """Each round opens with an admission round, then two means of other sizes, as the
    trainer's averaging rounds do: the joiner is let in only at an admission round, whatever
    the survivors are reducing when it arrives."""
    mode = ["--admit"]
    workers = [_start(r, 3, lighthouse, 60, *mode, *(["--die-at", "10"] if r == 2 else []))
               for r in range(3)]
    assert workers[2].wait(timeout=120) == 1
    died = time.time()
    time.sleep(1.0)
    joiner = _start(2, 3, lighthouse, 60, "--join", *mode)
    (a, err_a), (b, err_b), (j, err_j) = (_rounds(p) for p in (workers[0], workers[1], joiner))
    assert workers[0].returncode == workers[1].returncode == joiner.returncode == 0, \
        err_a[-500:] + err_b[-500:] + err_j[-500:]
    assert sorted(a) == sorted(b) == list(range(1, 61))
    # Every round was committed alike by the survivors, bitwise, with and without rank 2.
    for r in a:
        assert a[r]["x"] == b[r]["x"] and a[r]["members"] == b[r]["members"], r
    assert all(a[r]["members"] == [0, 1, 2] for r in range(1, 10))
    without = [r for r in a if a[r]["members"] == [0, 1]]
    assert without and without[0] == 10, without[:3]
    # The first round without it came within a few heartbeats of its death.
    assert a[10]["t"] - died < 5.0
    # The joiner healed from a survivor and from then on holds bitwise their state, the
    # state it did not average (its momentum) included.
    first = min(j)
    assert j[first]["healed"] and 2 not in j[first]["members"], [j[r] for r in sorted(j)[:3]]
    assert j[first]["x"] == a[first]["x"] and j[first]["m"] == a[first]["m"]
    rejoined = [r for r in j if j[r]["members"] == [0, 1, 2]]
    assert rejoined and rejoined[0] == first + 1
    for r in j:
        assert j[r]["x"] == a[r]["x"] and j[r]["m"] == a[r]["m"], r


def test_the_first_round_leaves_identical_workers_unchanged(lighthouse):
    """torchft's default first sync divides the sum by N with zeros in it; ours must not."""
    workers = [_start(r, 3, lighthouse, 3, "--same") for r in range(3)]
    results = [_rounds(p) for p in workers]
    assert [p.returncode for p in workers] == [0, 0, 0], [e[-300:] for _, e in results]
    expected = torch.zeros(6, dtype=torch.float64)
    for r in (1, 2, 3):
        expected += 0.001 * r  # what each worker moved: the mean of equal moves is that move
        for rounds, _ in results:
            assert rounds[r]["members"] == [0, 1, 2]
            assert rounds[r]["x"] == pytest.approx(expected.tolist(), abs=1e-15)


def test_the_last_worker_below_min_workers_ends_in_one_line():
    lighthouse = Lighthouse(min_workers=2, heartbeat_ms=1000, join_timeout_ms=1000)
    workers = [_start(r, 2, lighthouse, 40, "--min-workers", "2",
                      *(["--die-at", "5"] if r == 1 else [])) for r in range(2)]
    assert workers[1].wait(timeout=120) == 1
    out, err = workers[0].communicate(timeout=120)
    assert workers[0].returncode != 0
    assert "TooFewWorkers" in err or "too few" in err.lower(), err[-800:]
    lighthouse.close()
    assert max(d["round"] for d in map(json.loads, out.splitlines())) == 4


def test_collectives_without_an_elastic_form_are_refused(lighthouse):
    comm = ElasticCommunicator(0, 1, lighthouse.address, timeout_s=5, quorum_timeout_s=10)
    try:
        comm.gather(10)
        buf = torch.arange(4, dtype=torch.float32)
        comm.allreduce_mean(buf)
        assert buf.tolist() == [0, 1, 2, 3] and comm.size == 1 and comm.members == (0,)
        with pytest.raises(ElasticUnsupported, match="hierarchical"):
            comm.split(0)
        with pytest.raises(ElasticUnsupported, match="point-to-point"):
            comm.sendrecv(buf, 0, buf, 0)
        recv = torch.zeros(4, dtype=torch.uint8)
        comm.allgather(torch.tensor([7, 0, 255, 1], dtype=torch.uint8), recv)
        assert recv.tolist() == [7, 0, 255, 1]
    finally:
        comm.close()


def test_a_joiner_that_finds_no_worker_ends_without_training(lighthouse):
    """The others finished as it started: with no survivor to heal from, its first round must
    not make it the job (it trained alone from step 0 and wrote over the run's summary)."""
    joiner = _start(1, 2, lighthouse, 5, "--join", "--admit")
    rounds, err = _rounds(joiner, timeout=120)
    assert joiner.returncode != 0 and rounds == {}, (rounds, err[-800:])
    assert "JobFinished: rank 1 found no worker to join" in err, err[-800:]
