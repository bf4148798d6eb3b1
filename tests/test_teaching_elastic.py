"""What notebook 09's elastic section shows of a run's events (labavg.studies.teaching_elastic):
a lost rank's curve ends and its joiner's begins, N over the steps, the changes in words. The
events are those an elastic run records (4 workers, rank 3 lost at step 20 and back at step 40);
the notebook's slow test (tests/test_notebooks.py) and tests/test_notebook_elastic_lab.py follow
a real run."""

from __future__ import annotations

from labavg.base.events import (Averaged, MemberJoined, MemberLost, MinibatchDone, RunFinished,
                                RunStarted)
from labavg.studies import teaching_elastic

STARTED = dict(size=4, pid=1, host="h", device="cpu", num_params=10, num_pdfs=3, input_dim=5,
               steps_per_epoch=30, train_utterances=4, cv_utterances=1, average_every=5,
               effective_lr=0.032, start_step=0)


def _minibatch(rank: int, step: int, loss: float) -> MinibatchDone:
    return MinibatchDone(rank=rank, epoch=0, step=step, loss=loss, frame_accuracy=0.5, frames=64,
                         lr=0.01, applied=True, max_change_scale=1.0)


def _events() -> list:
    events = [RunStarted(rank=r, **STARTED) for r in range(4)]
    for step in range(1, 61):
        for rank in range(4):
            if rank == 3 and 20 < step <= 35:  # killed after step 20; the joiner trains from 36
                continue
            events.append(_minibatch(rank, step, loss=float(step if rank == 3 else 1)))
        if step % 5 == 0:
            present = [r for r in range(4) if not (r == 3 and 20 < step <= 40)]
            events += [Averaged(rank=r, round=step // 5, step=step, divergence=0.1,
                                compute_seconds=0.1, comm_seconds=0.02 if step != 25 else 0.9,
                                frames_per_second=1.0) for r in present]
    # every survivor records each change; the first record of a round speaks for all
    events += [MemberLost(rank=r, step=25, round=9, lost=(3,), size=3, round_seconds=1.02,
                          time=1000.0 + r) for r in (2, 0, 1)]
    events += [MemberJoined(rank=r, step=40, round=15, joined=(3,), size=4, time=1007.5)
               for r in range(4)]
    events += [RunFinished(rank=r, step=60, wall_seconds=9.0, compute_seconds=5.0,
                           comm_seconds=2.0, averaging_rounds=12, frames_trained=1,
                           cv_loss=1.0, cv_frame_accuracy=0.5) for r in range(4)]
    return events


def test_a_lost_rank_has_one_curve_per_process():
    pieces = teaching_elastic.loss_pieces(_events(), smooth=1)
    spans = {w: (g.step.min(), g.step.max(), len(g)) for w, g in pieces.groupby("worker")}
    assert spans == {"rank 0": (1, 60, 60), "rank 1": (1, 60, 60), "rank 2": (1, 60, 60),
                     "rank 3, process 1: lost at step 25": (1, 20, 20),
                     "rank 3, process 2: joined at step 36": (36, 60, 25)}
    # the rolling mean stays within a piece: the joiner's first point is its own loss
    smoothed = teaching_elastic.loss_pieces(_events(), smooth=10)
    joiner = smoothed[smoothed.worker.str.contains("process 2")].sort_values("step")
    assert joiner.loss.iloc[0] == 36.0 and joiner.loss.iloc[-1] == sum(range(51, 61)) / 10


def test_the_workers_present_step_from_the_start_through_each_change_to_the_end():
    present = teaching_elastic.workers_present(_events())
    assert present.values.tolist() == [[0, 4], [25, 3], [40, 4], [60, 4]]


def test_each_change_is_said_once_with_what_it_cost():
    lines = teaching_elastic.membership_lines(_events(), join_asked_at=1000.5)
    assert lines == [
        "member_lost: rank 3 at step 25 (round 9): N = 3; the round that found it gone took "
        "1.02 s, waiting for the lighthouse to drop it (a round's communication otherwise: "
        "0.020 s, median)",
        "member_joined: rank 3 at step 40 (round 15): N = 4; 7.0 s from the join's request to "
        "its first round"]
    read_back = teaching_elastic.membership_lines(_events(), killed_at=999.5)
    assert read_back[0].endswith("; the first round without it committed 0.50 s after the kill")
    assert read_back[1] == "member_joined: rank 3 at step 40 (round 15): N = 4"
