"""The one place a run's averaging plan becomes its averager: method, payload, hierarchy,
overlap."""

from __future__ import annotations

import dataclasses

import torch

from labavg.averaging.hierarchy import HierarchicalAverager, node_communicator
from labavg.averaging.interface import RoundAverager
from labavg.averaging.overlap import OverlapAverager, fragment_bounds
from labavg.averaging.registry import methods
from labavg.averaging.settings import AveragingPlan
from labavg.base.errors import UserError
from labavg.comm.base import Communicator


def make_averager(plan: AveragingPlan, flat: torch.Tensor, comm: Communicator,
                  sizes: list[int] | None = None) -> RoundAverager:
    """The averager of a training run: the class of the registered method `plan.method`
    (imported here, not when the method is declared) with its section,
    K, the reduce algorithm and the payload; inside a HierarchicalAverager when
    `plan.hierarchy.every` > 0 (collective then: it splits `comm` into nodes); an
    OverlapAverager (labavg.averaging.overlap) when `plan.overlap` is not "none", which cuts
    `flat` between the parameter tensors of `sizes` values."""
    if plan.overlap != "none":
        return make_overlap_averager(plan, flat, comm, sizes)
    known = methods()
    if plan.method not in known:
        raise ValueError(f"unknown averaging method {plan.method!r}; known: {', '.join(known)}")
    method = known[plan.method]
    section = {} if method.settings is None else {"config": plan.method_settings}
    averager = method.averager_class()(flat, comm, plan.every, reduce=plan.reduce, payload=plan.payload,
                   bits=plan.bits, error_feedback=plan.error_feedback, **section)
    if plan.hierarchy.every == 0:
        return averager
    return HierarchicalAverager(averager, node_communicator(comm, plan.hierarchy.node_size),
                                plan.hierarchy.every)


def make_overlap_averager(plan: AveragingPlan, flat: torch.Tensor, comm: Communicator,
                          sizes: list[int] | None) -> OverlapAverager:
    """The averager of a run with `overlap` eager or streaming; `sizes` are the numbers of
    values of the parameter tensors laid out in `flat` (streaming cuts between them)."""
    fragments = plan.fragments if plan.overlap == "streaming" else 1
    sizes = sizes or [flat.numel()]
    if fragments > len(sizes):
        raise UserError(f"streaming_fragments = {fragments} exceeds the {len(sizes)} parameter "
                        f"tensors of the model")
    bounds = fragment_bounds(sizes, fragments)
    plain = dataclasses.replace(plan, overlap="none")
    averagers = [make_averager(plain, flat[a:b], comm) for a, b in bounds]
    return OverlapAverager(averagers, bounds, comm, plan.overlap)
