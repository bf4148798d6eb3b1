"""Overlapped averaging rounds: the mean runs while the next K minibatches compute.

`overlap = "eager"` (one round late; Wang et al. 2020, "Overlap Local-SGD: An Algorithmic
Approach to Hide Communication Delays in Distributed SGD", and the eager outer updates of
Douillard et al. 2025, "Streaming DiLoCo with overlapping communication", Sec. 2): at round t
each rank keeps a snapshot S_t of its parameters and starts the non-blocking mean of S_t
(`Communicator.iallreduce_mean`); it trains the next K minibatches from its own model W; at
round t+1 it waits for S̄_t and takes

    W_g(t) = update(W_g(t-1), S̄_t)      the run's method (labavg.averaging.methods); plain: W_g(t) = S̄_t
    W     <- W_g(t) + (W - S_t)          the new global model plus this rank's own progress

then snapshots and starts the next mean. BMUF's G(t) and DiLoCo's outer gradient are
therefore S̄_t - W_g(t-1): the block between two snapshots, K minibatches, as without overlap.

`overlap = "streaming"` (Douillard et al. 2025, Sec. 2, "streaming partial updates"): the flat
buffer is cut into P = `streaming_fragments` contiguous fragments at parameter-tensor
boundaries, as equal in size as the tensors allow; round t runs the eager round above on
fragment p = t mod P only (non-blocking too), so a round sends that fragment's bytes and each
fragment is synced every P rounds (its block lasts P K minibatches). Each fragment has its own
global model and outer-optimizer state (the slices of what the method keeps for the whole
model).

Both: a round at an epoch end first finishes the mean in flight, then is today's blocking
round over the whole buffer with the method's step on every fragment, so every rank
evaluates, schedules (Newbob) and saves the same averaged model. A checkpoint taken mid-epoch
waits for the mean in flight and saves it with the snapshot (the merge happens at the next
round, as it would have), so a resumed run continues bit for bit.

Non-finite ranks: the 16-byte control allreduce stays blocking, at the start of each mean. A
rank whose parameters are not finite anywhere at a round restarts every fragment from its
global model and is left out of the mean started there (contributing zeros, as in
labavg.averaging.mean); a rank that diverges while a mean is in flight is caught the same way at
the next round, after that mean is merged. When every rank is left out, no mean starts and
the fragment's global model stays as it was.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch

from labavg.averaging.interface import AveragerInfo
from labavg.averaging.methods import ALL, Averager
from labavg.averaging.mean import AverageStats, average_parameters, finite_norm
from labavg.comm.base import Communicator, Pending

# The scope of a round whose mean runs while training goes on (`due`).
OVERLAP = "overlap"
MODES = ("eager", "streaming")


def fragment_bounds(sizes: list[int], fragments: int) -> list[tuple[int, int]]:
    """[start, end) of `fragments` contiguous fragments of a buffer of tensors of `sizes`,
    cut at tensor boundaries, each cut at the boundary nearest its equal share."""
    if not 1 <= fragments <= len(sizes):
        raise ValueError(f"cannot cut {len(sizes)} parameter tensors into {fragments} fragments")
    ends = [0]
    for n in sizes:
        ends.append(ends[-1] + n)
    total, cuts = ends[-1], [0]
    for k in range(1, fragments):
        # Leave at least one tensor for each fragment still to come.
        low, high = cuts[-1] + 1, len(sizes) - (fragments - k)
        target = k * total / fragments
        cuts.append(min(range(low, high + 1), key=lambda j: (abs(ends[j] - target), j)))
    cuts.append(len(sizes))
    return [(ends[a], ends[b]) for a, b in zip(cuts, cuts[1:])]


@dataclass
class _InFlight:
    """The mean of one fragment, started at the last round."""

    fragment: int
    snapshot: torch.Tensor  # S_t, this rank's fragment when the mean started
    mean: torch.Tensor | None  # S̄_t once `handle` is done; None when every rank was left out
    handle: Pending | None
    dropped: int
    finite: bool
    started: float


class OverlapAverager:
    """Eager or streaming rounds (module docstring) around one method averager per fragment.

    `fragments[i]` is the run's method on `flat[bounds[i][0]:bounds[i][1]]`: its `update` and
    `global_model` serve that fragment; its blocking `round` is never used.
    """

    def __init__(self, fragments: list[Averager], bounds: list[tuple[int, int]],
                 comm: Communicator, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown overlap {mode!r}; known: {', '.join(MODES)}")
        self.fragments, self.bounds, self.comm, self.mode = fragments, bounds, comm, mode
        first = fragments[0]
        self.method, self.reduce = first.method, first.reduce
        self.average_every = first.average_every
        # Overlapped rounds send the fp32 parameters (a compressed payload is refused).
        self.payload, self.bits = first.payload, first.bits
        self.next_fragment = 0
        self._pending: _InFlight | None = None
        self._carried = 0.0  # seconds waited outside a round (a checkpoint), for the next

    @property
    def fragment_bytes(self) -> list[int]:
        """What a round of each fragment sends (0 with one rank)."""
        size = self.fragments[0].global_model.element_size()
        return [(b - a) * size if self.comm.size > 1 else 0 for a, b in self.bounds]

    def bytes_per_round(self, flat: torch.Tensor) -> int:
        """What a round of the whole model sends from this rank (an eager round, an epoch end);
        a streaming round sends one fragment's share, `fragment_bytes`."""
        return flat.numel() * flat.element_size() if self.comm.size > 1 else 0

    def describe(self, flat: torch.Tensor) -> AveragerInfo:
        """The method's description, with the overlap mode and each fragment's bytes."""
        return dataclasses.replace(
            self.fragments[0].describe(flat), bytes_per_round=self.bytes_per_round(flat),
            overlap=self.mode, fragment_bytes=tuple(self.fragment_bytes))

    def observe(self, loss_sum: float, frames: int) -> None:
        """K is constant here (a schedule does not combine with overlap yet)."""

    def due(self, step: int, end_of_epoch: bool) -> str | None:
        """ALL (blocking, the whole model) at every epoch end, OVERLAP every other K-th."""
        if end_of_epoch:
            return ALL
        return OVERLAP if step % self.average_every == 0 else None

    def round(self, flat: torch.Tensor, stop: bool = False, scope: str = OVERLAP) -> AverageStats:
        """One round on this rank's parameters `flat` (in place, every rank at once); its
        stats say which part of it was the non-blocking mean (AverageStats.overlap_seconds)."""
        start = time.perf_counter()
        waited, in_flight, merged = self._merge(flat)
        divergence = merged[0]
        overlap_seconds = time.perf_counter() - start + self._carried
        self._carried = 0.0
        if scope == ALL:
            t0 = time.perf_counter()
            stats = average_parameters(flat, self.comm, stop=stop, fallback=self._global(),
                                       reduce=self.reduce)
            for part, averager in self._parts(flat):
                if stats.dropped < self.comm.size and averager.keeps_global:
                    new = averager.update(averager.global_model, part)
                    if new is not part:
                        part.copy_(new)
                averager.global_model.copy_(part)
            seconds = time.perf_counter() - t0
            return AverageStats(stats.divergence, overlap_seconds + seconds, stats.finite,
                                stats.dropped, stats.stop, stats.bytes_sent,
                                overlap_seconds=overlap_seconds, overlap_bytes=0,
                                wait_seconds=waited, in_flight_seconds=in_flight)
        if scope != OVERLAP:
            raise ValueError(f"unknown round scope {scope!r}; known: {OVERLAP}, {ALL}")
        t0 = time.perf_counter()
        finite, _ = finite_norm(flat)  # one pass, no buffer-sized mask
        if not finite:  # restart from the global model; left out of the mean started now
            for part, averager in self._parts(flat):
                part.copy_(averager.global_model)
        agreed_stop, sent = self._start(flat, finite, stop)
        seconds = overlap_seconds + time.perf_counter() - t0
        return AverageStats(divergence, seconds, finite, self._pending.dropped, agreed_stop,
                            sent, overlap_seconds=seconds, overlap_bytes=sent,
                            wait_seconds=waited, in_flight_seconds=in_flight)

    def _parts(self, flat: torch.Tensor):
        return ((flat[a:b], averager) for (a, b), averager in zip(self.bounds, self.fragments))

    def _global(self) -> torch.Tensor:
        return torch.cat([averager.global_model for averager in self.fragments])

    def _start(self, flat: torch.Tensor, finite: bool, stop: bool) -> tuple[bool, int]:
        """Snapshot the next fragment and start its mean; (agreed stop, bytes sent)."""
        index = self.next_fragment
        self.next_fragment = (index + 1) % len(self.fragments)
        a, b = self.bounds[index]
        snapshot = flat[a:b].clone()
        control = torch.tensor([0.0 if finite else 1.0, 1.0 if stop else 0.0],
                               dtype=torch.float64)
        self.comm.allreduce_mean(control)  # blocking: every rank must agree on who is left out
        dropped = round(control[0].item() * self.comm.size)
        agreed_stop = control[1].item() > 0
        mean, handle, sent = None, None, 0
        if dropped < self.comm.size:
            mean = snapshot.clone() if finite else torch.zeros_like(snapshot)
            if self.comm.size > 1:
                handle = self.comm.iallreduce_mean(mean)
                sent = mean.numel() * mean.element_size()
        self._pending = _InFlight(index, snapshot, mean, handle, dropped, finite,
                                  time.perf_counter())
        return agreed_stop, sent

    def _settle(self) -> tuple[float, float]:
        """Wait for the mean in flight, if any; (seconds waited, seconds it was in flight)."""
        pending = self._pending
        if pending is None or pending.handle is None:
            return 0.0, 0.0
        t0 = time.perf_counter()
        pending.handle.wait()
        done = time.perf_counter()
        pending.handle = None
        size = self.comm.size
        if pending.dropped:
            pending.mean.mul_(size / (size - pending.dropped))
        return done - t0, done - pending.started

    def _merge(self, flat: torch.Tensor) -> tuple[float, float, tuple[float, bool, int]]:
        """Finish the mean in flight into `flat`: W_g(t) = update(W_g(t-1), S̄_t), W <- W_g(t)
        + (W - S_t). (waited, in flight, (divergence, finite, dropped)) of that mean."""
        waited, in_flight = self._settle()
        pending, self._pending = self._pending, None
        if pending is None:
            return waited, in_flight, (0.0, True, 0)
        a, b = self.bounds[pending.fragment]
        part, averager = flat[a:b], self.fragments[pending.fragment]
        divergence = 0.0
        if pending.mean is not None:
            mean = pending.mean
            if pending.finite and self.comm.size > 1:
                norm = torch.linalg.vector_norm(mean).item()
                dist = torch.linalg.vector_norm(pending.snapshot - mean).item()
                divergence = dist / norm if norm > 0 else 0.0
            new = averager.update(averager.global_model, mean) if averager.keeps_global else mean
            averager.global_model.copy_(new)
        part.sub_(pending.snapshot).add_(averager.global_model)
        return waited, in_flight, (divergence, pending.finite, pending.dropped)

    def restart(self, flat: torch.Tensor) -> None:
        """As Averager.restart, for every fragment; a mean in flight is dropped (Newbob rolls
        back after an epoch end's blocking round, when there is none)."""
        self._settle()
        self._pending = None
        for part, averager in self._parts(flat):
            averager.restart(part)

    # Checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The fragments' global models and outer state, and the mean in flight (waited for
        now, merged at the next round): the parameters alone are not the global model here."""
        waited, _ = self._settle()
        self._carried += waited
        names = self.fragments[0].outer_state().keys()
        state: dict[str, Any] = {
            "method": self.method, "overlap": self.mode, "fragments": len(self.fragments),
            "next_fragment": self.next_fragment,
            "global": self._global().detach().cpu().clone(),
            **{name: torch.cat([f.outer_state()[name] for f in self.fragments]).detach().cpu()
               for name in names},
        }
        pending = self._pending
        state["pending_fragment"] = -1 if pending is None else pending.fragment
        if pending is not None:
            state["pending_snapshot"] = pending.snapshot.detach().cpu().clone()
            state["pending_mean"] = (None if pending.mean is None
                                     else pending.mean.detach().cpu().clone())
            state["pending_dropped"], state["pending_finite"] = pending.dropped, pending.finite
        return state

    def load_state_dict(self, state: dict[str, Any] | None, flat: torch.Tensor) -> None:
        """Continue from a checkpoint whose parameters `flat` has just been loaded; one of a run
        without overlap (taken after a blocking round) starts the fragments from it."""
        if state is None or "overlap" not in state:
            for (a, b), averager in zip(self.bounds, self.fragments):
                part_state = state if state is None else {
                    k: (v[a:b] if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
                averager.load_state_dict(part_state, flat[a:b])
            return
        if (state["method"], state["overlap"], state["fragments"]) != (
                self.method, self.mode, len(self.fragments)):
            raise ValueError(
                f"the checkpoint was trained with averaging {state['method']!r}, overlap "
                f"{state['overlap']!r} in {state['fragments']} fragment(s); this run uses "
                f"{self.method!r}, {self.mode!r} in {len(self.fragments)}")
        if state["global"].numel() != flat.numel():
            raise ValueError(f"the checkpoint's global model holds {state['global'].numel()} "
                             f"values, the model has {flat.numel()}")
        device = flat.device
        for (a, b), averager in zip(self.bounds, self.fragments):
            averager.global_model.copy_(state["global"][a:b].to(device))
            for name, tensor in averager.outer_state().items():
                tensor.copy_(state[name][a:b].to(device))
        self.next_fragment = state["next_fragment"]
        self._pending = None
        if state["pending_fragment"] >= 0:
            mean = state["pending_mean"]
            self._pending = _InFlight(
                state["pending_fragment"], state["pending_snapshot"].to(device),
                None if mean is None else mean.to(device), None, state["pending_dropped"],
                state["pending_finite"], time.perf_counter())
