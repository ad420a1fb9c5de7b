"""The user's errors: bad input, bad paths, runs that cannot go on. Each is one line for the user
(str() of the exception), never a traceback: `train/core/run.py:run()` prints it once per launch and
exits 1. Everything in data/ and train/ that refuses something raises one of these, through fail()
or its own subclass."""


class UserError(Exception):
    """A refusal with a one-line message that says what is wrong and what to do."""


def fail(message):
    """Stop with `message` as the one line the user reads (every rank that calls it stops alike)."""
    raise UserError(message)
