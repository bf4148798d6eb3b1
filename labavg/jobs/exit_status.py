"""How an error ending a labavg process becomes its exit status and its one line on stderr.

Shared by the `labavg` command (labavg.cli.main) and the ranks of a job that
labavg.jobs.launch starts (labavg.jobs.rank_main), so that a rank ends exactly as the command
would: JobRun reads these statuses and lines to say once why the job ended.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from labavg.base.errors import one_line, user_error_of

INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C
BROKEN_PIPE = 141  # 128 + SIGPIPE
USER_ERROR = 2


def exit_status(run: Callable[[], int]) -> int:
    """`run()`'s status; an error it raises is said in one line and becomes a status.

    A user error (UserError, also behind a simulated worker's failure) is 2, printed unless
    another rank prints it (PeerFailed); Ctrl-C is 130; a reader that left the pipe is 141; an
    in-process worker that went silent is the watchdog's status. Anything else is a bug: its
    traceback is kept.
    """
    try:
        return run()
    except KeyboardInterrupt:
        print("labavg: interrupted", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:
        # `labavg info runs | head`: the reader left; say nothing, as other Unix tools do, and
        # point stdout at devnull so the interpreter's final flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE
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
        return USER_ERROR
