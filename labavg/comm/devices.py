"""Which device a rank computes on."""

from __future__ import annotations

import torch

from labavg.base.errors import UserError


def select_device(requested: str | torch.device, local_rank: int) -> torch.device:
    """The device for this rank: "cpu", "cuda" (one GPU per local rank, round robin), "cuda:N", "auto".

    Raises UserError when CUDA is requested but this machine has none.
    """
    name = str(requested)
    if name == "cpu":
        return torch.device("cpu")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
        if name == "cpu":
            return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UserError(f"device {name!r} requested but CUDA is not available on this machine")
        if name == "cuda":
            return torch.device("cuda", local_rank % count)
        index = torch.device(name).index
        if index is None or index >= count:
            raise UserError(f"device {name!r} requested but this machine has {count} CUDA device(s)")
        return torch.device(name)
    raise UserError(f"unknown device {name!r}; choose one of 'cpu', 'cuda', 'cuda:N', 'auto'")
