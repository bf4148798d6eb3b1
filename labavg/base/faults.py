"""Deliberate faults, for teaching what a cluster does to a run and for fault-injection tests.

A fault is written `KIND@rankR:stepS`, e.g. `nan@rank1:step20`: after its S-th minibatch,
rank R
- `nan`: sets its parameters to NaN (a diverged worker; averaging must leave it out),
- `raise`: raises RuntimeError (a crashing worker),
- `kill`: sends itself SIGKILL (a lost process; not with the inproc backend),
- `hang`: stops making progress (a hung worker; only a hard stop ends the run).
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from labavg.base.errors import UserError

if TYPE_CHECKING:  # the configuration imports this module and no torch
    import torch

KINDS = ("nan", "raise", "kill", "hang")
_PATTERN = re.compile(r"^(nan|raise|kill|hang)@rank(\d+):step(\d+)$")


@dataclass(frozen=True)
class Fault:
    """One injected fault."""

    kind: str
    rank: int
    step: int


def parse_fault(text: str) -> Fault:
    """Parse `KIND@rankR:stepS`; UserError naming the text when it does not fit."""
    match = _PATTERN.match(text.strip())
    if match is None:
        raise UserError(
            f"inject_fault {text!r}: expected KIND@rankR:stepS with KIND one of {', '.join(KINDS)}"
        )
    return Fault(match[1], int(match[2]), int(match[3]))


def apply_fault(fault: Fault | None, rank: int, step: int, flat: torch.Tensor) -> None:
    """Trigger `fault` if it is due on this rank at this step."""
    if fault is None or fault.rank != rank or fault.step != step:
        return
    if fault.kind == "nan":
        flat.fill_(float("nan"))
    elif fault.kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")
    elif fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.kind == "hang":
        while True:
            time.sleep(3600)
