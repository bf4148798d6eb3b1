"""What a rank checkpoints besides its model and optimizer (`Progress`), and the checkpoint
itself: saving it after a round, restoring it on resume."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from labavg.averaging.interface import RoundAverager
from labavg.averaging.mean import AverageStats
from labavg.base import checkpoint
from labavg.training.config import TrainConfig
from labavg.base.settings import to_dict
from labavg.base.errors import UserError
from labavg.base.events import CheckpointSaved
from labavg.comm.base import Communicator
from labavg.optim.base import Optimizer
from labavg.training.schedules import NewbobState


@dataclass
class Progress:
    """What changes on a rank as training goes on, besides the model and optimizer.

    Checkpointed with them. No random-number state is needed: after initialisation the only
    randomness is the data order, a pure function of (seed, epoch, rank).
    """

    step: int = 0  # minibatches done since the start of the run
    rounds: int = 0  # averaging rounds done
    bytes_sent: int = 0  # parameter (or payload) bytes this rank put into the rounds' collectives
    node_rounds: int = 0  # of `rounds`, those within the node only ([averaging.hierarchy])
    node_bytes_sent: int = 0  # of `bytes_sent`, those of the node rounds
    overlap_seconds: float = 0.0  # of `comm_seconds`, those of non-blocking means (overlap)
    overlap_bytes_sent: int = 0  # of `bytes_sent`, those of non-blocking means
    wait_seconds: float = 0.0  # of `overlap_seconds`, those inside the waits
    compute_seconds: float = 0.0
    comm_seconds: float = 0.0
    wall_seconds: float = 0.0  # training wall time up to the last checkpoint (resumes add to it)
    # The training clock of time to accuracy (labavg.training.cv_check): wall seconds of
    # training from the run's first minibatch, every CV pass left out; resumes add to it.
    train_seconds: float = 0.0
    epoch_sums: torch.Tensor = field(  # this epoch's [summed loss, correct, frames]
        default_factory=lambda: torch.zeros(3, dtype=torch.float64)
    )
    newbob: NewbobState | None = None
    # [step, from N, to M] of each resume on fewer ranks (labavg.training.resume_layout)
    resized: list[list[int]] = field(default_factory=list)

    def add_round(self, stats: AverageStats) -> None:
        """Count one averaging round and what it measured."""
        self.rounds += 1
        self.comm_seconds += stats.comm_seconds
        self.bytes_sent += stats.bytes_sent
        if stats.within_node:
            self.node_rounds += 1
            self.node_bytes_sent += stats.bytes_sent
        self.overlap_seconds += stats.overlap_seconds
        self.overlap_bytes_sent += stats.overlap_bytes
        self.wait_seconds += stats.wait_seconds

    def state_dict(self) -> dict[str, Any]:
        """Plain values and tensors (loadable with weights_only=True)."""
        return {**asdict(self), "epoch_sums": self.epoch_sums.clone(),
                "newbob": None if self.newbob is None else asdict(self.newbob)}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> Progress:
        """Inverse of state_dict."""
        newbob = state.get("newbob")
        return cls(**{**state, "newbob": None if newbob is None else NewbobState(**newbob)})


@dataclass(frozen=True)
class Restored:
    """What a rank's checkpoint holds besides the parameters and the optimizer's state."""

    progress: Progress
    accepted_params: torch.Tensor | None  # Newbob's accepted model, when taken mid-epoch
    averager_state: dict[str, Any] | None  # None: a checkpoint from before averagers had one
    size: int = 0  # the ranks the checkpoint holds


def restore(run_dir: Path, rank: int, flat: torch.Tensor, optimizer: Optimizer) -> Restored | None:
    """Load this rank's part of the latest checkpoint into `flat` and `optimizer`; None when
    there is no checkpoint."""
    found = checkpoint.latest_step(run_dir)
    if found is None:
        return None
    state = checkpoint.load_rank_state(run_dir, found[0], rank)
    if state["params"].numel() != flat.numel():
        raise UserError(
            f"checkpoint {checkpoint.checkpoint_dir(run_dir) / f'{found[0]:09d}'} holds "
            f"{state['params'].numel()} parameters but the configured model has {flat.numel()}")
    flat.copy_(state["params"].to(flat.device))
    optimizer.load_state_dict(state["optimizer"])
    return Restored(Progress.from_state_dict(state["progress"]), state.get("accepted_params"),
                    state.get("averager"), found[1])


def save(run_dir: Path, comm: Communicator, progress: Progress, flat: torch.Tensor,
         optimizer: Optimizer, cfg: TrainConfig, accepted_params: torch.Tensor | None,
         averager: RoundAverager) -> CheckpointSaved:
    """Every rank saves its file; rank 0 publishes the checkpoint once all are on disk."""
    state = {
        "params": flat.detach().cpu().clone(),
        "optimizer": optimizer.state_dict(),
        "progress": progress.state_dict(),
        "config": to_dict(cfg),
        "averager": averager.state_dict(),
    }
    if accepted_params is not None:
        state["accepted_params"] = accepted_params.detach().cpu().clone()
    checkpoint.save_rank_state(run_dir, progress.step, comm.rank, state)
    comm.barrier()
    # An elastic run's lost ranks save nothing; the first one present commits (labavg.comm.elastic).
    members = getattr(comm, "members", None)
    if members is None and comm.rank == 0:
        checkpoint.commit_checkpoint(run_dir, progress.step, comm.size)
    elif members is not None and comm.rank == members[0]:
        checkpoint.commit_checkpoint(run_dir, progress.step, comm.launch_size, list(members))
    comm.barrier()  # nobody runs ahead into a later save before the manifest is written
    path = checkpoint.checkpoint_dir(run_dir) / f"{progress.step:09d}"
    return CheckpointSaved(rank=comm.rank, step=progress.step, path=str(path))
