"""RUN_DIR/decode_<set>/, Kaldi-style: written complete by a decode, read back to compare runs.

decode_<set>/ holds hyp_<acwt>.txt (Kaldi `text` format), wer_<acwt>, best_wer, ref.txt, per
(phone error rate at the reported scale) with phone_hyp.txt, and result.json. It is written
beside and renamed into place complete.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from labavg.base.errors import DataError, UserError
from labavg.base.json_files import NUMBER, PAIR, TEXT, check_fields, load_json
from labavg.decode.task import SetResult


# What a comparison reads of result.json, with the type it needs (labavg.base.json_files).
RESULT_FIELDS = {"acwt": NUMBER, "wer": NUMBER, "per": NUMBER, "wer_ci": PAIR, "per_ci": PAIR,
                 "acwt_from": TEXT}


def acwt_name(acwt: float) -> str:
    """An acoustic scale as it appears in file names (wer_0.1) and result.json keys."""
    return f"{acwt:g}"


def write_decode_dir(out: Path, result: SetResult, acwt: float, per, summary: dict) -> None:
    """Kaldi-style decode directory, built beside `out` and renamed into place."""
    build = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    try:
        _write_beside(build, out, result, acwt, per, summary)
    except OSError as exc:  # a full or read-only disk met while writing: nothing half-written
        shutil.rmtree(build, ignore_errors=True)
        raise UserError(f"cannot write {out}: {exc.strerror or exc}") from None


def _write_beside(build: Path, out: Path, result: SetResult, acwt: float, per, summary: dict
                  ) -> None:
    shutil.rmtree(build, ignore_errors=True)
    build.mkdir(parents=True)
    try:
        keys = result.test.keys
        for a, wer in result.wers.items():
            (build / f"wer_{acwt_name(a)}").write_text(wer.kaldi_lines("WER"))
            (build / f"hyp_{acwt_name(a)}.txt").write_text(
                "".join(f"{k} {' '.join(h)}\n" for k, h in zip(keys, result.hyps[a])))
        (build / "best_wer").write_text(
            f"{result.wers[acwt].kaldi_lines('WER').splitlines()[0]} {out}/wer_{acwt_name(acwt)}\n")
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


def _read_table(path: Path) -> dict[str, list[str]]:
    """`key word word ...` lines (Kaldi text format; a key alone is an empty hypothesis)."""
    table: dict[str, list[str]] = {}
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{path} not found: {path.parent} is incomplete") from None
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: binary data, not Kaldi text (byte {exc.start})") from None
    for number, line in enumerate(text.splitlines(), start=1):
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
    try:
        result = check_fields(load_json(result_path), RESULT_FIELDS, result_path, "decode result")
    except (FileNotFoundError, NotADirectoryError):
        raise UserError(f"{result_path} not found: decode the set first (labavg decode "
                        f"{run_dir} --data DIR, or train with --decode-data)") from None
    if result.get("acwt") is None:
        raise DataError(f"{result_path}: not a decode result (no field 'acwt')")
    acwt = float(result["acwt"])
    hyp_path = out / f"hyp_{acwt_name(acwt)}.txt"
    refs, hyps = _read_table(out / "ref.txt"), _read_table(hyp_path)
    if refs.keys() != hyps.keys():
        missing = sorted(refs.keys() ^ hyps.keys())
        raise DataError(f"{hyp_path} and {out / 'ref.txt'} list different utterances "
                        f"({len(missing)}, e.g. {missing[0]!r})")
    return Decoded(run_dir=run_dir, decode_dir=out, acwt=acwt,
                   acwt_from=str(result.get("acwt_from", "")), refs=refs, hyps=hyps)
