"""The frame pipeline: splicing, the CV split, sharding over ranks, shuffling, minibatches.

Training follows Kaldi nnet1 (src/nnetbin/nnet-train-frmshuff.cc): utterances are spliced one at
a time, their frames are poured into a bounded randomizer buffer (src/nnet/nnet-randomizer.cc,
`MatrixRandomizer`, defaults --randomizer-size=32768 --minibatch-size=256), the buffer is permuted
and emptied in minibatches, and the frames left over (fewer than a minibatch) stay for the next
fill. So a corpus of any size streams through memory of about one buffer.

For model averaging (Su & Chen 2015) every rank must run the same number of minibatches between
averagings, so each rank computes every shard from `num_frames` alone (no communication) and all
ranks stop an epoch after the same `steps_per_epoch` minibatches; a rank with more frames than the
poorest drops the frames it did not reach (the tail of its shuffled order, a different tail each
epoch).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # imported where batches are made: a job's launcher splits and counts
    import torch  # the data without it (labavg.training.runner.check_fits)

from labavg.data.base import UtteranceSource
from labavg.base.errors import DataError, UserError


def splice(feats: np.ndarray, context: int) -> np.ndarray:
    """Kaldi `splice-feats --left-context=c --right-context=c`: stack 2c+1 neighbouring frames.

    Output frame t is feats[clip(t-c)], ..., feats[clip(t+c)] concatenated, the first/last frame
    repeated at the edges (src/feat/feature-functions.cc, `SpliceFrames`). [T, D] -> [T, D*(2c+1)].
    """
    feats = np.asarray(feats)
    if feats.ndim != 2:
        raise ValueError(f"splice expects a [frames, dim] matrix, got shape {feats.shape}")
    return _splice_rows(feats, np.arange(feats.shape[0]), context)


def _splice_rows(feats: np.ndarray, rows: np.ndarray, context: int) -> np.ndarray:
    """Spliced frames `rows` of `feats` only (resume needs a few frames of an utterance)."""
    _check_context(context)
    num_rows, dim = feats.shape
    width = 2 * context + 1
    if num_rows == 0:
        return np.empty((len(rows), dim * width), dtype=feats.dtype)
    neighbours = np.clip(rows[:, None] + np.arange(-context, context + 1), 0, num_rows - 1)
    return feats[neighbours].reshape(len(rows), dim * width)


def split_cv(
    keys: list[str], cv_fraction: float = 0.1, seed: int = 0
) -> tuple[list[str], list[str]]:
    """Hold out a fraction of the utterances for cross-validation: returns (train, cv), sorted.

    Depends only on the set of keys, the fraction and the seed (never on the number of ranks), so
    every rank computes the same split. At least one CV utterance when the fraction is positive
    and there are two or more utterances; at least one training utterance always remains.
    """
    if not 0.0 <= cv_fraction < 1.0:
        raise UserError(f"cv_fraction must be in [0, 1), got {cv_fraction!r}")
    ordered = sorted(keys)
    _check_unique(ordered)
    num_cv = math.floor(cv_fraction * len(ordered) + 0.5)
    if cv_fraction > 0 and len(ordered) >= 2:
        num_cv = min(max(num_cv, 1), len(ordered) - 1)
    else:
        num_cv = 0
    held_out = np.random.default_rng(_seed_sequence(seed)).permutation(len(ordered))[:num_cv]
    is_cv = np.zeros(len(ordered), dtype=bool)
    is_cv[held_out] = True
    train = [k for k, cv in zip(ordered, is_cv) if not cv]
    cv = [k for k, cv in zip(ordered, is_cv) if cv]
    return train, cv


def shard(keys: Sequence[str], num_frames: dict[str, int], rank: int, size: int) -> list[str]:
    """The utterances of `rank` out of `size` ranks, sorted, with frames balanced over ranks.

    Longest utterance first, each to the rank with the fewest frames so far (ties to the lowest
    rank): deterministic, so every rank computes every shard locally.
    """
    if not 0 <= rank < size:
        raise UserError(f"rank {rank} is outside 0..{size - 1} (size {size})")
    return _deal(keys, num_frames, size)[rank]


def steps_per_epoch(
    keys: Sequence[str], num_frames: dict[str, int], size: int, minibatch: int
) -> int:
    """Minibatches per epoch common to all ranks: min over ranks of floor(rank frames / minibatch).

    Ranks stay in lockstep for averaging; each rank drops the frames beyond that many minibatches.
    """
    _check_positive("minibatch", minibatch)
    totals = [_count_frames(s, num_frames) for s in _deal(keys, num_frames, size)]
    steps = min(totals) // minibatch
    if steps == 0:
        raise DataError(
            f"too little training data: the {size} shard(s) hold {totals} frames, fewer than one "
            f"minibatch of {minibatch} frames on the smallest"
        )
    return steps


class FrameBatches:
    """One rank's training stream of shuffled, spliced minibatches (x float32, y int64, on CPU).

    `keys` are all training utterances; this rank keeps `shard(keys, ..., rank, size)`.
    `num_steps` defaults to `steps_per_epoch` over all ranks; every epoch yields exactly that many.
    """

    def __init__(
        self,
        source: UtteranceSource,
        keys: Sequence[str],
        *,
        context: int = 5,
        minibatch: int = 256,
        buffer_frames: int = 32768,
        seed: int = 0,
        rank: int = 0,
        size: int = 1,
        num_steps: int | None = None,
    ) -> None:
        _check_context(context)
        _check_positive("minibatch", minibatch)
        if buffer_frames < minibatch:
            raise UserError(
                f"buffer_frames ({buffer_frames}) must be at least the minibatch ({minibatch})"
            )
        _seed_sequence(seed)
        self.source = source
        self.context = context
        self.minibatch = minibatch
        self.buffer_frames = buffer_frames
        self.seed = seed
        self.rank = rank
        self.size = size
        self.keys = shard(keys, source.num_frames, rank, size)
        self.input_dim = source.feat_dim * (2 * context + 1)
        self.num_frames = _count_frames(self.keys, source.num_frames)
        available = self.num_frames // minibatch
        if num_steps is None:
            num_steps = steps_per_epoch(keys, source.num_frames, size, minibatch)
        _check_positive("num_steps", num_steps)
        if num_steps > available:
            raise DataError(
                f"rank {rank} holds {self.num_frames} frames, only {available} minibatches of "
                f"{minibatch}, fewer than num_steps={num_steps}"
            )
        self.num_steps = num_steps

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The minibatches start_step..num_steps-1 of `epoch`, the same as an uninterrupted epoch.

        Skipped buffers are planned from `num_frames` alone (the random draws only depend on
        frame counts) and never loaded.
        """
        if not 0 <= start_step <= self.num_steps:
            raise UserError(f"start_step {start_step} is outside 0..{self.num_steps}")
        rng = np.random.default_rng(_seed_sequence(self.seed, epoch, self.rank))
        order = [self.keys[i] for i in rng.permutation(len(self.keys))]
        lengths = np.array([self.source.num_frames[k] for k in order], dtype=np.int64)
        return self._stream(order, lengths, rng, start_step)

    def _stream(
        self, order: list[str], lengths: np.ndarray, rng: np.random.Generator, start_step: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        import torch

        starts = np.concatenate([[0], np.cumsum(lengths)])
        if start_step == self.num_steps:
            return
        step = 0
        carry: tuple[np.ndarray, np.ndarray] | None = None
        for fill in _plan(lengths, starts, rng, self.buffer_frames, self.minibatch):
            if step + fill.num_batches <= start_step:
                step += fill.num_batches
                continue
            if carry is None:
                carry = self._load_frames(order, starts, fill.ids[: fill.num_carried])
            x, y = self._fill_buffer(order, lengths, fill, carry)
            carry = None
            for j in range(fill.num_batches):
                if step >= self.num_steps:
                    return
                if step >= start_step:
                    rows = fill.perm[j * self.minibatch : (j + 1) * self.minibatch]
                    yield torch.from_numpy(x.take(rows, axis=0)), torch.from_numpy(y.take(rows))
                step += 1
            if step >= self.num_steps:
                return
            rest = fill.perm[fill.num_batches * self.minibatch :]
            carry = (x.take(rest, axis=0), y.take(rest))
            del x, y  # free the buffer before the next fill loads anything

    def _fill_buffer(
        self,
        order: list[str],
        lengths: np.ndarray,
        fill: _Fill,
        carry: tuple[np.ndarray, np.ndarray],
    ) -> tuple[np.ndarray, np.ndarray]:
        """Carried frames then the fill's new utterances, spliced, in `fill.ids` order."""
        x = np.empty((len(fill.ids), self.input_dim), dtype=np.float32)
        y = np.empty(len(fill.ids), dtype=np.int64)
        x[: fill.num_carried], y[: fill.num_carried] = carry
        row = fill.num_carried
        for pos in range(fill.first_utt, fill.end_utt):
            feats, labels = self._load(order[pos])
            x[row : row + lengths[pos]] = splice(feats, self.context)
            y[row : row + lengths[pos]] = labels
            row += lengths[pos]
        return x, y

    def _load_frames(
        self, order: list[str], starts: np.ndarray, ids: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Spliced frames with epoch-global ids `ids` (a resumed fill's carried frames)."""
        x = np.empty((len(ids), self.input_dim), dtype=np.float32)
        y = np.empty(len(ids), dtype=np.int64)
        positions = np.searchsorted(starts, ids, side="right") - 1
        for pos in np.unique(positions):
            mask = positions == pos
            feats, labels = self._load(order[pos])
            rows = ids[mask] - starts[pos]
            x[mask] = _splice_rows(feats, rows, self.context)
            y[mask] = labels[rows]
        return x, y

    def _load(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        return _load_checked(self.source, key)


def cv_batches(
    source: UtteranceSource, keys: Sequence[str], *, context: int = 5, minibatch: int = 4096
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """All frames of `keys` in order, spliced, unshuffled; the last batch may be short."""
    _check_context(context)
    _check_positive("minibatch", minibatch)
    return _cv_stream(source, list(keys), context, minibatch)


def _cv_stream(
    source: UtteranceSource, keys: list[str], context: int, minibatch: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    import torch

    pending_x: list[np.ndarray] = []
    pending_y: list[np.ndarray] = []
    num_pending = 0
    for key in keys:
        feats, labels = _load_checked(source, key)
        pending_x.append(splice(feats, context))
        pending_y.append(labels)
        num_pending += len(labels)
        if num_pending < minibatch:
            continue
        x, y = np.concatenate(pending_x), np.concatenate(pending_y)
        num_full = num_pending // minibatch * minibatch
        for begin in range(0, num_full, minibatch):
            yield (
                torch.from_numpy(x[begin : begin + minibatch].copy()),
                torch.from_numpy(y[begin : begin + minibatch].copy()),
            )
        pending_x, pending_y = [x[num_full:]], [y[num_full:]]
        num_pending -= num_full
    if num_pending:
        x, y = np.concatenate(pending_x), np.concatenate(pending_y)
        yield torch.from_numpy(x), torch.from_numpy(y)


@dataclass(frozen=True)
class _Fill:
    """One randomizer fill, known from frame counts alone.

    `ids` are epoch-global frame ids (offset of the utterance in the epoch order + frame index):
    first the frames carried over from the previous fill, then those of utterances
    first_utt..end_utt-1. Minibatch j is ids[perm[j*B:(j+1)*B]].
    """

    first_utt: int
    end_utt: int
    ids: np.ndarray
    num_carried: int
    perm: np.ndarray
    num_batches: int


def _plan(
    lengths: np.ndarray,
    starts: np.ndarray,
    rng: np.random.Generator,
    buffer_frames: int,
    minibatch: int,
) -> Iterator[_Fill]:
    """The fills of one epoch, as in nnet1's MatrixRandomizer: fill to >= buffer_frames, permute,
    emit whole minibatches, carry the rest (< minibatch) into the next fill."""
    carried = np.empty(0, dtype=np.int64)
    first = 0
    while True:
        end, total = first, len(carried)
        while end < len(lengths) and total < buffer_frames:
            total += int(lengths[end])
            end += 1
        if total < minibatch:
            return  # end of the epoch's data: the leftover frames are dropped
        ids = np.concatenate([carried, np.arange(starts[first], starts[end], dtype=np.int64)])
        perm = rng.permutation(total)
        num_batches = total // minibatch
        yield _Fill(first, end, ids, len(carried), perm, num_batches)
        carried = ids[perm[num_batches * minibatch :]]
        first = end


def _deal(keys: Sequence[str], num_frames: dict[str, int], size: int) -> list[list[str]]:
    """All ranks' shards (each sorted): longest first, to the rank with the fewest frames."""
    _check_positive("size", size)
    _check_unique(sorted(keys))
    if size > len(keys):
        raise DataError(
            f"{size} ranks but only {len(keys)} training utterances: every rank needs at least one"
        )
    lengths = {k: _frames_of(k, num_frames) for k in keys}
    by_length = sorted(keys, key=lambda k: (-lengths[k], k))
    heap = [(0, r) for r in range(size)]  # (frames so far, rank): ties go to the lowest rank
    shards: list[list[str]] = [[] for _ in range(size)]
    for key in by_length:
        frames, rank = heapq.heappop(heap)
        shards[rank].append(key)
        heapq.heappush(heap, (frames + lengths[key], rank))
    return [sorted(s) for s in shards]


def _load_checked(source: UtteranceSource, key: str) -> tuple[np.ndarray, np.ndarray]:
    """`source.load(key)` as float32/int64, checked against num_frames, feat_dim and num_pdfs."""
    feats, labels = source.load(key)
    feats = np.asarray(feats, dtype=np.float32)
    labels = np.asarray(labels, dtype=np.int64)
    expected = source.num_frames[key]
    if feats.shape != (expected, source.feat_dim) or labels.shape != (expected,):
        raise DataError(
            f"utterance {key}: features {feats.shape} and labels {labels.shape} do not match "
            f"num_frames={expected}, feat_dim={source.feat_dim}"
        )
    if expected and (labels.min() < 0 or labels.max() >= source.num_pdfs):
        bad = labels[(labels < 0) | (labels >= source.num_pdfs)][0]
        raise DataError(f"utterance {key}: pdf id {bad} outside 0..{source.num_pdfs - 1}")
    return feats, labels


def _frames_of(key: str, num_frames: dict[str, int]) -> int:
    if key not in num_frames:
        raise DataError(f"utterance {key} has no frame count (not in the features)")
    return int(num_frames[key])


def _count_frames(keys: Sequence[str], num_frames: dict[str, int]) -> int:
    return sum(_frames_of(k, num_frames) for k in keys)


def _check_unique(sorted_keys: list[str]) -> None:
    for a, b in zip(sorted_keys, sorted_keys[1:]):
        if a == b:
            raise DataError(f"utterance {a} appears more than once")


def _check_context(context: int) -> None:
    if context < 0:
        raise UserError(f"splice context must be >= 0, got {context}")


def _check_positive(name: str, value: int) -> None:
    if value < 1:
        raise UserError(f"{name} must be >= 1, got {value}")


def _seed_sequence(*entropy: int) -> np.random.SeedSequence:
    """A seed stream per (seed, epoch, rank) tuple; numpy rejects negative entropy."""
    if any(e < 0 for e in entropy):
        raise UserError(f"seeds and epochs must be >= 0, got {entropy}")
    return np.random.SeedSequence(list(entropy))


def feature_stats(
    source: UtteranceSource, keys: Sequence[str], context: int, max_frames: int = 200_000
) -> tuple[np.ndarray, np.ndarray]:
    """Mean and standard deviation of the spliced input, for nnet1's global feature transform.

    nnet1 measures them on spliced training features (`compute-cmvn-stats` over
    `feature_transform`). A spliced frame is 2c+1 copies of frame statistics, so measuring the
    unspliced frames and tiling is the same up to edge frames. The same leading utterances
    (sorted keys, up to `max_frames`) are used on every rank, so all ranks agree without
    communicating.
    """
    total = np.zeros(source.feat_dim)
    total_sq = np.zeros(source.feat_dim)
    count = 0
    for key in sorted(keys):
        feats, _ = source.load(key)
        feats = feats.astype(np.float64)
        total += feats.sum(axis=0)
        total_sq += np.square(feats).sum(axis=0)
        count += len(feats)
        if count >= max_frames:
            break
    if count == 0:
        raise DataError("no training frames to compute the input normalisation from")
    mean = total / count
    std = np.sqrt(np.maximum(total_sq / count - np.square(mean), 0.0))
    reps = 2 * context + 1
    return np.tile(mean, reps), np.tile(std, reps)
