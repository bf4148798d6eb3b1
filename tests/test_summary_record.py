"""RunSummary, a run's results declared once (labavg.jobs.run_json): where each field comes
from, the file's keys and their order, the readers' type checks, the columns' paths, and the
reproduction's typed reading of rank 0's events."""

from __future__ import annotations

import dataclasses
import json

import pytest

from labavg.base.events import EpochDone, MinibatchDone, RunFinished, RunStarted
from labavg.jobs.columns import COLUMNS
from labavg.jobs.run_json import SUMMARY_FIELDS, RunSummary, summary_sources
from labavg.jobs.summary import RunEnd, load_summary, make_summary, run_row
from labavg.studies.reproduction.results import run_trace
from labavg.training.config import TrainConfig

# summary.json's keys in the order every labavg since the speedup pairs has written them: old
# run directories and experiments/reproduction-results.jsonl hold them so.
FILE_KEYS = (
    "ranks backend average_every averaging reduce payload optimizer pretrain schedule minibatch "
    "epochs lr effective_lr num_params num_pdfs frames_trained steps averaging_rounds "
    "cv_frame_accuracy cv_loss wall_seconds compute_seconds comm_seconds bytes_per_round "
    "bytes_sent hierarchy_every node_ranks node_rounds node_bytes_sent all_rounds all_bytes_sent "
    "stopped comm_fraction overlap fragment_bytes overlap_bytes_sent comm_wait_seconds "
    "comm_hidden_fraction cores load_average speedup_pairs config speedup speedup_low "
    "speedup_high speedup_bound speedup_flag parallel_efficiency speedup_text resumed wer wer_ci "
    "per per_ci acwt decode_set "
    # Appended since (an elastic run's membership): the keys before keep their order.
    "worker_steps worker_counts frames_untrained "
    # The whole command's time (issue 45).
    "process_seconds").split()


def _end(**finished) -> RunEnd:
    started = RunStarted(rank=0, size=2, pid=1, host="h", device="cpu", num_params=1000,
                         num_pdfs=120, input_dim=40, steps_per_epoch=10, train_utterances=5,
                         cv_utterances=1, average_every=3, effective_lr=0.008, start_step=0,
                         bytes_per_round=4000, fragment_bytes=(1500, 2500), backend="inproc",
                         cores=4, overlap="streaming")
    values = dict(rank=0, step=20, wall_seconds=9.0, compute_seconds=6.0, comm_seconds=2.0,
                  averaging_rounds=7, frames_trained=2560, cv_loss=1.5, cv_frame_accuracy=0.4,
                  bytes_sent=28000, node_rounds=2, node_bytes_sent=8000, overlap_seconds=1.0,
                  overlap_bytes_sent=6000, wait_seconds=0.25)
    return RunEnd(TrainConfig(ranks=2, lr=0.004), started, RunFinished(**{**values, **finished}),
                  [(1.0, 1.25), (1.0, 1.1)], {"start": 0.5, "end": 0.75}, resumed=True)


def test_each_field_comes_from_where_the_declaration_says():
    end = _end()
    summary = make_summary(end)
    assert list(summary.to_dict()) == FILE_KEYS
    assert (summary.ranks, summary.backend, summary.steps, summary.comm_wait_seconds) == (
        2, end.config.backend, 20, 0.25)
    assert (summary.all_rounds, summary.all_bytes_sent) == (5, 20000)
    assert summary.comm_fraction == pytest.approx(0.25)
    assert summary.fragment_bytes == [1500, 2500] and summary.speedup_pairs == [[1.0, 1.25], [1.0, 1.1]]
    assert summary.config == end.config and summary.resumed is True
    assert (summary.speedup, summary.speedup_low, summary.speedup_high) == (
        pytest.approx((1.6 + 2 / 1.1) / 2), pytest.approx(1.6), pytest.approx(2 / 1.1))
    assert summary.speedup_text == end.speedup.text()
    # The decode's fields are filled in after the run, by the decode.
    assert summary.wer is None and "wer" not in summary_sources()


def test_the_file_round_trips_and_every_field_is_type_checked(tmp_path):
    summary = make_summary(_end())
    assert set(SUMMARY_FIELDS) == {f.name for f in dataclasses.fields(RunSummary)}
    (tmp_path / "summary.json").write_text(json.dumps(summary.to_dict(), indent=2))
    assert load_summary(tmp_path) == summary
    bad = {**summary.to_dict(), "fragment_bytes": [1.5]}
    (tmp_path / "summary.json").write_text(json.dumps(bad))
    with pytest.raises(Exception, match="'fragment_bytes' is a list .*expected a list of integers"):
        load_summary(tmp_path)


def test_every_columns_path_names_an_attribute_of_the_run():
    config, summary = TrainConfig(), make_summary(_end())
    for column in COLUMNS.values():
        if column.path is None:
            continue
        owner = {"summary": summary, "config": config}[column.path[0]]
        assert hasattr(owner, column.path[1]), column.key
    row = run_row("r", config, summary)
    assert row["seed"] == config.seed and row["comm_fraction"] == summary.comm_fraction
    assert row["wer_ci_low"] is None and run_row("r", None, None)["cv_frame_accuracy"] is None


def test_the_trace_reads_rank_0s_events_typed_however_the_line_is_spaced(tmp_path):
    events = [EpochDone(rank=0, epoch=0, step=10, train_loss=2.0, train_frame_accuracy=0.3,
                        cv_loss=1.9, cv_frame_accuracy=0.35, lr=0.004, accepted=True, seconds=1.0),
              EpochDone(rank=1, epoch=0, step=10, train_loss=2.0, train_frame_accuracy=0.3,
                        cv_loss=1.9, cv_frame_accuracy=0.99, lr=0.004, accepted=True, seconds=1.0),
              MinibatchDone(rank=0, epoch=0, step=1, loss=2.0, frame_accuracy=0.3, frames=64,
                            lr=0.004, applied=True, max_change_scale=0.5)]
    lines = [json.dumps(e.to_dict(), separators=(",", ":")) for e in events]  # compact JSON
    (tmp_path / "events.jsonl").write_text("\n".join(lines) + "\n")
    trace = run_trace(tmp_path)
    assert [e["cv_frame_accuracy"] for e in trace["epochs"]] == [0.35]
    assert trace["max_change_limited"] == 1.0 and trace["max_change_median_scale"] == 0.5
