"""TransitionModel (binary and text final.mdl), alignment tables and dirs, TextGrid labels."""

from __future__ import annotations

import gzip
import shutil
import struct

import kaldiio
import numpy as np
import pytest

from labavg.data.alignment import read_ali_dir, read_gzip_ark, read_int_vectors
from labavg.data.textgrid import build_phone_table, textgrid_labels
from labavg.data.transition import (HmmState, Topology, TransitionModel, TransitionTuple,
                                    read_transition_model)
from labavg.base.errors import DataError

SIL, Y, N = 1, 2, 3  # data/lang/phones.txt of yesno


@pytest.fixture(scope="module")
def yesno(shared_data):
    return shared_data / "kaldi-yesno"


@pytest.fixture(scope="module")
def model(yesno):
    return read_transition_model(yesno / "exp/mono0a/final.mdl")


# --------------------------------------------------- Kaldi's writers, for round trips


def write_text_model(model: TransitionModel) -> str:
    """TransitionModel::Write / HmmTopology::Write in text mode (tokens end in a space)."""
    out = ["<TransitionModel> \n<Topology> \n"]
    for index, entry in enumerate(model.topology.entries):
        phones = [str(p) for p, i in enumerate(model.topology.phone2idx) if i == index]
        out.append("<TopologyEntry> \n<ForPhones> \n" + " ".join(phones) + " \n</ForPhones> \n")
        for number, state in enumerate(entry):
            line = f"<State> {number} "
            if state.forward_pdf_class != -1:
                if model.is_hmm:
                    line += f"<PdfClass> {state.forward_pdf_class} "
                else:
                    line += (f"<ForwardPdfClass> {state.forward_pdf_class} "
                             f"<SelfLoopPdfClass> {state.self_loop_pdf_class} ")
            for dest, prob in state.transitions:
                line += f"<Transition> {dest} {prob:g} "
            out.append(line + "</State> \n")
        out.append("</TopologyEntry> \n")
    out.append("</Topology> \n")
    kind = "Triples" if model.is_hmm else "Tuples"
    out.append(f"<{kind}> {len(model.tuples)} \n")
    for t in model.tuples:
        fields = [t.phone, t.hmm_state, t.forward_pdf] + ([] if model.is_hmm else [t.self_loop_pdf])
        out.append(" ".join(str(f) for f in fields) + " \n")
    out.append(f"</{kind}> \n<LogProbs> \n [ ")
    out.append(" ".join(f"{v:g}" for v in model.log_probs) + " ]\n</LogProbs> \n")
    out.append("</TransitionModel> \n<DIMENSION> 39 <NUMPDFS> 11 <DiagGMM> \n")
    return "".join(out)


def write_binary_model(model: TransitionModel) -> bytes:
    """TransitionModel::Write in binary mode, with the -1 marker of the extended topology."""
    def i32(v):
        return b"\x04" + struct.pack("<i", v)

    def f32(v):
        return b"\x04" + struct.pack("<f", v)

    def ivec(vs):
        return b"\x04" + struct.pack("<i", len(vs)) + struct.pack(f"<{len(vs)}i", *vs)

    out = b"\0B<TransitionModel> <Topology> " + ivec(model.topology.phones)
    out += ivec(model.topology.phone2idx)
    if not model.is_hmm:
        out += i32(-1)
    out += i32(len(model.topology.entries))
    for entry in model.topology.entries:
        out += i32(len(entry))
        for state in entry:
            out += i32(state.forward_pdf_class)
            if not model.is_hmm:
                out += i32(state.self_loop_pdf_class)
            out += i32(len(state.transitions))
            for dest, prob in state.transitions:
                out += i32(dest) + f32(prob)
    kind = "Triples" if model.is_hmm else "Tuples"
    out += f"</Topology> <{kind}> ".encode() + i32(len(model.tuples))
    for t in model.tuples:
        out += i32(t.phone) + i32(t.hmm_state) + i32(t.forward_pdf)
        if not model.is_hmm:
            out += i32(t.self_loop_pdf)
    out += f"</{kind}> <LogProbs> FV ".encode() + i32(len(model.log_probs))
    out += np.asarray(model.log_probs, dtype="<f4").tobytes()
    return out + b"</LogProbs> </TransitionModel> <DIMENSION> " + i32(39)


def chain_style_model() -> TransitionModel:
    """A 1-state topology with distinct forward/self-loop pdf classes (Kaldi's chain topo)."""
    state = HmmState(0, 1, ((0, 0.5), (1, 0.5)))
    topo = Topology((1, 2), (-1, 0, 0), ((state, HmmState(-1, -1, ())),))
    tuples = [TransitionTuple(1, 0, 0, 1), TransitionTuple(2, 0, 2, 3)]
    return TransitionModel(topo, tuples, np.zeros(5, dtype=np.float32), is_hmm=False)


# ------------------------------------------------------------------ TransitionModel


def test_yesno_model_hand_checked(model):
    assert model.is_hmm and model.num_pdfs == 11 and model.num_transition_ids == 30
    # SIL: 5 emitting states (4 with 4 transitions, the last with 2) -> tids 1..18;
    # Y and N: 3 states x 2 transitions -> tids 19..24 and 25..30.
    np.testing.assert_array_equal(model.tid_to_pdf[1:19], np.repeat([0, 1, 2, 3, 4], [4, 4, 4, 4, 2]))
    np.testing.assert_array_equal(model.tid_to_pdf[19:], [5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 10])
    np.testing.assert_array_equal(model.tid_to_phone[1:], [SIL] * 18 + [Y] * 6 + [N] * 6)
    # tid 1 is SIL state 0's self-loop (first transition, 0 -> 0); tid 4 is 0 -> 3.
    assert model.tid_is_self_loop[1] and not model.tid_is_self_loop[4]
    assert model.tid_is_self_loop[17] and not model.tid_is_self_loop[18]
    assert [t.hmm_state for t in model.tuples[:5]] == [0, 1, 2, 3, 4]
    assert model.log_probs.shape == (31,)
    assert model.log_probs[2] == pytest.approx(np.log(0.01), rel=1e-5)


def test_every_yesno_tid_maps_consistently(model, yesno):
    tids = read_gzip_ark(yesno / "exp/mono0a/ali.1.gz")
    assert len(tids) == 31
    pdfs_of_phone = {SIL: set(range(5)), Y: {5, 6, 7}, N: {8, 9, 10}}
    for ali in tids.values():
        assert ali.min() >= 1 and ali.max() <= model.num_transition_ids
        pdfs = model.pdfs_of(ali)
        assert pdfs.min() >= 0 and pdfs.max() < 11
        for tid, pdf in zip(ali, pdfs):
            assert pdf in pdfs_of_phone[int(model.tid_to_phone[tid])]


def test_yesno_phone_sequence_follows_transcripts(model, yesno):
    """The phones of each alignment, silences removed, spell the utterance's words."""
    tids = read_gzip_ark(yesno / "exp/mono0a/ali.1.gz")
    lines = (yesno / "data/train_yesno/text").read_text().splitlines()
    word_phone = {"YES": Y, "NO": N}
    for line in lines:
        key, *words = line.split()
        phones = [int(p) for p in model.tid_to_phone[tids[key]] if p != SIL]
        runs = [p for i, p in enumerate(phones) if i == 0 or p != phones[i - 1]]
        expected = [word_phone[w] for w in words]
        expected = [p for i, p in enumerate(expected) if i == 0 or p != expected[i - 1]]
        assert runs == expected, key


def test_text_final_mdl_reads_like_binary(model, tmp_path):
    text = write_text_model(model)
    assert "<PdfClass> 4 <Transition> 4 0.75 <Transition> 5 0.25 </State>" in text
    (tmp_path / "final.mdl").write_text(text)
    again = read_transition_model(tmp_path / "final.mdl")
    assert again.num_pdfs == 11 and again.is_hmm
    np.testing.assert_array_equal(again.tid_to_pdf, model.tid_to_pdf)
    np.testing.assert_array_equal(again.tid_to_phone, model.tid_to_phone)
    np.testing.assert_allclose(again.log_probs, model.log_probs, rtol=1e-5)
    (tmp_path / "bad.mdl").write_text(text.split("<Triples>")[0])
    with pytest.raises(DataError, match="unexpected end of file"):
        read_transition_model(tmp_path / "bad.mdl")


@pytest.mark.parametrize("form", ["text", "binary"])
def test_tuples_format_uses_self_loop_pdf(tmp_path, form):
    model = chain_style_model()
    path = tmp_path / "final.mdl"
    if form == "text":
        path.write_text(write_text_model(model))
    else:
        path.write_bytes(write_binary_model(model))
    again = read_transition_model(path)
    assert not again.is_hmm and again.num_pdfs == 4
    # Per state the self-loop (0 -> 0) comes first, then the forward transition.
    np.testing.assert_array_equal(again.tid_to_pdf, [-1, 1, 0, 3, 2])
    np.testing.assert_array_equal(again.tid_to_phone, [-1, 1, 1, 2, 2])


def test_binary_writer_round_trips_the_real_model(model, tmp_path, yesno):
    written = write_binary_model(model)
    original = (yesno / "exp/mono0a/final.mdl").read_bytes()
    end = original.index(b"</TransitionModel> ") + len(b"</TransitionModel> ")
    assert written[:end] == original[:end]


# ------------------------------------------------------------------ alignment tables


def test_ali_dir_equals_gunzip_pipe(yesno, monkeypatch, model):
    monkeypatch.chdir(yesno)
    pdfs, ali_model = read_ali_dir("exp/mono0a")
    assert ali_model.num_pdfs == 11 and len(pdfs) == 31
    tids = read_int_vectors("ark:gunzip -c exp/mono0a/ali.1.gz |", allow_pipes=True)
    assert set(tids) == set(pdfs)
    for key in pdfs:
        np.testing.assert_array_equal(pdfs[key], model.tid_to_pdf[tids[key]])
    first = pdfs["0_0_0_0_1_1_1_1"]
    assert len(first) == 633 and list(first[:8]) == [0, 0, 0, 0, 0, 0, 3, 4]


def test_binary_text_and_scp_int_vector_tables(shared_data, tmp_path):
    folder = shared_data / "kaldi-io-arks"
    binary = read_int_vectors(f"ark:{folder / 'ali.ark'}")
    text = read_int_vectors(f"ark,t:{folder / 'ali_ascii.ark'}")
    assert len(binary) == 10 and binary.keys() == text.keys()
    for key in binary:
        assert binary[key].dtype == np.int32
        np.testing.assert_array_equal(binary[key], text[key])
    with kaldiio.WriteHelper(f"ark,scp:{tmp_path / 'a.ark'},{tmp_path / 'a.scp'}") as writer:
        for key in sorted(binary)[:3]:
            writer(key, binary[key])
    via_scp = read_int_vectors(f"scp:{tmp_path / 'a.scp'}")
    assert sorted(via_scp) == sorted(binary)[:3]
    np.testing.assert_array_equal(via_scp[sorted(binary)[1]], binary[sorted(binary)[1]])


@pytest.mark.skipif(shutil.which("ali-to-pdf") is not None, reason="Kaldi is installed")
def test_ali_to_pdf_pipe_without_kaldi_says_what_to_do(yesno, monkeypatch):
    monkeypatch.chdir(yesno)
    with pytest.raises(DataError, match=r"'ali-to-pdf', which is not on PATH.*ali_dir"):
        read_int_vectors("ark:gunzip -c exp/mono0a/ali.1.gz | ali-to-pdf exp/mono0a/final.mdl "
                         "ark:- ark:- |", allow_pipes=True)


def test_ali_dir_rejects_foreign_transition_ids(yesno, tmp_path):
    shutil.copy(yesno / "exp/mono0a/final.mdl", tmp_path / "final.mdl")
    with gzip.open(tmp_path / "ali.1.gz", "wt") as handle:
        handle.write("utt1 4 1 1 31 17\n")
    with pytest.raises(DataError, match=r"utt1.*transition id 31 at frame 3 is out of range 1\.\.30"):
        read_ali_dir(tmp_path)


# ------------------------------------------------------------------ TextGrid


def test_textgrid_labels_of_real_utterance(shared_data, tmp_path):
    grid = shared_data / "real-utterance/acoustic_corpus.TextGrid"
    labels, table = textgrid_labels(grid, snip_edges=False)
    assert len(labels) == 2672 and labels.dtype == np.int64
    assert table == sorted(table) and len(table) == 40 and "sil" in table and "" not in table
    names = [table[i] for i in labels]
    # phones tier: '' 0-1.05, DH 1.05-1.06, IH0 1.06-1.11, S 1.11-1.20; last S ends 25.25.
    assert set(names[:105]) == {"sil"}
    assert names[105] == "DH" and names[106:111] == ["IH0"] * 5 and names[111:120] == ["S"] * 9
    assert names[2524] == "S" and set(names[2525:]) == {"sil"}
    snipped, _ = textgrid_labels(grid, snip_edges=True)
    assert len(snipped) == 2670  # 1 + (26.72325 - 0.025) // 0.01
    # frame t centred at t*0.01+0.0125: frame 104 (1.0525 s) is already DH.
    assert table[snipped[103]] == "sil" and table[snipped[104]] == "DH"
    forced, _ = textgrid_labels(grid, snip_edges=False, num_frames=2680, phone_table=table)
    np.testing.assert_array_equal(forced[:2672], labels)
    assert set(forced[2672:]) == {table.index("sil")}


def test_textgrid_unknown_phone_and_built_table(shared_data):
    grid = shared_data / "real-utterance/acoustic_corpus.TextGrid"
    with pytest.raises(DataError, match=r"interval at 1\.050s has label 'DH', which is not in"):
        textgrid_labels(grid, phone_table=["sil", "S"])
    assert build_phone_table({"b", "a"}) == ["a", "b", "sil"]
    with pytest.raises(DataError, match="no tier named 'phone'"):
        textgrid_labels(grid, tier="phone")
