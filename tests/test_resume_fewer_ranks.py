"""`labavg train --resume RUN --ranks M` with fewer ranks than the checkpoint holds (issue 43):
the epoch layout (labavg.training.resume_layout), what a resume refuses in one line, a tiny
4-rank run resumed on 3, and the report's "losing a worker" section from recorded results."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from labavg.base import checkpoint
from labavg.base.errors import UserError
from labavg.base.settings import to_dict
from labavg.data.dataset import open_dataset
from labavg.data.frames import FrameBatches, shard, split_cv, steps_per_epoch
from labavg.jobs.run_dir import check_resume_config
from labavg.studies.reproduction import elastic
from labavg.studies.reproduction.results import Run, read_results_file, write_results_file
from labavg.training.config import TrainConfig, validate
from labavg.training.resume_layout import Layout
from tests.support import child_env

MB = 32


def _layout(corpus: Path, rank: int, resized: list[list[int]], epochs: int = 3):
    source = open_dataset(corpus)
    keys, _ = split_cv(source.keys, 0.1, seed=0)
    size = resized[-1][2] if resized else 4
    batches = FrameBatches(source, keys, context=2, minibatch=MB, buffer_frames=2048, rank=rank,
                           size=size)
    spe = {n: steps_per_epoch(keys, source.num_frames, n, MB) for n in (3, 4)}
    return Layout(batches, keys, resized, epochs), spe, keys, source


def test_a_run_never_resized_keeps_its_one_split(corpus):
    layout, spe, _, _ = _layout(corpus, 1, [])
    n = spe[4]
    assert layout.total_steps == 3 * n and layout.steps_per_epoch() == n
    for step in (0, 1, n - 1, n, n + 1, 3 * n - 1):
        assert layout.position(step) == divmod(step, n)
    assert [s for s in range(1, 3 * n + 1) if layout.epoch_ends(s)] == [n, 2 * n, 3 * n]
    assert layout.batches(2).size == 4 and layout.finished_fields(3 * n, MB, 4) == {}
    assert layout.worker_steps(2 * n) == 2 * n * 4


def test_a_mid_epoch_resize_ends_the_epoch_on_the_old_split(corpus):
    _, spe, keys, source = _layout(corpus, 2, [])
    start = 5
    at = spe[4] + start  # epoch 1, minibatch 5
    layout, _, _, _ = _layout(corpus, 2, [[at, 4, 3]])
    boundary = 2 * spe[4]
    assert layout.position(at) == (1, start)
    assert layout.position(boundary) == (2, 0) and layout.position(boundary + 1) == (2, 1)
    assert layout.epoch_ends(boundary) and not layout.epoch_ends(at)
    assert layout.epoch_ends(boundary + spe[3])
    assert layout.total_steps == boundary + spe[3]
    # The rest of epoch 1 on rank 2's shard of the 4-way split, epoch 2 on its 3-way one.
    assert layout.batches(1).keys == shard(keys, source.num_frames, 2, 4)
    assert layout.batches(2).keys == shard(keys, source.num_frames, 2, 3)
    end = layout.total_steps
    fields = layout.finished_fields(end, MB, 3)
    assert fields["worker_steps"] == (0, at) and fields["worker_counts"] == (4, 3)
    assert fields["members"] == (0, 1, 2)
    assert fields["frames_untrained"] == (spe[4] - start) * MB  # one lost shard, to the epoch end
    assert MB * layout.worker_steps(end) == MB * (4 * at + 3 * (end - at))


def test_a_resize_on_an_epoch_boundary_splits_over_the_new_ranks_at_once(corpus):
    _, spe, _, _ = _layout(corpus, 0, [])
    layout, _, _, _ = _layout(corpus, 0, [[spe[4], 4, 3]])
    assert layout.position(spe[4]) == (1, 0) and layout.batches(1).size == 3
    assert layout.finished_fields(layout.total_steps, MB, 3)["frames_untrained"] == 0


def _checkpointed(tmp_path: Path, corpus: Path, **changes) -> tuple[Path, TrainConfig]:
    """A run directory whose latest checkpoint holds cfg.ranks ranks (their files hold only
    the settings, all check_resume_config reads)."""
    cfg = validate(TrainConfig(out=str(tmp_path / "run"), ranks=4, data=replace(
        TrainConfig().data, data=str(corpus)), **changes))
    for rank in range(cfg.ranks):
        checkpoint.save_rank_state(tmp_path / "run", 10, rank, {"config": to_dict(cfg)})
    checkpoint.commit_checkpoint(tmp_path / "run", 10, cfg.ranks)
    return tmp_path / "run", cfg


def test_resume_takes_fewer_ranks_and_refuses_more_in_one_line(tmp_path, corpus):
    run, cfg = _checkpointed(tmp_path, corpus)
    for fewer in (1, 3, 4):
        check_resume_config(run, replace(cfg, ranks=fewer), 4)
    with pytest.raises(UserError) as refused:
        check_resume_config(run, replace(cfg, ranks=5), 4)
    assert "ranks = 4 -> 5" in str(refused.value) and "\n" not in str(refused.value)
    # Fewer ranks do not let anything else change.
    with pytest.raises(UserError, match="lr = 0.008 -> 0.01"):
        check_resume_config(run, replace(cfg, ranks=3, lr=0.01), 4)


def test_an_elastic_run_is_not_resumed_on_fewer_ranks(tmp_path, corpus):
    run, cfg = _checkpointed(tmp_path, corpus, backend="torch", on_rank_loss="continue")
    check_resume_config(run, cfg, 4)
    with pytest.raises(UserError) as refused:
        check_resume_config(run, replace(cfg, ranks=3), 4)
    assert "ranks = 4 -> 3 on the elastic run" in str(refused.value)
    assert "\n" not in str(refused.value)


# The report's section, from recorded results ------------------------------------------------

def _recorded(variant: str, seed: int, wer: float, acc: float) -> Run:
    counts, steps = ([4], [0]) if variant == "kept" else ([4, 3], [0, 160])
    untrained = {"kept": 0, "lost": 472 * 256, "resumed": 156 * 256}[variant]
    summary = {"steps": 632 if variant != "resumed" else 716, "wer": wer,
               "cv_frame_accuracy": acc, "worker_counts": counts, "worker_steps": steps,
               "frames_untrained": untrained if variant != "kept" else None,
               "frames_trained": 600_000}
    settings = {"seed": seed, "ranks": 4 if variant != "resumed" else 3, "epochs": 2,
                "minibatch": 256, "lr": 0.008, "model.hidden_layers": 2,
                "model.hidden_dim": 256, "averaging.average_every": 10, "corpus_hours": 1.0}
    return Run(f"{variant}-s{seed}", settings, summary)


def _elastic_runs() -> list[Run]:
    runs = []
    for seed in range(3):
        runs += [_recorded("kept", seed, 7.0 + seed * 0.1, 0.632 + seed * 0.001),
                 _recorded("lost", seed, 9.0 + seed * 0.2, 0.600 + seed * 0.002),
                 _recorded("resumed", seed, 7.2 + seed * 0.1, 0.628 + seed * 0.001)]
    return runs


def test_the_losing_a_worker_section_comes_from_recorded_results(tmp_path):
    path = write_results_file({"elastic": _elastic_runs()}, tmp_path / "results.jsonl")
    runs = read_results_file(path)["elastic"]
    lines = elastic.section(runs, Path("experiments/elastic.toml"))
    text = "\n".join(lines)
    assert lines[0] == "## Beyond the paper: losing a worker"
    assert "4 worker processes share 2 cores (oversubscribed)" in text
    assert "at step 160, a quarter of the run" in text
    kept = next(line for line in lines if line.startswith("| 4 workers, none lost"))
    assert "| 3 " in kept and "7.10 ± 0.10" in kept and "63.30 ± 0.10" in kept
    lost = next(line for line in lines if line.startswith("| worker 3 lost"))
    assert "4 -> 3 at step 160" in lost and "120,832" in lost
    verdicts = [line for line in lines if line.startswith("- ")]
    assert len(verdicts) == 3
    assert "WER **worse**" in verdicts[0] and "CV frame accuracy **worse**" in verdicts[0]
    assert elastic.section(runs, Path("experiments/elastic.toml")) == lines  # no state


def test_a_spurious_member_loss_is_caught(tmp_path):
    run = tmp_path / "lost-s0"
    run.mkdir()
    lost = {"type": "member_lost", "rank": 0, "step": 160, "round": 17, "lost": [3], "size": 3,
            "round_seconds": 1.0, "time": 0.0}
    (run / "summary.json").write_text(json.dumps({"worker_counts": [4, 3],
                                                  "worker_steps": [0, 160]}))
    (run / "events.jsonl").write_text("\n".join(json.dumps({**lost, "rank": r})
                                                for r in (0, 1, 2)) + "\n")
    assert elastic.check_run(run, "lost", 160) is None
    (run / "events.jsonl").write_text("\n".join(json.dumps({**lost, "rank": r, "lost": [1]})
                                                for r in (0, 2, 3)) + "\n")
    assert "member_lost" in elastic.check_run(run, "lost", 160)
    assert "workers [4, 3]" in elastic.check_run(run, "kept", 160)


# A tiny 4-rank run resumed on 3 --------------------------------------------------------------

def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "labavg", "train", "--no-progress", *args],
                          capture_output=True, text=True, env=child_env(), timeout=300)


@pytest.mark.slow
def test_a_4_rank_run_resumed_on_3(corpus, tmp_path):
    run = tmp_path / "run"
    first = _cli("--data", str(corpus), "--out", str(run), "--ranks", "4", "--backend", "inproc",
                 "--hidden-layers", "1", "--hidden-dim", "32", "--minibatch", str(MB),
                 "--average-every", "5", "--epochs", "2", "--speedup-pairs", "0",
                 "--checkpoint-every", "1", "--set", 'inject_fault="raise@rank3:step11"')
    assert first.returncode != 0 and checkpoint.latest_step(run) == (10, 4), first.stderr[-800:]
    before = sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*"))
    more = _cli("--resume", str(run), "--ranks", "5")
    assert more.returncode == 2, more.stderr
    assert more.stderr.strip().count("\n") == 0 and "ranks = 4 -> 5" in more.stderr
    assert sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*")) == before
    resumed = _cli("--resume", str(run), "--ranks", "3")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    source = open_dataset(corpus)
    keys, _ = split_cv(source.keys, 0.1, seed=0)
    spe4, spe3 = (steps_per_epoch(keys, source.num_frames, n, MB) for n in (4, 3))
    assert summary["worker_counts"] == [4, 3] and summary["worker_steps"] == [0, 10]
    assert summary["frames_untrained"] == (spe4 - 10) * MB  # rank 3's shard, to epoch 0's end
    assert summary["steps"] == spe4 + spe3
    assert summary["frames_trained"] == MB * (4 * 10 + 3 * (spe4 + spe3 - 10))
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    finished = [e for e in events if e["type"] == "run_finished"]
    assert sorted(e["rank"] for e in finished) == [0, 1, 2]
    assert all(e["members"] == [0, 1, 2] for e in finished)
    restarted = [e for e in events if e["type"] == "run_started" and e["start_step"] == 10]
    assert {e["size"] for e in restarted} == {3}
    assert all(e["effective_lr"] == pytest.approx(3 * 0.008) for e in restarted)
    model = torch.load(run / "final.pt", weights_only=True)
    tensors = [v for v in model.values() if isinstance(v, torch.Tensor)]
    assert tensors and all(torch.isfinite(t).all() for t in tensors)


def test_reproduce_only_names_its_experiments(tmp_path):
    from labavg.studies.reproduction.pipeline import reproduce

    with pytest.raises(UserError, match="--only elastic,nope: no experiment 'nope'"):
        reproduce(tmp_path / "out", only=("elastic", "nope"))
    assert not (tmp_path / "out").exists()
