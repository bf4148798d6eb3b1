"""The `labavg` command line: a thin consumer of the library.

    labavg corpus synth OUT_DIR      write the built-in synthetic corpus
    labavg train [CONFIG.toml] ...   train (flags override the file)
    labavg sweep SWEEP.toml --out D  train a grid of configurations
    labavg dashboard                 serve the live dashboard
    labavg decode RUN_DIR --data D   word and phone error rates of a run's final model
    labavg compare RUN_A RUN_B       paired bootstrap of two runs' WERs on one decoded set
    labavg info RUN_DIR...           print run summaries as a table

Bad input prints one message and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from labavg.errors import PeerFailed, UserError, one_line, user_error_of

def _default_of(flag: Any) -> Any:
    from labavg.config import setting_field

    f = setting_field(flag.key)
    return f.default_factory() if callable(f.default_factory) else f.default


def _add_train_parser(sub) -> None:
    p = sub.add_parser(
        "train", help="train a DNN with periodic model averaging",
        description="Train a DNN acoustic model on N workers with periodic model averaging. "
        "Settings come from the defaults, then CONFIG (TOML), then the flags given.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from labavg.config import cli_flags

    p.add_argument("config", nargs="?", help="TOML configuration file")
    for flag in cli_flags():  # declared with the settings (labavg.config)
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
    p.add_argument("--hosts", help="MPI host list (h1,h2 or h1:4,h2:4) when starting mpiexec")
    p.add_argument("--allow-pipes", action="store_true",
                   help="let data files and rspecifiers run commands (Kaldi's 'cmd |'); off by "
                   "default because a data file could then run anything as you")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    # How a launcher (labavg.launch) hands its ranks their configuration: not for people.
    p.add_argument("--config-json", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_train)


EXAMPLES = """examples:
  labavg corpus synth data/synth --hours 1          a 1-hour synthetic Kaldi data directory
  labavg train --data data/synth --out runs/n1 --ranks 1
  labavg train --data data/synth --out runs/n4 --ranks 4 --average-every 10
  labavg info runs                                  every run under runs/ as one table
  labavg dashboard --runs-dir runs                  http://localhost:5006/app
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `labavg` command."""
    parser = argparse.ArgumentParser(prog="labavg", description=__doc__.split("\n\n")[0],
                                     epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    corpus = sub.add_parser("corpus", help="built-in synthetic speech corpus")
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

    _add_train_parser(sub)

    sweep = sub.add_parser(
        "sweep", help="train a grid of configurations",
        description="Train every combination of a sweep file's [grid] on its [base] configuration, "
        "one run directory each; finished runs are skipped, interrupted ones resumed; writes "
        "results.csv and results.md.",
    )
    sweep.add_argument("sweep_file", help="TOML file with [base] and [grid] tables")
    sweep.add_argument("--out", required=True, help="sweep directory")
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
    dash.add_argument("--runs-dir", default="runs", help="where runs are written and found")
    dash.add_argument("--data", default="data/synth",
                      help="data directory preset for new runs (default data/synth)")
    dash.add_argument("--no-browser", action="store_true", help="do not open a browser")
    dash.set_defaults(func=cmd_dashboard)

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
    rep.add_argument("--report-only", action="store_true",
                     help="train nothing: remake the report, figure and results file from the runs "
                     "finished so far (while the sweeps run elsewhere)")
    rep.add_argument("--tiny", action="store_true",
                     help="the same pipeline at a tiny size (a few minutes): the sweep files' grids "
                     "with two seeds, a tiny model and corpora, all under --out (report included)")
    rep.set_defaults(func=cmd_reproduce)

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
    _add_compare_parser(sub)

    info = sub.add_parser("info", help="summarise run directories",
                          description="Print the summaries of runs as one table: each PATH is a "
                          "run directory or a directory searched (recursively) for runs.")
    info.add_argument("run_dirs", nargs="+", metavar="PATH",
                      help="a run directory, or a directory of runs (a sweep, runs/)")
    info.add_argument("--json", action="store_true", help="print summary.json instead")
    info.set_defaults(func=cmd_info)
    return parser


def cmd_synth(args: argparse.Namespace) -> int:
    from labavg.data.synth import synthesize

    info = synthesize(args.out_dir, hours=args.hours, seed=args.seed, overwrite=args.overwrite,
                      dev_hours=args.dev_hours, test_hours=args.test_hours)
    print(f"wrote {info.out_dir}: {info.hours:.2f} h of speech, {info.num_utts} utterances from "
          f"{info.num_speakers} speakers, {info.num_frames:,} frames of {info.feat_dim} features, "
          f"{info.num_phones} phones, {info.num_pdfs} pdfs (seed {info.seed}, "
          f"{info.seconds_taken:.0f} s)")
    return 0


def _dest(flag) -> str:
    return "setting:" + flag.key


def _parse_set(items: list[str]) -> dict[str, Any]:
    import tomllib

    overrides = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UserError(f"--set {item!r}: expected KEY=VALUE")
        try:
            overrides[key.strip()] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            overrides[key.strip()] = raw  # a bare word: take it as a string
    return overrides


def train_config(args: argparse.Namespace):
    """Defaults, then the TOML file (or the resumed run's config), then the flags."""
    from labavg.config import TrainConfig, cli_flags, load_config, validate, with_overrides
    from labavg.runs import load_config_of

    if args.resume:
        cfg = load_config_of(Path(args.resume))
    elif args.config:
        cfg = load_config(args.config)
    else:
        cfg = TrainConfig()
    overrides = {}
    for flag in cli_flags():
        value = getattr(args, _dest(flag))
        if value is not None and value is not False:  # only flags the user gave override
            overrides[flag.key] = value
    overrides.update(_parse_set(args.set))
    if args.resume:
        overrides["out"] = args.resume
        # A fault is injected once: the resumed run is the recovery from it.
        overrides.setdefault("inject_fault", None)
    return validate(with_overrides(cfg, overrides))


def cmd_train(args: argparse.Namespace) -> int:
    from labavg.comm.launchers import detect_launcher, launcher_rank
    from labavg.launch import JobFailed, rank_config, start_run
    from labavg.runs import format_table, run_training

    try:
        if args.config_json:  # a rank of a job labavg.launch started
            cfg, resume, stop_file = rank_config(args.config_json)
        else:
            cfg, resume, stop_file = train_config(args), bool(args.resume), None
    except UserError as exc:
        if detect_launcher() is not None and launcher_rank() > 0:
            # Every rank parses the same flags and files: rank 0 alone says what is wrong.
            raise PeerFailed(str(exc)) from None
        raise
    progress = not args.no_progress
    if cfg.backend == "torch" and detect_launcher() == "mpi":
        raise UserError("backend 'torch' runs under torchrun: torchrun --nproc-per-node N -m labavg train ...")
    if detect_launcher() is not None or args.config_json:
        # This process is one rank of a job that mpiexec, srun, torchrun or labavg started.
        should_stop = None if stop_file is None else (lambda: os.path.exists(stop_file))
        summary = run_training(cfg, resume=resume, progress=progress, should_stop=should_stop,
                               allow_pipes=args.allow_pipes)
    else:
        try:
            summary = start_run(cfg, resume=resume, allow_pipes=args.allow_pipes,
                                hosts=args.hosts, progress=progress).wait()
        except JobFailed as exc:  # its ranks have said why
            return exc.code
    if summary is not None and not args.config_json:  # a rank labavg started: its parent says it
        print(format_table([{"run": cfg.out, **summary}]))
        written = "events.jsonl, summary.json" + (", tensorboard/" if cfg.tensorboard else "")
        print(f"run directory: {cfg.out}  ({written})")
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    from dashboard.app import serve

    print(f"labavg dashboard: http://{args.address}:{args.port}/app (Ctrl-C stops it)")
    serve(port=args.port, open_browser=not args.no_browser, runs_dir=args.runs_dir,
          address=args.address, data=args.data)
    return 0


def cmd_reproduce(args: argparse.Namespace) -> int:
    from labavg.reproduction import reproduce

    if args.parallel < 1:
        raise UserError(f"--parallel must be >= 1, got {args.parallel}")
    command = ("labavg reproduce " + " ".join(sys.argv[2:])).strip()
    out, experiments, report = Path(args.out), Path(args.experiments), Path(args.report)
    figure = Path(args.figure) if args.figure else None
    if args.tiny:
        from labavg.reproduction import tiny_experiments

        for name in ("paper.toml", "regime.toml"):
            if not (experiments / name).is_file():
                raise UserError(f"{experiments / name}: no such sweep file (--experiments DIR)")
        experiments = tiny_experiments(experiments, out / "experiments")
        if args.report == "REPRODUCTION.md":  # never overwrite the real report with a tiny one
            report = out / "REPRODUCTION.md"
        figure = figure or out / "regime-map.png"
    path = reproduce(out, experiments=experiments, yesno=Path(args.yesno) if args.yesno else None,
                     report=report, figure=figure, parallel=args.parallel, mpi=not args.no_mpi,
                     train=not args.report_only, command=command)
    print(f"wrote {path}")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from labavg.sweep import load_sweep, run_sweep

    sweep = load_sweep(args.sweep_file)
    recorded = None
    if args.recorded:
        from labavg.results import read_results_file

        runs = read_results_file(Path(args.recorded)).get(Path(args.sweep_file).stem, [])
        recorded = {r.name: {"settings": r.settings, "summary": r.summary} for r in runs}
    rows = run_sweep(sweep, Path(args.out), recorded=recorded)
    print((Path(args.out) / "results.md").read_text())
    print(f"{len(rows)} runs in {args.out}/runs; tables in {args.out}/results.csv and results.md")
    return 0


def cmd_decode(args: argparse.Namespace) -> int:
    from labavg.decode.decoder import DEFAULT_BEAM
    from labavg.decode.run import DEFAULT_ACWTS, decode_run, format_result

    summary = decode_run(args.run_dir, args.data, dev=args.dev, lang_dir=args.lang,
                         lexicon=args.lexicon, lm=args.lm, acwts=tuple(args.acwt or DEFAULT_ACWTS),
                         beam=args.beam if args.beam is not None else DEFAULT_BEAM)
    print(format_result(summary))
    print(f"decode directory: {Path(args.run_dir) / ('decode_' + summary['set'])}")
    return 0


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


def cmd_compare(args: argparse.Namespace) -> int:
    from labavg.decode.run import compare_decodes, format_comparison

    a, b, comparison = compare_decodes(args.run_a, args.run_b, args.set_name)
    if args.json:
        print(json.dumps({"set": args.set_name, "run_a": str(a.run_dir), "run_b": str(b.run_dir),
                          "acwt_a": a.acwt, "acwt_b": b.acwt, **comparison.to_dict()}, indent=2))
    else:
        print(format_comparison(a, b, comparison, args.set_name))
    return 0


def _runs_under(path: str) -> list[Path]:
    """`path` if it is a run, else every run below it (a run's own subfolders are not searched)."""
    import re

    from labavg.index import CONFIG, SUMMARY

    top = Path(path)
    if not top.exists():
        raise UserError(f"{path}: no such run or directory")
    if not top.is_dir():
        raise UserError(f"{path}: not a run directory (a run is a directory with {CONFIG} or {SUMMARY})")
    # Sweeps name runs ranks_1, ranks_2, ..., ranks_16: compare their numbers as numbers.
    natural = lambda name: [(0, int(t), "") if t.isdigit() else (1, 0, t)  # noqa: E731
                            for t in re.split(r"(\d+)", name)]
    found = []
    for here, dirs, files in os.walk(top):
        if CONFIG in files or SUMMARY in files:
            found.append(Path(here))
            dirs[:] = []
        else:
            dirs.sort(key=natural)
    if not found:
        raise UserError(f"{path}: no labavg run in it or below it (no {CONFIG} or {SUMMARY})")
    return found


def cmd_info(args: argparse.Namespace) -> int:
    from labavg.index import CONFIG, SUMMARY, read_json
    from labavg.runs import format_table, read_summary

    run_dirs, seen = [], set()
    for path in args.run_dirs:
        for run_dir in _runs_under(path):
            if run_dir.resolve() not in seen:
                seen.add(run_dir.resolve())
                run_dirs.append(run_dir)
    summaries, rows = [], []
    for run_dir in run_dirs:
        if (run_dir / SUMMARY).exists():
            summary = {"run": str(run_dir), **read_summary(run_dir)}
            row = summary
        else:  # started, not ended: its settings are known, its results not yet
            config = read_json(run_dir / CONFIG)
            if not isinstance(config, dict):
                raise UserError(f"{run_dir / CONFIG}: not a JSON object")
            summary = {"run": str(run_dir), "status": "running/incomplete", "config": config}
            row = {"run": f"{run_dir} (running/incomplete)", "config": config}
        summaries.append(summary)
        rows.append(row)
    if args.json:
        # One run named by itself prints its object, as before; anything searched is a list.
        single = len(summaries) == 1 and len(args.run_dirs) == 1 and run_dirs[0] == Path(args.run_dirs[0])
        print(json.dumps(summaries[0] if single else summaries, indent=2))
    else:
        print(format_table(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("labavg: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `labavg info runs | head`: the reader left; say nothing, as other Unix tools do, and
        # point stdout at devnull so the interpreter's final flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as exc:
        user = user_error_of(exc)
        if user is None:
            from labavg.comm.inproc import CollectiveTimeout
            from labavg.watchdog import EXIT_WATCHDOG

            cause = getattr(exc, "exc", None)
            if isinstance(cause, CollectiveTimeout):  # an in-process worker went silent
                print(f"labavg: error: {one_line(cause)}; ending the run", file=sys.stderr)
                return EXIT_WATCHDOG
            raise
        if not getattr(user, "quiet", False):  # a PeerFailed: another rank printed the message
            print(f"labavg: error: {one_line(user)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
