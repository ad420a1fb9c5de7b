"""The user errors of data/: what a user did (or a file holds) that cannot be right, each with a
message of one line that names the thing and the fix. Every refusal in data/ raises one of these,
so a script catches `UserError` (or the two kinds) and prints it as it is, never a traceback.

This module imports nothing from the project: every other module of data/ may use it.
"""

ORIGINAL_TRACEBACK = "Original Traceback"


class UserError(Exception):
    """Base of the user errors; str() is one line.

    Raised in a DataLoader worker, torch re-raises the error in the main process as the same type
    with the worker's whole traceback as its message; the user's line is then the traceback's last
    line, after the exception's name."""

    def __str__(self):
        text = super().__str__()
        if ORIGINAL_TRACEBACK in text:
            last = text.strip().splitlines()[-1]
            return last.split(": ", 1)[-1]
        return " ".join(line.strip() for line in text.splitlines() if line.strip())


class DataError(UserError, RuntimeError):
    """Missing or unreadable data, or a folder that is not ours to write: what was looked for and the fix."""


class PlanError(UserError, ValueError):
    """A batch plan, data state or source that cannot be right: the problem and the fix."""


def fail(message):
    """Stop with `message` as the one line the user reads (every rank that calls it stops alike)."""
    raise UserError(message)
