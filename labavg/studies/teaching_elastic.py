"""What notebook 09's "Losing a worker and taking it back" shows of an elastic run
(on_rank_loss = "continue"): each worker's loss curve in pieces, the workers present over the
steps, and the membership changes in words, all from the run's typed events.

A lost launch rank's curve ends where its process died, and the process that joined in its
place (labavg.jobs.elastic_join.join: the same launch rank, the same shard) starts a new piece:
one process, one curve, so a class sees the gap. The cells start the run, lose a worker and
join one themselves (start_run, inject_fault, elastic_join.join); this module only reads what
the run recorded.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence

from labavg.base.events import (Averaged, Event, MemberJoined, MemberLost, MinibatchDone,
                                RunFinished, RunStarted)


def _changes(events: Sequence[Event]) -> list[MemberLost | MemberJoined]:
    """Each membership change once, in step order: every survivor records it, and the first
    to commit the round speaks for all (its time is when the job went on without the worker)."""
    seen: dict[tuple[str, int], MemberLost | MemberJoined] = {}
    for event in events:
        if isinstance(event, (MemberLost, MemberJoined)):
            key = (event.type, event.round)
            if key not in seen or event.time < seen[key].time:
                seen[key] = event
    return sorted(seen.values(), key=lambda e: (e.step, e.type != "member_lost"))


def loss_pieces(events: Sequence[Event], smooth: int = 1):
    """A DataFrame of each worker's training loss (nats per frame) over its steps, a rolling
    mean of `smooth` minibatches within each piece, with the column "worker": "rank r" for a
    worker present throughout, else one piece per process of that rank, "rank r, process 1:
    lost at step s", "rank r, process 2: joined at step j" (its first minibatch)."""
    import pandas as pd

    lost_at: dict[int, list[int]] = {}
    for change in _changes(events):
        if isinstance(change, MemberLost):
            for rank in change.lost:
                lost_at.setdefault(rank, []).append(change.step)
    frame = pd.DataFrame([(e.rank, e.step, e.loss) for e in events if isinstance(e, MinibatchDone)],
                         columns=["rank", "step", "loss"]).sort_values(["rank", "step"])
    workers = []
    for rank, steps in frame.groupby("rank")["step"]:
        losses = lost_at.get(rank, [])
        piece = [sum(step > lost for lost in losses) for step in steps]  # losses before it
        first = {i: int(s) for i, s in zip(reversed(piece), reversed(list(steps)))}
        for i in piece:
            words = ([f"joined at step {first[i]}"] if i > 0 else []) + (
                [f"lost at step {losses[i]}"] if i < len(losses) else [])
            workers.append(f"rank {rank}, process {i + 1}: {', '.join(words)}" if losses
                           else f"rank {rank}")
    frame["worker"] = workers
    frame["loss"] = frame.groupby("worker")["loss"].transform(
        lambda s: s.rolling(smooth, min_periods=1).mean())
    return frame.reset_index(drop=True)


def workers_present(events: Sequence[Event]):
    """A DataFrame of the workers present (column "N") from each step on: the start, each
    change and the run's last step (a step plot's right end)."""
    import pandas as pd

    start = next(e for e in events if isinstance(e, RunStarted))
    points = [(start.start_step, start.size)]
    points += [(change.step, change.size) for change in _changes(events)]
    finished = [e.step for e in events if isinstance(e, RunFinished)]
    last = max(finished) if finished else max(
        (e.step for e in events if isinstance(e, MinibatchDone)), default=points[-1][0])
    points.append((last, points[-1][1]))
    return pd.DataFrame(points, columns=["step", "N"])


def quarter_of_run(cfg) -> int:
    """The step at a quarter of `cfg`'s run, on an averaging round: where REPRODUCTION.md's
    elastic runs lose their worker (labavg.studies.reproduction.elastic.loss_step)."""
    from labavg.data.dataset import open_dataset
    from labavg.data.frames import split_cv, steps_per_epoch
    from labavg.studies.reproduction.elastic import loss_step

    source = open_dataset(cfg.data.data)
    keys, _ = split_cv(source.keys, cfg.data.cv_fraction, seed=cfg.seed)
    return loss_step(steps_per_epoch(keys, source.num_frames, cfg.ranks, cfg.minibatch),
                     cfg.epochs, cfg.effective_average_every())


def membership_lines(events: Sequence[Event], killed_at: float | None = None,
                     join_asked_at: float | None = None) -> list[str]:
    """Each membership change in words: its step, its round, the new N and what it cost in
    seconds. A loss: the round that found the worker gone, against the median of the others
    (and, given the kill's Unix time `killed_at`, the time from the kill to the first round
    committed without it). A join: from its request (`join_asked_at`) to its first round."""
    changes = _changes(events)
    first = min((c.rank for c in changes), default=0)  # one survivor's rounds speak for all
    changed = {c.step for c in changes}
    usual = sorted(e.comm_seconds for e in events if isinstance(e, Averaged) and e.rank == first
                   and e.step not in changed)
    median = f"{usual[len(usual) // 2]:.3f} s" if usual else "not measured"
    lines = []
    for change in changes:
        where = f"at step {change.step} (round {change.round}): N = {change.size}"
        if isinstance(change, MemberLost):
            ranks = ", ".join(map(str, change.lost))
            since = ("" if killed_at is None else
                     f"; the first round without it committed {change.time - killed_at:.2f} s "
                     f"after the kill")
            lines.append(f"member_lost: rank {ranks} {where}; the round that found it gone took "
                         f"{change.round_seconds:.2f} s, waiting for the lighthouse to drop it "
                         f"(a round's communication otherwise: {median}, median){since}")
        else:
            ranks = ", ".join(map(str, change.joined))
            took = ("" if join_asked_at is None else
                    f"; {change.time - join_asked_at:.1f} s from the join's request to its "
                    f"first round")
            lines.append(f"member_joined: rank {ranks} {where}{took}")
    return lines


@contextlib.contextmanager
def launcher_lines_as_output() -> Iterator[None]:
    """What the job's launcher writes on stderr while a cell follows an elastic run ("rank 3
    left the job (signal SIGKILL); 3 workers go on") shown as the cell's ordinary output: here
    it is the expected report of the loss the cell caused, not an error on a red background."""
    with contextlib.redirect_stderr(sys.stdout):
        yield
