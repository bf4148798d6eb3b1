"""The one exception type for bad input from the user."""


class UserError(Exception):
    """Bad input the user can fix: a missing file, a malformed line, a bad value.

    The message must name the file, line or value at fault. The CLI prints the
    message alone (no traceback) and exits with status 2.
    """


class DataError(UserError):
    """Bad or inconsistent training data (features, alignments, data directories)."""


class PeerFailed(UserError):
    """Another rank met a user error and reports it; this rank ends quietly with status 2.

    Raised on the ranks that did not meet the error, so that the message is printed once.
    """

    quiet = True


def user_error_of(exc: BaseException | None) -> UserError | None:
    """The UserError behind `exc`, also when a simulated worker raised it or it was chained."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, UserError):
            return exc
        exc = getattr(exc, "exc", None) or exc.__cause__
    return None


def one_line(exc: BaseException | str) -> str:
    """A message on one line (library messages can carry newlines)."""
    return " ".join(str(exc).split())
