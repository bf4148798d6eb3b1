"""The data's settings: the [data] section (labavg.data.dataset, labavg.data.frames).
Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from labavg.base.schema import NONEMPTY, POSITIVE, integer, real, setting


@dataclass
class DataConfig:
    """Where the frames come from and how they are cut into minibatches.

    `data` is a Kaldi data directory (feats.scp, cmvn.scp, utt2spk, ...) or a feature
    rspecifier. Labels come from `ali` (an rspecifier of pdf-id vectors), `ali_dir`
    (ali.*.gz + final.mdl, transition ids mapped to pdfs) or `textgrid` (TextGrid phone tiers);
    with none of them, a built-in corpus directory's own `pdf_ali.ark` is used.
    """

    data: str = setting("corpus", "Kaldi data directory or feature rspecifier", NONEMPTY,
                        flag="--data")
    ali: str | None = setting(None, "rspecifier of pdf-id alignments (ark:..., scp:..., ark:...|)",
                              NONEMPTY, flag="--ali")
    ali_dir: str | None = setting(None, "alignment directory with ali.*.gz and final.mdl",
                                  NONEMPTY, flag="--ali-dir")
    textgrid: str | None = setting(None, "TextGrid file or directory of <utt>.TextGrid phone tiers",
                                   NONEMPTY, flag="--textgrid")
    context: int = setting(5, "frames of context on each side (splice; Kaldi nnet1: 5)", integer(0),
                           flag="--context")
    cv_fraction: float = setting(0.1, "held-out utterances, as Kaldi nnet1",
                                 real(0, 1, high_open=True))
    buffer_frames: int = setting(32768, "frames shuffled together (nnet1's --randomizer-size)",
                                 POSITIVE)
    apply_cmvn: bool = setting(True, "apply cmvn.scp per speaker, as apply-cmvn")
    norm_vars: bool = setting(False, "CMVN normalises variances too (apply-cmvn --norm-vars)",
                              flag="--norm-vars")
    skip_mismatched: bool = setting(False, "drop utterances missing features or alignments",
                                    flag="--skip-mismatched")
