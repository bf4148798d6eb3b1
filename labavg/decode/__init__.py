"""Decoding a trained hybrid DNN-HMM to word and phone error rates.

    model.py    RUN_DIR/final.pt: the exported model (parameters, input normalisation, log pdf
                priors, topology) and the loader that computes log-likelihoods
    lexicon.py  lexicons, phone and word symbol tables, transcripts
    graph.py    H, L, G and the phone-loop graph with kaldifst; HLG cached per corpus
    decoder.py  kaldi-decoder's FasterDecoder over acwt * (log posterior - log prior)
    score.py    WER / PER with kaldialign, bootstrap confidence intervals, Kaldi's files
    task.py     a model with its graphs (`prepare`), a data set's log-likelihoods (`load_set`)
    run.py      `decode_run`: everything above for one run directory and one data set
    decode_dir.py  RUN_DIR/decode_<set>/, Kaldi-style: written by a decode, read back
    compare.py  two runs' decodes of one set compared (paired bootstrap)

See docs/decoding.md.
"""
