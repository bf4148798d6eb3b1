"""The paired speedup measurement inside a run of several ranks (labavg.jobs.speedup reads it).

On a shared machine two wall times taken minutes apart differ by a third or more, so a 1-rank
run timed before or after this one says as much about the load then as about averaging. The
measurement is made inside the run instead, in pairs: at a few averaging rounds spread over the
run, rank 0 replays its last few minibatches **alone** on the model it holds (then restores the
parameters, the optimizer state and the random state, so training goes on bitwise as without
the measurement), while the other ranks wait in `idle_barrier`, which leaves it the cores; then
every rank trains up to the next round. The two segments run back to back under the same load,
and each gives seconds per minibatch: `ranks x solo / parallel` is one pair's speedup over the
same frames.
"""

from __future__ import annotations

import copy
import socket
import time
import zlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from labavg.base.events import Event, SpeedupPair
from labavg.base.machine import usable_cores
from labavg.comm.base import Communicator
from labavg.training.step import train_step

# Minibatches rank 0 keeps to replay alone: K, kept within these bounds.
SOLO_STEPS = (4, 10)
# A solo segment replays them (round and round) for at least this long: a segment of a few
# tens of milliseconds is one scheduler time slice, and a pair then measures the machine's other
# work more than the training's. At most MAX_SOLO_STEPS minibatches, and all the pairs' solo
# minibatches at most 1/SOLO_SHARE of the run's, so a short run is not made much longer.
SOLO_SECONDS = 0.3
MAX_SOLO_STEPS = 60
SOLO_SHARE = 8


@dataclass
class SpeedupProbe:
    """When to measure, and the pair in progress (only rank 0 keeps minibatches and times)."""

    targets: list[int]  # the rounds after which a pair starts, ascending; empty: no pairs
    interval: int  # K: a parallel segment cut short by an epoch's end is not steady training
    solo_steps: int
    max_solo_steps: int
    recent: deque = field(default_factory=deque)  # rank 0's last minibatches, to replay alone
    solo_seconds: float | None = None  # per minibatch, of the pair whose parallel part runs
    solo_count: int = 0  # minibatches the solo segment of that pair trained
    parallel_start: float = 0.0
    parallel_start_step: int = 0


def make_probe(comm: Communicator, pairs: int, interval: int, total_steps: int) -> SpeedupProbe:
    """`pairs` pairs spread evenly over a run of `total_steps` minibatches averaging every
    `interval`; none with one rank (its speedup is 1 by definition) or too few rounds."""
    interval = max(interval, 1)
    rounds = total_steps // interval
    targets = [] if comm.size == 1 or rounds < 2 else sorted(
        {max(1, round((i + 1) * rounds / (pairs + 1))) for i in range(pairs)})
    solo = min(max(interval, SOLO_STEPS[0]), SOLO_STEPS[1])
    most = min(MAX_SOLO_STEPS, max(SOLO_STEPS[0], total_steps // (SOLO_SHARE * max(pairs, 1))))
    return SpeedupProbe(targets=targets, interval=interval, solo_steps=min(solo, most),
                        max_solo_steps=most, recent=deque(maxlen=solo))


def run_cores(comm: Communicator) -> int:
    """CPU cores the run's ranks may use: this process's affinity, summed over distinct hosts.

    Collective: every rank calls it (ranks on one host share its cores).
    """
    mine = usable_cores()
    if comm.size == 1:
        return mine
    host = zlib.crc32(socket.gethostname().encode())  # exact in a float64
    recv = torch.zeros(2 * comm.size, dtype=torch.float64)
    comm.allgather(torch.tensor([host, mine], dtype=torch.float64), recv)
    per_host: dict[int, int] = {}
    for h, cores in recv.view(-1, 2).tolist():
        per_host[int(h)] = max(per_host.get(int(h), 0), int(cores))
    return sum(per_host.values())


def remember(probe: SpeedupProbe, rank: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """Keep rank 0's minibatch for the next solo segment (a copy: batch buffers are reused)."""
    if probe.targets and rank == 0:
        probe.recent.append((x.clone(), y.clone()))


def close_pair(probe: SpeedupProbe, rank: int, step: int, round_: int, end_of_epoch: bool,
               device: torch.device) -> Iterator[Event]:
    """At a round: the pair whose parallel segment has now trained as many minibatches as its
    solo segment (whole rounds), measured on rank 0. A segment an epoch's end cuts short is
    dropped: CV and the forced round follow it, which steady training does not have."""
    if rank != 0 or probe.solo_seconds is None:
        return
    steps = step - probe.parallel_start_step
    if steps < max(probe.interval, probe.solo_count):
        if end_of_epoch:
            probe.solo_seconds = None
        return
    _sync(device)
    yield SpeedupPair(
        rank=rank, step=step, round=round_, solo_step_seconds=probe.solo_seconds,
        parallel_step_seconds=(time.perf_counter() - probe.parallel_start) / steps,
        solo_steps=probe.solo_count, parallel_steps=steps)
    probe.solo_seconds = None


def start_pair(probe: SpeedupProbe, comm: Communicator, model: torch.nn.Module,
               flat: torch.Tensor, optimizer, lr: float, round_: int, step: int,
               device: torch.device) -> None:
    """At a round after which training goes on (not an epoch's end, not a stop): when a pair
    is due, rank 0 trains alone while the others wait idle; then the parallel segment starts on
    every rank. Every rank sees the same rounds, so all agree when."""
    if not probe.targets or round_ < probe.targets[0]:
        return
    while probe.targets and probe.targets[0] <= round_:  # a resumed run skips those it passed
        probe.targets.pop(0)
    # When is decided by the round alone, the same on every rank; the rest is rank 0's (a pair
    # still open is dropped: it never reached its length).
    solo, count = _solo(probe, model, flat, optimizer, lr, device) if comm.rank == 0 else (0.0, 0)
    comm.idle_barrier()
    probe.solo_seconds, probe.solo_count = (solo, count) if count else (None, 0)
    probe.parallel_start = time.perf_counter()
    probe.parallel_start_step = step


def _solo(probe: SpeedupProbe, model: torch.nn.Module, flat: torch.Tensor, optimizer,
          lr: float, device: torch.device) -> tuple[float, int]:
    """Seconds per minibatch of rank 0 replaying its recent minibatches alone, and how many it
    trained; the parameters, optimizer state and random state are put back, so training goes
    on bitwise as without the measurement."""
    batches = list(probe.recent)
    if not batches:
        return 0.0, 0
    saved_flat = flat.clone()
    saved_optimizer = copy.deepcopy(optimizer.state_dict())
    saved_rng = torch.get_rng_state()
    _sync(device)
    t0 = time.perf_counter()
    count = 0
    while count < probe.max_solo_steps and (count < probe.solo_steps
                                      or time.perf_counter() - t0 < SOLO_SECONDS):
        x, y = batches[count % len(batches)]
        train_step(model, optimizer, x.to(device), y.to(device), lr)
        count += 1
        if count % len(batches) == 0:
            _sync(device)
    _sync(device)
    seconds = (time.perf_counter() - t0) / count
    flat.copy_(saved_flat)
    optimizer.load_state_dict(saved_optimizer)
    torch.set_rng_state(saved_rng)
    return seconds, count


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
