"""Decode a data set with a run's final model: WER and PER, Kaldi-style RUN_DIR/decode_<set>/.

    result = decode_run("runs/x", "data/synth/test", dev="data/synth/dev")

Kaldi's convention: the acoustic scale is swept on the dev set and the test set is reported at
the dev-best scale (every scale's WER of the test set is written too, as score.sh does). Without
a dev set the best scale of the set itself is reported, which flatters it slightly; the result
says which.

decode_<set>/ holds hyp_<acwt>.txt (Kaldi `text` format), wer_<acwt>, best_wer, per (phone
error rate at the reported scale, phone-loop graph with the training phone bigram),
phone_hyp.txt and result.json. It is written beside and renamed into place complete.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from labavg.decode import graph as graphs
from labavg.decode.decoder import DEFAULT_BEAM, Decoder
from labavg.decode.lexicon import map_oov, read_lexicon, read_text
from labavg.decode.model import (ExportedModel, load_final_model, read_phones_txt,
                                 topology_num_pdfs)
from labavg.decode.score import Comparison, ErrorRate, compare_error_rates, error_rate
from labavg.base.errors import DataError, UserError

# Kaldi's score.sh sweeps LM weights 7..17 on acwt 1 (= acwt 1/17 .. 1/7 at LM weight 1).
DEFAULT_ACWTS = (0.05, 0.0667, 0.0833, 0.1, 0.125, 0.15, 0.2)
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


def _words(task: Task, labels: list[int]) -> list[str]:
    silence = task.lang.silence_words
    return [w for w in (task.lang.words[i] for i in labels) if w not in silence]


def _phones_of_words(task: Task, words: list[str]) -> list[str]:
    pron = {}
    for word, phones in task.lang.lexicon:
        pron.setdefault(word, phones)
    return [p for w in words for p in pron.get(w, []) if p != task.lang.silence]


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


def decode_set(task: Task, test: TestSet, acwts=DEFAULT_ACWTS, beam: float = DEFAULT_BEAM) -> SetResult:
    """Decode every utterance at every acoustic scale."""
    decoder = Decoder(task.hlg, beam=beam)
    wers, hyps = {}, {}
    start = time.perf_counter()
    for acwt in acwts:
        hyps[acwt] = [_words(task, decoder.decode(x, acwt).labels) for x in test.loglikes]
        wers[acwt] = error_rate(test.refs, hyps[acwt])
    seconds = time.perf_counter() - start
    return SetResult(test=test, wers=wers, hyps=hyps, decode_seconds=seconds,
                     frames=sum(len(x) for x in test.loglikes))


def phone_error_rate(task: Task, test: TestSet, acwt: float, beam: float = DEFAULT_BEAM
                     ) -> tuple[ErrorRate, list[list[str]]] | None:
    """PER on the phone loop (silence not scored); None without a phone bigram."""
    if task.phone_loop is None:
        return None
    decoder = Decoder(task.phone_loop, beam=beam)
    label_phone = task.lang.label_phone
    hyps = [[label_phone[i] for i in decoder.decode(x, acwt).labels if label_phone[i] != task.lang.silence]
            for x in test.loglikes]
    refs = [_phones_of_words(task, ref) for ref in test.refs]
    return error_rate(refs, hyps), hyps


def _fmt(acwt: float) -> str:
    return f"{acwt:g}"


def write_decode_dir(out: Path, result: SetResult, acwt: float, per, summary: dict) -> None:
    """Kaldi-style decode directory, built beside `out` and renamed into place."""
    build = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(build, ignore_errors=True)
    build.mkdir(parents=True)
    try:
        keys = result.test.keys
        for a, wer in result.wers.items():
            (build / f"wer_{_fmt(a)}").write_text(wer.kaldi_lines("WER"))
            (build / f"hyp_{_fmt(a)}.txt").write_text(
                "".join(f"{k} {' '.join(h)}\n" for k, h in zip(keys, result.hyps[a])))
        (build / "best_wer").write_text(
            f"{result.wers[acwt].kaldi_lines('WER').splitlines()[0]} {out}/wer_{_fmt(acwt)}\n")
        (build / "ref.txt").write_text("".join(f"{k} {' '.join(r)}\n" for k, r in zip(keys, result.test.refs)))
        if per is not None:
            rate, phone_hyps = per
            (build / "per").write_text(rate.kaldi_lines("PER"))
            (build / "phone_hyp.txt").write_text(
                "".join(f"{k} {' '.join(h)}\n" for k, h in zip(keys, phone_hyps)))
        (build / "result.json").write_text(json.dumps(summary, indent=2) + "\n")
        if out.exists():
            old = out.with_name(f"{out.name}.old-{os.getpid()}")
            out.rename(old)
            build.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            build.rename(out)
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise


def decode_run(run_dir: str | os.PathLike, data: str | os.PathLike, *,
               dev: str | os.PathLike | None = None, lang_dir: str | os.PathLike | None = None,
               lexicon: str | os.PathLike | None = None, lm: str | os.PathLike | None = None,
               acwts=DEFAULT_ACWTS, beam: float = DEFAULT_BEAM,
               cache_dir: str | os.PathLike | None | bool = True) -> dict[str, Any]:
    """Decode `data` (and `dev` for the scale) with RUN_DIR/final.pt; write decode_<set>/.

    `cache_dir`: True for the default graph cache (labavg.decode.graph.default_cache_dir),
    False/None for none. Returns the summary (also in decode_<set>/result.json).
    """
    run_dir, data = Path(run_dir), Path(data)
    if not acwts:
        raise UserError("give at least one acoustic scale")
    if any(not (a > 0) for a in acwts):
        raise UserError(f"acoustic scales must be positive, got {list(acwts)}")
    cache = graphs.default_cache_dir() if cache_dir is True else (Path(cache_dir) if cache_dir else None)
    model = load_final_model(run_dir)
    task = prepare(model, data, lang_dir=Path(lang_dir) if lang_dir else None,
                   lexicon=Path(lexicon) if lexicon else None, lm=Path(lm) if lm else None,
                   cache_dir=cache)
    dev_result = None
    if dev is not None:
        dev_result = decode_set(task, load_set(task, Path(dev)), acwts, beam)
        acwt_from = "dev"
    test = load_set(task, data)
    if dev_result is not None:
        # The scale is the dev set's to choose: the test set is decoded at that scale alone.
        acwt = dev_result.best_acwt()
        result = decode_set(task, test, [acwt], beam)
    else:
        result = decode_set(task, test, acwts, beam)
        acwt, acwt_from = result.best_acwt(), "this set (no dev set given)"
    per = phone_error_rate(task, test, acwt, beam)
    wer = result.wers[acwt]
    seconds_per_audio = result.decode_seconds / len(result.wers) / max(test.audio_seconds, 1e-9)
    summary: dict[str, Any] = {
        "set": test.name, "data": str(data.resolve()), "utterances": len(test.keys),
        "words": wer.ref_tokens, "oov_words": test.oov, "acwt": acwt, "acwt_from": acwt_from,
        "wer": wer.rate, "wer_ci": [wer.ci_low, wer.ci_high], "wer_detail": wer.to_dict(),
        "per": per[0].rate if per else None, "per_ci": [per[0].ci_low, per[0].ci_high] if per else None,
        "wer_by_acwt": {_fmt(a): r.rate for a, r in result.wers.items()},
        "dev": None if dev_result is None else {
            "set": dev_result.test.name, "wer": dev_result.wers[acwt].rate,
            "wer_by_acwt": {_fmt(a): r.rate for a, r in dev_result.wers.items()}},
        "lexicon": str(task.lexicon_path), "lm": task.lm, "beam": beam,
        "graph_states": task.hlg.num_states, "audio_seconds": test.audio_seconds,
        "decode_seconds_per_audio_second": seconds_per_audio,
        "nnet_seconds_per_audio_second": test.seconds / max(test.audio_seconds, 1e-9),
    }
    write_decode_dir(run_dir / f"decode_{test.name}", result, acwt, per, summary)
    return summary


def format_result(summary: dict[str, Any]) -> str:
    """A short table for the terminal: the scale sweep (on dev when given), then the result."""
    head = f"decode {summary['set']}: {summary['utterances']} utterances, {summary['words']} words"
    if summary["oov_words"]:
        head += f" ({summary['oov_words']} OOV mapped to <unk>)"
    dev = summary["dev"]
    sweep = dev["wer_by_acwt"] if dev else summary["wer_by_acwt"]
    lines = [head, f"| acwt | {'dev' if dev else summary['set']} WER % |", "|---|---|"]
    for a, rate in sweep.items():
        mark = " *" if float(a) == summary["acwt"] else ""
        lines.append(f"| {a}{mark} | {rate:.2f} |")
    lines.append(f"{summary['set']} WER {summary['wer']:.2f} % (95% CI {summary['wer_ci'][0]:.2f}-"
                 f"{summary['wer_ci'][1]:.2f}) at acwt {summary['acwt']:g} (best on "
                 f"{summary['acwt_from']})")
    if summary["per"] is not None:
        lines.append(f"PER {summary['per']:.2f} % (95% CI {summary['per_ci'][0]:.2f}-"
                     f"{summary['per_ci'][1]:.2f}), phone loop with the training phone bigram")
    return "\n".join(lines)


def split_decode_data(path: str | os.PathLike) -> tuple[Path, Path | None]:
    """(test, dev) of `--decode-data`: a corpus with test/ and dev/ inside, or one data dir."""
    path = Path(path)
    if (path / "test" / "feats.scp").is_file():
        dev = path / "dev"
        return path / "test", dev if (dev / "feats.scp").is_file() else None
    return path, None


def check_decode_data(path: str | os.PathLike) -> None:
    """UserError unless `path` is something `split_decode_data` can decode (checked up front)."""
    test, dev = split_decode_data(path)
    if not (test / "feats.scp").is_file():
        raise UserError(f"decode_data {str(path)!r}: {test / 'feats.scp'} does not exist (a data dir "
                        f"with feats.scp and text, or a corpus with test/ and dev/)")
    if not (test / "text").is_file():
        raise UserError(f"decode_data {str(path)!r}: {test / 'text'} does not exist: decoding "
                        f"needs reference transcripts")


def export_and_decode(run_dir: Path, cfg, source, decode_data: str | os.PathLike | None = None
                      ) -> dict[str, Any]:
    """End of a run: write final.pt; with `decode_data`, decode it and return the summary's
    `wer`, `wer_ci`, `per`, `per_ci`, `acwt` and `decode_set` fields."""
    from labavg.decode.model import export_final_model

    export_final_model(run_dir, cfg, source)
    if decode_data is None:
        return {}
    test, dev = split_decode_data(decode_data)
    result = decode_run(run_dir, test, dev=dev)
    return {key: result[key] for key in ("wer", "wer_ci", "per", "per_ci", "acwt")} | {
        "decode_set": result["set"]}


def _read_table(path: Path) -> dict[str, list[str]]:
    """`key word word ...` lines (Kaldi text format; a key alone is an empty hypothesis)."""
    table: dict[str, list[str]] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        fields = line.split()
        if not fields:
            continue
        if fields[0] in table:
            raise DataError(f"{path}:{number}: utterance {fields[0]!r} appears twice")
        table[fields[0]] = fields[1:]
    return table


@dataclass
class Decoded:
    """One run's decode_<set>/ at its reported acoustic scale."""

    run_dir: Path
    decode_dir: Path
    acwt: float
    acwt_from: str
    refs: dict[str, list[str]]
    hyps: dict[str, list[str]]


def read_decode_dir(run_dir: str | os.PathLike, set_name: str = "test") -> Decoded:
    """RUN_DIR/decode_<set>/: references and the hypotheses at the scale result.json reports."""
    run_dir = Path(run_dir)
    out = run_dir / f"decode_{set_name}"
    result_path = out / "result.json"
    if not result_path.is_file():
        raise UserError(f"{result_path} not found: decode the set first (labavg decode "
                        f"{run_dir} --data DIR, or train with --decode-data)")
    try:
        result = json.loads(result_path.read_text(encoding="utf-8"))
        acwt = float(result["acwt"])
    except (ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{result_path}: not a decode result ({exc})") from None
    hyp_path = out / f"hyp_{_fmt(acwt)}.txt"
    for path in (out / "ref.txt", hyp_path):
        if not path.is_file():
            raise DataError(f"{path} not found: {out} is incomplete")
    refs, hyps = _read_table(out / "ref.txt"), _read_table(hyp_path)
    if refs.keys() != hyps.keys():
        missing = sorted(refs.keys() ^ hyps.keys())
        raise DataError(f"{hyp_path} and {out / 'ref.txt'} list different utterances "
                        f"({len(missing)}, e.g. {missing[0]!r})")
    return Decoded(run_dir=run_dir, decode_dir=out, acwt=acwt,
                   acwt_from=str(result.get("acwt_from", "")), refs=refs, hyps=hyps)


def compare_decodes(run_a: str | os.PathLike, run_b: str | os.PathLike, set_name: str = "test",
                    ) -> tuple[Decoded, Decoded, Comparison]:
    """Run B against run A on the same decoded set, each at its own reported scale.

    WER(B) - WER(A) with the paired bootstrap's 95 % interval and the probability that B is
    better. The two runs must have decoded the same utterances with the same references.
    """
    a, b = read_decode_dir(run_a, set_name), read_decode_dir(run_b, set_name)
    if a.refs.keys() != b.refs.keys():
        only = sorted(a.refs.keys() ^ b.refs.keys())
        raise DataError(f"{a.decode_dir} and {b.decode_dir} decoded different utterances "
                        f"({len(only)} not in both, e.g. {only[0]!r}): not the same test set")
    keys = sorted(a.refs)
    differ = [k for k in keys if a.refs[k] != b.refs[k]]
    if differ:
        raise DataError(f"{a.decode_dir}/ref.txt and {b.decode_dir}/ref.txt differ for "
                        f"{len(differ)} utterances (e.g. {differ[0]!r}): not the same references")
    comparison = compare_error_rates([a.refs[k] for k in keys], [a.hyps[k] for k in keys],
                                     [b.hyps[k] for k in keys])
    return a, b, comparison


def format_comparison(a: Decoded, b: Decoded, c: Comparison, set_name: str = "test") -> str:
    """The comparison for the terminal: both WERs with intervals, then B - A."""
    def line(tag: str, d: Decoded, r: ErrorRate) -> str:
        return (f"{tag} {d.run_dir}: WER {r.rate:.2f} % (95% CI {r.ci_low:.2f}-{r.ci_high:.2f}) "
                f"[ {r.errors} / {r.ref_tokens} ] at acwt {d.acwt:g}")

    verdict = ("resolved: the interval excludes 0" if c.resolved
               else "not resolved: the interval contains 0")
    return "\n".join([
        f"{set_name}: {c.a.sentences} utterances, {c.a.ref_tokens} words",
        line("A", a, c.a), line("B", b, c.b),
        f"B - A: {c.diff:+.2f} points (95% CI {c.diff_ci_low:+.2f} to {c.diff_ci_high:+.2f}, "
        f"paired bootstrap over utterances, {c.replications} replications); "
        f"P(B better) = {c.p_b_better:.3f}; {verdict}"])
