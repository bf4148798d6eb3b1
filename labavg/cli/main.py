"""The `labavg` command line: a thin consumer of the library.

    labavg corpus synth OUT_DIR      write the built-in synthetic corpus
    labavg train [CONFIG.toml] ...   train (flags override the file)
    labavg sweep SWEEP.toml --out D  train a grid of configurations
    labavg dashboard                 serve the live dashboard
    labavg decode RUN_DIR --data D   word and phone error rates of a run's final model
    labavg compare RUN_A RUN_B       paired bootstrap of two runs' WERs on one decoded set
    labavg info RUN_DIR...           print run summaries as a table
    labavg plan [RUN_DIR]            predicted speedup and accuracy of each N, K and method

Bad input prints one message and exits with status 2. SIGINT and SIGTERM end a long command
(train, sweep, decode, reproduce, corpus) with 130 and 143 and one line naming the command that
goes on (labavg.cli.signals).
"""

from __future__ import annotations

import sys

from labavg.cli.parser import build_parser
from labavg.jobs.exit_status import exit_status


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status. Run as the process's own command (no
    `argv`: the `labavg` script, `python -m labavg`), a `labavg train` that succeeded ends the
    process at once (labavg.comm.launchers.end_process_now), without torch's teardown."""
    from labavg.cli.commands import cmd_train, rerun_command
    from labavg.cli.signals import answer_signals

    whole_process = argv is None
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    rerun = rerun_command(args, argv)
    if rerun is None:
        return exit_status(lambda: args.func(args))
    # A long command: every signal answered by one policy (labavg.cli.signals).
    code = exit_status(lambda: answer_signals(rerun, lambda: args.func(args)))
    if whole_process and args.func is cmd_train:
        from labavg.comm.launchers import end_process_now

        end_process_now(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
