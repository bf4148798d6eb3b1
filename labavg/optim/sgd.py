"""Plain SGD (Kaldi nnet1/nnet2 style) with Kaldi's max-change limits."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from labavg.optim.base import StepStats
from labavg.optim.max_change import (
    LayerUpdate,
    LinearTap,
    apply_updates,
    find_linears,
    per_sample_scale,
    row_sq_norms,
)


class SGD:
    """SGD on the summed per-frame loss, optionally with (heavy-ball) momentum.

    Plain by default, as nnet1's SGD (the paper's baseline). Asked for, every `nn.Linear`
    gets nnet2's per-frame max-change (limit max_change_per_sample x minibatch size on the sum
    of per-frame update norms) and the whole update nnet3's `max_param_change`; 0 turns
    either off. A non-finite update is skipped. Parameters are updated in place.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        momentum: float = 0.0,
        max_change_per_sample: float = 0.0,
        max_param_change: float = 0.0,
    ) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.momentum = momentum
        self.max_change_per_sample = max_change_per_sample
        self.max_param_change = max_param_change
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.linears = find_linears(model)
        # The tap's hooks cost a copy of every layer input; only the per-frame limit needs them.
        self.tap = LinearTap(self.linears) if max_change_per_sample > 0.0 else None
        self._velocity: list[torch.Tensor | None] = [None] * len(self.params)
        self._group_list = self._groups()

    def _groups(self) -> list[tuple[list[int], int | None]]:
        """Parameter indices per Linear layer (with the layer index), then the rest."""
        index_of = {id(p): i for i, p in enumerate(self.params)}
        groups, used = [], set()
        for layer_index, layer in enumerate(self.linears):
            idx = [index_of[id(p)] for p in layer.parameters(recurse=False) if id(p) in index_of]
            used.update(idx)
            groups.append((idx, layer_index))
        rest = [i for i in range(len(self.params)) if i not in used]
        if rest:
            groups.append((rest, None))
        return groups

    def _layer_factor(self, layer_index: int | None, lr: float) -> torch.Tensor | float:
        if layer_index is None or self.tap is None:
            return 1.0
        taken = self.tap.take(layer_index)
        if taken is None:
            return 1.0
        x, dy = taken
        in_sq = row_sq_norms(x)
        if self.linears[layer_index].bias is not None:
            in_sq = in_sq + 1.0  # the 1 appended for the bias, as nnet2 does
        return per_sample_scale(in_sq, row_sq_norms(dy), lr, self.max_change_per_sample)

    def step(self, lr: float) -> StepStats:
        """Apply one update from the gradients of the last backward pass; clear them."""
        updates: list[LayerUpdate] = []
        new_velocity: dict[int, torch.Tensor] = {}
        for idx, layer_index in self._group_list:
            with_grad = [i for i in idx if self.params[i].grad is not None]
            if not with_grad:
                continue
            factor = self._layer_factor(layer_index, lr)
            if self.momentum == 0.0:
                # The gradients themselves are the deltas: -lr and the max-change factor go
                # into the coefficient, so no full-size temporaries are made.
                deltas = [self.params[i].grad for i in with_grad]
                updates.append(LayerUpdate([self.params[i] for i in with_grad], deltas,
                                           factor * -lr, factor))
                continue
            deltas = []
            for i in with_grad:
                g = self.params[i].grad * factor
                v = self._velocity[i]
                g = g if v is None else v * self.momentum + g
                new_velocity[i] = g
                deltas.append(g)
            updates.append(LayerUpdate([self.params[i] for i in with_grad], deltas, -lr, factor))
        stats = apply_updates(updates, self.max_param_change)
        if stats.applied:
            for i, v in new_velocity.items():
                self._velocity[i] = v
        for p in self.params:
            p.grad = None
        if self.tap is not None:
            self.tap.clear()
        return stats

    def state_dict(self) -> dict[str, Any]:
        """Momentum buffers by parameter index (tensors only)."""
        return {
            "momentum_buffers": {
                str(i): v.detach().clone() for i, v in enumerate(self._velocity) if v is not None
            }
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore momentum buffers saved by `state_dict`, onto the parameters' devices."""
        velocity: list[torch.Tensor | None] = [None] * len(self.params)
        for key, v in state.get("momentum_buffers", {}).items():
            i = int(key)
            if not 0 <= i < len(self.params) or v.shape != self.params[i].shape:
                raise ValueError(f"momentum buffer {key} does not fit this model")
            velocity[i] = v.to(self.params[i].device, self.params[i].dtype).clone()
        self._velocity = velocity
