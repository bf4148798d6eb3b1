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

import os
import sys

from labavg.base.errors import one_line, user_error_of

from labavg.cli.parser import build_parser


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
            from labavg.comm.inproc_group import CollectiveTimeout
            from labavg.comm.watchdog import EXIT_WATCHDOG

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
