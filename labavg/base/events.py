"""Typed events the trainer yields; one JSON object per line in RUN_DIR/events.jsonl.

Every event has `type` and `rank`. The fields of each type are the dataclasses below
(docs/events.md lists them). Times are seconds, losses are mean cross-entropy per frame in
nats, accuracies are fractions in [0, 1], `step` counts minibatches from the start of the run.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class Event:
    """Base of all events."""

    type: ClassVar[str] = "event"
    rank: int

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with the event's `type` first."""
        return {"type": self.type, **dataclasses.asdict(self)}


@dataclass(frozen=True)
class RunStarted(Event):
    """Once per rank, before training: what is about to run."""

    type: ClassVar[str] = "run_started"
    size: int
    pid: int  # of the process running this rank (to name a lost rank from a launcher's report)
    host: str
    device: str
    num_params: int
    num_pdfs: int
    input_dim: int
    steps_per_epoch: int
    train_utterances: int
    cv_utterances: int
    average_every: int
    effective_lr: float
    start_step: int
    averaging: str = "model"  # the averaging method (labavg.averaging.methods)
    reduce: str = "allreduce"  # the algorithm computing the mean (labavg.comm.reduce)
    payload: str = "fp32"  # what a round sends: fp32, bf16, fp16, int4, int8, int16
    bytes_per_round: int = 0  # what each rank puts into a round's collective across all ranks
    hierarchy_every: int = 0  # K2, minibatches between rounds across nodes (0: no hierarchy)
    node_ranks: int = 0  # ranks in this rank's node (0: no hierarchy)
    overlap: str = "none"  # none, eager, streaming (labavg.averaging.overlap)
    fragment_bytes: tuple[int, ...] = ()  # overlap: what a round of each fragment sends
    backend: str = ""  # inproc, mpi or torch
    cores: int = 0  # CPU cores the run's ranks may use, over all their hosts (0: not known)
    load: float | None = None  # this host's 1-minute load average as the rank started


@dataclass(frozen=True)
class MinibatchDone(Event):
    """One optimizer step on one rank."""

    type: ClassVar[str] = "minibatch"
    epoch: int
    step: int
    loss: float
    frame_accuracy: float
    frames: int
    lr: float
    applied: bool
    max_change_scale: float


@dataclass(frozen=True)
class Averaged(Event):
    """One averaging round on one rank; `divergence` was measured just before averaging."""

    type: ClassVar[str] = "average"
    round: int
    step: int
    divergence: float
    compute_seconds: float  # since the previous round
    comm_seconds: float
    frames_per_second: float  # this rank's training frames / compute seconds in the round
    bytes_sent: int = 0  # the parameter buffer (or compressed change) this rank sent this round
    scope: str = "all"  # "node": among this rank's node only ([averaging.hierarchy]); "all": every rank
    # (blocking); "overlap": every rank, the mean running while the next K minibatches compute
    wait_seconds: float = 0.0  # overlap: inside the wait for the mean started one round earlier
    in_flight_seconds: float = 0.0  # overlap: that mean's start to the end of its wait
    # K from this round to the next (averaging.schedule: it may change at a round); 0 in the
    # logs of runs made before it was recorded
    average_every: int = 0


@dataclass(frozen=True)
class EpochDone(Event):
    """End of an epoch: cross-validation of the (averaged) model."""

    type: ClassVar[str] = "epoch"
    epoch: int
    step: int
    train_loss: float
    train_frame_accuracy: float
    cv_loss: float
    cv_frame_accuracy: float
    lr: float
    accepted: bool  # False when Newbob rejected the epoch and restored the previous model
    seconds: float


@dataclass(frozen=True)
class CVChecked(Event):
    """A held-out CV check (`cv_every`): every cv_every minibatches and at each epoch end, the
    mean of the workers' models on the whole CV set, with the training time it took to get
    there (time to accuracy, read from the events alone)."""

    type: ClassVar[str] = "cv"
    epoch: int
    step: int
    epochs: float  # epochs trained at the check: `epoch` + the part of it done (1.0: its end)
    cv_loss: float
    cv_frame_accuracy: float
    # Training wall seconds from the run's first minibatch to the check, summed over resumes:
    # setup, RBM pretraining and every CV pass (this one included) are left out.
    train_seconds: float
    cv_seconds: float  # this check's own wall seconds, the mean of the models included
    epoch_end: bool = False  # the epoch end's CV (the averaged model), not a check inside it


@dataclass(frozen=True)
class CheckpointSaved(Event):
    """A checkpoint all ranks can resume from."""

    type: ClassVar[str] = "checkpoint"
    step: int
    path: str


@dataclass(frozen=True)
class Message(Event):
    """Something worth telling the user (a skipped update, an early stop)."""

    type: ClassVar[str] = "message"
    step: int
    text: str


@dataclass(frozen=True)
class SpeedupPair(Event):
    """Rank 0, a few times a run: one paired speedup measurement (labavg.jobs.speedup).

    Rank 0 trained `solo_steps` minibatches alone on a scratch copy of its model while the
    other ranks waited idle, then every rank trained the next `parallel_steps` minibatches and
    averaged: seconds per minibatch of each, measured back to back under the same load.
    """

    type: ClassVar[str] = "speedup_pair"
    step: int
    round: int
    solo_step_seconds: float
    parallel_step_seconds: float
    solo_steps: int
    parallel_steps: int


@dataclass(frozen=True)
class RunFinished(Event):
    """Once per rank, after training."""

    type: ClassVar[str] = "run_finished"
    step: int
    wall_seconds: float
    compute_seconds: float
    comm_seconds: float
    averaging_rounds: int
    frames_trained: int  # over all ranks
    cv_loss: float
    cv_frame_accuracy: float
    stopped: bool = False  # True when stopped on request before the planned end
    bytes_sent: int = 0  # this rank's parameter bytes over all averaging rounds
    node_rounds: int = 0  # of averaging_rounds, those within the node only ([averaging.hierarchy])
    node_bytes_sent: int = 0  # of bytes_sent, those of the node rounds
    overlap_seconds: float = 0.0  # of comm_seconds, those spent on non-blocking means
    overlap_bytes_sent: int = 0  # of bytes_sent, those sent by non-blocking means
    wait_seconds: float = 0.0  # of overlap_seconds, those inside the waits
    # An elastic run (on_rank_loss = "continue"): the number of workers present from each of
    # `worker_steps` on (the start and each change), and the launch ranks present at the end.
    # Empty otherwise.
    worker_steps: tuple[int, ...] = ()
    worker_counts: tuple[int, ...] = ()
    members: tuple[int, ...] = ()
    # A run resumed on fewer ranks (labavg.training.resume_layout): the frames of the lost
    # ranks' shards left untrained for the rest of the epoch they were lost in. None otherwise.
    frames_untrained: int | None = None


@dataclass(frozen=True)
class MemberLost(Event):
    """An elastic run's first round committed without a worker (labavg.comm.elastic)."""

    type: ClassVar[str] = "member_lost"
    step: int
    round: int
    lost: tuple[int, ...]  # launch ranks
    size: int  # workers present now
    round_seconds: float  # this round on this rank: the wait for the lighthouse to drop it too
    time: float  # Unix time the round committed: a kill's time from it is the recovery time


@dataclass(frozen=True)
class MemberJoined(Event):
    """A worker that healed at the round before took part in an elastic run's round."""

    type: ClassVar[str] = "member_joined"
    step: int
    round: int
    joined: tuple[int, ...]  # launch ranks
    size: int
    time: float


EVENT_TYPES: dict[str, type[Event]] = {cls.type: cls for cls in (
    RunStarted, MinibatchDone, Averaged, EpochDone, CVChecked, CheckpointSaved, Message,
    SpeedupPair, RunFinished, MemberLost, MemberJoined)}


def event_from_dict(values: Any) -> Event | None:
    """The typed event of one events.jsonl object (what `Event.to_dict` wrote); None for
    anything else a line can hold: JSON that is not an object, a type this labavg does not
    know, an object that lacks one of its type's fields or has one of the wrong type (a
    reader then skips it as a torn line). Fields added since the event was written take their
    defaults; fields it does not know are left out."""
    found = _typed_fields(values)
    if found is None:
        return None
    cls, fields = found
    for name in _TUPLE_FIELDS.get(cls, ()):
        if isinstance(fields.get(name), list):
            fields[name] = tuple(fields[name])  # JSON has no tuples
    return cls(**fields)


# Each event type's fields declared as tuples, which JSON gives back as lists.
_TUPLE_FIELDS: dict[type[Event], tuple[str, ...]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls) if str(f.type).startswith("tuple"))
    for cls in EVENT_TYPES.values()}


def well_formed(values: Any) -> bool:
    """Whether one events.jsonl line's JSON value is an event a reader can index by its
    fields: an object with a text `type`, a `rank` >= 0 and, if it has one, an integer
    `step`; of a type this labavg knows, one `event_from_dict` reads. A newer labavg's types
    pass (a reader of typed events leaves them out)."""
    if not isinstance(values, Mapping) or not isinstance(values.get("type"), str):
        return False
    if values["type"] in EVENT_TYPES:
        return _typed_fields(values) is not None
    rank, step = values.get("rank"), values.get("step", 0)
    return _is_int(rank) and rank >= 0 and _is_int(step)


def _typed_fields(values: Any) -> tuple[type[Event], dict[str, Any]] | None:
    """(event class, its fields) of an events.jsonl object of a known type whose every
    field has its type and whose rank is >= 0; None for anything else."""
    if not isinstance(values, Mapping):
        return None
    kind = values.get("type")
    cls = EVENT_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        return None
    accepts, required = _field_types(cls)
    fields = {}
    for key, value in values.items():
        allowed = accepts.get(key)
        if allowed is None:
            continue  # `type`, or a field of a newer labavg
        if type(value) not in allowed and not (
                allowed is _INTS and isinstance(value, list) and all(map(_is_int, value))):
            return None
        fields[key] = value
    if not required <= fields.keys() or fields["rank"] < 0:
        return None
    return cls, fields


def _is_int(value: Any) -> bool:
    return type(value) is int


# The Python types a JSON value of a field's type may have (json gives exact types: a bool is
# never an int here, an int is a float); _INTS: a list of ints (JSON has no tuples).
_INTS: frozenset[type] = frozenset({tuple})
_JSON_TYPES = {bool: {bool}, int: {int}, float: {int, float}, str: {str}, type(None): {type(None)}}


@functools.cache
def _field_types(cls: type[Event]) -> tuple[dict[str, frozenset[type]], frozenset[str]]:
    """For each field of an event class, the types a JSON value of it may have; and the
    fields without a default."""
    hints = typing.get_type_hints(cls)
    accepts = {f.name: _accepts(hints[f.name]) for f in dataclasses.fields(cls)}
    required = frozenset(f.name for f in dataclasses.fields(cls)
                         if f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)
    return accepts, required


def _accepts(hint: Any) -> frozenset[type]:
    if typing.get_origin(hint) is tuple:
        return _INTS
    options = (typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType)
               else (hint,))
    return frozenset().union(*(_JSON_TYPES[option] for option in options))
