"""Who trains in an elastic run (on_rank_loss = "continue", labavg.comm.elastic), round by round.

Each averaging round opens with the communicator's admission round: it says which launch ranks
are present, and lets in a worker started by `labavg train --join`, which receives a survivor's
state there (`state`/`load` below: what a checkpoint holds, the run's membership included) and
takes part from the next round. What changed becomes a MemberLost or MemberJoined event.

Decisions (docs/averaging.md, "Elastic runs"):
- a shard belongs to its launch rank, as Kaldi's archives belong to a job: a lost worker's shard
  goes untrained until a worker joins in its place (the join takes the lowest rank not running),
  and the summary counts the frames left untrained;
- the learning rate follows the workers present under `lr_scaling`, as Kaldi's effective
  learning rate follows num_jobs;
- the CV set is split over the workers present, so every CV figure covers all of it.

`run` below is the rank's labavg.training.rank._RankRun.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from labavg.base.events import Event, MemberJoined, MemberLost
from labavg.training.rank_state import Progress
from labavg.training.schedules import scale_lr


@dataclass
class Membership:
    """The workers present, and since which step each count held."""

    members: tuple[int, ...]
    steps: list[int] = field(default_factory=lambda: [0])
    counts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [len(self.members)]

    def change(self, members: tuple[int, ...], step: int) -> None:
        self.members = members
        if self.counts[-1] != len(members):
            self.steps.append(step)
            self.counts.append(len(members))

    def worker_steps(self, end: int) -> int:
        """Minibatches trained by all workers present, from the start to step `end`."""
        bounds = [*self.steps[1:], end]
        return sum(max(0, min(b, end) - a) * n for a, b, n in zip(self.steps, bounds, self.counts))

    def state_dict(self) -> dict[str, Any]:
        return {"members": list(self.members), "steps": list(self.steps),
                "counts": list(self.counts)}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "Membership":
        return cls(tuple(state["members"]), list(state["steps"]), list(state["counts"]))


def admit(comm: Any, membership: Membership, *, rank: int, step: int, rounds: int
          ) -> Iterator[Event]:
    """The admission round that opens an averaging round; events for what changed."""
    before = set(membership.members)
    start = time.perf_counter()
    present = comm.admit().members
    seconds = time.perf_counter() - start
    lost = tuple(sorted(before - set(present)))
    joined = tuple(sorted(set(present) - before))
    membership.change(present, step)
    if lost:
        yield MemberLost(rank=rank, step=step, round=rounds + 1, lost=lost, size=len(present),
                         round_seconds=seconds, time=time.time())
    if joined:
        yield MemberJoined(rank=rank, step=step, round=rounds + 1, joined=joined,
                           size=len(present), time=time.time())


def follow_members(run: Any) -> None:
    """The learning rate of the workers present, under the run's lr_scaling (Kaldi's
    effective learning rate follows num_jobs)."""
    n, cfg = len(run.membership.members), run.cfg
    run.lr0 = scale_lr(cfg.lr, n, cfg.lr_scaling)
    run.lr_final = scale_lr(cfg.final_learning_rate(), n, cfg.lr_scaling)


def elastic_state(run: Any) -> dict[str, Any]:
    """What a joining worker receives from a survivor: what a checkpoint holds, and who is
    present (tensors, numbers, lists: loadable with weights_only=True)."""
    # Unlike a checkpoint's (taken after a round, when the parameters are the global model),
    # this state is taken as a round opens: the global model is its own.
    return {"params": run.flat, "optimizer": run.optimizer.state_dict(),
            "progress": run.progress.state_dict(), "averager": run.averager.state_dict(),
            "global_model": getattr(run.averager, "global_model", None),
            "accepted_params": run.accepted_params, "membership": run.membership.state_dict(),
            "lr": run.lr}


def elastic_load(run: Any, state: dict[str, Any]) -> None:
    progress = Progress.from_state_dict(state["progress"])
    if not run.joining and progress.step != run.progress.step:
        # Dropped (stopped, or far behind) and back at a round: its epoch is at another step
        # than the survivors' state; a worker one round late (same step) heals and goes on.
        from labavg.comm.elastic import TooFewWorkers

        raise TooFewWorkers(f"rank {run.comm.rank} was dropped by the others (silent for longer "
                            f"than elastic.heartbeat_ms or elastic.join_timeout_ms: stopped?) and "
                            f"came back at step {run.progress.step}, the others at step "
                            f"{progress.step}; `labavg train --join` starts a worker in its place")
    run.flat.copy_(state["params"].to(run.flat.device))
    run.optimizer.load_state_dict(state["optimizer"])
    run.progress = progress
    run.averager.load_state_dict(state["averager"], run.flat)
    if state["global_model"] is not None:
        run.averager.global_model.copy_(state["global_model"].to(run.flat.device))
    accepted = state["accepted_params"]
    run.accepted_params = run.resumed_accepted = (None if accepted is None
                                                  else accepted.to(run.device))
    run.membership = Membership.from_state_dict(state["membership"])
    run.lr = state["lr"]
