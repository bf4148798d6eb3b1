"""Viterbi beam search with kaldi-decoder's FasterDecoder (Kaldi's decode-faster)."""

from __future__ import annotations

from dataclasses import dataclass

import kaldi_decoder
import kaldifst
import numpy as np

DEFAULT_BEAM = 13.0  # Kaldi's decode.sh default
DEFAULT_MAX_ACTIVE = 7000


@dataclass(frozen=True)
class Hypothesis:
    """The best path of one utterance: output labels (words or phones) and its costs."""

    labels: list[int]
    graph_cost: float
    acoustic_cost: float
    reached_final: bool


class Decoder:
    """Decodes matrices of log-likelihoods on one graph; column i scores input label i + 1."""

    def __init__(self, graph: kaldifst.StdVectorFst, beam: float = DEFAULT_BEAM,
                 max_active: int = DEFAULT_MAX_ACTIVE) -> None:
        self.graph = graph
        self._decoder = kaldi_decoder.FasterDecoder(
            graph, kaldi_decoder.FasterDecoderOptions(beam=beam, max_active=max_active))

    def decode(self, loglikes: np.ndarray, acwt: float) -> Hypothesis:
        """The best path for acwt * loglikes ([T, num_pdfs] log-likelihoods)."""
        scaled = np.ascontiguousarray(acwt * np.asarray(loglikes), dtype=np.float32)
        self._decoder.decode(kaldi_decoder.DecodableCtc(scaled))
        final = self._decoder.reached_final()
        ok, lattice = self._decoder.get_best_path()
        if not ok:
            return Hypothesis([], float("inf"), float("inf"), False)
        ok, _, olabels, weight = kaldifst.get_linear_symbol_sequence(lattice)
        return Hypothesis(list(olabels), float(weight.value1), float(weight.value2) / acwt, final)
