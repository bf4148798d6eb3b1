"""Decoding: graphs that decode a known answer, the yesno recipe to <= 2 % WER, bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from labavg.data.alignment import read_ali_dir, read_int_vectors
from labavg.decode import graph as graphs
from labavg.decode.decoder import Decoder
from labavg.decode.lexicon import map_oov, read_lexicon, read_text
from labavg.decode.model import kaldi_topology, load_final_model, read_phones_txt, synth_topology
from labavg.decode.score import error_rate
from labavg.base.errors import DataError

PYTHON = sys.executable
REPO = Path(__file__).resolve().parents[1]


def _cli(*args, cwd=None, env_extra=None):
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env_extra or {})}
    return subprocess.run([PYTHON, "-m", "labavg", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=600)


def _sharp(ali: np.ndarray, num_pdfs: int) -> np.ndarray:
    """Log-likelihoods that put every frame on its aligned pdf."""
    ll = np.full((len(ali), num_pdfs), -20.0, dtype=np.float32)
    ll[np.arange(len(ali)), ali] = 0.0
    return ll


def _synth_task(corpus: Path):
    names = [line.split()[0] for line in (corpus / "phones.txt").read_text().splitlines()]
    topology = synth_topology(names)
    lang = graphs.make_lang(topology, read_lexicon(corpus / "lexicon.txt"), "lexicon", "synth")
    return topology, lang


def test_sharp_posteriors_of_the_alignment_decode_the_transcripts(corpus):
    """HLG from the built-in corpus' lexicon and a unigram: the reference alignment's pdfs,
    as certain log-likelihoods, decode to the exact transcripts; scrambled ones do not."""
    topology, lang = _synth_task(corpus)
    text = read_text(corpus / "text")
    counts: dict[str, int] = {}
    for words in text.values():
        for w in words:
            counts[w] = counts.get(w, 0) + 1
    l_fst, nd = graphs.build_l(lang)
    hlg = graphs.compose_hlg(graphs.build_h(topology, nd, max(lang.phone_labels) + 1), l_fst,
                             graphs.unigram_g(lang, counts, len(text)), 120)
    decoder = Decoder(hlg)
    alis = read_int_vectors(f"ark:{corpus / 'pdf_ali.ark'}")
    keys = sorted(alis)
    refs = [text[k] for k in keys]
    hyps = [[lang.words[i] for i in decoder.decode(_sharp(alis[k], 120), 1.0).labels] for k in keys]
    assert error_rate(refs, hyps).errors == 0
    rng = np.random.default_rng(0)
    wrong = [[lang.words[i] for i in decoder.decode(_sharp(rng.permutation(alis[k]), 120), 1.0).labels]
             for k in keys[:3]]
    assert error_rate(refs[:3], wrong).rate > 50


def test_phone_loop_decodes_the_alignment_phones(corpus):
    topology, lang = _synth_task(corpus)
    alis = read_int_vectors(f"ark:{corpus / 'pdf_ali.ark'}")
    seqs = graphs.alignment_phone_sequences(topology, alis.values())
    graph = graphs.compose_phone_loop(graphs.build_h(topology),
                                      graphs.phone_bigram_g(topology, graphs.phone_bigram_counts(topology, seqs)))
    decoder = Decoder(graph)
    for key, seq in list(zip(alis, seqs))[:5]:
        assert decoder.decode(_sharp(alis[key], 120), 1.0).labels == seq


def test_yesno_graph_with_trained_transitions_decodes_alignments(shared_data):
    """H from final.mdl's topology and trained transition probabilities, L with optional
    silence, G from the recipe's ARPA through kaldilm: the GMM's alignments decode exactly."""
    recipe = shared_data / "kaldi-yesno"
    pdfs, tmodel = read_ali_dir(recipe / "exp/mono0a")
    topology = kaldi_topology(tmodel, read_phones_txt(recipe / "data/lang/phones.txt"))
    assert topology["phones"] == ["SIL", "Y", "N"] and topology["silence"] == "SIL"
    lang = graphs.make_lang(topology, read_lexicon(recipe / "input/lexicon.txt"), "lex", "mdl")
    l_fst, nd = graphs.build_l(lang)
    g_fst = graphs.arpa_g(lang, recipe / "input/task.arpabo", Path(os.environ.get("TMPDIR", "/tmp")))
    hlg = graphs.compose_hlg(graphs.build_h(topology, nd, max(lang.phone_labels) + 1), l_fst, g_fst,
                             tmodel.num_pdfs)
    text = read_text(recipe / "data/train_yesno/text")
    decoder = Decoder(hlg)
    refs = [text[k] for k in sorted(pdfs)]
    hyps = [[lang.words[i] for i in decoder.decode(_sharp(pdfs[k], tmodel.num_pdfs), 1.0).labels]
            for k in sorted(pdfs)]
    assert error_rate(refs, hyps).errors == 0


def test_error_rate_counts_and_interval():
    refs = [["a", "b", "c", "d"]] * 10
    hyps = [["a", "b", "c", "d"]] * 8 + [["a", "x", "c"], ["a", "b", "c", "d", "e"]]
    rate = error_rate(refs, hyps)
    assert (rate.ins, rate.dels, rate.subs, rate.ref_tokens) == (1, 1, 1, 40)
    assert rate.rate == pytest.approx(7.5)
    assert 0 <= rate.ci_low < rate.rate < rate.ci_high
    assert error_rate(refs, hyps) == rate  # seeded


def test_disambiguation_symbols_for_homophones_and_prefixes():
    prons, top = graphs._disambiguate([["a", "b"], ["a", "b"], ["a"], ["c"]])
    assert prons == [["a", "b", "#1"], ["a", "b", "#2"], ["a", "#1"], ["c"]] and top == 2


def test_oov_words_map_to_unk_or_fail_with_a_count():
    mapped, count, unk = map_oov({"u1": ["a", "zz", "zz"]}, {"a", "<unk>"}, "text")
    assert mapped == {"u1": ["a", "<unk>", "<unk>"]} and count == 2 and unk == "<unk>"
    with pytest.raises(DataError, match="2 word token.*1 word type.*'zz'"):
        map_oov({"u1": ["a", "zz", "zz"]}, {"a"}, "text")


@pytest.fixture(scope="module")
def yesno_run(shared_data, tmp_path_factory):
    """A small DNN trained on train_yesno (from the recipe dir) and decoded on test_yesno."""
    recipe = shared_data / "kaldi-yesno"
    out = tmp_path_factory.mktemp("yesno") / "run"
    cache = tmp_path_factory.mktemp("cache")
    proc = _cli("train", "--data", "data/train_yesno", "--ali-dir", "exp/mono0a", "--out", str(out),
                "--minibatch", "64", "--epochs", "4", "--hidden-layers", "2", "--hidden-dim", "64",
                "--lr", "0.002", "--no-progress", "--set", "tensorboard=false",
                "--decode-data", "data/test_yesno", cwd=recipe, env_extra={"LABAVG_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stderr
    return recipe, out, cache


@pytest.mark.slow  # end to end: out of the fast suite's 10 minutes
def test_yesno_trained_model_decodes_test_set(yesno_run):
    """The recipe's monophone GMM scores 0 % WER on test_yesno; a labavg DNN must be <= 2 %."""
    recipe, out, cache = yesno_run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["wer"] <= 2.0 and summary["decode_set"] == "test_yesno"
    assert summary["wer_ci"][0] <= summary["wer"] <= summary["wer_ci"][1]
    assert summary["per"] is not None and summary["per"] <= 5.0
    proc = _cli("decode", str(out), "--data", "data/test_yesno", "--lexicon", "input/lexicon.txt",
                "--lm", "input/task.arpabo", cwd=recipe, env_extra={"LABAVG_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stderr
    decode_dir = out / "decode_test_yesno"
    result = json.loads((decode_dir / "result.json").read_text())
    assert result["wer"] <= 2.0 and result["words"] == 232 and result["utterances"] == 29
    assert (decode_dir / "best_wer").read_text().startswith("%WER")
    hyp = (decode_dir / f"hyp_{result['acwt']:g}.txt").read_text().splitlines()
    assert len(hyp) == 29 and all(set(line.split()[1:]) <= {"YES", "NO"} for line in hyp)


def test_final_model_is_self_contained(yesno_run):
    """final.pt loads with weights_only and reproduces the trained DNN's outputs."""
    recipe, out, _ = yesno_run
    blob = torch.load(out / "final.pt", weights_only=True)
    assert blob["num_pdfs"] == 11 and blob["context"] == 5 and blob["apply_cmvn"]
    counts = blob["pdf_counts"]
    assert torch.allclose(blob["log_priors"].double(), torch.log(counts / counts.sum()), atol=1e-5)
    model = load_final_model(out)
    # The input normalisation is the one training computed, not zeros and ones.
    assert not torch.allclose(model.dnn.input_scale, torch.ones_like(model.dnn.input_scale))
    from labavg.data.dataset import open_dataset

    cwd = os.getcwd()
    os.chdir(recipe)
    try:
        source = open_dataset("data/train_yesno", ali_dir="exp/mono0a")
        key = source.keys[0]
        feats, pdfs = source.load(key)
    finally:
        os.chdir(cwd)
    ll = model.log_likelihoods(feats)
    assert ll.shape == (len(pdfs), 11)
    posteriors = ll + model.log_priors.numpy()
    assert np.allclose(np.exp(posteriors).sum(axis=1), 1.0, atol=1e-4)
    assert (posteriors.argmax(axis=1) == pdfs).mean() > 0.6


@pytest.mark.parametrize("case", ["oov", "pdfs", "phone", "empty"])
def test_bad_decode_input_gives_one_line_and_exit_2(yesno_run, tmp_path, case):
    recipe, out, cache = yesno_run
    data = tmp_path / "data"
    shutil.copytree(recipe / "data/test_yesno", data)
    for name in ("feats.scp", "cmvn.scp"):  # absolute paths: the copy decodes from anywhere
        lines = (data / name).read_text().splitlines()
        (data / name).write_text("".join(f"{k} {recipe / v}\n" for k, v in (l.split(" ", 1) for l in lines)))
    args = ["decode", str(out), "--data", str(data), "--lexicon", str(recipe / "input/lexicon.txt")]
    expect = ""
    if case == "oov":
        text = (data / "text").read_text().replace("YES", "MAYBE", 3)
        (data / "text").write_text(text)
        expect = "3 word token(s) of 1 word type(s) are not in the lexicon (e.g. 'MAYBE')"
    elif case == "pdfs":
        blob = torch.load(out / "final.pt", weights_only=True)
        blob["topology"]["hmm"][0][0].append((1, 11, -1.0))
        other = tmp_path / "run"
        other.mkdir()
        torch.save(blob, other / "final.pt")
        args[1] = str(other)
        expect = "the model has 11 pdfs but its HMM topology (the graph) has 12"
    elif case == "phone":
        lexicon = tmp_path / "lexicon.txt"
        lexicon.write_text("<SIL> SIL\nYES Y EH S\nNO N\n")
        args[-1] = str(lexicon)
        expect = "word 'YES' uses phone 'EH', which the model's topology"
    else:
        (data / "feats.scp").write_text("")
        expect = "lists no utterances: nothing to decode"
    proc = _cli(*args, env_extra={"LABAVG_CACHE": str(cache)})
    assert proc.returncode == 2, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.startswith("labavg")]
    assert len(lines) == 1 and expect in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_graph_cache_is_reused(corpus, tmp_path):
    topology, lang = _synth_task(corpus)
    calls = []

    def build():
        calls.append(1)
        l_fst, nd = graphs.build_l(lang)
        return graphs.compose_hlg(graphs.build_h(topology, nd, max(lang.phone_labels) + 1), l_fst,
                                  graphs.unigram_g(lang, {}, 1), 120)

    first = graphs.cached_fst(tmp_path, "k", "HLG.fst", build)
    second = graphs.cached_fst(tmp_path, "k", "HLG.fst", build)
    assert len(calls) == 1 and first.num_states == second.num_states > 0
