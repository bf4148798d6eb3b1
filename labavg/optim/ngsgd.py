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
    finish_updates,
    gamma,
    start_precondition,
)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


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

    def _layer_update(self, index: int, lr: float) -> tuple[LayerUpdate, Preconditioned, Preconditioned] | None:
        """One layer's update on its own, as `step` makes it (tests compare it with Kaldi's)."""
        started = self._precondition_layer(index, set())
        if started is None:
            return None
        update, p_in, p_out = self._updates([started], lr)[0]
        (in_state, out_state) = finish_updates([p_in, p_out], self.config)
        return update, p_in._replace(state=in_state, job=None), p_out._replace(state=out_state, job=None)

    def _precondition_layer(self, index: int, owned: set[int]) -> tuple[int, Preconditioned, Preconditioned] | None:
        """Both sides of layer `index` preconditioned, their Fisher updates pending; X and dY
        whose storage is in `owned` are overwritten with X_hat and dY_hat (no copies)."""
        taken = self.tap.take(index)
        if taken is None:
            return None
        x, dy = taken
        pre_in, pre_out = self.preconditioners[index]
        cfg = self.config
        # nnet2 appends a 1 so the bias is preconditioned too; done analytically here
        p_in = start_precondition(x, pre_in.state, pre_in.rank, cfg, with_one=self.linears[index].bias is not None,
                                  overwrite=_storage(x) in owned)
        dy = dy.to(x.dtype)
        p_out = start_precondition(dy, pre_out.state, pre_out.rank, cfg, with_one=False,
                                   overwrite=_storage(dy) in owned)
        return index, p_in, p_out

    def _updates(self, started: list[tuple[int, Preconditioned, Preconditioned]],
                 lr: float) -> list[tuple[LayerUpdate, Preconditioned, Preconditioned]]:
        """The layers' updates, their gammas and max-change factors computed for all layers at
        once (elementwise over the stacked traces and row norms)."""
        sides = [p for _, p_in, p_out in started for p in (p_in, p_out)]
        gammas = gamma(torch.stack([p.tr_x for p in sides]), torch.stack([p.tr_hat for p in sides]))
        scale = gammas[0::2] * gammas[1::2]  # gamma_in * gamma_out of each layer
        in_sq = [p_in.row_sq for _, p_in, _ in started]
        out_sq = [p_out.row_sq for _, _, p_out in started]
        if len({t.shape for t in in_sq + out_sq}) == 1:
            factor = per_sample_scale(torch.stack(in_sq), torch.stack(out_sq), scale * lr, self.max_change_per_sample)
        else:  # layers seeing different numbers of frames
            factor = torch.stack([per_sample_scale(i, o, s * lr, self.max_change_per_sample)
                                  for i, o, s in zip(in_sq, out_sq, scale)])
        coef = scale * factor * -lr  # the deltas' scale gamma_in * gamma_out goes in coef
        out = []
        for k, (index, p_in, p_out) in enumerate(started):
            layer = self.linears[index]
            # dY_hat^T [X_hat, x_hat_one] as separate weight and bias parts: a 513-wide
            # product is ~50% slower than a 512-wide one on MKL, and slicing it gives strided
            # deltas.
            dy_hat_t = p_out.x_hat.T
            if layer.bias is None:
                update = LayerUpdate([layer.weight], [torch.mm(dy_hat_t, p_in.x_hat)], coef[k], factor[k])
            else:
                deltas = [torch.mm(dy_hat_t, p_in.x_hat), torch.mv(dy_hat_t, p_in.x_hat_one)]
                update = LayerUpdate([layer.weight, layer.bias], deltas, coef[k], factor[k])
            out.append((update, p_in, p_out))
        return out

    def step(self, lr: float) -> StepStats:
        """One NG-SGD update from the last backward pass; clears what it used."""
        others = [p for p in self.other_params if p.grad is not None]
        owned = self.tap.owned_storages(exclude=[p.grad for p in others])
        started = [s for s in (self._precondition_layer(i, owned) for i in range(len(self.linears)))
                   if s is not None]
        layer_updates = self._updates(started, lr) if started else []
        updates = [u for u, _, _ in layer_updates]
        if others:
            updates.append(LayerUpdate(others, [p.grad for p in others], -lr))
        stats = apply_updates(updates, self.max_param_change)
        if stats.applied:  # a skipped step must not feed NaNs into the Fisher estimates either
            # The Fisher updates of all layers at once (their R x R algebra batched); they
            # need nothing the parameter update changed.
            sides = [p for _, p_in, p_out in layer_updates for p in (p_in, p_out)]
            states = iter(finish_updates(sides, self.config))
            for index, _, _ in started:
                self.preconditioners[index][0].state = next(states)
                self.preconditioners[index][1].state = next(states)
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
