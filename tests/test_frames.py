"""The frame pipeline: splicing as Kaldi does it, CV split, sharding, shuffled minibatches."""

from __future__ import annotations

import collections
from pathlib import Path

import kaldiio
import numpy as np
import pytest
import torch

from labavg.data.frames import (
    FrameBatches,
    cv_batches,
    shard,
    splice,
    split_cv,
    steps_per_epoch,
)
from labavg.base.errors import DataError, UserError


class MemorySource:
    """An in-memory UtteranceSource. Feature column 0 holds a corpus-unique frame id (exact in
    float32 below 2**24) so that tests can tell which frames a minibatch holds."""

    def __init__(
        self, lengths: dict[str, int], feat_dim: int = 4, num_pdfs: int = 7, seed: int = 0
    ):
        rng = np.random.default_rng(seed)
        self.keys = sorted(lengths)
        self.num_frames = dict(lengths)
        self.feat_dim = feat_dim
        self.num_pdfs = num_pdfs
        self.data: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        next_id = 0
        for key in self.keys:
            n = lengths[key]
            feats = rng.standard_normal((n, feat_dim)).astype(np.float32)
            feats[:, 0] = np.arange(next_id, next_id + n)
            next_id += n
            self.data[key] = (feats, rng.integers(0, num_pdfs, n))
        self.loads: list[str] = []

    def load(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        self.loads.append(key)
        return self.data[key]


def skewed_lengths(num_utts: int, seed: int = 1) -> dict[str, int]:
    """Log-normal utterance lengths (many short, a few very long), like real corpora."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(5.5, 0.8, num_utts), 20, 3000).astype(int)
    return {f"utt{i:05d}": int(n) for i, n in enumerate(lengths)}


def centre_ids(x: torch.Tensor, feat_dim: int, context: int) -> np.ndarray:
    """The frame ids (column 0 of the centre frame) of spliced rows."""
    return x[:, context * feat_dim].numpy().astype(np.int64)


def splice_reference(feats: np.ndarray, left: int, right: int) -> np.ndarray:
    """A literal transcription of Kaldi's SpliceFrames loop (src/feat/feature-functions.cc)."""
    num_frames, dim = feats.shape
    out = np.zeros((num_frames, dim * (left + right + 1)), dtype=feats.dtype)
    for t in range(num_frames):
        for j in range(left + right + 1):
            t2 = min(max(t + j - left, 0), num_frames - 1)
            out[t, j * dim : (j + 1) * dim] = feats[t2]
    return out


# --- splice ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_feats(shared_data: Path) -> dict[str, np.ndarray]:
    return dict(kaldiio.load_ark(str(shared_data / "kaldi-io-arks" / "feats.ark")))


def test_splice_matches_kaldi_loop_on_real_features(real_feats):
    assert len(real_feats) == 10
    for context in (0, 1, 5):
        for feats in real_feats.values():
            got = splice(feats, context)
            assert got.shape == (feats.shape[0], 13 * (2 * context + 1))
            np.testing.assert_array_equal(got, splice_reference(feats, context, context))


def test_splice_edges_repeat_first_and_last_frame(real_feats):
    feats = next(iter(real_feats.values()))
    out = splice(feats, 5)
    # first output frame: offsets -5..0 are all frame 0, then frames 1..5
    for j in range(6):
        np.testing.assert_array_equal(out[0, j * 13 : (j + 1) * 13], feats[0])
    np.testing.assert_array_equal(out[0, 10 * 13 :], feats[5])
    for j in range(5, 11):
        np.testing.assert_array_equal(out[-1, j * 13 : (j + 1) * 13], feats[-1])
    np.testing.assert_array_equal(out[-1, :13], feats[-6])


def test_splice_40_dim_gives_440_and_short_utterances(real_feats):
    feats = np.concatenate([f[:50] for f in list(real_feats.values())[:4]], axis=1)[:, :40]
    assert splice(feats, 5).shape == (50, 440)
    short = feats[:3]  # shorter than the context: every offset clips
    np.testing.assert_array_equal(splice(short, 5), splice_reference(short, 5, 5))
    assert splice(feats[:0], 5).shape == (0, 440)
    with pytest.raises(UserError, match="-1"):
        splice(feats, -1)


# --- CV split -------------------------------------------------------------------------------


def test_split_cv_is_deterministic_disjoint_and_sized():
    keys = [f"u{i:03d}" for i in range(200)]
    train, cv = split_cv(keys, 0.1, seed=3)
    assert len(cv) == 20 and len(train) == 180
    assert set(train).isdisjoint(cv) and set(train) | set(cv) == set(keys)
    assert split_cv(list(reversed(keys)), 0.1, seed=3) == (train, cv)  # order of input irrelevant
    assert split_cv(keys, 0.1, seed=4)[1] != cv
    assert split_cv(["a", "b"], 0.01)[1] in (["a"], ["b"])  # at least one CV utterance
    assert split_cv(["a"], 0.5) == (["a"], [])
    assert split_cv(keys, 0.0) == (keys, [])
    with pytest.raises(UserError, match="1.5"):
        split_cv(keys, 1.5)
    with pytest.raises(DataError, match="u001"):
        split_cv(keys + ["u001"], 0.1)


# --- sharding -------------------------------------------------------------------------------


def test_shard_balances_frames_and_partitions_keys():
    lengths = skewed_lengths(600)
    keys = sorted(lengths)
    size = 7
    shards = [shard(keys, lengths, r, size) for r in range(size)]
    flat = [k for s in shards for k in s]
    assert sorted(flat) == keys and len(flat) == len(set(flat))
    totals = [sum(lengths[k] for k in s) for s in shards]
    assert max(totals) / min(totals) < 1.02, totals
    # greedy invariant: the spread is at most the longest utterance
    assert max(totals) - min(totals) <= max(lengths.values())
    # deterministic and independent of the key order given
    assert shard(list(reversed(keys)), lengths, 3, size) == shards[3]


def test_shard_greedy_ties_go_to_lowest_rank():
    lengths = {"a": 10, "b": 10, "c": 5, "d": 5, "e": 1}
    # b, a: ties by key after length -> a to rank 0, b to rank 1; c to 0, d to 1; e to 0
    assert shard(sorted(lengths), lengths, 0, 2) == ["a", "c", "e"]
    assert shard(sorted(lengths), lengths, 1, 2) == ["b", "d"]


def test_shard_too_many_ranks_names_both_numbers():
    lengths = {"a": 10, "b": 10, "c": 5}
    with pytest.raises(DataError, match=r"4 ranks.*3 training utterances"):
        shard(sorted(lengths), lengths, 0, 4)


def test_steps_per_epoch_is_min_over_ranks_and_errors_when_zero():
    lengths = {"a": 1000, "b": 700, "c": 600}  # shards: [a]=1000, [b, c]=1300
    assert steps_per_epoch(sorted(lengths), lengths, 2, 256) == 1000 // 256
    assert steps_per_epoch(sorted(lengths), lengths, 1, 256) == 2300 // 256
    with pytest.raises(DataError, match=r"\[1000, 1300\].*2048"):
        steps_per_epoch(sorted(lengths), lengths, 2, 2048)


# --- training stream ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus() -> MemorySource:
    return MemorySource(skewed_lengths(150), feat_dim=4, num_pdfs=9)


def make_batches(corpus, rank=0, size=1, **kw) -> FrameBatches:
    kw = {"context": 2, "minibatch": 64, "buffer_frames": 2000, "seed": 11, **kw}
    return FrameBatches(corpus, corpus.keys, rank=rank, size=size, **kw)


def test_lockstep_steps_and_frames_once_per_epoch(corpus):
    size = 3
    streams = [make_batches(corpus, rank=r, size=size) for r in range(size)]
    steps = {s.num_steps for s in streams}
    assert steps == {steps_per_epoch(corpus.keys, corpus.num_frames, size, 64)}
    seen_all: list[np.ndarray] = []
    for s in streams:
        batches = list(s.epoch(0))
        assert len(batches) == s.num_steps
        for x, y in batches:
            assert x.dtype == torch.float32 and y.dtype == torch.int64
            assert x.shape == (64, 4 * 5) and y.shape == (64,)
        ids = np.concatenate([centre_ids(x, 4, 2) for x, _ in batches])
        assert len(ids) == len(set(ids))  # no frame twice
        # labels and features stay paired, and frames come from this rank's shard only
        shard_ids = {}
        for key in s.keys:
            feats, labels = corpus.data[key]
            shard_ids.update(zip(feats[:, 0].astype(np.int64), labels))
        emitted_labels = np.concatenate([y.numpy() for _, y in batches])
        assert [shard_ids[i] for i in ids] == emitted_labels.tolist()
        # emitted labels = shard labels minus the dropped frames
        shard_labels = collections.Counter(int(shard_ids[i]) for i in shard_ids)
        dropped = shard_labels - collections.Counter(emitted_labels.tolist())
        assert sum(dropped.values()) == s.num_frames - s.num_steps * 64
        seen_all.append(ids)
    all_ids = np.concatenate(seen_all)
    assert len(all_ids) == len(set(all_ids))  # shards disjoint
    # the smallest shard drops less than one minibatch
    assert min(s.num_frames for s in streams) - streams[0].num_steps * 64 < 64


def test_single_rank_drops_less_than_a_minibatch(corpus):
    stream = make_batches(corpus)
    labels = np.concatenate([y.numpy() for _, y in stream.epoch(2)])
    shard_labels = np.concatenate([corpus.data[k][1] for k in corpus.keys])
    missing = collections.Counter(shard_labels.tolist()) - collections.Counter(labels.tolist())
    assert len(labels) == stream.num_steps * 64
    assert sum(missing.values()) == len(shard_labels) - len(labels) < 64
    assert not collections.Counter(labels.tolist()) - collections.Counter(shard_labels.tolist())


def test_splice_inside_stream_matches_splice(corpus):
    stream = make_batches(corpus)
    x, _ = next(iter(stream.epoch(0)))
    where = {}
    for key in corpus.keys:
        feats = corpus.data[key][0]
        for t, i in enumerate(feats[:, 0].astype(np.int64)):
            where[i] = (key, t)
    for row, i in zip(x.numpy(), centre_ids(x, 4, 2)):
        key, t = where[i]
        np.testing.assert_array_equal(row, splice(corpus.data[key][0], 2)[t])


def test_epochs_are_deterministic_and_differ(corpus):
    a = make_batches(corpus, rank=1, size=2)
    b = make_batches(corpus, rank=1, size=2)
    first = [x for x, _ in a.epoch(4)]
    again = [x for x, _ in b.epoch(4)]
    assert all(torch.equal(p, q) for p, q in zip(first, again))
    other = [x for x, _ in a.epoch(5)]
    assert not torch.equal(first[0], other[0])
    same_frames = np.intersect1d(centre_ids(first[0], 4, 2), centre_ids(other[0], 4, 2))
    assert len(same_frames) < 32
    other_seed = [x for x, _ in make_batches(corpus, rank=1, size=2, seed=12).epoch(4)]
    assert not torch.equal(first[0], other_seed[0])


@pytest.mark.parametrize("start_step", [0, 1, 31, 32, 33, 57, "half", "end"])
def test_resume_equals_tail_of_uninterrupted_epoch(corpus, start_step):
    stream = make_batches(corpus)
    full = list(stream.epoch(3))
    start = {"half": stream.num_steps // 2, "end": stream.num_steps}.get(start_step, start_step)
    corpus.loads.clear()
    tail = list(stream.epoch(3, start_step=start))
    assert len(tail) == len(full) - start
    for (x1, y1), (x2, y2) in zip(full[start:], tail):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    if start_step == "half":
        # skipped fills are never loaded (only the few utterances of carried frames)
        assert len(set(corpus.loads)) < len(corpus.keys) * 0.65
    if start_step == "end":
        assert corpus.loads == []


def test_shuffle_buffer_is_bounded():
    lengths = skewed_lengths(120, seed=5)
    source = MemorySource(lengths)
    stream = FrameBatches(source, source.keys, context=1, minibatch=32, buffer_frames=1500)
    emitted = 0
    peak = 0

    original_load = source.load

    def counting_load(key):
        feats, labels = original_load(key)
        loaded = sum(lengths[k] for k in source.loads)
        nonlocal peak
        peak = max(peak, loaded - emitted)
        assert loaded - emitted <= 1500 + lengths[key], (loaded, emitted)
        return feats, labels

    source.load = counting_load
    for _, y in stream.epoch(0):
        emitted += len(y)
    assert emitted == stream.num_steps * 32
    assert peak > 1500  # the buffer did fill (the bound is tight, not vacuous)


def test_num_steps_and_argument_errors(corpus):
    stream = make_batches(corpus, num_steps=5)
    assert len(list(stream.epoch(0))) == 5
    with pytest.raises(DataError, match="num_steps=100000"):
        make_batches(corpus, num_steps=100000)
    with pytest.raises(UserError, match="start_step 99999"):
        stream.epoch(0, start_step=99999)
    with pytest.raises(UserError, match="buffer_frames"):
        make_batches(corpus, buffer_frames=10)
    tiny = MemorySource({"a": 30, "b": 40})
    with pytest.raises(DataError, match=r"\[70\].*minibatch of 128"):
        FrameBatches(tiny, tiny.keys, minibatch=128)
    with pytest.raises(DataError, match="3 ranks"):
        FrameBatches(tiny, tiny.keys, minibatch=8, rank=0, size=3)


def test_bad_utterance_from_source_is_named():
    source = MemorySource({"a": 300, "b": 300}, num_pdfs=7)
    feats, labels = source.data["b"]
    source.data["b"] = (feats, np.where(labels == labels[0], 7, labels))
    with pytest.raises(DataError, match="utterance b: pdf id 7"):
        list(FrameBatches(source, source.keys, minibatch=16, buffer_frames=1000).epoch(0))
    source.data["b"] = (feats[:-1], labels[:-1])
    with pytest.raises(DataError, match="utterance b"):
        list(FrameBatches(source, source.keys, minibatch=16, buffer_frames=1000).epoch(0))


# --- CV stream ------------------------------------------------------------------------------


def test_cv_batches_all_frames_in_order(real_feats):
    class RealSource:
        keys = sorted(real_feats)
        num_frames = {k: v.shape[0] for k, v in real_feats.items()}
        feat_dim = 13
        num_pdfs = 5

        def load(self, key):
            n = real_feats[key].shape[0]
            return real_feats[key], np.arange(n) % 5

    source = RealSource()
    keys = source.keys[2:7]
    batches = list(cv_batches(source, keys, context=5, minibatch=128))
    total = sum(source.num_frames[k] for k in keys)
    assert [len(y) for _, y in batches] == [128] * (total // 128) + [total % 128]
    x = torch.cat([b[0] for b in batches]).numpy()
    y = torch.cat([b[1] for b in batches]).numpy()
    np.testing.assert_array_equal(x, np.concatenate([splice(real_feats[k], 5) for k in keys]))
    labels = np.concatenate([np.arange(source.num_frames[k]) % 5 for k in keys])
    np.testing.assert_array_equal(y, labels)
    assert x.shape[1] == 143
