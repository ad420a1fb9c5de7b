"""One writer per folder: a run's output folder, a data folder being prepared.

The lock is an `flock` on FOLDER/.lock, which the kernel releases when its holder dies, however it
dies: a lock can never be left behind by a killed process on the same host. The file also holds who
took it (host, pid, start, command), so a refusal can name the holder. A clean release empties the
file; a file that still names a holder but can be locked was left by a process that died, and the
new holder says so in one line. A holder that names its job (the fingerprint of the data set it
prepares) is waited for by a process that comes for the same job, rather than refused.
"""

import fcntl
import json
import os
import socket
import sys
import time

from data.errors import UserError

LOCK_NAME = ".lock"


class FolderBusy(UserError):
    """Another process holds the folder's lock; str() is the one line for the user."""


def _describe(holder):
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return (
        f"pid {holder.get('pid')} on {holder.get('host')}, started {started}: "
        f"{holder.get('command') or 'unknown command'}"
    )


class FolderLock:
    """Held from lock_folder() until release() or the end of the process."""

    def __init__(self, folder, fd):
        self.folder, self._fd = folder, fd

    def release(self):
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)  # empty: released on purpose, not left by a dead holder
        except OSError:
            pass
        os.close(self._fd)  # closing the descriptor drops the flock
        self._fd = None

    def in_place(self):
        """Whether the file locked is still FOLDER/.lock: a folder swapped by renames can lose it to a
        process that made the folder again in between, whose lock file is then not ours to remove."""
        try:
            return os.path.samestat(os.fstat(self._fd), os.stat(os.path.join(self.folder, LOCK_NAME)))
        except OSError:
            return False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def lock_folder(folder, what="this folder", note=print, job=None):
    """Take FOLDER/.lock (creating the folder) or raise FolderBusy naming its holder. `what` says
    in the refusal what the folder is for; `note` prints the line about a lock taken over. `job`
    (a data set's fingerprint) goes in the lock file: a holder doing the same job is waited for,
    with one line, instead of refused."""
    path = os.path.join(folder, LOCK_NAME)
    for _ in range(100):
        try:
            os.makedirs(folder, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except (FileNotFoundError, FileExistsError):
            if os.path.lexists(folder) and not os.path.isdir(folder):
                raise  # a file where the folder should be: no other process will change that
            # its holder removed the folder (a failed first write cleans up) between our makedirs and open
            continue
        try:
            _take(fd, folder, what, note, job)
        except BaseException:
            os.close(fd)
            raise
        # The file locked must still be the one at `path`: its holder may have removed or replaced it
        # (a folder swapped in whole, a failed first write cleaned up) between our open and our flock.
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    else:
        raise FolderBusy(f"{path} keeps being replaced while we lock it; another process is using {folder}")
    left = _read_holder(fd)
    if left:
        note(f"note: {folder} was locked by a process that is gone ({_describe(left)}); taking it over")
    holder = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.time(),
        "command": " ".join(sys.argv),
        **({"job": job} if job is not None else {}),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    os.fsync(fd)
    return FolderLock(folder, fd)


def _take(fd, folder, what, note, job):
    """flock fd, or raise FolderBusy naming the holder; a holder doing `job` too is waited for."""
    for _ in range(100):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            holder = _read_holder(fd)
        except OSError as e:  # a file system without flock: say so rather than run unguarded
            raise FolderBusy(
                f"cannot lock {os.path.join(folder, LOCK_NAME)} ({e.strerror}); this file system does "
                "not support flock, use a folder on another one"
            ) from None
        if holder is not None:
            break
        time.sleep(0.01)  # locked a moment ago and not yet named by its holder (or a waiter looking): look again
    if job is not None and holder and holder.get("job") == job:
        note(_waiting(folder, holder))
        fcntl.flock(fd, fcntl.LOCK_EX)
        return
    who = _describe(holder) if holder else "another process"
    raise FolderBusy(f"{folder} is in use as {what} by {who}; wait for it to finish, stop it, or use another folder")


def wait_for_job(folder, job, note=print):
    """If a process doing `job` holds FOLDER/.lock, wait until it lets go (one line); True if we
    waited. Holds nothing after: the caller looks at what that process left."""
    try:
        fd = os.open(os.path.join(folder, LOCK_NAME), os.O_RDONLY)
    except OSError:  # no lock file: nobody is preparing it
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            holder = _read_holder(fd)
        except OSError:
            return False
        if not holder or holder.get("job") != job:
            return False
        note(_waiting(folder, holder))
        fcntl.flock(fd, fcntl.LOCK_SH)
        return True
    finally:
        os.close(fd)  # and with it the shared lock we waited for


def _waiting(folder, holder):
    return f"waiting for pid {holder.get('pid')} on {holder.get('host')}, preparing {folder} (the same set)"


def _read_holder(fd):
    try:
        text = os.pread(fd, 65536, 0).decode(errors="replace").strip()
        return json.loads(text) if text else None
    except (OSError, ValueError):
        return {"command": "unreadable lock file"}
