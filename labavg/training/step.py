"""The pure training step and the evaluation of a model: no I/O, no communication."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from labavg.optim.base import Optimizer, StepStats


@dataclass(frozen=True)
class StepResult:
    """What one training step measured on its minibatch."""

    loss_sum: float  # summed cross-entropy over the minibatch's frames
    correct: int
    frames: int
    stats: StepStats


def train_step(
    model: torch.nn.Module, optimizer: Optimizer, x: torch.Tensor, y: torch.Tensor, lr: float
) -> StepResult:
    """Forward, cross-entropy (summed over frames, Kaldi's objective), backward, update."""
    logits = model(x)
    loss = F.cross_entropy(logits, y, reduction="sum")
    loss.backward()
    stats = optimizer.step(lr)
    correct = (logits.detach().argmax(dim=1) == y).sum()
    return StepResult(loss.item(), int(correct.item()), y.numel(), stats)


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches, device: torch.device) -> torch.Tensor:
    """[summed loss, correct frames, frames] of `model` over `batches`, as float64."""
    totals = torch.zeros(3, dtype=torch.float64)
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)
        totals[0] += F.cross_entropy(logits, y, reduction="sum").item()
        totals[1] += (logits.argmax(dim=1) == y).sum().item()
        totals[2] += y.numel()
    return totals
