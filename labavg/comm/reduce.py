"""Reduce algorithms: the mean over ranks of a flat buffer, by the backend's allreduce or by
point-to-point exchanges written here once for every backend.

Su & Chen (2015) average with MPI_Allreduce and compare it with the alternatives that Su's
Kaldi fork offers; labavg has the same three (`reduce` setting, docs/averaging.md):

allreduce
    the backend's own collective (`comm.allreduce_mean`): MPICH picks its algorithm by message
    size (Rabenseifner's for the long messages of model averaging), gloo its ring, inproc the
    recursive-doubling association MPICH uses.
butterfly
    Rabenseifner's allreduce (Thakur, Rabenseifner & Gropp 2005): a reduce-scatter by
    recursive halving, then an allgather by recursive doubling, over the largest power of two
    p' <= p ranks. The p - p' extra ranks are folded in first as MPICH does
    (allreduce_intra_reduce_scatter_allgather.c): among ranks 0 .. 2(p - p') - 1 each even
    rank sends its whole buffer to the odd rank above, which adds it and takes part; each odd
    rank sends the result back at the end. Cost: 2 lg p' alpha + 2 (p'-1)/p' n beta, plus
    2 alpha + 2 n beta when p is not a power of two (costmodel "rabenseifner").
ring
    a reduce-scatter ring then an allgather ring: the buffer in p chunks of about n/p; in each
    of p - 1 steps every rank passes a chunk to the next rank and adds the one it gets from
    the previous; then p - 1 steps pass the finished chunks on. Cost: 2 (p-1) alpha +
    2 (p-1)/p n beta (costmodel "ring").

Every element of the sum is computed on one rank and copied to the others, so all ranks get
bitwise the same mean, as model averaging needs. The butterfly adds in the same association
as `labavg.comm.inproc_group.tree_sum` (pairs first, then pairs of pairs), so on inproc it equals
allreduce bitwise; the ring adds each chunk around the ring, so it differs from allreduce by
float rounding only. The sum is divided by the size in place, as every backend's allreduce does.

The exchanges need one primitive from the backend, `comm.sendrecv(send, dst, recv, src)`.
"""

from __future__ import annotations

import torch

from labavg.comm.base import Communicator
from labavg.comm.buffers import check_buffer

# The names of `TrainConfig.reduce` (labavg.comm.settings.REDUCE, kept there to import no torch).
ALGORITHMS = ("allreduce", "butterfly", "ring")
# The cost model's formula for each (labavg.studies.costmodel.allreduce_coefficients). MPICH's
# allreduce of a long message (over 2 KiB, labavg's parameters) is Rabenseifner's.
COST_MODEL = {"allreduce": "rabenseifner", "butterfly": "rabenseifner", "ring": "ring"}


def reduce_mean(comm: Communicator, buf: torch.Tensor, algorithm: str = "allreduce") -> None:
    """Replace `buf` on every rank with the element-wise mean over ranks, by `algorithm`."""
    if algorithm == "allreduce":
        comm.allreduce_mean(buf)
        return
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown reduce algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")
    check_buffer(buf)
    if comm.size == 1:
        return
    if not callable(getattr(comm, "sendrecv", None)):
        raise TypeError(f"the {algorithm} reduce needs point-to-point messages, which "
                        f"{type(comm).__name__} does not offer (no sendrecv)")
    if algorithm == "butterfly":
        butterfly_sum(comm, buf)
    else:
        ring_sum(comm, buf)
    buf.div_(comm.size)


def bounds(length: int, parts: int) -> list[int]:
    """parts + 1 offsets cutting `length` elements into `parts` chunks whose sizes differ by
    at most one (the first `length % parts` one longer)."""
    size, extra = divmod(length, parts)
    return [i * size + min(i, extra) for i in range(parts + 1)]


def _exchange(comm: Communicator, send: torch.Tensor | None, dst: int,
              recv: torch.Tensor | None, src: int) -> None:
    """sendrecv without its empty halves: both sides compute the same chunk sizes, so a
    zero-length message is skipped by its sender and its receiver alike (gloo refuses them)."""
    send = send if send is not None and send.numel() else None
    recv = recv if recv is not None and recv.numel() else None
    if send is not None or recv is not None:
        comm.sendrecv(send, dst, recv, src)


def butterfly_sum(comm: Communicator, buf: torch.Tensor) -> None:
    """Replace `buf` with the sum over ranks: recursive halving, then recursive doubling."""
    rank, size = comm.rank, comm.size
    pof2 = 1 << (size.bit_length() - 1)
    rem = size - pof2
    # Fold: the even ranks below 2 rem hand their buffers to the odd rank above and sit out.
    if rank < 2 * rem:
        if rank % 2 == 0:
            _exchange(comm, buf, rank + 1, None, -1)
            _exchange(comm, None, -1, buf, rank + 1)  # the result, once the others are done
            return
        other = torch.empty_like(buf)
        _exchange(comm, None, -1, other, rank - 1)
        buf.add_(other)
        new_rank = rank // 2
    else:
        new_rank = rank - rem

    def real(new: int) -> int:
        return 2 * new + 1 if new < rem else new + rem

    edges = bounds(buf.numel(), pof2)
    lo, hi = 0, pof2  # the blocks (of pof2) this rank is still summing
    scratch = torch.empty(edges[pof2 // 2] if pof2 > 1 else 0, dtype=buf.dtype, device=buf.device)
    # Reduce-scatter by recursive halving. Partners at distance 1 first, as MPICH: that
    # association is tree_sum's (pairs of ranks, then pairs of pairs).
    mask = 1
    while mask < pof2:
        partner = real(new_rank ^ mask)
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if new_rank & mask == 0 else ((mid, hi), (lo, mid))
        kept = buf[edges[keep[0]]:edges[keep[1]]]
        incoming = scratch[:kept.numel()]
        _exchange(comm, buf[edges[give[0]]:edges[give[1]]], partner, incoming, partner)
        kept.add_(incoming)
        lo, hi = keep
        mask <<= 1
    # Allgather by recursive doubling: the same partners in reverse, each half now final.
    mask = pof2 >> 1
    while mask:
        partner = real(new_rank ^ mask)
        width = hi - lo
        theirs = (lo + width, hi + width) if new_rank & mask == 0 else (lo - width, hi - width)
        _exchange(comm, buf[edges[lo]:edges[hi]], partner,
                  buf[edges[theirs[0]]:edges[theirs[1]]], partner)
        lo, hi = min(lo, theirs[0]), max(hi, theirs[1])
        mask >>= 1
    if rank < 2 * rem:
        _exchange(comm, buf, rank - 1, None, -1)  # unfold: the even neighbour's result


def ring_sum(comm: Communicator, buf: torch.Tensor) -> None:
    """Replace `buf` with the sum over ranks: a reduce-scatter ring, then an allgather ring."""
    rank, size = comm.rank, comm.size
    right, left = (rank + 1) % size, (rank - 1) % size
    edges = bounds(buf.numel(), size)

    def chunk(index: int) -> torch.Tensor:
        index %= size
        return buf[edges[index]:edges[index + 1]]

    scratch = torch.empty(edges[1], dtype=buf.dtype, device=buf.device)  # the longest chunk
    # Step s: pass on chunk rank - s (this rank's partial sum of it), add to chunk rank - s - 1
    # what the left neighbour has summed of it. After p - 1 steps chunk rank + 1 is complete.
    for step in range(size - 1):
        mine = chunk(rank - step - 1)
        incoming = scratch[:mine.numel()]
        _exchange(comm, chunk(rank - step), right, incoming, left)
        mine.add_(incoming)
    # Step s: pass on the complete chunk rank + 1 - s, receive complete chunk rank - s.
    for step in range(size - 1):
        _exchange(comm, chunk(rank + 1 - step), right, chunk(rank - step), left)
