"""Decoding graphs with kaldifst: H (HMM), L (lexicon), G (grammar), HLG, and a phone loop.

Labels. H's input labels are pdf + 1 (0 is epsilon), so a decodable's column i scores input
label i + 1 (kaldi_decoder.DecodableCtc's convention); the disambiguation symbols get input
labels above num_pdfs and are turned into epsilons once HLG is determinized. Phones carry the
topology's labels (>= 1), words their index in the word table (0 = <eps>).

Construction follows Kaldi's mkgraph.sh for a monophone system (C is the identity):
LG = min(det(L o G)) with disambiguation symbols, HLG = det(H o LG), disambiguation symbols
removed, minimised. Transition log-probabilities sit on H's arcs, the self-loops scaled by
`self_loop_scale` (0.1 in Kaldi) and the rest by `transition_scale` (1.0).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kaldifst

from labavg.decode.lexicon import check_lexicon_phones
from labavg.base.errors import DataError

GRAPH_VERSION = 1
SIL_PROB = 0.5  # Kaldi's prepare_lang.sh default


def _compile(arcs: list[tuple], finals: dict[int, float]) -> kaldifst.StdVectorFst:
    """An FST from (src, dst, ilabel, olabel, cost) arcs and {state: final cost}; state 0 starts."""
    lines = [f"{s} {d} {i} {o} {w:.7g}" for s, d, i, o, w in arcs]
    lines += [f"{s} {w:.7g}" for s, w in finals.items()]
    return kaldifst.compile("\n".join(lines) + "\n")


@dataclass
class Lang:
    """Symbol tables of one decoding task: phones (topology labels) and words."""

    phones: list[str]
    phone_labels: list[int]
    silence: str | None
    lexicon: list[tuple[str, list[str]]]
    words: list[str] = field(default_factory=list)  # index = word label; 0 is <eps>

    def __post_init__(self) -> None:
        if not self.words:
            vocab = sorted({w for w, _ in self.lexicon})
            self.words = ["<eps>", *vocab, "#0", "<s>", "</s>"]
        self.word_id = {w: i for i, w in enumerate(self.words)}
        self.phone_label = dict(zip(self.phones, self.phone_labels))
        self.label_phone = dict(zip(self.phone_labels, self.phones))

    @property
    def silence_words(self) -> set[str]:
        """Words pronounced as the silence phone alone (not scored, never in G)."""
        return {w for w, pron in self.lexicon if self.silence is not None and pron == [self.silence]}

    @property
    def real_words(self) -> list[str]:
        """The words G may produce: the lexicon's, less the silence words."""
        return [w for w in self.words[1:] if w not in ("#0", "<s>", "</s>")
                and w not in self.silence_words]

    def words_txt(self) -> str:
        """Kaldi's words.txt."""
        return "".join(f"{w} {i}\n" for i, w in enumerate(self.words))


def make_lang(topology: dict[str, Any], lexicon: list[tuple[str, list[str]]], where: str,
              topology_from: str) -> Lang:
    """The Lang of a model topology and a lexicon (DataError for a phone the model lacks)."""
    check_lexicon_phones(lexicon, topology["phones"], where, topology_from)
    return Lang(phones=list(topology["phones"]), phone_labels=list(topology["labels"]),
                silence=topology.get("silence"), lexicon=lexicon)


# ----------------------------------------------------------------------------- H


def build_h(topology: dict[str, Any], num_disambig: int = 0, first_phone_disambig: int = 0,
            transition_scale: float = 1.0, self_loop_scale: float = 0.1) -> kaldifst.StdVectorFst:
    """H: pdf + 1 in, phone out (on each phone's first arc), closed over phone sequences.

    State 0 is the phone boundary (start and final). Each emitting state s of phone p is a
    state of H; an arc leaving s emits s's pdf. A forward transition of probability a out of a
    state with self-loop probability l weighs transition_scale * log(a / (1 - l)) +
    self_loop_scale * log(1 - l), the self-loop self_loop_scale * log l (Kaldi's AddSelfLoops).
    `num_disambig` disambiguation symbols loop on state 0: input num_pdfs + 1 + k, output
    first_phone_disambig + k.
    """
    arcs: list[tuple] = []
    next_state = 1
    for label, states in zip(topology["labels"], topology["hmm"]):
        ids = list(range(next_state, next_state + len(states)))
        next_state += len(states)
        for s, transitions in enumerate(states):
            loop = [lp for d, _, lp in transitions if d == s]
            loop_lp = min(loop[0], math.log(1.0 - 1e-6)) if loop else -math.inf
            rest = math.log1p(-math.exp(loop_lp))
            for dest, pdf, lp in transitions:
                if dest == s:
                    cost = -self_loop_scale * lp
                else:
                    cost = -(transition_scale * (lp - rest) + self_loop_scale * rest)
                target = 0 if dest >= len(states) else ids[dest]
                arcs.append((ids[s], target, pdf + 1, 0, cost))
                if s == 0:  # entering the phone from the boundary: emit the phone label
                    arcs.append((0, target, pdf + 1, label, cost))
    num_pdfs = 1 + max(pdf for states in topology["hmm"] for arcs_ in states for _, pdf, _ in arcs_)
    for k in range(num_disambig):
        arcs.append((0, 0, num_pdfs + 1 + k, first_phone_disambig + k, 0.0))
    arcs.sort(key=lambda a: a[0])
    return _compile(arcs, {0: 0.0})


# ----------------------------------------------------------------------------- L


def _disambiguate(prons: list[list[str]]) -> tuple[list[list[str]], int]:
    """Kaldi's add_lex_disambig.pl: #1, #2, ... after a pronunciation that another one repeats
    or extends, so that L o G determinizes. Returns the new pronunciations and the largest k."""
    counts = Counter(tuple(p) for p in prons)
    prefixes = {tuple(p[:i]) for p in prons for i in range(1, len(p))}
    used: Counter[tuple] = Counter()
    out, top = [], 0
    for pron in prons:
        key = tuple(pron)
        if counts[key] > 1 or key in prefixes:
            used[key] += 1
            out.append([*pron, f"#{used[key]}"])
            top = max(top, used[key])
        else:
            out.append(list(pron))
    return out, top


def build_l(lang: Lang, sil_prob: float = SIL_PROB) -> tuple[kaldifst.StdVectorFst, int]:
    """L_disambig: phones (and #k) in, words out, optional silence between words.

    Kaldi's make_lexicon_fst.py with --sil-prob: states 0 (start), 1 (word boundary), 2 (after
    an optional silence). Returns the FST and the number of phone disambiguation symbols
    (#0 .. #K); #0 loops on the boundary state to pass G's back-off symbol.
    """
    prons, top = _disambiguate([p for _, p in lang.lexicon])
    num_disambig = top + 1
    first = max(lang.phone_labels) + 1
    label = {**lang.phone_label, **{f"#{k}": first + k for k in range(num_disambig)}}
    sil = lang.phone_label.get(lang.silence) if lang.silence is not None else None
    arcs: list[tuple] = []
    if sil is None or sil_prob <= 0:
        no_sil, with_sil = 0.0, None
    else:
        no_sil, with_sil = -math.log(1.0 - sil_prob), -math.log(sil_prob)
    start, loop, sil_state = 0, 1, 2
    arcs.append((start, loop, 0, 0, no_sil))
    if with_sil is not None:
        arcs.append((start, sil_state, 0, 0, with_sil))
        arcs.append((sil_state, loop, sil, 0, 0.0))
    state = 3
    for (word, _), pron in zip(lang.lexicon, prons):
        src = loop
        wid = lang.word_id[word]
        for i, phone in enumerate(pron[:-1]):
            arcs.append((src, state, label[phone], wid if i == 0 else 0, 0.0))
            src, state = state, state + 1
        last = label[pron[-1]]
        out = wid if len(pron) == 1 else 0
        arcs.append((src, loop, last, out, no_sil))
        if with_sil is not None:
            arcs.append((src, sil_state, last, out, with_sil))
    arcs.append((loop, loop, first, lang.word_id["#0"], 0.0))
    arcs.sort(key=lambda a: a[0])
    return _compile(arcs, {loop: 0.0}), num_disambig


# ----------------------------------------------------------------------------- G


def unigram_g(lang: Lang, word_counts: dict[str, int], num_utts: int) -> kaldifst.StdVectorFst:
    """A unigram G from training word counts, add-one smoothed over the lexicon's words.

    p(</s>) = utterances / (smoothed word count + utterances); every lexicon word keeps a
    chance, so a word the training text never used can still be recognised.
    """
    vocab = lang.real_words
    counts = {w: word_counts.get(w, 0) + 1 for w in vocab}
    total = sum(counts.values())
    p_end = max(num_utts, 1) / (total + max(num_utts, 1))
    arcs = [(0, 0, lang.word_id[w], lang.word_id[w], -math.log((1 - p_end) * c / total))
            for w, c in counts.items()]
    return _compile(arcs, {0: -math.log(p_end)})


_NGRAM_HEADER = re.compile(r"^\\(\d+)-grams:\s*$")


def arpa_words(path: Path) -> set[str]:
    """The words of an ARPA file's unigram section."""
    words: set[str] = set()
    section = None
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        raise DataError(f"language model {path} not found") from None
    for line in lines:
        header = _NGRAM_HEADER.match(line.strip())
        if header:
            section = int(header.group(1))
            continue
        if line.strip() == "\\end\\":
            break
        parts = line.split()
        if section == 1 and len(parts) >= 2:
            words.add(parts[1])
    if not words:
        raise DataError(f"{path}: no \\1-grams: section; not an ARPA language model")
    return words


def arpa_g(lang: Lang, arpa: Path, work_dir: Path) -> kaldifst.StdVectorFst:
    """G from an ARPA file through kaldilm (back-off arcs take #0 on the input side)."""
    import kaldilm

    missing = sorted(arpa_words(arpa) - set(lang.words))
    if missing:
        raise DataError(f"{arpa}: {len(missing)} word(s) of the language model are not in the "
                        f"lexicon: {', '.join(repr(w) for w in missing[:5])}")
    words_txt = work_dir / "words.txt"
    words_txt.write_text(lang.words_txt(), encoding="utf-8")
    text = kaldilm.arpa2fst(str(arpa), disambig_symbol="#0", read_symbol_table=str(words_txt))
    return kaldifst.compile(text)


# ----------------------------------------------------------------------------- HLG


def _remove_input_labels_above(fst: kaldifst.StdVectorFst, limit: int) -> kaldifst.StdVectorFst:
    """Replace input labels > limit (the disambiguation symbols) by epsilon (fstrmsymbols)."""
    lines = []
    for line in fst.to_str(show_weight_one=True).splitlines():
        parts = line.split()
        if len(parts) >= 4 and int(parts[2]) > limit:
            parts[2] = "0"
        lines.append(" ".join(parts))
    return kaldifst.compile("\n".join(lines) + "\n")


def compose_hlg(h: kaldifst.StdVectorFst, l: kaldifst.StdVectorFst, g: kaldifst.StdVectorFst,
                num_pdfs: int) -> kaldifst.StdVectorFst:
    """HLG = rmsymbols(det(H o min(det(L o G)))), minimised, as mkgraph.sh does."""
    lg = _compose_determinized(l, g)
    kaldifst.minimize_encoded(lg)
    hlg = _remove_input_labels_above(_compose_determinized(h, lg), num_pdfs)
    kaldifst.minimize_encoded(hlg)
    kaldifst.arcsort(hlg, sort_type="ilabel")
    return hlg


def _compose_determinized(a: kaldifst.StdVectorFst, b: kaldifst.StdVectorFst) -> kaldifst.StdVectorFst:
    """det(a o b), in the log semiring as Kaldi's fsttablecompose + fstdeterminizestar do."""
    kaldifst.arcsort(a, sort_type="olabel")
    kaldifst.arcsort(b, sort_type="ilabel")
    ab = kaldifst.compose(a, b)
    kaldifst.determinize_star(ab, use_log=True)
    return ab


def phone_bigram_counts(topology: dict[str, Any], sequences: list[list[int]]) -> list[list[float]]:
    """Bigram counts [history][next] of phone label sequences, add-0.5 smoothed.

    History 0 is the sentence start, 1 + i "phone i"; next == number of phones is </s>.
    """
    index = {lab: i for i, lab in enumerate(topology["labels"])}
    n = len(index)
    counts = [[0.5] * (n + 1) for _ in range(n + 1)]
    for seq in sequences:
        prev = 0
        for lab in seq:
            counts[prev][index[lab]] += 1
            prev = 1 + index[lab]
        counts[prev][n] += 1
    return counts


def phone_bigram_g(topology: dict[str, Any], counts: list[list[float]]) -> kaldifst.StdVectorFst:
    """The phone bigram acceptor of `phone_bigram_counts` (labels = topology labels)."""
    labels = list(topology["labels"])
    n = len(labels)
    if len(counts) != n + 1:
        raise DataError(f"phone bigram of {len(counts) - 1} phones for a topology of {n}")
    arcs, finals = [], {}
    for hist in range(n + 1):
        total = sum(counts[hist])
        for j, lab in enumerate(labels):
            arcs.append((hist, 1 + j, lab, lab, -math.log(counts[hist][j] / total)))
        if hist > 0:
            finals[hist] = -math.log(counts[hist][n] / total)
    return _compile(arcs, finals)


def compose_phone_loop(h: kaldifst.StdVectorFst, g: kaldifst.StdVectorFst) -> kaldifst.StdVectorFst:
    """det(H o G) of a phone grammar G (no disambiguation needed: G is deterministic)."""
    hg = _compose_determinized(h, g)
    kaldifst.minimize_encoded(hg)
    kaldifst.arcsort(hg, sort_type="ilabel")
    return hg


def alignment_phone_sequences(topology: dict[str, Any], alignments) -> list[list[int]]:
    """Phone label sequences of pdf alignments: a new phone starts where the phone changes or
    its entry state's pdf follows another of its states."""
    phone_of, entry = {}, set()
    for label, states in zip(topology["labels"], topology["hmm"]):
        for s, arcs in enumerate(states):
            for _, pdf, _ in arcs:
                phone_of[pdf] = label
                if s == 0:
                    entry.add(pdf)
    sequences = []
    for ali in alignments:
        seq, prev = [], None
        for pdf in ali:
            pdf = int(pdf)
            if pdf not in phone_of:
                continue
            if prev is None or phone_of[pdf] != phone_of[prev] or (pdf in entry and prev != pdf):
                seq.append(phone_of[pdf])
            prev = pdf
        sequences.append(seq)
    return sequences


# ----------------------------------------------------------------------------- cache


def default_cache_dir() -> Path:
    """$LABAVG_CACHE/graphs, else ~/.cache/labavg/graphs."""
    root = os.environ.get("LABAVG_CACHE") or Path.home() / ".cache" / "labavg"
    return Path(root) / "graphs"


def cache_key(*parts: Any) -> str:
    """A hash of everything a graph depends on."""
    blob = json.dumps([GRAPH_VERSION, *parts], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def cached_fst(cache_dir: Path | None, key: str, name: str, build) -> kaldifst.StdVectorFst:
    """Read `name` from cache_dir/key, or build it and store it there (atomically)."""
    if cache_dir is None:
        return build()
    path = Path(cache_dir) / key / name
    if path.is_file():
        try:
            return kaldifst.StdVectorFst.read(str(path))
        except Exception:  # a damaged cache entry: build it again
            pass
    fst = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{name}.{os.getpid()}.tmp")
        fst.write(str(tmp))
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache only costs rebuilding next time
    return fst
