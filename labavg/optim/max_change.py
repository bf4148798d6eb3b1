"""Kaldi's limits on the size of one update, and the per-frame taps they need.

Two limits, applied in this order (docs/ngsgd.md says why these variants):

1. per affine layer, nnet2's `max_change_per_sample` (AffineComponentPreconditionedOnline::
   GetScalingFactor in src/nnet2/nnet-component.cc, kept as NaturalGradientAffineComponent::
   GetScalingFactor in early nnet3): the update of a layer is the sum over frames i of the
   rank-one terms lr * s * dy_i x_i^T, whose Frobenius norms are lr * s * |dy_i| |x_i|
   (x_i with the 1 appended for the bias). Their sum, an upper bound on the norm of the
   layer's update, is limited to max_change_per_sample * N for a minibatch of N frames;
2. over the whole model, nnet3's `max_param_change` (UpdateNnetWithMaxChange in
   src/nnet3/nnet-utils.cc): the whole update is scaled down if its 2-norm exceeds it, and an
   update whose norm is not finite is not applied at all ("Infinite parameter change, will
   not apply").

A value of 0 switches a limit off, as in Kaldi.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from labavg.optim.base import StepStats


def per_sample_scale(
    in_row_sq: torch.Tensor,
    out_row_sq: torch.Tensor,
    lr_scale: torch.Tensor | float,
    max_change_per_sample: float,
) -> torch.Tensor:
    """nnet2's GetScalingFactor: the factor (<= 1) that keeps one layer's update in bounds.

    `in_row_sq` / `out_row_sq` are the squared 2-norms of each frame's (preconditioned) input
    and output derivative; `lr_scale` is the learning rate times any scale the update gets.
    Returns a 0-d tensor on the rows' device (no host sync); it is NaN when the rows are.
    Several layers' rows stacked ([L, N], `lr_scale` [L]) give the L layers' factors.
    """
    ones = torch.ones(in_row_sq.shape[:-1], dtype=in_row_sq.dtype, device=in_row_sq.device)
    if max_change_per_sample <= 0.0:
        return ones
    # tot_change_norm = lr * sum_i sqrt(|x_i|^2 |dy_i|^2), max_change_norm = mcps * N.
    tot_change_norm = torch.sqrt(in_row_sq * out_row_sq).sum(-1) * lr_scale
    max_change_norm = max_change_per_sample * in_row_sq.shape[-1]
    factor = max_change_norm / tot_change_norm
    # A NaN/inf total gives a NaN/0 factor, so the non-finite update is skipped later.
    return torch.where(tot_change_norm <= max_change_norm, ones, factor)


@dataclass
class LayerUpdate:
    """One layer's update: parameter p gets coef * delta (coef includes -lr, any
    preconditioning scale and the layer's max-change `factor`, which is kept for reporting).
    `coef` and `factor` may be 0-d tensors, so computing them needs no host sync."""

    params: Sequence[torch.Tensor]
    deltas: Sequence[torch.Tensor]
    coef: torch.Tensor | float
    factor: torch.Tensor | float = 1.0


def apply_updates(updates: Sequence[LayerUpdate], max_param_change: float) -> StepStats:
    """Add the updates to the parameters in place, after nnet3's whole-model max_param_change.

    Nothing is changed when the update is not finite. The returned `scale` is the smallest
    total factor any layer's update was shrunk by (per-layer factor times the global one).
    Parameters are updated with `add_` under no_grad, so views into a flat buffer stay views.
    """
    if not updates:
        return StepStats(applied=True, scale=1.0)
    deltas = [d.detach() for u in updates for d in u.deltas]
    device = deltas[0].device
    # One dispatch for all norms and one host sync for everything the decision needs: per-tensor
    # calls cost ~3x the parameter update itself on this model (~0.6 ms of a ~22 ms CPU step).
    # On the CPU _foreach_norm is each tensor's vector_norm, so the values are a per-tensor loop's
    # (CUDA's fused kernel may differ in the last bits; they only feed max_param_change's scale).
    sq = torch.stack(torch._foreach_norm(deltas)).to(torch.float64).square()
    # Stacked first and widened once (exactly, float32 -> float64): two ops, not two a scalar.
    tensor_scalars = [v if v.dim() == 0 else v.reshape(())
                      for u in updates for v in (u.coef, u.factor) if isinstance(v, torch.Tensor)]
    if tensor_scalars:
        scalars = torch.stack(tensor_scalars).to(device=device, dtype=torch.float64)
        values = torch.cat([sq, scalars]).tolist()
    else:
        values = sq.tolist()
    if not all(math.isfinite(v) for v in values):  # a non-finite float coef fails param_delta
        return StepStats(applied=False, scale=0.0)
    sq_norms, scalars = iter(values[: len(deltas)]), iter(values[len(deltas):])
    coefs, factors, group_sq = [], [], []
    for u in updates:
        # Summed in order, as torch sums two elements (every affine layer's weight and bias).
        group_sq.append(sum(next(sq_norms) for _ in u.deltas))
        coefs.append(next(scalars) if isinstance(u.coef, torch.Tensor) else float(u.coef))
        factors.append(next(scalars) if isinstance(u.factor, torch.Tensor) else float(u.factor))
    param_delta = math.sqrt(sum(c * c * n for c, n in zip(coefs, group_sq)))
    if not math.isfinite(param_delta):
        return StepStats(applied=False, scale=0.0)
    global_scale = 1.0
    if max_param_change > 0.0 and param_delta > max_param_change:
        global_scale = max_param_change / param_delta
    with torch.no_grad():
        for u, coef in zip(updates, coefs):
            params = list(u.params)
            torch._foreach_add_(params, [d.to(p.dtype) for p, d in zip(params, u.deltas)],
                                alpha=coef * global_scale)
    return StepStats(applied=True, scale=min(factors) * global_scale)


class LinearTap:
    """Records, per `nn.Linear`, each forward input X and the derivative dY of the loss
    w.r.t. its output, which nnet2's per-frame max-change and NG-SGD's preconditioning need.

    With `skip_weight_grad` the layer's weight and bias do not require grad while it runs,
    so autograd does not spend a matmul on dW that NG-SGD would throw away (the update is
    built from the preconditioned X and dY instead); the first layer's output then becomes
    a leaf that requires grad so its dY is still computed. Captures only when grad is enabled.
    """

    def __init__(self, layers: Sequence[nn.Linear], *, skip_weight_grad: bool = False) -> None:
        self.layers = list(layers)
        self.skip_weight_grad = skip_weight_grad
        self._records: list[list[list]] = [[] for _ in self.layers]
        self._toggled: dict[int, list[torch.Tensor]] = {}
        for index, layer in enumerate(self.layers):
            if skip_weight_grad:
                layer.register_forward_pre_hook(self._pre_hook)
            layer.register_forward_hook(self._make_hook(index), always_call=True)

    def _pre_hook(self, layer: nn.Module, inputs: tuple) -> None:
        if torch.is_grad_enabled():
            toggled = [p for p in layer.parameters(recurse=False) if p.requires_grad]
            for p in toggled:
                p.requires_grad_(False)
            self._toggled[id(layer)] = toggled

    def _make_hook(self, index: int):
        def hook(layer: nn.Module, inputs: tuple, output: torch.Tensor):
            for p in self._toggled.pop(id(layer), []):
                p.requires_grad_(True)
            if not torch.is_grad_enabled() or not isinstance(output, torch.Tensor):
                return None
            if not output.requires_grad:
                if not self.skip_weight_grad:
                    return None
                output = output.detach().requires_grad_(True)
            # [X, dY, X made by an op of the graph (not a tensor of the caller's)]
            record: list = [inputs[0].detach(), None, inputs[0].grad_fn is not None]
            self._records[index].append(record)

            def keep_grad(grad: torch.Tensor) -> None:
                record[1] = grad if record[1] is None else record[1] + grad

            output.register_hook(keep_grad)
            return output

        return hook

    def take(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(X, dY) of layer `index` as 2-D matrices over all frames backpropagated since the
        last `clear`, or None when none were."""
        done = [r for r in self._records[index] if r[1] is not None]
        if not done:
            return None
        dim_in, dim_out = self.layers[index].in_features, self.layers[index].out_features
        xs = [r[0].reshape(-1, dim_in) for r in done]
        dys = [r[1].reshape(-1, dim_out) for r in done]
        if len(done) == 1:
            return xs[0], dys[0]
        return torch.cat(xs), torch.cat(dys)

    def owned_storages(self, exclude: Sequence[torch.Tensor] = ()) -> set[int]:
        """Storages (data pointers) of the recorded X and dY that an optimizer may overwrite
        once backward is done: X made inside the graph and dY, each used by one record only
        and not by a tensor of `exclude` (e.g. other parameters' grads, which autograd may
        alias to a dY). A layer fed twice (two records) is concatenated by `take` anyway."""
        seen: dict[int, int] = {}
        candidates = []
        for records in self._records:
            for rec in records:
                for t, ours in ((rec[0], len(records) == 1 and rec[2]), (rec[1], len(records) == 1)):
                    if t is None:
                        continue
                    ptr = t.untyped_storage().data_ptr()
                    seen[ptr] = seen.get(ptr, 0) + 1
                    if ours:
                        candidates.append(ptr)
        for t in exclude:
            ptr = t.untyped_storage().data_ptr()
            seen[ptr] = seen.get(ptr, 0) + 1
        return {ptr for ptr in candidates if seen[ptr] == 1}

    def clear(self) -> None:
        """Forget all records (the step has used them)."""
        self._records = [[] for _ in self.layers]


def find_linears(model: nn.Module) -> list[nn.Linear]:
    """Every `nn.Linear` in `model`, in module order, each once."""
    seen: set[int] = set()
    out = []
    for m in model.modules():
        if isinstance(m, nn.Linear) and id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


def row_sq_norms(x: torch.Tensor) -> torch.Tensor:
    """Squared 2-norm of every row."""
    return torch.linalg.vector_norm(x, dim=1).square()
