"""The exported model, RUN_DIR/final.pt: everything decoding needs, without the training data.

A hybrid DNN-HMM decodes with scaled likelihoods: the DNN gives p(pdf | x), the HMM wants
p(x | pdf) = p(pdf | x) p(x) / p(pdf); p(x) is the same for every path, so the decoder is fed
log p(pdf | x) - log p(pdf), the priors p(pdf) being the pdfs' frequencies in the training
alignments (Kaldi nnet1's `--class-frame-counts`). The file holds only tensors and plain values,
so `torch.load(path, weights_only=True)` reads it.

    final.pt = {
      "format": "labavg-final", "version": 1,
      "state_dict": the DNN's parameters and its input_shift / input_scale buffers,
      "input_dim", "num_pdfs", "feat_dim", "model_config": ModelConfig as a dict,
      "context": splice +-context, "apply_cmvn", "norm_vars": the feature pipeline,
      "pdf_counts": float64 [num_pdfs], "log_priors": float32 [num_pdfs],
      "topology": see `synth_topology` / `kaldi_topology`,
      "phone_bigram": phone bigram counts of the training alignments (for the PER graph),
      "word_counts": {word: count} of the training transcripts (for a unigram G),
      "train_utts": training utterances, "train_data": absolute path of the training data, "lexicon": a lexicon path or None,
    }
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from labavg.base.checkpoint import FINAL, load_weights
from labavg.base.errors import DataError, UserError
from labavg.training.model import DNN
from labavg.training.settings import ModelConfig

FORMAT = "labavg-final"
VERSION = 1
# Kaldi's default topology probabilities: a self-loop of 0.75 per state (utils/gen_topo.pl).
SYNTH_LOOP_PROB = 0.75
SILENCE_NAMES = ("sil", "SIL", "<sil>", "<SIL>", "!SIL")


# A topology is plain data: {"phones": [name], "labels": [FST label >= 1], "silence": name|None,
# "hmm": per phone, per emitting state, [(destination state, pdf, log prob)]}; destination
# == number of states means the phone's end. The pdf of an arc is that of its source state
# (Kaldi's convention: a frame is emitted on leaving a state).


def synth_topology(phone_names: list[str], states: int = 3, loop_prob: float = SYNTH_LOOP_PROB
                   ) -> dict[str, Any]:
    """The built-in corpus' 3-state left-to-right phones, pdf = 3 * phone + state."""
    loop, forward = math.log(loop_prob), math.log(1.0 - loop_prob)
    hmm = [[[(s, states * p + s, loop), (s + 1, states * p + s, forward)] for s in range(states)]
           for p in range(len(phone_names))]
    silence = next((n for n in phone_names if n in SILENCE_NAMES), None)
    return {"phones": list(phone_names), "labels": list(range(1, len(phone_names) + 1)),
            "silence": silence, "hmm": hmm}


def kaldi_topology(model, phone_names: dict[int, str] | None) -> dict[str, Any]:
    """A monophone Kaldi TransitionModel (labavg.data.transition) with its trained probabilities.

    `phone_names` maps Kaldi phone ids to names (phones.txt); without it phones are named by id.
    """
    by_state: dict[tuple[int, int], list] = {}
    seen: dict[tuple[int, int], int] = {}
    for tstate, tup in enumerate(model.tuples, start=1):
        key = (tup.phone, tup.hmm_state)
        if key in seen:
            raise DataError(f"the model has several transition states for phone {tup.phone} state "
                            f"{tup.hmm_state}: a context-dependent model; labavg decodes "
                            "monophone models only")
        seen[key] = tstate
    position: Counter[int] = Counter()  # a transition state's ids follow its topology order
    for tid in range(1, model.num_transition_ids + 1):
        phone, state = int(model.tid_to_phone[tid]), int(model.tid_to_hmm_state[tid])
        entry = model.topology.for_phone(phone)
        index = position[int(model.tid_to_tstate[tid])]
        position[int(model.tid_to_tstate[tid])] += 1
        dest, prob = entry[state].transitions[index]
        logprob = float(model.log_probs[tid]) if model.log_probs.size else math.log(max(prob, 1e-30))
        by_state.setdefault((phone, state), []).append((int(dest), int(model.tid_to_pdf[tid]), logprob))
    phones = sorted({p for p, _ in by_state})
    hmm = []
    for phone in phones:
        entry = model.topology.for_phone(phone)
        emitting = [s for s in range(len(entry)) if entry[s].transitions]
        hmm.append([by_state.get((phone, s), []) for s in range(len(emitting))])
    names = [(phone_names or {}).get(p, str(p)) for p in phones]
    silence = next((n for n in names if n in SILENCE_NAMES), None)
    return {"phones": names, "labels": phones, "silence": silence, "hmm": hmm}


def topology_num_pdfs(topology: dict[str, Any]) -> int:
    """1 + the largest pdf of any arc."""
    return 1 + max(pdf for states in topology["hmm"] for arcs in states for _, pdf, _ in arcs)


def pdf_counts(pdfs: dict[str, np.ndarray], keys: list[str], num_pdfs: int) -> np.ndarray:
    """How often each pdf labels a frame of the utterances `keys`."""
    counts = np.zeros(num_pdfs, dtype=np.float64)
    for key in keys:
        counts += np.bincount(pdfs[key], minlength=num_pdfs)[:num_pdfs]
    return counts


def log_priors(counts: np.ndarray) -> np.ndarray:
    """log p(pdf) from frame counts; a pdf never seen counts as one frame, so it stays finite."""
    counts = np.maximum(np.asarray(counts, dtype=np.float64), 1.0)
    return np.log(counts / counts.sum()).astype(np.float32)


def read_word_counts(text_path: Path, keys: set[str] | None = None) -> dict[str, int]:
    """Word frequencies of a Kaldi `text` file (only the utterances `keys` when given)."""
    counts: Counter[str] = Counter()
    if not text_path.is_file():
        return {}
    for line in text_path.read_text(encoding="utf-8").splitlines():
        parts = line.split()
        if len(parts) >= 2 and (keys is None or parts[0] in keys):
            counts.update(parts[1:])
    return dict(sorted(counts.items()))


def read_phones_txt(path: Path) -> dict[int, str]:
    """Kaldi phones.txt (`name id`) as {id: name}, without <eps> and disambiguation symbols."""
    table: dict[int, str] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 2 or not parts[1].lstrip("-").isdigit():
            raise DataError(f"{path} line {number}: expected '<phone> <id>', got {line!r}")
        if parts[0] != "<eps>" and not parts[0].startswith("#"):
            table[int(parts[1])] = parts[0]
    return table


def find_kaldi_phones(ali_dir: Path) -> Path | None:
    """phones.txt of a Kaldi alignment dir: its own copy, else the recipe's data/lang."""
    for candidate in (ali_dir / "phones.txt", ali_dir.parent.parent / "data" / "lang" / "phones.txt"):
        if candidate.is_file():
            return candidate
    return None


def build_export(model: DNN, cfg, source, train_keys: list[str]) -> dict[str, Any]:
    """The final.pt payload for `model` trained with `cfg` on `source` (a KaldiUtterances)."""
    from labavg.decode.graph import alignment_phone_sequences, phone_bigram_counts

    data = Path(cfg.data.data).resolve()
    counts = pdf_counts(source.pdfs, train_keys, source.num_pdfs)
    lexicon = None
    if cfg.data.ali_dir is not None:
        from labavg.data.alignment import read_ali_dir

        ali_dir = Path(cfg.data.ali_dir).resolve()
        _, tmodel = read_ali_dir(ali_dir)
        phones_txt = find_kaldi_phones(ali_dir)
        topology = kaldi_topology(tmodel, read_phones_txt(phones_txt) if phones_txt else None)
        dict_lexicon = ali_dir.parent.parent / "data" / "local" / "dict" / "lexicon.txt"
        lexicon = str(dict_lexicon) if dict_lexicon.is_file() else None
    elif data.is_dir() and (data / "phones.txt").is_file() and (data / "pdfs.txt").is_file():
        names = [line.split()[0] for line in (data / "phones.txt").read_text().splitlines() if line.strip()]
        topology = synth_topology(names)
        lexicon = str(data / "lexicon.txt") if (data / "lexicon.txt").is_file() else None
    else:
        topology = None  # frame-level labels only (e.g. TextGrids): no HMM to decode with
    return {
        "format": FORMAT, "version": VERSION,
        "state_dict": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "input_dim": int(model.input_shift.numel()), "num_pdfs": int(model.output.out_features),
        "feat_dim": int(source.feat_dim), "model_config": asdict(model.cfg),
        "context": int(cfg.data.context), "apply_cmvn": bool(cfg.data.apply_cmvn),
        "norm_vars": bool(cfg.data.norm_vars),
        "pdf_counts": torch.from_numpy(counts), "log_priors": torch.from_numpy(log_priors(counts)),
        "topology": topology,
        "phone_bigram": None if topology is None else phone_bigram_counts(
            topology, alignment_phone_sequences(topology, (source.pdfs[k] for k in train_keys))),
        "word_counts": read_word_counts(data / "text", set(train_keys)) if data.is_dir() else {},
        "train_utts": len(train_keys), "train_data": str(data), "lexicon": lexicon,
    }


def export_final_model(run_dir: Path, cfg, source) -> Path:
    """Write RUN_DIR/final.pt from the run's last checkpoint (rank 0's averaged parameters).

    The input normalisation is not in the checkpoints; it is recomputed exactly as training
    computed it (same keys, same statistics), so the exported model is the trained one.
    """
    import io

    from labavg.base import checkpoint
    from labavg.averaging.mean import flatten_parameters
    from labavg.data.frames import split_cv
    from labavg.training.initial_model import build_model

    found = checkpoint.latest_step(run_dir)
    if found is None:
        raise UserError(f"{run_dir}: no checkpoint to export the final model from")
    state = checkpoint.load_rank_state(run_dir, found[0], checkpoint.model_rank(run_dir))
    train_keys, _ = split_cv(source.keys, cfg.data.cv_fraction, seed=cfg.seed)
    model = build_model(cfg, source, train_keys, torch.device("cpu"))
    flat = flatten_parameters([model])
    flat.copy_(state["params"])
    buf = io.BytesIO()
    torch.save(build_export(model, cfg, source, train_keys), buf)
    path = Path(run_dir) / FINAL
    checkpoint.atomic_write_bytes(path, buf.getvalue())
    return path


@dataclass
class ExportedModel:
    """A loaded final.pt: the DNN and what its inputs and outputs mean."""

    dnn: DNN
    log_priors: torch.Tensor
    context: int
    apply_cmvn: bool
    norm_vars: bool
    feat_dim: int
    topology: dict[str, Any] | None
    phone_bigram: list[list[float]] | None
    word_counts: dict[str, int]
    train_utts: int
    train_data: str
    lexicon: str | None
    path: Path

    @property
    def num_pdfs(self) -> int:
        """Output dimension of the DNN."""
        return int(self.log_priors.numel())

    def log_likelihoods(self, feats: np.ndarray) -> np.ndarray:
        """Scaled log-likelihoods log p(pdf|x) - log p(pdf), float32 [T, num_pdfs], of features
        after CMVN (unspliced, [T, feat_dim])."""
        from labavg.data.frames import splice

        if feats.ndim != 2 or feats.shape[1] != self.feat_dim:
            raise DataError(f"features of shape {feats.shape} for a model of feature dim "
                            f"{self.feat_dim} ({self.path})")
        with torch.no_grad():
            x = torch.from_numpy(splice(np.asarray(feats, dtype=np.float32), self.context))
            logpost = torch.log_softmax(self.dnn(x), dim=1)
            return (logpost - self.log_priors).numpy()


def load_final_model(path: str | os.PathLike) -> ExportedModel:
    """Rebuild the DNN of a final.pt (a run directory or the file itself)."""
    path = Path(path)
    if path.is_dir():
        path = path / FINAL
    try:
        blob = load_weights(path, "model file")
    except FileNotFoundError:
        raise UserError(f"{path} not found: not a finished labavg run (runs write final.pt at "
                        "the end)") from None
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise UserError(f"{path}: not a labavg final model")
    if blob.get("version") != VERSION:
        raise UserError(f"{path}: final model version {blob.get('version')}, this labavg reads {VERSION}")
    cfg = ModelConfig(**blob["model_config"])
    dnn = DNN(blob["input_dim"], blob["num_pdfs"], cfg)
    dnn.load_state_dict(blob["state_dict"])
    dnn.eval()
    return ExportedModel(
        dnn=dnn, log_priors=blob["log_priors"].float(), context=int(blob["context"]),
        apply_cmvn=bool(blob["apply_cmvn"]), norm_vars=bool(blob["norm_vars"]),
        feat_dim=int(blob["feat_dim"]), topology=blob["topology"],
        phone_bigram=blob["phone_bigram"], word_counts=dict(blob["word_counts"]),
        train_utts=int(blob["train_utts"]), train_data=blob["train_data"],
        lexicon=blob["lexicon"], path=path)
