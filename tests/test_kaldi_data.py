"""Reading Kaldi feature tables (every format, scp ranges) and Kaldi-exact CMVN."""

from __future__ import annotations

import io

import kaldiio
import numpy as np
import pytest

from labavg.data.archives import MatrixTable, read_matrix
from labavg.data.cmvn import CmvnTable, apply_cmvn
from labavg.data.object_header import ObjectHeader, parse_header
from labavg.data.rxfilenames import is_rspecifier
from labavg.data.text_tables import read_scp
from labavg.base.errors import DataError

FULL = "AMI_ES2011a_H00_FEE041_0003714_0003915"


@pytest.fixture()
def io_arks(shared_data, monkeypatch):
    """cwd at kaldi-io-arks: its scp paths are relative to that folder, as in Kaldi."""
    monkeypatch.chdir(shared_data / "kaldi-io-arks")
    return shared_data / "kaldi-io-arks"


def test_rspecifier_detection():
    assert is_rspecifier("ark:a.ark") and is_rspecifier("ark,t:a.txt")
    assert is_rspecifier("scp:data/train/feats.scp")
    assert not is_rspecifier("data/train") and not is_rspecifier("/abs/feats.scp")


@pytest.mark.parametrize("scp", ["feats.scp", "feats_compressed.scp"])
def test_scp_ranges_equal_slices_of_full_matrix(io_arks, scp):
    table = MatrixTable.open(f"scp:{scp}")
    full = table.load(FULL)
    assert full.shape == (199, 13) and full.dtype == np.float32
    # Kaldi ranges are inclusive: [0:5] is 6 rows.
    np.testing.assert_array_equal(table.load(FULL + "_slice1"), full)
    np.testing.assert_array_equal(table.load(FULL + "_slice2"), full[0:6])
    np.testing.assert_array_equal(table.load(FULL + "_slice3"), full[:, 7:13])
    np.testing.assert_array_equal(table.load(FULL + "_slice4"), full[20:31, 7:13])
    assert table.load(FULL + "_slice4").shape == (11, 6)


def test_fm_cm_and_text_arks_agree(io_arks):
    float_table = MatrixTable.open("ark:feats.ark")
    compressed = MatrixTable.open("ark:feats_compressed.ark")
    text = MatrixTable.open("ark,t:feats_ascii.ark")
    assert float_table.keys == compressed.keys and len(float_table) == 10
    assert float_table.shapes[FULL] == (199, 13)
    for key in float_table.keys:
        x, y = float_table.load(key), compressed.load(key)
        assert y.dtype == np.float32 and y.shape == x.shape
        # CM stores 8-bit codes between per-column quantiles: error << column range.
        column_range = x.max(0) - x.min(0)
        assert np.all(np.abs(x - y) <= column_range / 255 + 1e-5)
    for key in text.keys:
        np.testing.assert_allclose(text.load(key), float_table.load(key), atol=1e-4)
    # The indexed ark and the scp point at the same bytes.
    np.testing.assert_array_equal(MatrixTable.open("scp:feats.scp").load(FULL),
                                  float_table.load(FULL))


def test_duplicate_scp_key_is_reported_with_lines(io_arks):
    with pytest.raises(DataError, match=r"feats_ascii\.scp line 5: key '.*_slice2' repeats line 4"):
        MatrixTable.open("scp:feats_ascii.scp")
    entries = read_scp("feats.scp")
    assert entries[3].line == 4 and entries[3].rxfilename == "feats.ark:14913[0:5]"


@pytest.mark.parametrize("method,tolerance", [(2, 0.05), (3, 1e-3), (5, 0.05)])
def test_cm_cm2_cm3_and_double_matrices(tmp_path, method, tolerance):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 5)).astype(np.float32)
    kaldiio.save_ark(str(tmp_path / "c.ark"), {"u": x}, compression_method=method)
    kaldiio.save_ark(str(tmp_path / "d.ark"), {"u": x.astype(np.float64)})
    header = (tmp_path / "c.ark").read_bytes()[:8]
    assert header[2:4] == b"\0B" and header[4:6] == b"CM"
    y = MatrixTable.open(f"ark:{tmp_path / 'c.ark'}").load("u")
    assert y.dtype == np.float32 and np.abs(y - x).max() < tolerance * (x.max() - x.min())
    assert b"DM" in (tmp_path / "d.ark").read_bytes()[:8]
    d = MatrixTable.open(f"ark:{tmp_path / 'd.ark'}").load("u")
    assert d.dtype == np.float32
    np.testing.assert_array_equal(d, x)


def test_yesno_compressed_scp_and_ark_index_agree(shared_data, monkeypatch):
    monkeypatch.chdir(shared_data / "kaldi-yesno")
    scp = MatrixTable.open("scp:data/train_yesno/feats.scp")
    ark = MatrixTable.open("ark:mfcc/raw_mfcc_train_yesno.1.ark")
    assert scp.keys == ark.keys and len(scp) == 31
    key = scp.keys[7]
    np.testing.assert_array_equal(scp.load(key), ark.load(key))
    assert ark.shapes[scp.keys[0]] == (633, 13)


def test_scp_paths_resolve_against_cwd(shared_data, monkeypatch):
    monkeypatch.chdir(shared_data / "kaldi-yesno" / "data")
    with pytest.raises(DataError) as info:
        MatrixTable.open("scp:train_yesno/feats.scp")
    message = str(info.value)
    assert "train_yesno/feats.scp line 1" in message
    assert "mfcc/raw_mfcc_train_yesno.1.ark" in message
    assert "working directory" in message
    assert f"exists relative to {shared_data / 'kaldi-yesno'}" in message


# ------------------------------------------------------------------ CMVN


@pytest.fixture()
def utterance(shared_data):
    folder = shared_data / "real-utterance"
    feats = dict(kaldiio.load_ark(str(folder / "mfccs.ark")))["1-1"]
    stats = dict(kaldiio.load_ark(str(folder / "cmvn.ark")))["1"]
    target = dict(kaldiio.load_ark(str(folder / "final_features.ark")))["1-1"]
    return feats, stats, target


def test_mean_normalisation_matches_kaldi_bit_for_bit(utterance):
    feats, stats, target = utterance
    assert stats.dtype == np.float64 and stats.shape == (2, 14) and stats[0, -1] == 2672
    np.testing.assert_array_equal(apply_cmvn(feats, stats), target)
    # A plain float64 mean subtraction is off by 1 ulp in a quarter of the entries: the
    # exact match above needs Kaldi's float offset = float(-1/count) * sum.
    naive = (feats.astype(np.float64) - stats[0, :-1] / stats[0, -1]).astype(np.float32)
    assert not np.array_equal(naive, target)


def test_variance_normalisation_and_floor(utterance):
    feats, stats, _ = utterance
    normed = apply_cmvn(feats, stats, norm_vars=True)
    np.testing.assert_allclose(normed.mean(0, dtype=np.float64), 0, atol=1e-4)
    np.testing.assert_allclose(normed.var(0, dtype=np.float64), 1, atol=1e-3)
    # A constant column has variance 0 -> floored at 1e-20, scale 1e10: Kaldi maps it to 0.
    flat = np.full((4, 2), 3.0, dtype=np.float32)
    flat_stats = np.array([[12.0, 12.0, 4.0], [36.0, 36.0, 0.0]])
    np.testing.assert_array_equal(apply_cmvn(flat, flat_stats, norm_vars=True), 0.0)
    with pytest.raises(DataError, match="no second"):
        apply_cmvn(flat, flat_stats[:1], norm_vars=True)
    with pytest.raises(DataError, match="count = 0.5"):
        apply_cmvn(flat, np.array([[1.0, 1.0, 0.5], [1.0, 1.0, 0.0]]))


def test_cmvn_table_per_speaker_and_global(shared_data, monkeypatch):
    monkeypatch.chdir(shared_data / "kaldi-yesno")
    table = CmvnTable.open("scp:data/train_yesno/cmvn.scp", "data/train_yesno/utt2spk")
    stats = table.stats_for("0_0_0_0_1_1_1_1")
    assert stats.shape == (2, 14) and stats[0, -1] == 18996
    single = CmvnTable.open(str(shared_data / "real-utterance" / "cmvn.ark"))
    assert single.stats_for("anything")[0, -1] == 2672
    raw = read_matrix("mfcc/cmvn_train_yesno.ark:7")
    np.testing.assert_allclose(raw, stats)


def _kaldi_bytes(array: np.ndarray, compression_method: int | None = None) -> bytes:
    buffer = io.BytesIO()
    kaldiio.save_mat(buffer, array, compression_method=compression_method)
    return buffer.getvalue()


def _never_called() -> str:
    raise AssertionError("the place of a sound matrix header is never named")


@pytest.mark.parametrize("array, method, kind", [
    (np.ones((3, 4), np.float32), None, "FM"), (np.ones((3, 4)), None, "DM"),
    (np.ones((6, 4), np.float32), 2, "CM"), (np.ones((6, 4), np.float32), 3, "CM2"),
    (np.ones((6, 4), np.float32), 5, "CM3"), (np.ones(5, np.float32), None, "FV"),
    (np.ones(5), None, "DV"), (np.arange(5, dtype=np.int32), None, "IV")])
def test_object_header_gives_kind_shape_and_the_whole_size(array, method, kind):
    data = _kaldi_bytes(array, method)
    # Matrices, read once per utterance at open time, are checked without naming their place.
    place = _never_called if kind in ("FM", "DM", "CM", "CM2", "CM3") else "x"
    header = parse_header(data[:32], len(data), place)
    cols = array.shape[1] if array.ndim == 2 else None
    assert header == ObjectHeader(kind, array.shape[0], cols, len(data))
    # One byte short: the quick path for common matrices gives way to the full check.
    with pytest.raises(DataError, match=rf"^x: {kind} header says .* \({len(data)} bytes\) but only "
                                        rf"{len(data) - 1} bytes are left"):
        parse_header(data[:32], len(data) - 1, "x")


@pytest.mark.parametrize("kind", ["FM", "CM", "FV"])
def test_object_header_cut_short_is_truncated(kind):
    array = np.ones((6, 4) if kind != "FV" else 5, np.float32)
    data = _kaldi_bytes(array, 2 if kind == "CM" else None)[:8]
    with pytest.raises(DataError, match=r"^x: truncated object header \(8 bytes left"):
        parse_header(data, 100, "x")
