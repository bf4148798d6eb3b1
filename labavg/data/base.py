"""The contract between data sources and the frame pipeline."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class UtteranceSource(Protocol):
    """A set of utterances with per-frame pdf labels, loaded lazily one utterance at a time.

    `keys` is sorted. `num_frames[key]` is known without loading the features, so that the
    pipeline can shard and count minibatches up front. `load(key)` returns features after
    CMVN (float32, shape [T, feat_dim]) and pdf ids (int64, shape [T]).
    """

    keys: list[str]
    num_frames: dict[str, int]
    feat_dim: int
    num_pdfs: int

    def load(self, key: str) -> tuple[np.ndarray, np.ndarray]: ...
