"""How a run's data is laid out over its epochs when `labavg train --resume RUN --ranks M` takes
fewer ranks than the checkpoint holds (N), taken as an elastic run takes a lost worker
(labavg.training.membership):

- ranks 0..M-1 go on from their own files of the checkpoint: the model (every rank holds the
  averaged one after the round a checkpoint follows), their own optimizer, NG-SGD and averager
  state; ranks M..N-1 are the lost ones;
- the epoch in progress ends as it was planned: each rank keeps its shard of the N-way split and
  its number of minibatches, so the lost ranks' shards go untrained for the rest of that epoch
  (the summary counts those frames: `frames_untrained`);
- from the next epoch on, the data is split over the M ranks (more minibatches per epoch);
- the learning rate follows M under lr_scaling (the ranks' own scale_lr, as Kaldi's effective
  learning rate follows num_jobs), and the exponential schedule runs over the run's new length.

Each resize is kept in the checkpoint's progress (`Progress.resized`, [step, from N, to M]), so
that later resumes lay the epochs out the same way. A run never resized has one segment: the
split over its ranks from step 0, and every figure below is what it was before resizes existed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from labavg.data.frames import FrameBatches, steps_per_epoch


@dataclass(frozen=True)
class Segment:
    """From `step` on (the start of `epoch`), the data is split over `size` ranks."""

    step: int
    epoch: int
    size: int
    steps_per_epoch: int


class Layout:
    """Which split of the data each epoch uses, and how many ranks train from which step."""

    def __init__(self, batches: FrameBatches, keys: list[str], resized: list[list[int]],
                 epochs: int) -> None:
        self._keys, self._first = keys, batches
        self._batches = {batches.size: batches}
        self.resized = [list(r) for r in resized]
        first = self.resized[0][1] if self.resized else batches.size
        self.segments = [Segment(0, 0, first, self._steps(first))]
        self.workers = [(0, first)]  # (from step, ranks training)
        for step, _, size in self.resized:
            self._resize(step, size)
        last = self.segments[-1]
        self.total_steps = last.step + (epochs - last.epoch) * last.steps_per_epoch

    def _steps(self, size: int) -> int:
        b = self._first
        return (b.num_steps if size == b.size
                else steps_per_epoch(self._keys, b.source.num_frames, size, b.minibatch))

    def _resize(self, step: int, size: int) -> None:
        i = max(j for j, s in enumerate(self.segments) if s.step <= step)
        seg = self.segments[i]
        epoch, start = divmod(step - seg.step, seg.steps_per_epoch)
        # Mid-epoch, the epoch ends on the old split; the new one starts with the next epoch.
        new = Segment(step + (seg.steps_per_epoch - start if start else 0),
                      seg.epoch + epoch + (1 if start else 0), size, self._steps(size))
        self.segments = self.segments[:i] + ([seg] if new.step > seg.step else []) + [new]
        self.workers = [w for w in self.workers if w[0] < step] + [(step, size)]

    def _segment_at(self, step: int, strictly_before: bool = False) -> Segment:
        return [s for s in self.segments if s.step < step or (s.step == step and not strictly_before)
                ][-1]

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, minibatch within it) of the minibatch after `step` minibatches."""
        seg = self._segment_at(step)
        epoch, start = divmod(step - seg.step, seg.steps_per_epoch)
        return seg.epoch + epoch, start

    def epoch_ends(self, step: int) -> bool:
        """Whether the `step`-th minibatch (1-based) is the last of its epoch."""
        seg = self._segment_at(step, strictly_before=True)
        return (step - seg.step) % seg.steps_per_epoch == 0

    def steps_per_epoch(self) -> int:
        """Minibatches per epoch of the run's last split (what a resized run goes on with)."""
        return self.segments[-1].steps_per_epoch

    def batches(self, epoch: int) -> FrameBatches:
        """This rank's minibatches of `epoch`, on the split that epoch uses."""
        seg = [s for s in self.segments if s.epoch <= epoch][-1]
        if seg.size not in self._batches:
            b = self._first
            self._batches[seg.size] = FrameBatches(
                b.source, self._keys, context=b.context, minibatch=b.minibatch,
                buffer_frames=b.buffer_frames, seed=b.seed, rank=b.rank, size=seg.size,
                num_steps=seg.steps_per_epoch)
        return self._batches[seg.size]

    def worker_steps(self, end: int, spans: list[tuple[int, int]] | None = None) -> int:
        """Minibatches trained by all ranks in the first `end` steps (by `spans`' ranks)."""
        spans = self.workers if spans is None else spans
        bounds = [s for s, _ in spans[1:]] + [end]
        return sum(max(0, min(b, end) - a) * n for (a, n), b in zip(spans, bounds))

    def finished_fields(self, end: int, minibatch: int, size: int) -> dict[str, Any]:
        """A resized run's RunFinished fields: who trained when, what was left untrained."""
        if not self.resized:
            return {}
        planned = self.worker_steps(end, [(s.step, s.size) for s in self.segments])
        return {"worker_steps": tuple(s for s, _ in self.workers),
                "worker_counts": tuple(n for _, n in self.workers),
                "members": tuple(range(size)),
                "frames_untrained": minibatch * (planned - self.worker_steps(end))}


def resized(progress_resized: list[list[int]], step: int, restored: Any, size: int
            ) -> list[list[int]]:
    """The run's resizes, with this resume's when it takes another number of ranks than the
    checkpoint holds (`restored`: labavg.training.rank_state.Restored, None when it starts
    afresh)."""
    if restored is None or restored.size in (0, size):
        return progress_resized
    return [r for r in progress_resized if r[0] < step] + [[step, restored.size, size]]
