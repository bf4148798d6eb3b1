"""Averaging schedules (`averaging.schedule`): K that changes during a run.

constant (the paper; Su & Chen 2015)
    a round every K-th minibatch and at every epoch end; the run's averager is used as it is,
    so a constant run is bitwise what it was before schedules existed.

post_local (Lin et al. 2020, "Don't use large mini-batches, use local SGD", Sec. 3; PyTorch's
PostLocalSGDOptimizer)
    a round after every minibatch until the workers together have trained
    `averaging.post_local_frames` frames, then every K. The paper switches at the first
    learning-rate decay; a frame count says the same thing for the exponential schedule, and
    does not change with N the way a step count would.

adacomm (Wang & Joshi 2019, "Adaptive communication strategies to achieve the best
error-runtime trade-off in local-update SGD", Sec. 4, the fixed-learning-rate rule)
    K_t = min(K_0, max(1, ceil(K_0 sqrt(L_t / L_0))))
    with K_0 = averaging.average_every, L_0 the training loss of the first block and L_t that
    of the block the round just ended (per frame, over every rank's minibatches of the block).
    Two departures from the paper, both for reproducibility: K is re-evaluated at every round
    rather than at fixed wall-clock intervals (a clock would make the schedule depend on the
    machine's load and a resume would not repeat it bit for bit), and L is the loss the workers
    measured while training the block (free) rather than the loss of the averaged model (a
    pass over data). K never rises above K_0: a loss above L_0 (an early spike) keeps K_0.
    The paper's learning-rate-aware variant is not used: with the exponential schedule the
    learning rate and the loss fall together, and the rule would then shrink K twice.

A scheduled run averages after the step its K runs out, counted from the last round (an epoch
end included), so the rounds of a schedule follow its K whatever the epoch length. Each round's
K is in its event (labavg.base.events.Averaged.average_every), and checkpoints keep the
schedule's state, so a resume repeats it bitwise.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from labavg.averaging.interface import AveragerInfo
from labavg.averaging.mean import AverageStats
from labavg.averaging.methods import ALL
from labavg.averaging.schedule_names import SCHEDULES



def post_local_k(k: int, frames: int, warmup_frames: int) -> int:
    """K after `frames` frames trained by all workers: 1 during the warm-up, then `k`."""
    return 1 if frames < warmup_frames else k


def adacomm_k(k0: int, loss: float, loss0: float) -> int:
    """AdaComm's K for a block loss `loss` against the first block's `loss0` (module docstring)."""
    if not (math.isfinite(loss) and math.isfinite(loss0)) or loss0 <= 0 or loss < 0:
        return k0  # a diverged block (or a loss that is no loss) says nothing of progress
    return min(k0, max(1, math.ceil(k0 * math.sqrt(loss / loss0))))


class ScheduledAverager:
    """A run's averager (`inner`, a plain, BMUF or DiLoCo Averager) with rounds when its
    schedule says (`post_local` or `adacomm`), every rank at the same steps.

    `frames_per_step` is the frames all workers train per minibatch step (ranks x minibatch),
    which post_local's warm-up counts. `observe` takes each minibatch's loss; adacomm averages
    the block's over the ranks at its rounds (one allreduce of two numbers).
    """

    def __init__(self, inner: Any, schedule: str, frames_per_step: int,
                 warmup_frames: int = 0) -> None:
        if schedule not in SCHEDULES[1:]:
            raise ValueError(f"unknown averaging schedule {schedule!r}; known: "
                             f"{', '.join(SCHEDULES[1:])} (constant needs no schedule)")
        self.inner, self.schedule = inner, schedule
        self.frames_per_step, self.warmup_frames = frames_per_step, warmup_frames
        self.k0 = inner.average_every
        self.comm = inner.comm
        self.average_every = self._k_after(0)  # K in force: the minibatches to the next round
        self.next_step = self.average_every
        self.loss0: float | None = None
        self._due_step = 0
        # Since the last round; plain numbers, so a minibatch costs no tensor op.
        self._loss_sum, self._frames = 0.0, 0

    def observe(self, loss_sum: float, frames: int) -> None:
        """The minibatch just trained: its summed loss over `frames` frames."""
        self._loss_sum += loss_sum
        self._frames += frames

    def due(self, step: int, end_of_epoch: bool) -> str | None:
        """ALL once K minibatches have passed since the last round, and at every epoch end."""
        if step >= self.next_step or end_of_epoch:
            self._due_step = step
            return ALL
        return None

    def round(self, flat: torch.Tensor, stop: bool = False, scope: str = ALL) -> AverageStats:
        """The method's round, then the K of the next block (counted from this round's step,
        the one `due` said it was due after)."""
        stats = self.inner.round(flat, stop=stop, scope=scope)
        self.average_every = self._k_after(self._due_step)
        self.next_step = self._due_step + self.average_every
        return stats

    def _k_after(self, step: int) -> int:
        if self.schedule == "post_local":
            return post_local_k(self.k0, step * self.frames_per_step, self.warmup_frames)
        if step == 0:
            return self.k0
        block = torch.tensor([self._loss_sum, self._frames], dtype=torch.float64)
        self._loss_sum, self._frames = 0.0, 0
        if self.comm.size > 1:
            self.comm.allreduce_mean(block)  # the mean of sums: its ratio is the pooled loss
        loss, frames = block.tolist()
        if frames <= 0:
            return self.average_every
        loss /= frames
        if self.loss0 is None:
            self.loss0 = loss
        return adacomm_k(self.k0, loss, self.loss0)

    def describe(self, flat: torch.Tensor) -> AveragerInfo:
        return self.inner.describe(flat)

    def restart(self, flat: torch.Tensor) -> None:
        """As the method's (Newbob's rollback); the schedule goes on where it is."""
        self.inner.restart(flat)

    def state_dict(self) -> dict[str, Any]:
        """The method's state and the schedule's (plain numbers), taken right after a round."""
        return {**self.inner.state_dict(),
                "schedule": {"name": self.schedule, "k": self.average_every,
                             "next_step": self.next_step,
                             "loss0": -1.0 if self.loss0 is None else self.loss0}}

    def load_state_dict(self, state: dict[str, Any] | None, flat: torch.Tensor) -> None:
        """As the method's, and the schedule where the checkpoint left it."""
        saved = (state or {}).get("schedule")
        if saved is None or saved.get("name") != self.schedule:
            trained = "constant" if saved is None else saved.get("name")
            raise ValueError(f"the checkpoint was trained with averaging schedule {trained!r}, "
                             f"this run uses {self.schedule!r}")
        self.inner.load_state_dict({k: v for k, v in state.items() if k != "schedule"}, flat)
        self.average_every, self.next_step = int(saved["k"]), int(saved["next_step"])
        self.loss0 = None if saved["loss0"] < 0 else float(saved["loss0"])
