"""The model a run starts from: the DNN with its input normalisation, and RBM pretraining."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from labavg.training.config import TrainConfig
from labavg.base.events import Event
from labavg.comm.base import Communicator
from labavg.data.base import UtteranceSource
from labavg.data.frames import FrameBatches, feature_stats, steps_per_epoch
from labavg.training.model import DNN


def build_model(cfg: TrainConfig, source: UtteranceSource, train_keys, device: torch.device) -> DNN:
    """The initial DNN with its fixed input normalisation (the same on every rank)."""
    generator = torch.Generator().manual_seed(cfg.seed)
    input_dim = source.feat_dim * (2 * cfg.data.context + 1)
    model = DNN(input_dim, source.num_pdfs, cfg.model, generator=generator)
    mean, std = feature_stats(source, train_keys, cfg.data.context)
    model.set_input_transform(torch.from_numpy(mean).float(), torch.from_numpy(std).float())
    return model.to(device)


def input_dim(model: DNN) -> int:
    """The width of the model's input: the spliced feature frames."""
    return model.hidden[0].in_features if model.hidden else model.output.in_features


def pretrain(model: DNN, cfg: TrainConfig, source: UtteranceSource, keys,
             comm: Communicator, device: torch.device) -> Iterator[Event]:
    """RBM pretraining of the sigmoid layers, itself data-parallel with periodic averaging."""
    from labavg.training.rbm import pretrain_dbn

    minibatch = cfg.rbm.minibatch_size
    num_steps = steps_per_epoch(keys, source.num_frames, comm.size, minibatch)
    batches = FrameBatches(
        source, keys, context=cfg.data.context, minibatch=minibatch,
        buffer_frames=max(cfg.data.buffer_frames, minibatch), seed=cfg.seed + 7919,
        rank=comm.rank, size=comm.size, num_steps=num_steps,
    )

    def batches_for_epoch(epoch: int):
        # The Gaussian RBM expects the DNN's normalised input, as pretrain_dbn.sh feeds it.
        return (model.normalize_input(x.to(device)) for x, _ in batches.epoch(epoch))

    yield from pretrain_dbn(
        model, batches_for_epoch, comm, cfg.rbm, average_every=cfg.effective_average_every(), device=device,
        reduce=cfg.averaging.reduce,
    )
