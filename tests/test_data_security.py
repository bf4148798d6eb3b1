"""Data files run no commands: pipes are refused unless allowed, pickles never decoded.

Each hostile case names a command that would create a marker file; the test asserts
the DataError and that the marker does not exist. An audit hook (sys.addaudithook,
which sees every subprocess start and every unpickled class) checks the same for
commands that leave no trace.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import kaldiio
import numpy as np
import pytest

from labavg.data.alignment import read_int_vectors
from labavg.data.dataset import open_dataset
from labavg.data.archives import MatrixTable, read_matrix
from labavg.data.cmvn import CmvnTable
from labavg.base.errors import DataError
from test_dataset_errors import make_data_dir, small_corpus

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def corpus_dir(tmp_path):
    """A small data dir (feats.scp, pdf_ali.ark, num_pdfs) and a marker path beside it."""
    folder = make_data_dir(tmp_path / "d", *small_corpus(), num_pdfs=5)
    return folder, tmp_path / "MARKER"


@pytest.fixture()
def yesno(shared_data, tmp_path, monkeypatch):
    """A writable copy of the yesno recipe, cwd there."""
    root = tmp_path / "yesno"
    shutil.copytree(shared_data / "kaldi-yesno", root)
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    monkeypatch.chdir(root)
    return root


def replace_line(path: Path, number: int, text: str) -> None:
    lines = path.read_text().splitlines()
    lines[number - 1] = text
    path.write_text("\n".join(lines) + "\n")


class Touch:
    """Unpickling this runs `touch` (what a PKL object in an ark could do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def write_pickle_object(path: Path, key: str, marker: Path) -> None:
    """An ark whose one object is kaldiio's PKL format (which kaldiio would unpickle)."""
    path.write_bytes(key.encode() + b" PKL" + pickle.dumps(Touch(marker)))


# ------------------------------------------------------------------ features


@pytest.mark.parametrize("line", ["utt1 touch {m} |", "utt1 | touch {m}", "utt1 touch {m} |:12",
                                  "utt1 touch {m} |[0:3]", "utt1   touch {m}|  "])
@pytest.mark.parametrize("allow", [False, True])
def test_feature_pipe_in_feats_scp_is_refused(corpus_dir, line, allow):
    folder, marker = corpus_dir
    replace_line(folder / "feats.scp", 2, line.format(m=marker))
    with pytest.raises(DataError) as info:
        open_dataset(folder, allow_pipes=allow)
    message = str(info.value)
    assert "feats.scp line 2 (key 'utt1')" in message and "is a pipe" in message
    # Refused even when allowed: features are read lazily, the command would rerun per load.
    assert "even with allow_pipes" in message and "copy-feats" in message
    assert not marker.exists()


def test_feature_rspecifier_pipes_are_refused(corpus_dir):
    folder, marker = corpus_dir
    for spec in (f"ark:touch {marker} |", f"scp:touch {marker} |", f"ark:| touch {marker}"):
        with pytest.raises(DataError, match="even with allow_pipes"):
            open_dataset(spec, ali=f"ark:{folder / 'pdf_ali.ark'}", allow_pipes=True)
        with pytest.raises(DataError, match="pipe"):
            MatrixTable.open(spec)
    with pytest.raises(DataError, match="is a pipe"):
        read_matrix(f"touch {marker} |")
    assert not marker.exists()


def test_pickle_object_in_feature_ark_is_never_decoded(corpus_dir):
    folder, marker = corpus_dir
    write_pickle_object(folder / "evil.ark", "utt1", marker)
    replace_line(folder / "feats.scp", 2, f"utt1 {folder / 'evil.ark'}:5")
    with pytest.raises(DataError, match=r"feats.scp line 2 \(key 'utt1'\).*holds a pickle object"):
        open_dataset(folder, allow_pipes=True)
    with pytest.raises(DataError, match=r"evil.ark byte 5 \(key 'utt1'\): holds a pickle object"):
        MatrixTable.open(f"ark:{folder / 'evil.ark'}")
    with pytest.raises(DataError, match="holds a pickle object"):
        read_int_vectors(f"ark:{folder / 'evil.ark'}", allow_pipes=True)
    assert not marker.exists()


# ------------------------------------------------------------------ CMVN


def test_pipe_in_cmvn_scp_is_refused_unless_allowed(yesno, tmp_path):
    marker = tmp_path / "MARKER"
    cmvn = yesno / "data/train_yesno/cmvn.scp"
    cmvn.write_text(f"global touch {marker} |\n")
    with pytest.raises(DataError) as info:
        open_dataset("data/train_yesno", ali_dir="exp/mono0a")
    message = str(info.value)
    assert message.startswith("data/train_yesno/cmvn.scp line 1 (key 'global'): ")
    assert "is a pipe" in message and "allow_pipes=True" in message and "--allow-pipes" in message
    assert not marker.exists()
    with pytest.raises(DataError, match="is a pipe"):
        open_dataset("data/train_yesno", ali_dir="exp/mono0a", cmvn=f"touch {marker} |")
    assert not marker.exists()

    # Allowed, the pipe runs (CMVN stats are read once, at open time) and gives the same stats.
    cmvn.write_text("global tail -c +8 mfcc/cmvn_train_yesno.ark |\n")
    piped = open_dataset("data/train_yesno", ali_dir="exp/mono0a", allow_pipes=True)
    cmvn.write_text("global mfcc/cmvn_train_yesno.ark:7\n")
    plain = open_dataset("data/train_yesno", ali_dir="exp/mono0a")
    np.testing.assert_array_equal(piped.cmvn.stats["global"], plain.cmvn.stats["global"])
    table = CmvnTable.open(f"touch {marker}; tail -c +8 mfcc/cmvn_train_yesno.ark |",
                           allow_pipes=True)
    assert marker.exists() and table.global_stats.shape == (2, 14)


# ------------------------------------------------------------------ alignments


def test_alignment_pipe_rspecifier_is_refused_unless_allowed(yesno, tmp_path):
    marker = tmp_path / "MARKER"
    spec = f"ark:touch {marker}; gunzip -c exp/mono0a/ali.1.gz |"
    with pytest.raises(DataError) as info:
        read_int_vectors(spec)
    message = str(info.value)
    assert message.startswith(f"alignment rspecifier {spec!r}: ")
    assert "allow_pipes=True" in message
    with pytest.raises(DataError, match="is a pipe"):
        open_dataset("data/train_yesno", ali=spec)
    assert not marker.exists()
    # Allowed, it works as in Kaldi (the command runs) and matches the alignment dir.
    tids = read_int_vectors(spec, allow_pipes=True)
    assert marker.exists() and len(tids) == 31


def test_pipe_lines_in_alignment_scp_are_refused(yesno, tmp_path):
    marker = tmp_path / "MARKER"
    tids = read_int_vectors("ark:gunzip -c exp/mono0a/ali.1.gz |", allow_pipes=True)
    kaldiio.save_ark(str(tmp_path / "ali.ark"), tids, scp=str(tmp_path / "ali.scp"))
    replace_line(tmp_path / "ali.scp", 3, f"{sorted(tids)[2]} touch {marker} |")
    with pytest.raises(DataError, match=rf"ali.scp line 3 \(key '{sorted(tids)[2]}'\): .* is a "
                                        r"pipe.*allow_pipes"):
        read_int_vectors(f"scp:{tmp_path / 'ali.scp'}")
    with pytest.raises(DataError, match=r"alignment rspecifier .scp:cat .* is a pipe"):
        read_int_vectors(f"scp:cat {tmp_path / 'ali.scp'} |")
    assert not marker.exists()


def test_allowed_pipe_that_fails_names_the_command(yesno):
    with pytest.raises(DataError, match=r"the command 'gunzip -c exp/mono0a/nothing.gz' failed "
                                        r"with exit status 1: .*nothing.gz"):
        read_int_vectors("ark:gunzip -c exp/mono0a/nothing.gz |", allow_pipes=True)


# ------------------------------------------------------------------ every way in

AUDIT_CHILD = r"""
import json, os, sys
seen = []
def hook(event, args):
    if event in ("subprocess.Popen", "os.system", "os.posix_spawn", "os.exec", "pickle.find_class"):
        seen.append(event)
sys.addaudithook(hook)
from labavg.data.dataset import open_dataset
from labavg.base.errors import DataError
cases = json.loads(sys.argv[1])
report = []
for case in cases:
    before = len(seen)
    outcome = "ok"
    try:
        open_dataset(case["data"], **case["kwargs"])
    except DataError as exc:
        outcome = "DataError"
    report.append([outcome, seen[before:]])
print(json.dumps(report))
"""


def test_no_command_or_unpickling_reaches_the_interpreter(corpus_dir, tmp_path):
    """Python's audit hooks see every subprocess and unpickled class, whoever starts it."""
    folder, marker = corpus_dir
    pdf_ali = f"ark:{folder / 'pdf_ali.ark'}"
    hostile = tmp_path / "h"
    shutil.copytree(folder, hostile)
    replace_line(hostile / "feats.scp", 1, "utt0 true |")
    pickled = tmp_path / "p"
    shutil.copytree(folder, pickled)
    write_pickle_object(pickled / "evil.ark", "utt0", marker)
    replace_line(pickled / "feats.scp", 1, f"utt0 {pickled / 'evil.ark'}:5")
    cmvn = tmp_path / "c"
    shutil.copytree(folder, cmvn)
    (cmvn / "cmvn.scp").write_text("utt0 true |\nutt1 true |\nutt2 true |\n")
    cases = [
        {"data": str(hostile), "kwargs": {}},
        {"data": str(hostile), "kwargs": {"allow_pipes": True}},
        {"data": str(pickled), "kwargs": {"allow_pipes": True}},
        {"data": str(cmvn), "kwargs": {}},
        {"data": "ark:true |", "kwargs": {"ali": pdf_ali, "allow_pipes": True}},
        {"data": str(folder), "kwargs": {"ali": "ark:true |"}},
        {"data": str(folder), "kwargs": {"ali": "scp:true |"}},
        {"data": str(folder), "kwargs": {"ali": "ark:| true"}},
        {"data": str(folder), "kwargs": {"cmvn": "true |"}},
        # The control: an allowed alignment pipe does start a process, so the hook works.
        {"data": str(folder), "kwargs": {"ali": f"ark:cat {folder / 'pdf_ali.ark'} |",
                                         "allow_pipes": True}},
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", AUDIT_CHILD, json.dumps(cases)], env=env,
                          capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report[:-1] == [["DataError", []]] * (len(cases) - 1), report
    assert report[-1][0] == "ok" and "subprocess.Popen" in report[-1][1], report[-1]
    assert not marker.exists()


def test_only_checked_readers_touch_kaldiio():
    """kaldiio's openers run pipes; the readers use only its decoder, behind the checks."""
    openers = ("load_mat", "load_ark", "load_scp", "ReadHelper", "open_like_kaldi",
               "load_scp_sequential", "load_wav_scp")
    modules = sorted((REPO / "labavg" / "data").glob("*.py"))
    assert any(path.name == "archives.py" for path in modules)
    for path in modules:
        source = path.read_text()
        for opener in openers:
            assert opener not in source, (path.name, opener)
