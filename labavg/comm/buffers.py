"""Checks every backend makes on what it is handed: a collective writes the caller's memory."""

from __future__ import annotations

import torch

_FLOAT_DTYPES = (torch.float32, torch.float64)
# An allgather also carries bytes: the compressed payloads of labavg.averaging.payload.
_GATHER_DTYPES = (torch.uint8, *_FLOAT_DTYPES)


def check_buffer(buf: torch.Tensor) -> None:
    """Raise TypeError/ValueError unless `buf` is a flat contiguous float32/float64 tensor.

    The collectives write into the buffer's memory directly (numpy views for MPI), so a strided
    view or a copy would silently not update the caller's parameters.
    """
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"collective buffer must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"collective buffer must be float32 or float64, got {buf.dtype}")
    if buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(
            f"collective buffer must be flat (1-D) and contiguous, got shape {tuple(buf.shape)}"
            f" contiguous={buf.is_contiguous()}"
        )


def check_gather(send: torch.Tensor, recv: torch.Tensor, size: int) -> None:
    """Raise TypeError/ValueError unless `send` and `recv` are flat contiguous tensors of one
    dtype (uint8, float32 or float64) and `recv` holds `size` times `send`."""
    for name, buf in (("send", send), ("recv", recv)):
        if not isinstance(buf, torch.Tensor):
            raise TypeError(f"allgather {name} buffer must be a torch.Tensor, got "
                            f"{type(buf).__name__}")
        if buf.dtype not in _GATHER_DTYPES:
            raise TypeError(f"allgather {name} buffer must be uint8, float32 or float64, got "
                            f"{buf.dtype}")
        if buf.dim() != 1 or not buf.is_contiguous():
            raise ValueError(f"allgather {name} buffer must be flat (1-D) and contiguous, got "
                             f"shape {tuple(buf.shape)} contiguous={buf.is_contiguous()}")
    if recv.dtype != send.dtype or recv.numel() != size * send.numel():
        raise ValueError(f"allgather of {send.numel()} x {send.dtype} from {size} ranks needs "
                         f"{size * send.numel()} x {send.dtype}, got {recv.numel()} x {recv.dtype}")


def check_root(root: int, size: int) -> None:
    """Raise ValueError unless `root` is a rank of a group of `size`."""
    if not 0 <= root < size:
        raise ValueError(f"broadcast root {root} is not a rank of a group of {size}")


def check_peer(peer: int, size: int) -> None:
    """Raise ValueError unless `peer` is a rank of a group of `size`."""
    if not 0 <= peer < size:
        raise ValueError(f"point-to-point peer {peer} is not a rank of a group of {size}")


def split_members(pairs: list[tuple[int, int]]) -> list[list[int]]:
    """The groups of a split, given each rank's (color, key): per color in increasing order,
    its ranks ordered by (key, rank), as MPI_Comm_split numbers them. Every rank computes the
    same list, so backends that must create every group everywhere (torch's new_group) agree
    on the order."""
    colors = sorted({color for color, _ in pairs})
    return [sorted((r for r, (c, _) in enumerate(pairs) if c == color),
                   key=lambda r: (pairs[r][1], r)) for color in colors]
