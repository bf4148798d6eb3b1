"""Every kind of bad data reaches the user as one message and exit status 2, nothing written."""

from __future__ import annotations

import numpy as np
import pytest

from test_dataset_errors import make_data_dir, small_corpus
from test_train import _cli


def _frame_mismatch(tmp_path):
    feats, pdfs = small_corpus()
    pdfs["utt1"] = pdfs["utt1"][:-1]
    return make_data_dir(tmp_path / "d", feats, pdfs, num_pdfs=5)


def _pdf_out_of_range(tmp_path):
    feats, pdfs = small_corpus()
    pdfs["utt2"][7] = 5
    return make_data_dir(tmp_path / "d", feats, pdfs, num_pdfs=5)


def _nan(tmp_path):
    feats, pdfs = small_corpus()
    feats["utt1"][3, 2] = np.nan
    return make_data_dir(tmp_path / "d", feats, pdfs)


def _dims(tmp_path):
    feats, pdfs = small_corpus()
    feats["utt2"] = feats["utt2"][:, :3]
    return make_data_dir(tmp_path / "d", feats, pdfs)


def _keys(tmp_path):
    feats, pdfs = small_corpus()
    del pdfs["utt0"]
    return make_data_dir(tmp_path / "d", feats, pdfs)


def _empty(tmp_path):
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "feats.scp").write_text("")
    (folder / "pdf_ali.ark").write_bytes(b"")
    return folder


def _truncated(tmp_path):
    folder = make_data_dir(tmp_path / "d", *small_corpus())
    ark = folder / "feats.ark"
    ark.write_bytes(ark.read_bytes()[:-40])
    return folder


def _missing(tmp_path):
    return tmp_path / "nowhere"


def _too_many_ranks(tmp_path):
    return make_data_dir(tmp_path / "d", *small_corpus(num_utts=3))


CASES = {
    "missing": (_missing, "nowhere", []),
    "frame count": (_frame_mismatch, "21 feature frames", []),
    "pdf range": (_pdf_out_of_range, "pdf id 5 at frame 7", []),
    "nan": (_nan, "NaN or Inf", []),
    "dims": (_dims, "dimension 3 differs from 4", []),
    "key mismatch": (_keys, "utt0", []),
    "empty": (_empty, "empty data set", []),
    "truncated ark": (_truncated, "feats.ark", []),
    "more ranks than utterances": (_too_many_ranks, "4 ranks but only 2 training utterances",
                                   ["--ranks", "4"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_data_exits_2(tmp_path, case):
    build, fragment, extra = CASES[case]
    data = build(tmp_path)
    out = tmp_path / "run"
    proc = _cli("train", "--data", str(data), "--out", str(out), "--minibatch", "8",
                "--context", "1", "--no-progress", *extra)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert fragment in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (out / "summary.json").exists() and not (out / "events.jsonl").exists()


@pytest.mark.parametrize("table", ["feats.scp", "cmvn.scp"])
def test_pipe_in_a_data_file_runs_nothing_and_exits_2(tmp_path, table):
    folder = make_data_dir(tmp_path / "d", *small_corpus(), num_pdfs=5)
    marker = tmp_path / "MARKER"
    if table == "cmvn.scp":
        (folder / "cmvn.scp").write_text(f"utt0 touch {marker} |\n")
    else:
        lines = (folder / "feats.scp").read_text().splitlines()
        lines[1] = f"utt1 touch {marker} |"
        (folder / "feats.scp").write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    proc = _cli("train", "--data", str(folder), "--out", str(out), "--minibatch", "8",
                "--context", "1", "--no-progress")
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert f"{table} line" in proc.stderr and "is a pipe" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not marker.exists() and not (out / "events.jsonl").exists()


def test_a_comma_in_the_corpus_path_is_refused_before_anything_is_written(tmp_path, capsys):
    from labavg.cli.main import main

    out = tmp_path / "a,b"
    assert main(["corpus", "synth", str(out), "--hours", "0.01"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"labavg: error: corpus directory {str(out)!r}: Kaldi's file specifiers "
                           "cannot hold a comma in a path; choose one without")
    assert list(tmp_path.iterdir()) == []
