"""Hierarchical averaging (`[averaging.hierarchy]`, `HierarchicalAverager`) puts a plain
average of the ranks of each node every K minibatches inside the method's blocks, which then
last K2 = `averaging.hierarchy.across_nodes_every` minibatches: the outer step sees one block of
K2 per round across nodes.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from labavg.averaging.interface import AveragerInfo
from labavg.averaging.mean import AverageStats, average_parameters
from labavg.averaging.methods import ALL, NODE, Averager
from labavg.base.errors import UserError
from labavg.comm.base import Communicator


class HierarchicalAverager:
    """Averaging within nodes every K minibatches, across all ranks every K2
    (`[averaging.hierarchy]`).

    A node round (`due` gives NODE) is a plain mean over `node`, the ranks of this rank's node:
    one allreduce there, no outer step, the stop request kept for the next round across
    nodes (only there do all ranks agree on it). An all round (every K2-th minibatch and every
    epoch end) is `inner`'s round over every rank, the method's outer step included: BMUF's
    G(t) and DiLoCo's outer gradient are then the change since the last all round, the block
    of K2 minibatches the node rounds happened inside. Node rounds are not outer steps because
    each node would filter its own update with a momentum that is shared by all ranks: the
    nodes' momenta would part, and no all round could bring them together again.

    The fallback of a node whose ranks all diverged is the node's model after the last round.
    """

    def __init__(self, inner: Averager, node: Communicator, across_nodes_every: int) -> None:
        if across_nodes_every < 1 or across_nodes_every % inner.average_every:
            raise ValueError(f"across_nodes_every ({across_nodes_every}) must be a positive "
                             f"multiple of average_every ({inner.average_every})")
        self.inner, self.node, self.across_nodes_every = inner, node, across_nodes_every
        # Node rounds come every average_every minibatches, rounds of all ranks every
        # across_nodes_every (averaging.average_every, averaging.hierarchy.across_nodes_every).
        self.method, self.reduce, self.average_every, self.comm = (
            inner.method, inner.reduce, inner.average_every, inner.comm)
        # The payload is that of the rounds across nodes; node rounds send fp32 (shared memory).
        self.payload, self.bits = inner.payload, inner.bits
        self.node_model = inner.global_model.clone() if inner.global_model is not None else None
        self._stop = False

    def observe(self, loss_sum: float, frames: int) -> None:
        """K is constant here (a schedule does not combine with a hierarchy yet)."""

    def due(self, step: int, end_of_epoch: bool) -> str | None:
        """ALL every K2-th minibatch and every epoch end, NODE every other K-th, else None."""
        if step % self.across_nodes_every == 0 or end_of_epoch:
            return ALL
        return NODE if step % self.average_every == 0 else None

    def round(self, flat: torch.Tensor, stop: bool = False, scope: str = ALL) -> AverageStats:
        """One round of `scope` (the one `due` gave) on this rank's parameters, in place."""
        if scope == ALL:
            stats = self.inner.round(flat, stop=stop or self._stop)
            self._stop = False
        elif scope == NODE:
            start = time.perf_counter()
            self._stop = self._stop or stop
            stats = average_parameters(flat, self.node, fallback=self.node_model,
                                       reduce=self.reduce)
            stats = dataclasses.replace(stats, stop=False, within_node=True,
                                        comm_seconds=time.perf_counter() - start)
        else:
            raise ValueError(f"unknown round scope {scope!r}; known: {NODE}, {ALL}")
        if self.node_model is not None:
            self.node_model.copy_(flat)
        return stats

    def bytes_per_round(self, flat: torch.Tensor) -> int:
        """What a round across all ranks puts into its collective from this rank."""
        return self.inner.bytes_per_round(flat)

    def describe(self, flat: torch.Tensor) -> AveragerInfo:
        """The method's description, with K2 and the ranks of this rank's node."""
        return dataclasses.replace(self.inner.describe(flat),
                                   hierarchy_every=self.across_nodes_every,
                                   node_ranks=self.node.size)

    def restart(self, flat: torch.Tensor) -> None:
        """As Averager.restart (Newbob's rollback comes after an all round)."""
        self.inner.restart(flat)
        if self.node_model is not None:
            self.node_model.copy_(flat)

    def state_dict(self) -> dict[str, Any]:
        """The method's state, and the global model of the last all round: after a node round
        the parameters are the node's model, which the next outer step must not start from."""
        state = self.inner.state_dict()
        if self.inner.global_model is not None:
            state["hierarchy_global"] = self.inner.global_model.detach().cpu().clone()
        return state

    def load_state_dict(self, state: dict[str, Any] | None, flat: torch.Tensor) -> None:
        """As Averager.load_state_dict; a checkpoint without hierarchy was taken after a round
        across all ranks, so its parameters are that round's global model."""
        self.inner.load_state_dict(state, flat)
        saved = None if state is None else state.get("hierarchy_global")
        if saved is not None and self.inner.global_model is not None:
            if saved.shape != self.inner.global_model.shape:
                raise ValueError(f"the checkpoint's global model holds {saved.numel()} values, "
                                 f"the model has {self.inner.global_model.numel()}")
            self.inner.global_model.copy_(saved.to(self.inner.global_model.device))
        if self.node_model is not None:
            self.node_model.copy_(flat)


def node_communicator(comm: Communicator, node_size: int) -> Communicator:
    """This rank's node: ranks [i * node_size, (i + 1) * node_size) when `node_size` > 0, else
    the ranks the backend finds on this rank's host (collective)."""
    color = comm.rank // node_size if node_size > 0 else comm.node_color()
    if color is None:
        raise UserError("averaging.hierarchy.node_size = 0: this backend cannot tell which ranks "
                        "share a node; set averaging.hierarchy.node_size")
    return comm.split(color, comm.rank)
