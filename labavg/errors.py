"""The one exception type for bad input from the user."""


class UserError(Exception):
    """Bad input the user can fix: a missing file, a malformed line, a bad value.

    The message must name the file, line or value at fault. The CLI prints the
    message alone (no traceback) and exits with status 2.
    """


class DataError(UserError):
    """Bad or inconsistent training data (features, alignments, data directories)."""
