"""open_dataset on real Kaldi data, and one readable DataError per kind of bad input."""

from __future__ import annotations

import gzip
import shutil
import struct
from pathlib import Path

import kaldiio
import numpy as np
import pytest

from labavg.data.alignment import read_ali_dir, read_int_vectors
from labavg.data.dataset import open_dataset
from labavg.data.transition import read_transition_model
from labavg.base.errors import DataError


@pytest.fixture()
def recipe(shared_data, monkeypatch):
    """cwd at the yesno recipe dir, as Kaldi scripts run."""
    monkeypatch.chdir(shared_data / "kaldi-yesno")
    return shared_data / "kaldi-yesno"


def make_data_dir(folder: Path, feats: dict[str, np.ndarray], pdfs: dict[str, np.ndarray] | None,
                  num_pdfs: int | None = None) -> Path:
    """A data dir as the built-in corpus generator writes it (feats + pdf_ali.ark)."""
    folder.mkdir(parents=True, exist_ok=True)
    with kaldiio.WriteHelper(f"ark,scp:{folder / 'feats.ark'},{folder / 'feats.scp'}") as writer:
        for key in sorted(feats):
            writer(key, feats[key])
    if pdfs is not None:
        kaldiio.save_ark(str(folder / "pdf_ali.ark"),
                         {k: np.asarray(v, dtype=np.int32) for k, v in pdfs.items()})
    if num_pdfs is not None:
        (folder / "num_pdfs").write_text(f"{num_pdfs}\n")
    return folder


def small_corpus(num_utts: int = 3, frames: int = 20, dim: int = 4):
    rng = np.random.default_rng(1)
    feats = {f"utt{i}": rng.normal(size=(frames + i, dim)).astype(np.float32)
             for i in range(num_utts)}
    pdfs = {k: rng.integers(0, 5, size=len(v)) for k, v in feats.items()}
    return feats, pdfs


# ------------------------------------------------------------------ real data


def test_yesno_with_alignment_dir(recipe):
    data = open_dataset("data/train_yesno", ali_dir="exp/mono0a")
    assert len(data.keys) == 31 and data.keys == sorted(data.keys)
    assert data.feat_dim == 13 and data.num_pdfs == 11 and data.cmvn_applied
    assert data.num_pdfs_source.endswith("final.mdl")
    feats, pdfs = data.load("0_0_0_1_0_0_0_1")
    assert feats.dtype == np.float32 and pdfs.dtype == np.int64
    assert feats.shape == (data.num_frames["0_0_0_1_0_0_0_1"], 13) == (674, 13)
    assert len(pdfs) == 674 and pdfs.max() < 11
    for key in data.keys:
        assert data.num_frames[key] == len(data.pdfs[key])
    # Global CMVN: over the whole training set the normalised features average zero.
    total = sum(data.load(k)[0].astype(np.float64).sum(0) for k in data.keys)
    np.testing.assert_allclose(total / sum(data.num_frames.values()), 0, atol=1e-3)


def test_real_utterance_with_textgrid_and_cmvn(shared_data, monkeypatch):
    monkeypatch.chdir(shared_data / "real-utterance")
    data = open_dataset("ark:mfccs.ark", textgrid="acoustic_corpus.TextGrid",
                        cmvn="cmvn.ark", snip_edges=False)
    assert data.keys == ["1-1"] and data.num_frames == {"1-1": 2672} and data.num_pdfs == 40
    feats, labels = data.load("1-1")
    target = dict(kaldiio.load_ark("final_features.ark"))["1-1"]
    np.testing.assert_array_equal(feats, target)
    assert labels.shape == (2672,) and labels[105] != labels[104]


def test_pdf_ali_and_num_pdfs_file(tmp_path):
    feats, pdfs = small_corpus()
    folder = make_data_dir(tmp_path / "d", feats, pdfs, num_pdfs=7)
    data = open_dataset(folder)
    assert data.num_pdfs == 7 and not data.cmvn_applied and data.feat_dim == 4
    x, y = data.load("utt2")
    np.testing.assert_array_equal(x, feats["utt2"])
    np.testing.assert_array_equal(y, pdfs["utt2"])
    (folder / "num_pdfs").unlink()
    last_resort = open_dataset(folder)
    assert last_resort.num_pdfs == 1 + max(int(v.max()) for v in pdfs.values())
    assert "max(pdf)+1" in last_resort.num_pdfs_source


# ------------------------------------------------------------------ errors


def test_missing_data_dir_and_feats_scp(tmp_path):
    with pytest.raises(DataError, match="not found: give a Kaldi data dir"):
        open_dataset(tmp_path / "nowhere")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "text").write_text("")
    with pytest.raises(DataError, match=r"no feats.scp \(files there: 'text'\)"):
        open_dataset(tmp_path / "d")


def test_scp_pointing_nowhere_names_line_and_cwd_rule(shared_data, monkeypatch):
    monkeypatch.chdir(shared_data / "kaldi-yesno" / "data")
    with pytest.raises(DataError) as info:
        open_dataset("train_yesno", ali_dir="../exp/mono0a")
    message = str(info.value)
    assert "train_yesno/feats.scp line 1" in message
    assert "'mfcc/raw_mfcc_train_yesno.1.ark'" in message
    assert str(shared_data / "kaldi-yesno" / "data" / "mfcc") in message  # the path tried
    assert "working directory of the command" in message and "recipe directory" in message


def test_truncated_ark(recipe, tmp_path):
    ark = (recipe / "mfcc/raw_mfcc_train_yesno.1.ark").read_bytes()
    (tmp_path / "cut.ark").write_bytes(ark[: len(ark) - 100])
    lines = (recipe / "data/train_yesno/feats.scp").read_text().splitlines()
    scp = [f"{line.split()[0]} {tmp_path / 'cut.ark'}:{line.split(':')[-1]}" for line in lines]
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "feats.scp").write_text("\n".join(scp) + "\n")
    last = sorted(lines)[-1].split()[0]
    with pytest.raises(DataError, match=rf"feats.scp line 31 \(key '{last}'\).*truncated or corrupt"):
        open_dataset(folder, ali_dir="exp/mono0a")
    with pytest.raises(DataError, match=rf"cut.ark byte \d+ \(key '{last}'\): CM header says "
                                         r"616 x 13 \(8133 bytes\) but only 8033 bytes are left"):
        open_dataset(f"ark:{tmp_path / 'cut.ark'}", ali_dir="exp/mono0a")


def test_corrupt_ark_header(tmp_path):
    feats, pdfs = small_corpus()
    folder = make_data_dir(tmp_path / "d", feats, pdfs)
    raw = bytearray((folder / "feats.ark").read_bytes())
    at = raw.index(b"FM ", raw.index(b"utt1"))
    raw[at:at + 2] = b"XM"
    (folder / "feats.ark").write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"line 2 \(key 'utt1'\) at .*d/feats.ark byte \d+: "
                                        r"unknown binary object type 'XM'"):
        open_dataset(folder)


def test_key_mismatch_lists_keys_or_drops_them(recipe, tmp_path):
    feats = {k: np.zeros((5, 2), np.float32) for k in ["a", "b", "c", "d", "e", "f", "g"]}
    pdfs = {k: np.zeros(5, np.int32) for k in ["a", "c", "x"]}
    folder = make_data_dir(tmp_path / "d", feats, pdfs, num_pdfs=2)
    with pytest.raises(DataError) as info:
        open_dataset(folder)
    message = str(info.value)
    assert "5 of 7 feature utterances have no alignment" in message
    assert "'b', 'd', 'e', 'f', 'g'" in message
    assert "1 aligned utterances have no features: 'x'" in message and "skip_mismatched" in message
    data = open_dataset(folder, skip_mismatched=True)
    assert data.keys == ["a", "c"] and data.dropped_keys == ["b", "d", "e", "f", "g"]
    assert data.unused_alignment_keys == ["x"]
    many = {f"u{i:02d}": np.zeros((3, 2), np.float32) for i in range(12)}
    folder = make_data_dir(tmp_path / "m", many, {"u00": np.zeros(3, np.int32)}, num_pdfs=2)
    with pytest.raises(DataError, match=r"'u05', \.\.\. \(11 in all\)"):
        open_dataset(folder)


def test_frame_count_mismatch_names_key_and_counts(tmp_path):
    feats, pdfs = small_corpus()
    pdfs["utt1"] = pdfs["utt1"][:-1]
    folder = make_data_dir(tmp_path / "d", feats, pdfs, num_pdfs=5)
    with pytest.raises(DataError, match=r"utterance 'utt1': 21 feature frames .* but 20 alignment"):
        open_dataset(folder)


def test_pdf_out_of_range(tmp_path):
    feats, pdfs = small_corpus()
    pdfs["utt2"][7] = 5
    folder = make_data_dir(tmp_path / "d", feats, pdfs, num_pdfs=5)
    with pytest.raises(DataError, match=r"'utt2'.*pdf id 5 at frame 7 is out of range 0\.\.4 "
                                        r"\(num_pdfs 5 from .*num_pdfs\)"):
        open_dataset(folder)
    pdfs["utt2"][7] = -2
    folder = make_data_dir(tmp_path / "e", feats, pdfs)
    with pytest.raises(DataError, match="pdf id -2 at frame 7"):
        open_dataset(folder)


def test_nan_and_inf_in_features(tmp_path):
    feats, pdfs = small_corpus()
    feats["utt1"][3, 2] = np.nan
    with pytest.raises(DataError, match=r"key 'utt1'.*NaN or Inf .*frame 3, dim 2: nan"):
        open_dataset(make_data_dir(tmp_path / "d", feats, pdfs))
    feats["utt1"][3, 2] = np.inf
    with pytest.raises(DataError, match=r"frame 3, dim 2: inf"):
        open_dataset(make_data_dir(tmp_path / "e", feats, pdfs))


def test_feature_dims_differ(tmp_path):
    feats, pdfs = small_corpus()
    feats["utt2"] = feats["utt2"][:, :3]
    with pytest.raises(DataError, match=r"key 'utt2'.*dimension 3 differs from 4"):
        open_dataset(make_data_dir(tmp_path / "d", feats, pdfs))


def test_empty_data_set(tmp_path):
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "feats.scp").write_text("")
    kaldiio.save_ark(str(folder / "pdf_ali.ark"), {})
    with pytest.raises(DataError, match="empty data set"):
        open_dataset(folder)
    feats, pdfs = small_corpus()
    folder = make_data_dir(tmp_path / "e", feats, {"other": np.zeros(3, np.int32)})
    with pytest.raises(DataError, match="empty data set"):
        open_dataset(folder, skip_mismatched=True)


def test_no_alignments_and_two_sources(tmp_path):
    feats, _ = small_corpus()
    folder = make_data_dir(tmp_path / "d", feats, None)
    with pytest.raises(DataError, match="no alignments for .*ali_dir="):
        open_dataset(folder)
    with pytest.raises(DataError, match="give one alignment source, not ali and ali_dir"):
        open_dataset(folder, ali="ark:x.ark", ali_dir="exp/x")


def test_missing_alignment_dir_and_model(recipe, tmp_path):
    with pytest.raises(DataError, match="alignment dir not found: exp/tri3_ali"):
        open_dataset("data/train_yesno", ali_dir="exp/tri3_ali")
    shutil.copy(recipe / "exp/mono0a/ali.1.gz", tmp_path / "ali.1.gz")
    with pytest.raises(DataError, match="no final.mdl"):
        open_dataset("data/train_yesno", ali_dir=tmp_path)


def test_missing_speaker_stats_fail_at_open(tmp_path):
    feats, pdfs = small_corpus()
    folder = make_data_dir(tmp_path / "d", feats, pdfs, num_pdfs=5)
    kaldiio.save_ark(str(folder / "cmvn.ark"), {"spkA": np.ones((2, 5))},
                     scp=str(folder / "cmvn.scp"))
    (folder / "utt2spk").write_text("utt0 spkA\nutt1 spkA\nutt2 spkB\n")
    # At open time, before any rank starts: not only on the rank that loads 'utt2'.
    with pytest.raises(DataError, match=r"cmvn.scp: no CMVN stats for 'spkB' \(their speakers in "
                                        r".*d/utt2spk\), needed by 1 utterance\(s\), e.g. 'utt2'"):
        open_dataset(folder)
    (folder / "utt2spk").write_text("utt0 spkA\nutt1 spkA\nutt2 spkA\n")
    assert open_dataset(folder).cmvn_applied
    kaldiio.save_ark(str(folder / "cmvn.ark"), {"spkA": np.ones((2, 7))},
                     scp=str(folder / "cmvn.scp"))
    with pytest.raises(DataError, match=r"cmvn.scp line 1 \(key 'spkA'\): CMVN stats for 'spkA' "
                                        r"are for dimension 6, the features have 4"):
        open_dataset(folder)


def test_stale_utt2num_frames_is_named_with_its_line(tmp_path):
    feats, pdfs = small_corpus()
    folder = make_data_dir(tmp_path / "d", feats, pdfs, num_pdfs=5)
    (folder / "utt2num_frames").write_text("utt0 20\nutt1 99\nutt2 22\n")
    # Named before the alignments are compared with it (which would blame them instead).
    with pytest.raises(DataError, match=r"d/utt2num_frames line 2: 'utt1' has 99 frames, but its "
                                        r"feature matrix \(.*feats.scp line 2 \(key 'utt1'\)\) "
                                        r"has 21 rows; the file is stale"):
        open_dataset(folder)
    # Text matrices have no header to check at open time: the load names the file and line.
    text = tmp_path / "t"
    text.mkdir()
    kaldiio.save_ark(str(text / "feats.ark"), feats, scp=str(text / "feats.scp"), text=True)
    pdfs["utt1"] = np.zeros(99, np.int64)
    kaldiio.save_ark(str(text / "pdf_ali.ark"),
                     {k: np.asarray(v, dtype=np.int32) for k, v in pdfs.items()})
    (text / "num_pdfs").write_text("5\n")
    (text / "utt2num_frames").write_text("utt0 20\nutt1 99\nutt2 22\n")
    data = open_dataset(text)
    assert data.num_frames["utt1"] == 99
    data.load("utt0")
    with pytest.raises(DataError, match=r"feats.scp line 2 \(key 'utt1'\): 21 frames, but "
                                        r".*t/utt2num_frames line 2 says 99"):
        data.load("utt1")


# ------------------------------------------------------------------ corrupt headers and bytes


def copy_recipe(shared_data: Path, tmp_path: Path) -> Path:
    root = tmp_path / "yesno"
    shutil.copytree(shared_data / "kaldi-yesno", root)
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return root


def test_huge_matrix_header_is_refused_before_reading(shared_data, tmp_path, monkeypatch):
    """A CM header saying 2**31-1 rows asked kaldiio for ~144 GB; now the file size says no."""
    root = copy_recipe(shared_data, tmp_path)
    monkeypatch.chdir(root)
    ark = root / "mfcc/raw_mfcc_train_yesno.1.ark"
    raw = bytearray(ark.read_bytes())
    at = 8386  # the second utterance's object (data/train_yesno/feats.scp line 2)
    assert raw[at:at + 5] == b"\0BCM "
    raw[at + 13:at + 17] = struct.pack("<i", 0x7FFFFFFF)  # GlobalHeader rows
    ark.write_bytes(bytes(raw))
    left = len(raw) - at
    expected = (rf"feats.scp line 2 \(key '0_0_0_1_0_0_0_1'\) at mfcc/raw_mfcc_train_yesno.1.ark "
                rf"byte 8386: CM header says 2147483647 x 13 \(\d+ bytes\) but only {left} bytes")
    with pytest.raises(DataError, match=expected):
        open_dataset("data/train_yesno", ali_dir="exp/mono0a")
    with pytest.raises(DataError, match=r"raw_mfcc_train_yesno.1.ark byte 8386 \(key "
                                        r"'0_0_0_1_0_0_0_1'\): CM header says 2147483647 x 13"):
        open_dataset("ark:mfcc/raw_mfcc_train_yesno.1.ark", ali_dir="exp/mono0a")
    raw[at + 13:at + 17] = struct.pack("<i", -3)
    ark.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"byte 8386: corrupt CM header: negative size -3 x 13"):
        open_dataset("data/train_yesno", ali_dir="exp/mono0a")


def test_float_matrix_and_int_vector_sizes_are_checked(tmp_path):
    feats, pdfs = small_corpus()
    folder = make_data_dir(tmp_path / "d", feats, pdfs)
    raw = bytearray((folder / "feats.ark").read_bytes())
    at = raw.index(b"FM ", raw.index(b"utt1"))  # then \4 rows \4 cols
    assert raw[at + 3] == raw[at + 8] == 4
    raw[at + 9:at + 13] = struct.pack("<i", 1 << 28)
    (folder / "feats.ark").write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"line 2 \(key 'utt1'\) at .*feats.ark byte \d+: FM header "
                                        r"says 21 x 268435456 \(\d+ bytes\) but only \d+ bytes"):
        open_dataset(folder)
    ali = bytearray((folder / "pdf_ali.ark").read_bytes())
    at = ali.index(b"\0B\4", ali.index(b"utt2"))
    ali[at + 3:at + 7] = struct.pack("<i", 1 << 30)
    (folder / "pdf_ali.ark").write_bytes(bytes(ali))
    with pytest.raises(DataError, match=r"pdf_ali.ark byte \d+ \(key 'utt2'\): IV header says "
                                        r"1073741824 \(5368709127 bytes\) but only 117 bytes"):
        read_int_vectors(f"ark:{folder / 'pdf_ali.ark'}")


def test_corrupt_and_truncated_gzip_alignments(shared_data, tmp_path):
    root = copy_recipe(shared_data, tmp_path)
    ali = root / "exp/mono0a/ali.1.gz"
    data = ali.read_bytes()
    ali.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"ali.1.gz: not a readable gzip file \(truncated or "
                                        r"corrupt\?\): Compressed file ended"):
        read_ali_dir(root / "exp/mono0a")
    corrupt = bytearray(data)
    corrupt[len(data) // 2] ^= 0xFF
    ali.write_bytes(bytes(corrupt))
    with pytest.raises(DataError, match=r"ali.1.gz: not a readable gzip file"):
        read_ali_dir(root / "exp/mono0a")
    text = gzip.decompress(data).replace(b"0_0_1_0_1_0_0_0 ", b"0_0_1\xff1_0_0_0 ", 1)
    ali.write_bytes(gzip.compress(text))
    with pytest.raises(DataError, match=r"ali.1.gz \(decompressed\) byte \d+: unreadable key "
                                        r"b'0_0_1\\xff1_0_0_0'"):
        read_ali_dir(root / "exp/mono0a")


def test_model_with_a_huge_vector_length_is_refused(shared_data, tmp_path):
    model = bytearray((shared_data / "kaldi-yesno/exp/mono0a/final.mdl").read_bytes())
    at = model.index(b"<Topology> ") + len(b"<Topology> ")
    assert model[at] == 4  # the phones vector: size byte, then its length
    model[at + 1:at + 5] = struct.pack("<i", 400_000_000)
    (tmp_path / "final.mdl").write_bytes(bytes(model))
    with pytest.raises(DataError, match=r"final.mdl byte \d+: a size in the file asks for "
                                        r"1600000000 bytes, only \d+ are left"):
        read_transition_model(tmp_path / "final.mdl")


def test_undecodable_text_files_name_file_and_line(shared_data, tmp_path, monkeypatch):
    root = copy_recipe(shared_data, tmp_path)
    monkeypatch.chdir(root)
    utt2spk = root / "data/train_yesno/utt2spk"
    lines = utt2spk.read_bytes().split(b"\n")
    lines[3] = lines[3].replace(b"global", b"glob\xe9l")
    utt2spk.write_bytes(b"\n".join(lines))
    with pytest.raises(DataError, match=r"data/train_yesno/utt2spk line 4: not valid UTF-8 "
                                        r"\(invalid continuation byte at byte \d+ of the line"):
        open_dataset("data/train_yesno", ali_dir="exp/mono0a")
    feats_scp = root / "data/train_yesno/feats.scp"
    feats_scp.write_bytes(feats_scp.read_bytes().replace(b"0_0_0_1_0_0_0_1", b"0_0_0_1\xc0", 1))
    with pytest.raises(DataError, match=r"data/train_yesno/feats.scp line 2: not valid UTF-8"):
        open_dataset("data/train_yesno", ali_dir="exp/mono0a")


def test_kaldiio_multi_line_messages_become_one_line(tmp_path):
    feats, pdfs = small_corpus()
    folder = make_data_dir(tmp_path / "d", feats, pdfs)
    # A text ark whose first value is not a number: kaldiio says "...is not a digit\nFile format..."
    (folder / "feats.ark").write_bytes(b"utt0 [ x1 2\n 3 4 ]\n")
    (folder / "feats.scp").write_text(f"utt0 {folder / 'feats.ark'}:5\n")
    with pytest.raises(DataError) as info:
        open_dataset(folder, skip_mismatched=True)
    assert "\n" not in str(info.value) and "File format is wrong" in str(info.value)
    assert "feats.scp line 1 (key 'utt0')" in str(info.value)


def test_num_pdfs_argument_beats_the_data_dirs_file(tmp_path):
    feats, pdfs = small_corpus()
    folder = make_data_dir(tmp_path / "d", feats, pdfs, num_pdfs=7)
    data = open_dataset(folder, num_pdfs=9)
    assert data.num_pdfs == 9 and data.num_pdfs_source == "the num_pdfs argument"
    assert open_dataset(folder).num_pdfs_source == str(folder / "num_pdfs")


def test_alignment_model_beats_the_num_pdfs_argument(recipe):
    data = open_dataset("data/train_yesno", ali_dir="exp/mono0a", num_pdfs=99)
    assert data.num_pdfs == 11 and data.num_pdfs_source.endswith("final.mdl")
