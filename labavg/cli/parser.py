"""The `labavg` command's arguments: one parser per command, flags from the settings."""

from __future__ import annotations

import argparse
from typing import Any

from labavg.cli.plan_command import add_plan_parser
from labavg.cli.commands import (_dest, cmd_prepare, cmd_synth, cmd_train, cmd_dashboard, cmd_reproduce, cmd_sweep, cmd_decode, cmd_compare, cmd_info)


def _default_of(flag: Any) -> Any:
    from labavg.training.config import setting_field

    f = setting_field(flag.key)
    return f.default_factory() if callable(f.default_factory) else f.default


def _add_train_parser(sub) -> None:
    from labavg.averaging.registry import methods
    from labavg.training.config import cli_flags

    p = sub.add_parser(
        "train", help="train a DNN with periodic model averaging",
        description="Train a DNN acoustic model on N workers with periodic model averaging. "
        "Settings come from the defaults, then CONFIG (TOML), then the flags given.",
        epilog=EXAMPLES + "\naveraging methods: " + "; ".join(
            f"{name} ({method.help})" for name, method in methods().items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", nargs="?", help="TOML configuration file")
    for flag in cli_flags():  # declared with the settings, next to their code
        if flag.kind is bool:
            p.add_argument(flag.flag, dest=_dest(flag), action="store_true", help=flag.help)
        else:
            # The default shown, not set: None tells "not given" from a CONFIG file's value.
            p.add_argument(flag.flag, dest=_dest(flag), type=flag.kind, default=None,
                           help=f"{flag.help} (default: {_default_of(flag)})",
                           metavar=flag.flag[2:].upper().replace("-", "_"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any setting, e.g. --set ngsgd.rank_in=10 (value parsed as TOML)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its last checkpoint")
    p.add_argument("--join", metavar="RUN_DIR", help="add a worker to RUN_DIR's running elastic "
                   "job (on_rank_loss = \"continue\") in the place of a lost one; it takes the "
                   "job's own settings and heals from a survivor at the next round")
    p.add_argument("--hosts", help="MPI host list (h1,h2 or h1:4,h2:4) when starting mpiexec")
    p.add_argument("--launcher", choices=["slurm"], help="slurm: start the ranks with srun in "
                   "this Slurm allocation (salloc, sbatch) instead of mpiexec on this machine")
    p.add_argument("--allow-pipes", action="store_true",
                   help="let data files and rspecifiers run commands (Kaldi's 'cmd |'); off by "
                   "default because a data file could then run anything as you")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)


EXAMPLES = """examples:
  labavg corpus synth data/synth --hours 1          a 1-hour synthetic Kaldi data directory
  labavg train --data data/synth --out runs/n1 --ranks 1
  labavg train --data data/synth --out runs/n4 --ranks 4 --average-every 10
  labavg info runs                                  every run under runs/ as one table
  labavg plan runs/n4 --ranks 8 16 32 --network 10gbe   which N, K and method to book
  labavg dashboard --runs-dir runs                  http://localhost:5006/app
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `labavg` command."""
    parser = argparse.ArgumentParser(prog="labavg", description=__doc__.split("\n\n")[0],
                                     epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_corpus_parser(sub)
    _add_train_parser(sub)
    _add_sweep_and_dashboard_parsers(sub)
    _add_reproduce_parser(sub)
    _add_decode_parser(sub)
    _add_compare_parser(sub)
    _add_info_parser(sub)
    add_plan_parser(sub)
    return parser


def _add_corpus_parser(sub) -> None:
    corpus = sub.add_parser("corpus", help="the built-in synthetic corpus, or real recordings prepared")
    corpus_sub = corpus.add_subparsers(dest="corpus_command", required=True)
    synth = corpus_sub.add_parser(
        "synth", help="write a synthetic Kaldi data directory",
        description="Synthesise speech (source-filter, >= 40 phones, many speakers) and write a "
        "complete Kaldi data directory with 40-dim fbank features and pdf alignments.",
    )
    synth.add_argument("out_dir", help="directory to create")
    synth.add_argument("--hours", type=float, default=1.0, help="hours of speech (default 1.0)")
    synth.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    synth.add_argument("--overwrite", action="store_true", help="replace an existing directory")
    synth.add_argument("--dev-hours", type=float, default=0.1,
                       help="held-out dev set OUT_DIR/dev, other speakers (default 0.1; 0: none)")
    synth.add_argument("--test-hours", type=float, default=0.5,
                       help="held-out test set OUT_DIR/test, other speakers (default 0.5; 0: none)")
    synth.set_defaults(func=cmd_synth)
    prepare = corpus_sub.add_parser(
        "prepare", help="make a Kaldi data directory of real recordings and their transcripts",
        description="Align each recording to its transcript with pocketsphinx (US-English model, "
        "CMUdict) and write a complete Kaldi data directory as the built-in corpus has: features, "
        "CMVN, per-frame pdfs, phones.ctm, lexicon. Utterances with words outside the dictionary "
        "or that fail to align are left out and listed (OUT_DIR/left_out.txt). An interrupted "
        "run resumes from OUT_DIR.partial.")
    prepare.add_argument("audio_dir", help="folder of .wav or .flac recordings (mono, 8 kHz or more)")
    prepare.add_argument("out_dir", help="directory to create")
    prepare.add_argument("--text", required=True, help="transcripts: Kaldi text lines "
                         "(`name word ...`) or `name: word ...` lines; names are the files' stems")
    prepare.add_argument("--lexicon", help="extra pronunciations (`word PHONE ...`, ARPAbet) for "
                         "words CMUdict lacks")
    prepare.add_argument("--speaker", help="one speaker for every utterance (default: each its own)")
    prepare.add_argument("--overwrite", action="store_true", help="replace an existing directory")
    prepare.add_argument("--no-progress", action="store_true", help="no progress bar")
    prepare.set_defaults(func=cmd_prepare)


def _add_sweep_and_dashboard_parsers(sub) -> None:
    sweep = sub.add_parser(
        "sweep", help="train a grid of configurations",
        description="Train every combination of a sweep file's [grid] on its [base] configuration, "
        "one run directory each; finished runs are skipped, interrupted ones resumed; writes "
        "results.csv and results.md.",
    )
    sweep.add_argument("sweep_file", help="TOML file with [base] and [grid] tables")
    sweep.add_argument("--out", required=True, help="sweep directory")
    sweep.add_argument("--max-points", type=int, default=None, metavar="N",
                       help="train a grid of up to N points (default 200; larger grids are "
                       "refused unless this allows them)")
    sweep.add_argument("--recorded", help="a results file (experiments/reproduction-results.jsonl): "
                       "points it records for this sweep (by the file's name, e.g. beyond) with "
                       "the same settings are not trained again")
    sweep.set_defaults(func=cmd_sweep)

    dash = sub.add_parser(
        "dashboard", help="serve the live dashboard",
        description="Serve the Panel dashboard (live per-rank loss, divergence, speedup) on "
        "localhost and open it in the browser.",
    )
    dash.add_argument("--port", type=int, default=5006, help="port (default 5006)")
    dash.add_argument("--address", default="127.0.0.1",
                      help="address to listen on (default 127.0.0.1; see docs/dashboard.md before "
                      "exposing it)")
    dash.add_argument("--password-file", help="file holding the password a non-loopback "
                      "--address asks for (default: one made and printed at start)")
    dash.add_argument("--origin", action="append", default=[], metavar="HOST[:PORT]",
                      help="another origin whose pages may connect (a proxy's name; repeat)")
    dash.add_argument("--runs-dir", default="runs", help="where runs are written and found")
    dash.add_argument("--data", default="data/synth",
                      help="data directory preset for new runs (default data/synth)")
    dash.add_argument("--no-browser", action="store_true", help="do not open a browser")
    dash.set_defaults(func=cmd_dashboard)


def _add_reproduce_parser(sub) -> None:
    rep = sub.add_parser(
        "reproduce", help="the regime map and the paper's comparisons, into REPRODUCTION.md",
        description="Run the sweeps of experiments/ (paper.toml: the paper's comparisons, decoded; "
        "regime.toml: the regime map; explain.toml: the experiments behind each disagreement; "
        "yesno.toml with --yesno), measure 1 vs 2 MPI ranks, and write the report, its figure and "
        "experiments/reproduction-results.jsonl. Resumable: finished runs are reused.",
    )
    rep.add_argument("--out", default="runs", help="experiment directory (default runs: "
                     "runs/paper, runs/regime, runs/explain, runs/yesno, runs/mpi)")
    rep.add_argument("--experiments", default="experiments",
                     help="directory of the sweep files (default experiments)")
    rep.add_argument("--yesno", help="path of a Kaldi yesno recipe directory (kaldi-yesno)")
    rep.add_argument("--report", default="REPRODUCTION.md", help="report to write")
    rep.add_argument("--figure", help="regime map PNG (default docs/figures/regime-map.png beside "
                     "the report)")
    rep.add_argument("--parallel", type=int, default=2, help="sweeps run at once (default 2)")
    rep.add_argument("--no-mpi", action="store_true", help="skip the 1 vs 2 MPI ranks measurement")
    rep.add_argument("--only", metavar="NAME,...",
                     help="train only these experiments (paper, regime, regime-variables, explain, "
                     "beyond, yesno, asterisk, mpi, elastic); the report still has every one")
    rep.add_argument("--report-only", action="store_true",
                     help="train nothing: remake the report, figure and results file from the runs "
                     "finished so far (while the sweeps run elsewhere)")
    rep.add_argument("--tiny", action="store_true",
                     help="the same pipeline at a tiny size (a few minutes): the sweep files' grids "
                     "with two seeds, a tiny model and corpora, all under --out (report included)")
    rep.set_defaults(func=cmd_reproduce)


def _add_decode_parser(sub) -> None:
    decode = sub.add_parser(
        "decode", help="decode a data set with a run's final model (WER, PER)",
        description="Decode DIR with RUN_DIR/final.pt on an HLG graph (kaldifst, kaldi-decoder), "
        "sweep the acoustic scale (on --dev when given) and write RUN_DIR/decode_<set>/ "
        "(hyp_<acwt>.txt, wer_<acwt>, best_wer, per, result.json).",
    )
    decode.add_argument("run_dir", help="a finished run directory (with final.pt)")
    decode.add_argument("--data", required=True, help="Kaldi data dir to decode (feats.scp, text)")
    decode.add_argument("--dev", help="data dir to choose the acoustic scale on")
    words = decode.add_mutually_exclusive_group()
    words.add_argument("--lang", help="Kaldi lang dir (phones.txt; lexicon.txt or ../local/dict/lexicon.txt)")
    words.add_argument("--lexicon", help="lexicon.txt (word phone ...)")
    decode.add_argument("--lm", help="ARPA language model (default: unigram of the training text)")
    decode.add_argument("--acwt", type=float, action="append",
                        help="acoustic scale (repeat to sweep; default 0.05..0.2)")
    decode.add_argument("--beam", type=float, default=None, help="decoding beam (default 13)")
    decode.set_defaults(func=cmd_decode)


def _add_info_parser(sub) -> None:
    info = sub.add_parser("info", help="summarise run directories",
                          description="Print the summaries of runs as one table: each PATH is a "
                          "run directory or a directory searched (recursively) for runs.")
    info.add_argument("run_dirs", nargs="+", metavar="PATH",
                      help="a run directory, or a directory of runs (a sweep, runs/)")
    info.add_argument("--json", action="store_true", help="print summary.json instead")
    info.set_defaults(func=cmd_info)


def _add_compare_parser(sub) -> None:
    p = sub.add_parser(
        "compare", help="compare two runs' WERs on the same decoded set (paired bootstrap)",
        description="Read RUN_A/decode_SET and RUN_B/decode_SET (each at its reported acoustic "
        "scale) and print both WERs with 95 % intervals, WER(B) - WER(A) with the paired "
        "bootstrap's 95 % interval, and the probability that B is better.",
    )
    p.add_argument("run_a", help="run directory of system A (the baseline)")
    p.add_argument("run_b", help="run directory of system B")
    p.add_argument("--set", default="test", dest="set_name",
                   help="decoded set to compare: RUN/decode_SET (default test)")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.set_defaults(func=cmd_compare)
