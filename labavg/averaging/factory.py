"""The one place a run's settings become its averager: method, payload, hierarchy, overlap."""

from __future__ import annotations

import dataclasses

import torch

from labavg.averaging.hierarchy import HierarchicalAverager, node_communicator
from labavg.averaging.methods import AVERAGERS, Averager, BMUFAverager, DiLoCoAverager
from labavg.averaging.overlap import OverlapAverager, fragment_bounds
from labavg.base.config import TrainConfig
from labavg.base.errors import UserError
from labavg.comm.base import Communicator


def make_averager(cfg: TrainConfig, flat: torch.Tensor, comm: Communicator,
                  sizes: list[int] | None = None) -> Averager | HierarchicalAverager:
    """The averager of a training run: `cfg.averaging`'s method, its settings, K, `cfg.reduce`,
    the payload (`cfg.payload`, `cfg.payload_bits`, `cfg.error_feedback`); inside a
    HierarchicalAverager when `hierarchy.every` > 0 (collective then: it splits `comm` into
    nodes); an OverlapAverager (labavg.averaging.overlap) when `overlap` is not "none", which cuts `flat`
    between the parameter tensors of `sizes` values."""
    if cfg.overlap != "none":
        return make_overlap_averager(cfg, flat, comm, sizes)
    every, reduce = cfg.averaging_interval(), cfg.reduce
    payload = {"payload": cfg.payload, "bits": cfg.payload_bits,
               "error_feedback": cfg.error_feedback}
    if cfg.averaging == "bmuf":
        averager = BMUFAverager(flat, comm, every, config=cfg.bmuf, reduce=reduce, **payload)
    elif cfg.averaging == "diloco":
        averager = DiLoCoAverager(flat, comm, every, config=cfg.diloco, reduce=reduce, **payload)
    elif cfg.averaging == "model":
        averager = Averager(flat, comm, every, reduce=reduce, **payload)
    else:
        raise ValueError(f"unknown averaging method {cfg.averaging!r}; known: "
                         f"{', '.join(AVERAGERS)}")
    if cfg.hierarchy.every == 0:
        return averager
    return HierarchicalAverager(averager, node_communicator(comm, cfg.hierarchy.node_size),
                                cfg.hierarchy.every)


def make_overlap_averager(cfg: TrainConfig, flat: torch.Tensor, comm: Communicator,
                          sizes: list[int] | None) -> OverlapAverager:
    """The averager of a run with `overlap` eager or streaming; `sizes` are the numbers of
    values of the parameter tensors laid out in `flat` (streaming cuts between them)."""
    fragments = cfg.streaming_fragments if cfg.overlap == "streaming" else 1
    sizes = sizes or [flat.numel()]
    if fragments > len(sizes):
        raise UserError(f"streaming_fragments = {fragments} exceeds the {len(sizes)} parameter "
                        f"tensors of the model")
    bounds = fragment_bounds(sizes, fragments)
    plain = dataclasses.replace(cfg, overlap="none")
    averagers = [make_averager(plain, flat[a:b], comm) for a, b in bounds]
    return OverlapAverager(averagers, bounds, comm, cfg.overlap)
