"""Kaldi's online natural-gradient SGD (NG-SGD) for every `nn.Linear` of a model.

Follows nnet2's AffineComponentPreconditionedOnline and arXiv:1410.7455 (Povey et al., Sec. 3.5):
each affine layer's inputs X (with a 1 appended for the bias) and output derivatives dY are
preconditioned with their own online Fisher estimate (labavg.optim.natural_gradient), and the
update is  -lr * gamma_in * gamma_out * dY_hat^T X_hat  (nnet2's
AffineComponentPreconditionedOnline::Update, where Kaldi adds because its derivative is of an
objective to maximise), limited by nnet2's per-frame max-change and nnet3's max_param_change.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from labavg.optim.settings import NGConfig
from labavg.optim.base import StepStats
from labavg.optim.max_change import (
    LayerUpdate,
    LinearTap,
    apply_updates,
    find_linears,
    per_sample_scale,
)
from labavg.optim.natural_gradient import (
    OnlineNaturalGradient,
    Preconditioned,
    precondition_with_one,
)


class NGSGD:
    """Natural-gradient SGD: every `nn.Linear` gets Kaldi's online NG preconditioning of its
    inputs (rank_in) and output derivatives (rank_out), nnet2's per-frame max-change and
    nnet3's whole-model max_param_change. Other trainable parameters get plain SGD.

    The linear layers' weights do not get `.grad` (autograd is told not to compute it: the
    update is built from the captured X and dY). The Fisher estimates are this rank's own
    state; model averaging touches parameters only.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        config: NGConfig = NGConfig(),
        max_change_per_sample: float = 0.075,
        max_param_change: float = 2.0,
    ) -> None:
        self.config = config
        self.max_change_per_sample = max_change_per_sample
        self.max_param_change = max_param_change
        self.linears = [m for m in find_linears(model) if m.weight.requires_grad]
        self.tap = LinearTap(self.linears, skip_weight_grad=True)
        self.preconditioners = [
            (OnlineNaturalGradient(config.rank_in, config), OnlineNaturalGradient(config.rank_out, config))
            for _ in self.linears
        ]
        in_linears = {id(p) for m in self.linears for p in m.parameters(recurse=False)}
        self.other_params = [p for p in model.parameters() if p.requires_grad and id(p) not in in_linears]

    def _layer_update(
        self, index: int, lr: float
    ) -> tuple[LayerUpdate, Preconditioned, Preconditioned] | None:
        taken = self.tap.take(index)
        if taken is None:
            return None
        layer = self.linears[index]
        x, dy = taken
        pre_in, pre_out = self.preconditioners[index]
        if layer.bias is None:
            p_in = pre_in.precondition(x)
        else:  # nnet2 appends a 1 so the bias is preconditioned too; done analytically here
            p_in = precondition_with_one(x, pre_in.state, pre_in.rank, pre_in.config)
        p_out = pre_out.precondition(dy.to(x.dtype))
        scale = p_in.scale * p_out.scale
        factor = per_sample_scale(p_in.row_sq, p_out.row_sq, scale * lr, self.max_change_per_sample)
        # dY_hat^T [X_hat, x_hat_one] as separate weight and bias parts: a 513-wide product
        # is ~50% slower than a 512-wide one on MKL, and slicing it gives strided deltas.
        dy_hat_t = p_out.x_hat.T
        coef = scale * factor * -lr  # the deltas' scale gamma_in * gamma_out goes in coef
        if layer.bias is None:
            update = LayerUpdate([layer.weight], [torch.mm(dy_hat_t, p_in.x_hat)], coef, factor)
        else:
            deltas = [torch.mm(dy_hat_t, p_in.x_hat), torch.mv(dy_hat_t, p_in.x_hat_one)]
            update = LayerUpdate([layer.weight, layer.bias], deltas, coef, factor)
        return update, p_in, p_out

    def step(self, lr: float) -> StepStats:
        """One NG-SGD update from the last backward pass; clears what it used."""
        updates: list[LayerUpdate] = []
        pending: list[tuple[int, Preconditioned, Preconditioned]] = []
        for index in range(len(self.linears)):
            result = self._layer_update(index, lr)
            if result is not None:
                updates.append(result[0])
                pending.append((index, result[1], result[2]))
        others = [p for p in self.other_params if p.grad is not None]
        if others:
            updates.append(LayerUpdate(others, [p.grad for p in others], -lr))
        stats = apply_updates(updates, self.max_param_change)
        if stats.applied:  # a skipped step must not feed NaNs into the Fisher estimates either
            for index, p_in, p_out in pending:
                self.preconditioners[index][0].commit(p_in)
                self.preconditioners[index][1].commit(p_out)
        for p in self.other_params:
            p.grad = None
        self.tap.clear()
        return stats

    def state_dict(self) -> dict[str, Any]:
        """Per linear layer, both Fisher estimates (tensors only; readable with weights_only)."""
        return {
            "layers": [
                {"in": pin.state_dict(), "out": pout.state_dict()} for pin, pout in self.preconditioners
            ]
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the Fisher estimates saved by `state_dict` (same model structure)."""
        layers = state["layers"]
        if len(layers) != len(self.linears):
            raise ValueError(
                f"state has {len(layers)} linear layers, the model has {len(self.linears)}"
            )
        for layer, (pin, pout), saved in zip(self.linears, self.preconditioners, layers):
            for pre, key, dim in ((pin, "in", layer.in_features + (layer.bias is not None)),
                                  (pout, "out", layer.out_features)):
                W = saved[key].get("W")
                if W is not None and W.shape[1] != dim:
                    raise ValueError(f"Fisher estimate '{key}' has dim {W.shape[1]}, layer needs {dim}")
                pre.load_state_dict(saved[key], layer.weight.device)
