"""Decoding a trained hybrid DNN-HMM to word and phone error rates.

    model.py    RUN_DIR/final.pt: the exported model (parameters, input normalisation, log pdf
                priors, topology) and the loader that computes log-likelihoods
    lexicon.py  lexicons, phone and word symbol tables, transcripts
    graph.py    H, L, G and the phone-loop graph with kaldifst; HLG cached per corpus
    decoder.py  kaldi-decoder's FasterDecoder over acwt * (log posterior - log prior)
    score.py    WER / PER with kaldialign, bootstrap confidence intervals, Kaldi's files
    run.py      `decode_run`: everything above for one run directory and one data set

See docs/decoding.md.
"""
