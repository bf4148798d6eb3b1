"""The one place averagers are built: a run's [averaging] section becomes its averager
(method, payload, hierarchy, overlap; `make_averager`), and RBM pretraining gets its plain one
(`make_pretraining_averager`)."""

from __future__ import annotations

import dataclasses

import torch

from labavg.averaging.hierarchy import HierarchicalAverager, node_communicator
from labavg.averaging.interface import RoundAverager
from labavg.averaging.overlap import OverlapAverager, fragment_bounds
from labavg.averaging.registry import methods
from labavg.averaging.schedule import ScheduledAverager
from labavg.averaging.settings import AveragingConfig
from labavg.base.errors import UserError
from labavg.comm.base import Communicator


def make_averager(plan: AveragingConfig, minibatch: int, flat: torch.Tensor, comm: Communicator,
                  sizes: list[int] | None = None) -> RoundAverager:
    """The run's averager (`_method_averager`), inside a ScheduledAverager when
    `plan.schedule` is not constant (labavg.averaging.schedule): a constant K is the method's
    own `due`, unchanged."""
    averager = _method_averager(plan, minibatch, flat, comm, sizes)
    if plan.schedule == "constant":
        return averager
    return ScheduledAverager(averager, plan.schedule, comm.size * minibatch,
                             plan.post_local_frames)


def _method_averager(plan: AveragingConfig, minibatch: int, flat: torch.Tensor,
                     comm: Communicator, sizes: list[int] | None) -> RoundAverager:
    """The averager of a training run with minibatches of `minibatch` frames: the class of the
    registered method `plan.method` (imported here, not when the method is declared) with its
    table, K, the reduce algorithm and the payload; inside a HierarchicalAverager when
    `plan.hierarchy.across_nodes_every` > 0 (collective then: it splits `comm` into nodes); an
    OverlapAverager (labavg.averaging.overlap) when `plan.overlap` is not "none", which cuts
    `flat` between the parameter tensors of `sizes` values."""
    if plan.overlap != "none":
        return make_overlap_averager(plan, minibatch, flat, comm, sizes)
    known = methods()
    if plan.method not in known:
        raise ValueError(f"unknown averaging method {plan.method!r}; known: {', '.join(known)}")
    method = known[plan.method]
    section = {} if method.settings is None else {"config": plan.table()}
    averager = method.averager_class()(
        flat, comm, plan.effective_average_every(minibatch), reduce=plan.reduce,
        payload=plan.payload, bits=plan.payload_bits, error_feedback=plan.error_feedback,
        **section)
    across = plan.hierarchy.across_nodes_every
    if across == 0:
        return averager
    return HierarchicalAverager(averager, node_communicator(comm, plan.hierarchy.node_size), across)


def make_overlap_averager(plan: AveragingConfig, minibatch: int, flat: torch.Tensor,
                          comm: Communicator, sizes: list[int] | None) -> OverlapAverager:
    """The averager of a run with `overlap` eager or streaming; `sizes` are the numbers of
    values of the parameter tensors laid out in `flat` (streaming cuts between them)."""
    fragments = plan.streaming_fragments if plan.overlap == "streaming" else 1
    sizes = sizes or [flat.numel()]
    if fragments > len(sizes):
        raise UserError(f"averaging.streaming_fragments = {fragments} exceeds the "
                        f"{len(sizes)} parameter tensors of the model")
    bounds = fragment_bounds(sizes, fragments)
    plain = dataclasses.replace(plan, overlap="none")
    averagers = [make_averager(plain, minibatch, flat[a:b], comm) for a, b in bounds]
    return OverlapAverager(averagers, bounds, comm, plan.overlap)


def make_pretraining_averager(flat: torch.Tensor, comm: Communicator, average_every: int,
                              reduce: str) -> RoundAverager:
    """The averager of RBM pretraining (labavg.training.rbm): plain averaging of the fp32
    parameters every `average_every` RBM minibatches with the run's `reduce`, whatever the
    run's method (the outer steps of BMUF and DiLoCo are defined for the supervised model).
    It keeps no global copy to restore: an RBM whose every rank diverged ends the run."""
    return methods()["model"].averager_class()(flat, comm, average_every, restore=False,
                                               reduce=reduce)
