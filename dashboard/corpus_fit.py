"""Whether the model and the ranks fit THIS corpus and machine, said beside their boxes.

`labavg.training.config.validate` can only check a model against the smallest corpus there is (it has
no data); the dashboard has the corpus open, so it says what the boxes would cost on it, with
its sizes, under the box to change: hidden units (or layers) for a model too big, ranks for
too many in-process workers or too little data per rank.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

from labavg.training.memory import MEMORY_FRACTION, parameter_count, physical_memory
from labavg.training.config import TrainConfig, estimate_memory
from labavg.base.settings import with_overrides
from labavg.data.frames import split_cv, steps_per_epoch
from labavg.base.errors import UserError


@dataclasses.dataclass(frozen=True)
class CorpusSizes:
    """What the cost of a model and the share of a rank depend on."""

    feat_dim: int
    num_pdfs: int
    keys: tuple[str, ...]
    num_frames: dict[str, int]


@functools.lru_cache(maxsize=8)
def _sizes(data: str, ali: str | None, ali_dir: str | None, textgrid: str | None,
           stamp: float) -> CorpusSizes:
    from labavg.data.dataset import open_dataset

    source = open_dataset(data, ali=ali, ali_dir=ali_dir, textgrid=textgrid)
    return CorpusSizes(source.feat_dim, source.num_pdfs, tuple(source.keys),
                       dict(source.num_frames))


def corpus_sizes(cfg: TrainConfig) -> CorpusSizes | None:
    """The sizes of cfg's corpus (cached until the data directory changes); None when it
    cannot be opened (the data box says why)."""
    d = cfg.data
    try:
        stamp = Path(d.data).stat().st_mtime
        return _sizes(str(d.data), d.ali, None if d.ali_dir is None else str(d.ali_dir),
                      None if d.textgrid is None else str(d.textgrid), stamp)
    except (OSError, UserError):
        return None


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"


def fit_problems(values: dict[str, Any]) -> dict[str, str]:
    """Refusals by control name: the model or ranks that do not fit this corpus and machine,
    for the settings `values` the controls hold (RunSettings._values)."""
    try:
        cfg = with_overrides(TrainConfig(), values)
    except UserError:
        return {}  # a bad combination: validate words it (GENERAL)
    sizes = corpus_sizes(cfg)
    if sizes is None:
        return {}
    found: dict[str, str] = {}
    input_dim = sizes.feat_dim * (2 * cfg.data.context + 1)
    corpus = (f"this corpus's {input_dim} inputs ({sizes.feat_dim} features × "
              f"{2 * cfg.data.context + 1} frames) and {sizes.num_pdfs} pdfs")
    memory = physical_memory()
    if memory is not None:
        limit = MEMORY_FRACTION * memory
        need = estimate_memory(cfg, input_dim, sizes.num_pdfs)
        one = estimate_memory(dataclasses.replace(cfg, ranks=1), input_dim, sizes.num_pdfs)
        allowed = f"this machine allows {_gib(limit)} ({MEMORY_FRACTION:.0%} of its {_gib(memory)})"
        if one > limit:
            params = parameter_count(cfg.model, input_dim, sizes.num_pdfs)
            found["hidden_dim"] = (
                f"hidden units {cfg.model.hidden_dim} × hidden layers {cfg.model.hidden_layers} "
                f"on {corpus} make {params:.3g} parameters, about {_gib(one)} per rank; {allowed}")
        elif need > limit:
            found["ranks"] = (f"ranks {cfg.ranks}: {cfg.ranks} in-process workers of this model "
                              f"on {corpus} need about {_gib(need)}; {allowed}")
    if "ranks" not in found:
        problem = _share_problem(cfg, sizes)
        if problem is not None:
            found.update([problem])
    return found



def _share_problem(cfg: TrainConfig, sizes: CorpusSizes) -> tuple[str, str] | None:
    """(control, message) when some rank's share of the training data is under a minibatch:
    the ranks' fault if one rank alone would have enough, else the minibatch's."""
    train_keys, _ = split_cv(list(sizes.keys), cfg.data.cv_fraction, seed=cfg.seed)
    frames = sum(sizes.num_frames[k] for k in train_keys)
    data = f"{len(train_keys)} training utterances ({frames:,} frames)"
    for ranks in (cfg.ranks, 1):
        try:
            steps_per_epoch(train_keys, sizes.num_frames, ranks, cfg.minibatch)
        except UserError:
            continue
        if ranks == cfg.ranks:
            return None
        return "ranks", (f"ranks {cfg.ranks}: too many for this corpus: its {data} leave some "
                         f"rank less than one minibatch ({cfg.minibatch} frames)")
    return "minibatch", (f"minibatch {cfg.minibatch}: more frames than this corpus's {data} "
                         "hold for one rank")
