"""What a decode works on: the model with its graphs, a data set's log-likelihoods, the results.

    task = prepare(load_final_model("runs/x"), Path("data/synth/test"))
    test = load_set(task, Path("data/synth/test"))
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from labavg.base.errors import DataError
from labavg.decode import graph as graphs
from labavg.decode.lexicon import map_oov, read_lexicon, read_text
from labavg.decode.model import ExportedModel, read_phones_txt, topology_num_pdfs
from labavg.decode.score import ErrorRate

FRAME_SHIFT_S = 0.01


@dataclass
class Task:
    """A model with its graphs: HLG for words, the phone loop for phones."""

    model: ExportedModel
    lang: graphs.Lang
    hlg: Any
    phone_loop: Any | None
    lexicon_path: Path
    lm: str


def _lexicon_path(model: ExportedModel, data: Path, lang_dir: Path | None,
                  lexicon: Path | None) -> Path:
    candidates = [lexicon] if lexicon is not None else []
    if lang_dir is not None:
        candidates += [lang_dir / "lexicon.txt", lang_dir.parent / "local" / "dict" / "lexicon.txt"]
    candidates += [Path(model.lexicon) if model.lexicon else None, data / "lexicon.txt",
                   Path(model.train_data) / "lexicon.txt"]
    for path in candidates:
        if path is not None and path.is_file():
            return path
    if lexicon is not None:
        raise DataError(f"lexicon {lexicon} not found")
    raise DataError(f"no lexicon: pass --lexicon FILE or --lang DIR (looked beside {data} and "
                    f"the training data {model.train_data})")


def prepare(model: ExportedModel, data: Path, *, lang_dir: Path | None = None,
            lexicon: Path | None = None, lm: Path | None = None,
            cache_dir: Path | None = None) -> Task:
    """Build (or read from the cache) the graphs for `model` and a lexicon / LM."""
    topology = model.topology
    if topology is None:
        raise DataError(f"{model.path}: the model was trained without an HMM topology (TextGrid "
                        "labels); there is no graph to decode with")
    topology = dict(topology)
    if lang_dir is not None and (lang_dir / "phones.txt").is_file():
        names = read_phones_txt(lang_dir / "phones.txt")
        topology["phones"] = [names.get(lab, n) for lab, n in zip(topology["labels"], topology["phones"])]
        silence_file = lang_dir / "phones" / "optional_silence.txt"
        if silence_file.is_file():
            topology["silence"] = silence_file.read_text().split()[0]
    graph_pdfs = topology_num_pdfs(topology)
    if graph_pdfs != model.num_pdfs:
        raise DataError(f"{model.path}: the model has {model.num_pdfs} pdfs but its HMM topology "
                        f"(the graph) has {graph_pdfs}")
    lexicon_path = _lexicon_path(model, data, lang_dir, lexicon)
    lex = read_lexicon(lexicon_path)
    lang = graphs.make_lang(topology, lex, str(lexicon_path), f"{model.path}")
    lm_text = lm.read_bytes().decode("utf-8", "replace") if lm is not None and lm.is_file() else None
    if lm is not None and lm_text is None:
        raise DataError(f"language model {lm} not found")
    word_counts = model.word_counts
    if lm is None:
        mapped, _, _ = map_oov({"train": [w for w, c in word_counts.items() for _ in range(c)]},
                               set(lang.words), f"training transcripts of {model.train_data}")
        word_counts = {}
        for w in mapped["train"]:
            word_counts[w] = word_counts.get(w, 0) + 1
    key = graphs.cache_key(topology, lex, lm_text, None if lm is not None else word_counts,
                           model.train_utts, graphs.SIL_PROB)

    def build_hlg():
        l_fst, num_disambig = graphs.build_l(lang)
        h_fst = graphs.build_h(topology, num_disambig, max(lang.phone_labels) + 1)
        if lm is not None:
            import tempfile

            with tempfile.TemporaryDirectory() as tmp:
                g_fst = graphs.arpa_g(lang, lm, Path(tmp))
        else:
            g_fst = graphs.unigram_g(lang, word_counts, model.train_utts)
        return graphs.compose_hlg(h_fst, l_fst, g_fst, graph_pdfs)

    hlg = graphs.cached_fst(cache_dir, key, "HLG.fst", build_hlg)
    phone_loop = None
    if model.phone_bigram is not None:
        phone_key = graphs.cache_key(topology, model.phone_bigram)
        phone_loop = graphs.cached_fst(cache_dir, phone_key, "phone_loop.fst", lambda: graphs.compose_phone_loop(
            graphs.build_h(topology), graphs.phone_bigram_g(topology, model.phone_bigram)))
    return Task(model=model, lang=lang, hlg=hlg, phone_loop=phone_loop,
                lexicon_path=lexicon_path, lm=str(lm) if lm is not None else "unigram of the training transcripts")


@dataclass
class TestSet:
    """The utterances of a data dir: log-likelihoods and reference words."""

    name: str
    keys: list[str]
    loglikes: list[np.ndarray]
    refs: list[list[str]]
    oov: int
    seconds: float  # computing the log-likelihoods

    @property
    def audio_seconds(self) -> float:
        """Total duration at Kaldi's 10 ms frame shift."""
        return sum(len(x) for x in self.loglikes) * FRAME_SHIFT_S


def load_set(task: Task, data: Path) -> TestSet:
    """Features of `data` (feats.scp keys) through the model's pipeline, and their transcripts."""
    from labavg.data.dataset import load_checked, open_cmvn, open_features
    from labavg.data.cmvn import apply_cmvn

    if not Path(data).is_dir():
        raise DataError(f"decode data {data} is not a Kaldi data directory")
    features, data_dir = open_features(data)
    keys = list(features.keys)
    if not keys:
        raise DataError(f"{data}/feats.scp lists no utterances: nothing to decode")
    texts = read_text(Path(data) / "text")
    missing = [k for k in keys if k not in texts]
    if missing:
        raise DataError(f"{data}/text has no transcript for {len(missing)} of the {len(keys)} "
                        f"utterances of feats.scp (e.g. {missing[0]!r})")
    refs, oov, _ = map_oov({k: texts[k] for k in keys}, set(task.lang.words), f"{data}/text")
    silence = task.lang.silence_words
    stats = open_cmvn(data_dir, None) if task.model.apply_cmvn else None
    start = time.perf_counter()
    loglikes = []
    for key in keys:
        feats = load_checked(features, key, task.model.feat_dim)
        if stats is not None:
            feats = apply_cmvn(feats, stats.stats_for(key), task.model.norm_vars)
        loglikes.append(task.model.log_likelihoods(feats))
    return TestSet(name=Path(data).resolve().name, keys=keys, loglikes=loglikes,
                   refs=[[w for w in refs[k] if w not in silence] for k in keys], oov=oov,
                   seconds=time.perf_counter() - start)


@dataclass
class SetResult:
    """All scales' WERs of one set, hypotheses included."""

    test: TestSet
    wers: dict[float, ErrorRate]
    hyps: dict[float, list[list[str]]]
    decode_seconds: float
    frames: int

    def best_acwt(self) -> float:
        """The scale of the lowest WER (ties to the smaller scale, as Kaldi's sort does)."""
        return min(self.wers, key=lambda a: (self.wers[a].rate, a))
