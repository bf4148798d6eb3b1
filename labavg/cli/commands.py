"""What each `labavg` command does: thin calls into the library."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from labavg.base.errors import UserError


def cmd_synth(args: argparse.Namespace) -> int:
    from labavg.data.synth import synthesize

    info = synthesize(args.out_dir, hours=args.hours, seed=args.seed, overwrite=args.overwrite,
                      dev_hours=args.dev_hours, test_hours=args.test_hours)
    print(f"wrote {info.out_dir}: {info.hours:.2f} h of speech, {info.num_utts} utterances from "
          f"{info.num_speakers} speakers, {info.num_frames:,} frames of {info.feat_dim} features, "
          f"{info.num_phones} phones, {info.num_pdfs} pdfs (seed {info.seed}, "
          f"{info.seconds_taken:.0f} s)")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from labavg.data.prepare import prepare_corpus

    done = prepare_corpus(args.audio_dir, args.out_dir, text=args.text, lexicon=args.lexicon,
                          speaker=args.speaker, overwrite=args.overwrite,
                          progress=not args.no_progress)
    left = len(done.unknown_words) + len(done.failed)
    print(f"wrote {done.out_dir}: {done.num_utts} utterances, {done.hours * 60:.1f} min, "
          f"{done.num_frames:,} frames ({done.seconds_taken:.0f} s)"
          + (f"; left out {len(done.unknown_words)} with words outside the dictionary and "
             f"{len(done.failed)} not aligned (left_out.txt)" if left else ""))
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
    """Defaults, then the TOML file (or the resumed run's config), then the flags; not yet
    validated (start_run does that, once)."""
    from labavg.training.config import TrainConfig, cli_flags, load_config
    from labavg.base.settings import with_overrides

    if args.resume:
        from labavg.jobs.run_dir import load_config_of  # torch (checkpoints): only to resume

        cfg = load_config_of(Path(args.resume))
    elif args.config:
        cfg = load_config(args.config)
    else:
        cfg = TrainConfig()
    overrides, sources = {}, {}  # sources: the flag each key came from, for its messages
    for flag in cli_flags():
        value = getattr(args, _dest(flag))
        if value is not None and value is not False:  # only flags the user gave override
            overrides[flag.key], sources[flag.key] = value, flag.flag
    overrides.update(_parse_set(args.set))
    sources.update({item.partition("=")[0].strip(): f"--set {item}" for item in args.set})
    if args.resume:
        overrides["out"] = args.resume
        # A fault is injected once: the resumed run is the recovery from it.
        overrides.setdefault("inject_fault", None)
    return with_overrides(cfg, overrides, sources)


def _join(args: argparse.Namespace) -> int:
    from labavg.jobs.elastic_join import join
    from labavg.training.config import cli_flags

    given = [flag.flag for flag in cli_flags() if getattr(args, _dest(flag)) not in (None, False)]
    given += [name for name, value in (("CONFIG", args.config), ("--set", args.set),
                                       ("--resume", args.resume), ("--hosts", args.hosts),
                                       ("--launcher", args.launcher)) if value]
    if given:
        raise UserError(f"--join takes the running job's own settings: drop {', '.join(given)}")
    joined = join(args.join)
    print(f"labavg: rank {joined.rank} (pid {joined.pid}) joined the job in {args.join}; it "
          f"trains with the others until the job ends")
    return 0


def process_start() -> float:
    """The Unix time this process started: a run's process_seconds counts the interpreter's
    start and the imports too, which no clock read later in the process sees."""
    import psutil

    return psutil.Process().create_time()


def cmd_train(args: argparse.Namespace) -> int:
    from labavg.comm.launchers import detect_launcher
    from labavg.jobs.job_outcome import JobFailed
    from labavg.jobs.launch import start_run
    from labavg.jobs.rank_main import run_rank, said_by_rank_0
    from labavg.jobs.summary import format_runs

    progress = not args.no_progress
    if args.join:
        return _join(args)
    if detect_launcher() is not None:
        # The user's own mpiexec, srun or torchrun started this process as one rank: no
        # start_run validates for it, so it does, as every rank of a job labavg starts is
        # handed settings start_run validated.
        from labavg.training.config import validate

        try:
            cfg = validate(train_config(args))
        except UserError as exc:
            raise said_by_rank_0(exc) from None
        summary = run_rank(cfg, resume=bool(args.resume), progress=progress,
                           allow_pipes=args.allow_pipes, since=process_start())
    else:
        cfg = train_config(args)
        try:
            # SIGINT and SIGTERM end it through labavg.cli.signals, whatever ran it.
            summary = start_run(cfg, resume=bool(args.resume), allow_pipes=args.allow_pipes,
                                hosts=args.hosts, progress=progress, launcher=args.launcher,
                                since=process_start()).result()
        except JobFailed as exc:  # its ranks have said why
            return exc.code
    if summary is not None:
        print(format_runs([(cfg.out, None, summary)]))
        written = "events.jsonl, summary.json" + (", tensorboard/" if cfg.tensorboard else "")
        print(f"run directory: {cfg.out}  ({written})")
    return 0


def rerun_command(args: argparse.Namespace, argv: list[str]):
    """For a long command, a function naming the command that goes on after it was
    interrupted (labavg.cli.signals); None for a short one."""
    from labavg.cli.signals import command_line, train_rerun

    if args.func is cmd_train:
        def rerun() -> str:
            try:
                out = args.resume or train_config(args).out
            except UserError:
                out = None
            return train_rerun(argv, out, resumed=bool(args.resume))
        return rerun
    if args.func in (cmd_sweep, cmd_decode, cmd_reproduce, cmd_synth, cmd_prepare):
        return lambda: command_line(argv)
    return None


def cmd_dashboard(args: argparse.Namespace) -> int:
    from dashboard.exposure import plan_exposure

    # Address, port and credential checked before Panel loads: a mistake is one line.
    exposure = plan_exposure(args.address, args.port, args.password_file, args.origin)
    url = f"http://{args.address}:{args.port}/app"
    if exposure.loopback:
        print(f"labavg dashboard: {url} (Ctrl-C stops it)", flush=True)
    else:
        told = (f"password {exposure.password} (made for this session; --password-file sets one)"
                if exposure.generated else f"the password in {args.password_file}")
        print(f"labavg dashboard: {url} is reachable from the network: log in at /login with any "
              f"user name and {told}; pages served from {', '.join(exposure.origins)} only "
              f"(--origin adds one). Ctrl-C stops it", flush=True)
    from dashboard.app import serve

    extra = {} if exposure.password is None else {"basic_auth": exposure.password,
                                                  "cookie_secret": exposure.cookie_secret}
    try:
        serve(port=args.port, open_browser=not args.no_browser, runs_dir=args.runs_dir,
              address=args.address, data=args.data, websocket_origin=exposure.origins, **extra)
    except OSError as exc:  # taken between the check and the server's bind
        raise UserError(f"cannot listen on {args.address} port {args.port}: {exc.strerror}") from None
    return 0


def cmd_reproduce(args: argparse.Namespace) -> int:
    from labavg.studies.reproduction.pipeline import reproduce

    if args.parallel < 1:
        raise UserError(f"--parallel must be >= 1, got {args.parallel}")
    command = ("labavg reproduce " + " ".join(sys.argv[2:])).strip()
    out, experiments, report = Path(args.out), Path(args.experiments), Path(args.report)
    figure = Path(args.figure) if args.figure else None
    if args.tiny:
        from labavg.studies.reproduction.sweep_files import tiny_experiments

        for name in ("paper.toml", "regime.toml"):
            if not (experiments / name).is_file():
                raise UserError(f"{experiments / name}: no such sweep file (--experiments DIR)")
        experiments = tiny_experiments(experiments, out / "experiments")
        if args.report == "REPRODUCTION.md":  # never overwrite the real report with a tiny one
            report = out / "REPRODUCTION.md"
        figure = figure or out / "regime-map.png"
    path = reproduce(out, experiments=experiments, yesno=Path(args.yesno) if args.yesno else None,
                     report=report, figure=figure, parallel=args.parallel, mpi=not args.no_mpi,
                     train=not args.report_only, command=command,
                     only=None if args.only is None else tuple(args.only.split(",")))
    print(f"wrote {path}")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from labavg.studies.sweep import MAX_POINTS, load_sweep, run_sweep

    if args.max_points is not None and args.max_points < 1:
        raise UserError(f"--max-points must be >= 1, got {args.max_points}")
    sweep = load_sweep(args.sweep_file, max_points=args.max_points or MAX_POINTS)
    recorded = None
    if args.recorded:
        from labavg.studies.reproduction.results import read_results_file

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


def cmd_compare(args: argparse.Namespace) -> int:
    from labavg.decode.compare import compare_decodes, format_comparison

    a, b, comparison = compare_decodes(args.run_a, args.run_b, args.set_name)
    if args.json:
        print(json.dumps({"set": args.set_name, "run_a": str(a.run_dir), "run_b": str(b.run_dir),
                          "acwt_a": a.acwt, "acwt_b": b.acwt, **comparison.to_dict()}, indent=2))
    else:
        print(format_comparison(a, b, comparison, args.set_name))
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from labavg.base.errors import one_line
    from labavg.base.json_files import strict_json
    from labavg.base.settings import to_dict
    from labavg.jobs.index import list_runs
    from labavg.jobs.summary import format_runs, with_derived

    records, seen, problems = [], set(), []
    for path in args.run_dirs:
        for record in list_runs(Path(path), problems, search=True):
            if record.path.resolve() not in seen:
                seen.add(record.path.resolve())
                records.append(record)
    # One damaged run is named (in `problems`); the others are still listed.
    records = [r for r in records if r.damaged is None]
    problems = list(dict.fromkeys(problems))  # a run named twice is read twice
    if args.json:
        # Derived figures measured again, as the table does; strict JSON (no bare NaN).
        summaries = [{"run": str(r.path), **with_derived(r.summary).to_dict()}
                     if r.summary is not None else
                     {"run": str(r.path), "status": "running/incomplete",
                      "config": to_dict(r.config)} for r in records]
        # One run named by itself prints its object, as before; anything searched is a list.
        single = (len(summaries) == 1 and len(args.run_dirs) == 1
                  and records[0].path == Path(args.run_dirs[0]))
        print(strict_json(summaries[0] if single else summaries, indent=2))
    elif records:
        print(format_runs([(str(r.path), None, r.summary) if r.summary is not None else
                           (f"{r.path} (running/incomplete)", r.config, None) for r in records]))
    for problem in problems:
        print(f"labavg: error: {one_line(problem)}", file=sys.stderr)
    return 2 if problems else 0
