"""Decode a data set with a run's final model: WER and PER, Kaldi-style RUN_DIR/decode_<set>/.

    result = decode_run("runs/x", "data/synth/test", dev="data/synth/dev")

Kaldi's convention: the acoustic scale is swept on the dev set and the test set is reported at
the dev-best scale (every scale's WER of the test set is written too, as score.sh does). Without
a dev set the best scale of the set itself is reported, which flatters it slightly; the result
says which.

The files written are described in labavg.decode.decode_dir.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from labavg.base.errors import UserError
from labavg.base.paths import require_writable
from labavg.decode import graph as graphs
from labavg.decode.decode_dir import acwt_name, write_decode_dir
from labavg.decode.decoder import DEFAULT_BEAM, Decoder
from labavg.decode.model import load_final_model
from labavg.decode.score import ErrorRate, error_rate
from labavg.decode.task import SetResult, Task, TestSet, load_set, prepare

# Kaldi's score.sh sweeps LM weights 7..17 on acwt 1 (= acwt 1/17 .. 1/7 at LM weight 1).
DEFAULT_ACWTS = (0.05, 0.0667, 0.0833, 0.1, 0.125, 0.15, 0.2)


def _words(task: Task, labels: list[int]) -> list[str]:
    silence = task.lang.silence_words
    return [w for w in (task.lang.words[i] for i in labels) if w not in silence]


def _phones_of_words(task: Task, words: list[str]) -> list[str]:
    pron = {}
    for word, phones in task.lang.lexicon:
        pron.setdefault(word, phones)
    return [p for w in words for p in pron.get(w, []) if p != task.lang.silence]


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
    # Before minutes of decoding: decode_<set>/ goes into the run directory.
    require_writable(run_dir, "run directory", "the run directory")
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
        "wer_by_acwt": {acwt_name(a): r.rate for a, r in result.wers.items()},
        "dev": None if dev_result is None else {
            "set": dev_result.test.name, "wer": dev_result.wers[acwt].rate,
            "wer_by_acwt": {acwt_name(a): r.rate for a, r in dev_result.wers.items()}},
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


def decode_fields(run_dir: Path, decode_data: str | os.PathLike) -> dict[str, Any]:
    """Decode `decode_data` with RUN_DIR/final.pt: the summary's `wer`, `wer_ci`, `per`,
    `per_ci`, `acwt` and `decode_set` fields."""
    test, dev = split_decode_data(decode_data)
    result = decode_run(run_dir, test, dev=dev)
    return {key: result[key] for key in ("wer", "wer_ci", "per", "per_ci", "acwt")} | {
        "decode_set": result["set"]}
