"""Which rank stopped the run, for the others' line.

When one process of a job raises, the others only see its sockets close in their next collective,
which reads the same as a process that vanished (SIGKILL, a lost node): "lost contact". So a rank
that fails writes its one line into the job's rendezvous store before it exits, first writer wins,
and a rank that loses contact with a peer looks there before it blames the process or the network.

Under torch elastic's agent (torchrun, `accelerate launch` with several processes) that store is a
TCPStore the agent of the first node serves: it outlives any worker, every node reaches it, and the
per-attempt prefix of train/core/accelerator.py keeps a restarted job from reading the failure of
the attempt before. Without such a store (one process, no launcher) nothing is written or read.
"""

import time
from datetime import timedelta

KEY = "failed"  # "RANK<TAB>one line": the first failure of this attempt
QUICK = timedelta(seconds=2)  # a store that does not answer at once has gone with its node: do not wait on it

_board = []  # the rendezvous store, once the process group has one


def error_line(error):
    """An exception as one line: a user's error as the user reads it, an OSError as its reason and
    file, anything else as its type and first line."""
    from data.errors import UserError

    if isinstance(error, UserError):
        return str(error)
    if isinstance(error, OSError) and error.strerror:
        where = error.filename or error.filename2
        return f"{error.strerror}: {where}" if where else error.strerror
    first = next((part.strip() for part in str(error).splitlines() if part.strip()), "")
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def use_store(store):
    """Called by the rendezvous (train/core/accelerator.py) with the job's store."""
    from torch.distributed import PrefixStore

    _board[:] = [PrefixStore("failures/", store)]


def record_failure(rank, message):
    """On the rank that fails: its one line, unless another rank's failure came first."""
    if not _board:
        return
    try:
        _board[0].set_timeout(QUICK)
        _board[0].compare_set(KEY, "", f"{rank}\t{message}")
    except Exception:  # the store's node is gone too: the others will say they lost contact
        pass


def first_failure(wait_seconds=0.5):
    """(rank, one line) of the first rank that failed with an error of its own, or None: a peer that
    vanished (SIGKILL, the OOM killer, a lost node) wrote nothing. Waits up to `wait_seconds` for a
    failing rank still on its way out."""
    if not _board:
        return None
    deadline = time.monotonic() + wait_seconds
    try:
        _board[0].set_timeout(QUICK)
        while not _board[0].check([KEY]):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.1)
        rank, message = _board[0].get(KEY).decode().split("\t", 1)
    except Exception:  # no store to ask (its agent or node is gone)
        return None
    return int(rank), message
