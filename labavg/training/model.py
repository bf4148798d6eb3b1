"""Kaldi-nnet1-style DNN acoustic model: spliced features in, pdf log-posteriors out.

The model knows nothing about ranks or devices; callers move it with `.to(device)`.
"""

from __future__ import annotations

import torch
from torch import nn

# The model's settings and size live with the other settings (torch-free).
from labavg.training.settings import NONLINEARITIES, ModelConfig

class PNorm(nn.Module):
    """Kaldi's PnormComponent: the p-norm over non-overlapping groups of `group` units."""

    def __init__(self, group: int, p: float) -> None:
        super().__init__()
        self.group, self.p = group, p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (-1, self.group)).norm(p=self.p, dim=-1)


def _activation(cfg: ModelConfig) -> nn.Module:
    if cfg.nonlinearity == "sigmoid":
        return nn.Sigmoid()
    if cfg.nonlinearity == "tanh":
        return nn.Tanh()
    if cfg.nonlinearity == "relu":
        return nn.ReLU()
    if cfg.nonlinearity == "pnorm":
        return PNorm(cfg.pnorm_group, cfg.pnorm_p)
    raise ValueError(f"unknown nonlinearity {cfg.nonlinearity!r}; choose from {NONLINEARITIES}")


class DNN(nn.Module):
    """Affine + nonlinearity layers, then an affine layer to `num_pdfs` logits.

    `hidden` holds the hidden affine layers in order (RBM pretraining initialises them),
    `output` the final affine layer. `forward` returns logits; the softmax lives in the loss.
    """

    def __init__(
        self, input_dim: int, num_pdfs: int, cfg: ModelConfig, generator: torch.Generator | None = None
    ) -> None:
        super().__init__()
        if cfg.hidden_layers < 0 or cfg.hidden_dim < 1:
            raise ValueError(f"bad model shape {cfg}")
        if cfg.nonlinearity == "pnorm" and cfg.hidden_dim % cfg.pnorm_group:
            raise ValueError(
                f"hidden_dim {cfg.hidden_dim} is not a multiple of pnorm_group {cfg.pnorm_group}"
            )
        self.cfg = cfg
        out_dim = cfg.hidden_dim // cfg.pnorm_group if cfg.nonlinearity == "pnorm" else cfg.hidden_dim
        self.hidden = nn.ModuleList()
        layers: list[nn.Module] = []
        dim = input_dim
        for _ in range(cfg.hidden_layers):
            affine = nn.Linear(dim, cfg.hidden_dim)
            self.hidden.append(affine)
            layers += [affine, _activation(cfg)]
            dim = out_dim
        self.output = nn.Linear(dim, num_pdfs)
        layers.append(self.output)
        self.net = nn.Sequential(*layers)
        # nnet1's feature transform (<AddShift>, <Rescale>): global mean and variance
        # normalisation of the spliced input, fixed before training (see set_input_transform).
        self.register_buffer("input_shift", torch.zeros(input_dim))
        self.register_buffer("input_scale", torch.ones(input_dim))
        self.reset_parameters(generator)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Kaldi nnet1's initialisation: N(0, 0.1) weights (uniform for the output), zero biases.

        nnet1's `make_nnet_proto.py` draws hidden weights with stddev 0.1 and biases around
        -2..0 for sigmoids; we keep zero biases so every nonlinearity starts centred.
        """
        # An explicit generator keeps initialisation deterministic when simulated workers
        # share the process (and its global RNG) in threads.
        for affine in self.hidden:
            nn.init.normal_(affine.weight, std=0.1, generator=generator)
            nn.init.zeros_(affine.bias)
        nn.init.normal_(self.output.weight, std=0.1, generator=generator)
        nn.init.zeros_(self.output.bias)

    def set_input_transform(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        """Normalise inputs to zero mean and unit variance with fixed global statistics."""
        self.input_shift.copy_(-mean)
        self.input_scale.copy_(1.0 / std.clamp_min(1e-5))

    def normalize_input(self, x: torch.Tensor) -> torch.Tensor:
        """The input after the fixed feature transform."""
        return (x + self.input_shift) * self.input_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.normalize_input(x))


def count_parameters(model: nn.Module) -> int:
    """Number of trainable scalars."""
    return sum(p.numel() for p in model.parameters())
