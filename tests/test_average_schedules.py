"""Averaging schedules (labavg.averaging.schedule): each round's K follows its rule, a resume
repeats a schedule bitwise, a constant schedule is today's averager, and the settings that
cannot combine with one are refused before anything starts."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from labavg.averaging.factory import make_averager
from labavg.averaging.methods import Averager, BMUFAverager
from labavg.averaging.schedule import ScheduledAverager, adacomm_k, post_local_k
from labavg.averaging.settings import AveragingConfig
from labavg.base.errors import UserError
from labavg.comm.inproc import _communicators
from labavg.jobs.index import read_events
from labavg.jobs.runs import run_training
from labavg.training.config import validate
from support import stopped_then_resumed
from test_train import final_params, small_config


def test_the_rules_as_the_papers_give_them():
    assert [post_local_k(8, f, 1000) for f in (0, 999, 1000, 5000)] == [1, 1, 8, 8]
    assert post_local_k(8, 0, 0) == 8
    # AdaComm: ceil(K0 sqrt(L / L0)), never above K0 nor below 1.
    assert adacomm_k(10, 4.0, 4.0) == 10
    assert adacomm_k(10, 1.0, 4.0) == 5  # sqrt(1/4) = 0.5
    assert adacomm_k(10, 1.01, 4.0) == 6  # 5.02 rounds up
    assert adacomm_k(10, 9.0, 4.0) == 10  # a loss above the first keeps K0
    assert adacomm_k(10, 1e-9, 4.0) == 1
    assert adacomm_k(10, math.nan, 4.0) == 10 and adacomm_k(10, 1.0, math.inf) == 10


def _rounds(run_dir, rank: int = 0) -> list[dict]:
    return [e for e in read_events(run_dir) if e["type"] == "average" and e["rank"] == rank]


def _config(corpus, out, **averaging):
    cfg = small_config(corpus, out, epochs=3, log_every=1)
    return validate(dataclasses.replace(cfg, averaging=dataclasses.replace(
        cfg.averaging, average_every=6, **averaging)))


def _epoch_ends(run_dir) -> set[int]:
    return {e["step"] for e in read_events(run_dir) if e["type"] == "epoch" and e["rank"] == 0}


def test_post_local_averages_every_minibatch_until_its_frames_then_every_k(corpus, tmp_path):
    cfg = _config(corpus, tmp_path / "run", schedule="post_local", post_local_frames=1500)
    run_training(cfg, progress=False)
    rounds = _rounds(tmp_path / "run")
    per_step = cfg.ranks * cfg.minibatch
    ends, last = _epoch_ends(tmp_path / "run"), 0
    for r in rounds:
        expected = 1 if r["step"] * per_step < 1500 else 6
        assert r["average_every"] == expected, r
        # A round comes K after the last (or at an epoch end, which starts the count again).
        assert r["step"] - last == _k_before(rounds, r) or r["step"] in ends, (r, last)
        last = r["step"]
    assert rounds[0]["step"] == 1 and {r["average_every"] for r in rounds} == {1, 6}


def _k_before(rounds: list[dict], r: dict) -> int:
    i = rounds.index(r)
    return rounds[i - 1]["average_every"] if i else 6 if r["average_every"] == 6 else 1


def test_adacomm_k_follows_the_pooled_block_loss(corpus, tmp_path):
    """Each round's K recomputed from the minibatch losses every rank logged (log_every = 1):
    the block's loss over all ranks' frames against the first block's."""
    cfg = _config(corpus, tmp_path / "run", schedule="adacomm")
    # A loss that falls to about half its first block's within the run: K0 = 12 ends near 9.
    cfg = dataclasses.replace(cfg, lr=0.1, epochs=4, averaging=dataclasses.replace(
        cfg.averaging, average_every=12))
    run_training(cfg, progress=False)
    events = read_events(tmp_path / "run")
    rounds = _rounds(tmp_path / "run")
    losses: dict[int, list[tuple[float, int]]] = {}
    for e in events:
        if e["type"] == "minibatch":
            losses.setdefault(e["step"], []).append((e["loss"] * e["frames"], e["frames"]))
    last, loss0 = 0, None
    for r in rounds:
        block = [x for s in range(last + 1, r["step"] + 1) for x in losses[s]]
        assert len(block) == cfg.ranks * (r["step"] - last)
        loss = sum(x for x, _ in block) / sum(f for _, f in block)
        loss0 = loss if loss0 is None else loss0
        assert r["average_every"] == adacomm_k(12, loss, loss0), (r, loss, loss0)
        last = r["step"]
    assert len({r["average_every"] for r in rounds}) >= 3, "K shortened as the loss fell"


@pytest.mark.slow  # keeps README's fast command under 10 minutes; CI runs it
@pytest.mark.parametrize("schedule, method", [("adacomm", "model"), ("post_local", "bmuf")])
def test_a_stopped_and_resumed_schedule_matches_the_uninterrupted_run(corpus, tmp_path,
                                                                       schedule, method):
    changes = {"schedule": schedule, "method": method, "post_local_frames": 1500}
    full = _config(corpus, tmp_path / "full", **changes)
    run_training(full, progress=False)
    cfg = _config(corpus, tmp_path / "run", **changes)
    stopped, resumed = stopped_then_resumed(cfg, at_step=20)
    assert stopped.stopped and 0 < stopped.steps < resumed.steps
    for rank in range(cfg.ranks):
        assert torch.equal(final_params(tmp_path / "run", rank), final_params(tmp_path / "full", rank))
    assert [(r["step"], r["average_every"]) for r in _rounds(tmp_path / "full")][-8:] == \
        [(r["step"], r["average_every"]) for r in _rounds(tmp_path / "run")][-8:]


def test_constant_is_the_methods_own_averager_and_a_k_that_stays_trains_the_same_bits(corpus,
                                                                                       tmp_path):
    flat = torch.zeros(10)
    comm = _communicators(1)[0]
    plan = AveragingConfig(method="bmuf", average_every=4)
    assert type(make_averager(plan, 64, flat, comm)) is BMUFAverager
    scheduled = make_averager(dataclasses.replace(plan, schedule="adacomm"), 64, flat, comm)
    assert isinstance(scheduled, ScheduledAverager) and type(scheduled.inner) is BMUFAverager
    # A 1-epoch run whose loss stays near its first block's keeps K0: the wrapper's rounds
    # are the method's, bit for bit.
    base = small_config(corpus, tmp_path / "constant", epochs=1)
    run_training(base, progress=False)
    same = validate(dataclasses.replace(base, out=str(tmp_path / "adacomm"), averaging=(
        dataclasses.replace(base.averaging, schedule="adacomm"))))
    run_training(same, progress=False)
    assert {r["average_every"] for r in _rounds(tmp_path / "adacomm")} == {3}
    assert [r["step"] for r in _rounds(tmp_path / "adacomm")] == \
        [r["step"] for r in _rounds(tmp_path / "constant")]
    assert torch.equal(final_params(tmp_path / "adacomm"), final_params(tmp_path / "constant"))
    assert {r["average_every"] for r in _rounds(tmp_path / "constant")} == {3}
    assert type(make_averager(AveragingConfig(), 64, flat, comm)) is Averager


def test_a_checkpoint_of_another_schedule_is_refused(corpus, tmp_path):
    cfg = _config(corpus, tmp_path / "run", schedule="adacomm")
    stopped_then_resumed(cfg, at_step=8)
    other = validate(dataclasses.replace(cfg, averaging=dataclasses.replace(
        cfg.averaging, schedule="constant")))
    (tmp_path / "run" / "summary.json").unlink()
    with pytest.raises(UserError, match="averaging.schedule = 'adacomm' -> 'constant'; a resume keeps"):
        run_training(other, resume=True, progress=False)


@pytest.mark.parametrize("averaging, extra, words", [
    ({"schedule": "post_local"}, {}, "needs averaging.post_local_frames > 0"),
    ({"schedule": "adacomm", "overlap": "eager"}, {}, "does not combine with overlap = 'eager'"),
    ({"schedule": "adacomm"}, {"on_rank_loss": "continue", "backend": "torch"},
     "averaging.schedule = 'adacomm'"),
])
def test_what_a_schedule_does_not_combine_with_is_refused_by_name(corpus, tmp_path, averaging,
                                                                   extra, words):
    cfg = small_config(corpus, tmp_path / "run")
    with pytest.raises(UserError, match=words.replace("(", r"\(").replace(".", r"\.")):
        validate(dataclasses.replace(cfg, **extra, averaging=dataclasses.replace(
            cfg.averaging, **averaging)))
