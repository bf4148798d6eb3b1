"""What a training loop may ask of an averager, whatever its method, hierarchy or overlap.

The trainer (labavg.training.rank) holds a `RoundAverager` and asks nothing else of it: after
every minibatch `due` says whether a round is due and of which scope (`observe` has seen its loss first); `round` runs it and
returns an AverageStats (labavg.averaging.mean), whose fields cover what any kind of round
measures (node rounds, overlapped means) and are zero where they do not apply; `describe` is
what the run reports once before training. Checkpoints go through `state_dict` and
`load_state_dict`, Newbob's rollback through `restart`. Averager (labavg.averaging.methods),
HierarchicalAverager (labavg.averaging.hierarchy) and OverlapAverager (labavg.averaging.overlap)
implement it; a new kind of round implements it too and needs no change to the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from labavg.averaging.mean import AverageStats


@dataclass(frozen=True)
class AveragerInfo:
    """How an averager averages, as the run reports it (labavg.base.events.RunStarted's fields)."""

    averaging: str  # the method (labavg.averaging.methods)
    reduce: str  # the algorithm computing the mean (labavg.comm.reduce)
    payload: str  # what a round sends: fp32, bf16, fp16, int4, int8, int16
    bytes_per_round: int  # what this rank puts into a round's collective across all ranks
    hierarchy_every: int = 0  # minibatches between rounds across nodes (0: no hierarchy)
    node_ranks: int = 0  # ranks in this rank's node (0: no hierarchy)
    overlap: str = "none"  # none, eager, streaming
    fragment_bytes: tuple[int, ...] = ()  # overlap: what a round of each fragment sends


class RoundAverager(Protocol):
    """The averaging policy of one rank's run (module docstring)."""

    average_every: int  # K in force: the minibatches from the last round to the next

    def observe(self, loss_sum: float, frames: int) -> None:
        """The minibatch just trained: its loss summed over `frames` frames (a schedule that
        follows the loss keeps it, labavg.averaging.schedule)."""
        ...

    def due(self, step: int, end_of_epoch: bool) -> str | None:
        """The scope of the round after minibatch `step`, or None when no round is due."""
        ...

    def round(self, flat: torch.Tensor, stop: bool = False, scope: str = "all") -> AverageStats:
        """Run the round of `scope` (as `due` gave it) on this rank's parameters, in place;
        every rank calls it at once. `stop`: this rank asks all of them to stop."""
        ...

    def describe(self, flat: torch.Tensor) -> AveragerInfo:
        """What the run reports of this averager, for parameters like `flat`."""
        ...

    def restart(self, flat: torch.Tensor) -> None:
        """Start the next block from `flat` with fresh outer state (Newbob's rollback)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs besides the parameters (loadable with weights_only=True)."""
        ...

    def load_state_dict(self, state: dict[str, Any] | None, flat: torch.Tensor) -> None:
        """Continue from a checkpoint whose parameters `flat` has just been loaded."""
        ...
