"""labavg.jobs.followed: a run followed from its directory, as another process writes it."""

from __future__ import annotations

import threading
import time

from labavg.jobs.followed import FollowedRun
from labavg.jobs.index import read_run_events
from labavg.jobs.launch import start_run

from test_train import small_config


def test_following_a_run_being_written_reads_its_config_then_every_event(corpus, tmp_path):
    cfg = small_config(corpus, tmp_path / "run", epochs=2)
    followed = FollowedRun(tmp_path / "run")
    assert not followed.done()
    handle = start_run(cfg)  # the writer: a run this follower knows only by its directory
    config = followed.config()
    assert config is not None and config.out == cfg.out and config.epochs == 2
    events = list(followed.events())  # ends with the summary's writing
    assert followed.done() and handle.result() is not None
    assert events == read_run_events(tmp_path / "run")  # all of them, typed, in file order
    assert list(followed.events()) == []


def test_close_ends_a_follow_that_would_wait_for_ever(tmp_path):
    followed = FollowedRun(tmp_path / "never")
    threading.Timer(0.5, followed.close).start()
    started = time.monotonic()
    assert followed.config() is None
    assert list(followed.events()) == []
    assert time.monotonic() - started < 5


def test_events_of_a_type_this_labavg_does_not_know_are_passed_by(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text(
        '{"type": "from_a_newer_labavg", "rank": 0}\n'
        '{"type": "message", "rank": 0, "step": 3, "text": "hello"}\n'
        '{"type": "message", "rank": 1, "step": 3, "text": "half a li')
    (run / "summary.json").write_text("{}")
    events = list(FollowedRun(run).events())
    assert [(e.rank, e.text) for e in events] == [(0, "hello")]  # the torn last line left out
