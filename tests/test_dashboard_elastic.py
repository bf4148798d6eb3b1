"""The dashboard on an elastic run, without processes: N over time from the events, the curves
of a lost and a joined rank, the speedup line, and when "Lose a worker" / "Add a worker" may be
pressed. (The browser test that loses and adds real workers is in test_dashboard_browser.py.)"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dashboard.buffers import RunBuffers
from dashboard.membership import workers_over_time
from labavg.base.events import (Averaged, MemberJoined, MemberLost, MinibatchDone, RunStarted)

K = 5


def _started(rank: int, size: int = 4) -> RunStarted:
    return RunStarted(rank=rank, size=size, pid=100 + rank, host="h", device="cpu", num_params=10,
                      num_pdfs=3, input_dim=4, steps_per_epoch=100, train_utterances=10,
                      cv_utterances=2, average_every=K, effective_lr=0.01, start_step=0,
                      backend="torch")


def _step(rank: int, step: int) -> MinibatchDone:
    return MinibatchDone(rank=rank, epoch=0, step=step, loss=float(rank + 1) + 1.0 / step,
                         frame_accuracy=0.5, frames=32, lr=0.01, applied=True, max_change_scale=1.0)


def _averaged(rank: int, step: int) -> Averaged:
    return Averaged(rank=rank, round=step // K, step=step, divergence=0.1, compute_seconds=0.1,
                    comm_seconds=0.01, frames_per_second=320.0)


def elastic_events(lost_after: int = 32, seen_at: int = 35, join_at: int = 70,
                   end: int = 90) -> list:
    """A 4-worker run as its events.jsonl has it: rank 3 dies after step `lost_after`, the
    others see it at the round of step `seen_at`; a worker joins in its place, trains from
    step `join_at` + 1 and takes part in the round of step `join_at` + K."""
    events: list = [_started(r) for r in range(4)]
    for step in range(1, end + 1):
        if step == join_at:
            events.append(_started(3))  # the joiner's, as it starts (healed at the next round)
        members = [r for r in range(4) if r != 3 or step <= lost_after or step > join_at]
        events += [_step(r, step) for r in members]
        if step % K == 0:
            events += [_averaged(r, step) for r in members]
        if step == seen_at:
            events += [MemberLost(rank=r, step=step, round=step // K, lost=(3,), size=3,
                                  round_seconds=1.0, time=1000.0) for r in (0, 1, 2)]
        if step == join_at + K:
            events += [MemberJoined(rank=r, step=step, round=step // K, joined=(3,), size=4,
                                    time=1010.0) for r in range(4)]
    return events


def test_workers_over_time_is_a_step_plot_of_each_change_once():
    points = workers_over_time(elastic_events(), ranks=4)
    # At the start, at every round, and each change twice (N before, N after, at its step).
    assert points[0] == (0.0, 4.0)
    changes = [(x, n) for (x, n), (x2, n2) in zip(points, points[1:]) if x == x2 and n != n2]
    assert changes == [(35.0, 4.0), (75.0, 3.0)]
    assert (35.0, 3.0) in points and (75.0, 4.0) in points
    assert points[-1] == (90.0, 4.0)
    assert [n for x, n in points if 35 < x < 75] == [3.0] * len([x for x, _ in points if 35 < x < 75])
    assert all(x2 >= x for (x, _), (x2, _) in zip(points, points[1:]))  # a step plot: x never back


def test_a_lost_ranks_curve_ends_at_once_and_a_joined_ranks_begins_where_it_joined():
    buffers = RunBuffers(4)
    events = elastic_events()
    seen = next(i for i, e in enumerate(events) if isinstance(e, MemberLost))
    for event in events[:seen + 1]:
        buffers.add(event)
    rows = buffers.of("loss").take()
    # The survivors' rows up to the round that saw the loss are out at once, not 64 steps on.
    assert rows[-1][0] == 35
    for event in events[seen + 1:]:
        buffers.add(event)
    rows += buffers.of("loss").take()
    by_step = {row[0]: row for row in rows}
    assert sorted(by_step) == list(range(1, 91)) and len(rows) == 90  # each step once
    rank3 = [x for x, row in by_step.items() if not math.isnan(row[1 + 3])]
    assert max(x for x in rank3 if x < 50) == 32  # its curve ends where it died
    # The joined rank's begins where it trained, not at step 0 nor from its old line: at its
    # first step, or its second when the others' row of the first had gone out before it
    # reported (nobody waits for a worker before it reports; here its steps come last).
    assert min(x for x in rank3 if x > 50) in (71, 72)
    assert not any(33 <= x <= 70 for x in rank3)
    # The mean is over the workers present.
    row = by_step[50]
    assert row[-1] == np.mean([row[1], row[2], row[3]])


def test_the_speedup_line_says_how_n_changed_and_that_no_pairs_are_taken():
    from dashboard.speedup import elastic_text

    buffers = RunBuffers(4)
    for event in elastic_events():
        buffers.add(event)
    text = elastic_text(buffers.workers)
    assert text.startswith("**4 -> 3 workers at step 35 (rank 3 lost); "
                           "3 -> 4 workers at step 75 (rank 3 joined)**")
    assert "speedup pairs are not taken in elastic runs" in text
    assert "x (" not in text and "×" not in text  # no speedup figure


def test_lose_and_add_are_off_with_a_reason_outside_a_running_elastic_run():
    from dashboard.elastic import ENDED, NOT_ELASTIC, STARTING, rank_to_lose, reasons

    running = dict(elastic=True, running=True, launch=4)
    assert reasons(elastic=False, running=True, workers=(0, 1), launch=2) == (NOT_ELASTIC,) * 2
    assert reasons(**{**running, "running": False}, workers=(0, 1, 2, 3)) == (ENDED,) * 2
    assert reasons(**running, workers=None) == (STARTING,) * 2
    lose, add = reasons(**running, workers=(0, 1, 2, 3))
    assert lose == "" and add.startswith("all 4 workers are running")
    assert reasons(**running, workers=(0, 1, 2)) == ("", "")
    assert reasons(**running, workers=(0, 1, 2), joining=True) == ("", "a worker is joining…")
    lose, _ = reasons(**running, workers=(0,))
    assert lose == "1 worker left and min_workers = 1: losing one would end the run"
    assert reasons(**running, workers=(0, 2), min_workers=2)[0].startswith("2 workers left")
    assert rank_to_lose((0, 1, 2, 3)) == 3 and rank_to_lose((3, 1)) == 3
    assert rank_to_lose((0,)) is None


def _elastic_on_screen(tmp_path, workers, launcher):
    """A LiveRun showing a running 4-worker elastic run whose launcher's state file lists
    `workers` (no job: the state is what the page reads)."""
    import json

    from dashboard.live import LiveRun

    run = tmp_path / "run"
    run.mkdir()
    (run / ".elastic.json").write_text(json.dumps({
        "lighthouse": "http://127.0.0.1:1", "launcher": launcher,
        "workers": {str(r): 1 for r in workers}, "size": 4,
        "join_socket": str(tmp_path / "no-such.sock")}))
    live = LiveRun()
    live.param.update(config={"backend": "torch", "on_rank_loss": "continue", "ranks": 4,
                              "elastic": {"min_workers": 1, "heartbeat_ms": 1000}},
                      run_dir=str(run), mode="monitor", running=True)
    return live


def test_the_buttons_follow_the_run_on_screen_and_say_why_they_are_off(tmp_path):
    import os

    from dashboard.elastic import ENDED, NOT_ELASTIC, WorkerControls
    from dashboard.elastic_view import WorkerButtons

    live = _elastic_on_screen(tmp_path, (0, 1, 2, 3), os.getpid())
    controls = WorkerControls(live)
    buttons = WorkerButtons(controls)
    controls.refresh()
    assert controls.elastic and controls.workers == [0, 1, 2, 3] and controls.rank == 3
    assert not buttons.lose_button.disabled and buttons.add_button.disabled
    assert "all 4 workers are running" in buttons.add_line.object
    assert list(buttons.rank_select.options.values()) == [1, 2, 3]
    buttons.rank_select.value = 2  # the user chooses another rank
    assert controls.rank == 2
    controls.refresh()
    assert controls.rank == 2
    live.running = False  # the run ended
    controls.refresh()
    assert buttons.lose_button.disabled and buttons.add_button.disabled
    assert controls.lose_reason == ENDED and ENDED in buttons.lose_line.object
    live.config = {**live.config, "on_rank_loss": "stop"}
    controls.refresh()
    assert not controls.elastic and controls.add_reason == NOT_ELASTIC


def test_a_launcher_that_is_gone_leaves_nothing_to_press(tmp_path):
    from dashboard.elastic import STARTING, WorkerControls

    live = _elastic_on_screen(tmp_path, (0, 1, 2), 2 ** 22 + 1)  # above pid_max: no such process
    controls = WorkerControls(live)
    controls.refresh()
    assert controls.lose_reason == STARTING and controls.add_reason == STARTING


def test_add_says_in_one_line_why_a_join_failed_and_the_page_goes_on(tmp_path):
    import os
    import time

    from dashboard.elastic import WorkerControls

    live = _elastic_on_screen(tmp_path, (0, 1, 2), os.getpid())
    controls = WorkerControls(live)
    controls.refresh()
    assert controls.add_reason == ""
    controls.add()  # the launcher's socket is not there: join() fails on its thread
    assert controls.joining and controls.add_reason == "a worker is joining…"
    deadline = time.monotonic() + 5
    while controls.joining:
        assert time.monotonic() < deadline
        time.sleep(0.01)
        controls.refresh()
    assert controls.add_message.startswith("⚠ ") and "did not answer" in controls.add_message
    assert "\n" not in controls.add_message and controls.add_reason == ""
    controls.rank = 7  # not running: lose() refuses in one line
    controls.lose_reason = ""
    controls.lose()
    assert controls.lose_message.startswith("⚠ ") and "rank 7 is not running" in controls.lose_message


def test_the_live_tab_draws_n_where_the_speedup_was_and_no_line_bridges_the_gap():
    from dashboard.live import LiveRun
    from dashboard.live_plots import LIVE_PLOTS, RunKind
    from dashboard.live_view import LivePlots

    live = LiveRun()
    plots = LivePlots(live, plots=tuple(p for p in LIVE_PLOTS if p.name in ("loss", "workers")))
    assert plots.panes["workers"] not in plots.flex.objects
    live.buffers = RunBuffers(4)
    live.param.update(config={"backend": "torch", "on_rank_loss": "continue", "ranks": 4},
                      generation=live.generation + 1)
    assert plots.flex.objects == [plots.panes["loss"], plots.panes["workers"]]
    assert [p.name for p in LIVE_PLOTS if not p.shown(RunKind(elastic=True))] == ["k", "speedup"]
    for event in elastic_events():
        live.buffers.add(event)
    while plots.stream() == 0:  # the first flushes let new plots settle
        pass
    steps = plots.workers.sources["workers"][0].data
    assert list(zip(steps["step"], steps["workers"]))[:1] == [(0.0, 4.0)]
    assert (35.0, 3.0) in zip(steps["step"], steps["workers"])
    assert plots.workers.element.yaxis[0].axis_label == "workers present (N)"
    assert plots.workers.element.xaxis[0].axis_label == "step (minibatches)"
    # Rank 3's loss: segments up to step 32, then from its first step after the join on; none
    # from its old line to its new one.
    loss = plots.loss.sources["loss_r3"][0].data
    drawn = [(a, b) for a, b, y0, y1 in zip(loss["step_from"], loss["step"], loss["loss_r3_from"],
                                             loss["loss_r3"]) if not (math.isnan(y0) or math.isnan(y1))]
    assert max(b for a, b in drawn if b < 50) == 32 and min(a for a, b in drawn if a > 50) >= 71
    assert not any(a <= 32 and b >= 71 for a, b in drawn)
    assert "4 -> 3 workers at step 35" in plots.speedup_line.object


def test_the_sidebar_shows_an_elastic_runs_model_without_what_only_torch_takes(tmp_path):
    import dataclasses

    from dashboard.settings import GENERAL, RunSettings
    from labavg.base.settings import to_dict
    from labavg.comm.settings import ElasticConfig
    from labavg.training.config import TrainConfig

    cfg = dataclasses.replace(TrainConfig(), backend="torch", on_rank_loss="continue", ranks=4,
                              epochs=7, elastic=ElasticConfig(heartbeat_ms=3000))
    settings = RunSettings(runs_dir=str(tmp_path))
    settings.show_run(to_dict(cfg))
    assert settings.ranks == 4 and settings.epochs == 7
    assert not any(k == "on_rank_loss" or k.startswith("elastic.") for k in settings.overrides)
    assert GENERAL not in settings.errors  # Start is not refused for a setting it cannot show
