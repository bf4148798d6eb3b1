"""What the training step needs from an optimizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class StepStats:
    """Outcome of one update.

    `applied` is False when the update was not finite and was skipped (never applied).
    `scale` is the factor max-change shrank the update by (1.0 when it did not act).
    """

    applied: bool = True
    scale: float = 1.0


class Optimizer(Protocol):
    """Updates a model in place from the last backward pass.

    The loss that was backpropagated is the SUM of per-frame cross-entropies over the
    minibatch (Kaldi's objective), so learning rates are on Kaldi's per-frame scale
    (nnet1's default is 0.008). `step` also clears the gradients it used.
    """

    def step(self, lr: float) -> StepStats: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
