"""One writer per folder: a run's output folder, a data folder being prepared.

The lock is an `flock` on FOLDER/.lock, which the kernel releases when its holder dies, however it
dies: a lock can never be left behind by a killed process on the same host. The file also holds who
took it (host, pid, start, command), so a refusal can name the holder. A clean release empties the
file; a file that still names a holder but can be locked was left by a process that died, and the
new holder says so in one line.
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
    return (f"pid {holder.get('pid')} on {holder.get('host')}, started {started}: "
            f"{holder.get('command') or 'unknown command'}")


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


def lock_folder(folder, what="this folder", note=print):
    """Take FOLDER/.lock (creating the folder) or raise FolderBusy naming its holder. `what` says
    in the refusal what the folder is for; `note` prints the line about a lock taken over."""
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
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            who = _describe(holder) if holder else "another process"
            raise FolderBusy(f"{folder} is in use as {what} by {who}; wait for it to finish, stop it, or use another "
                             "folder") from None
        except OSError as e:  # a file system without flock: say so rather than run unguarded
            os.close(fd)
            raise FolderBusy(f"cannot lock {path} ({e.strerror}); this file system does not support flock, use a "
                             "folder on another one") from None
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
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
              "command": " ".join(sys.argv)}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    os.fsync(fd)
    return FolderLock(folder, fd)


def _read_holder(fd):
    try:
        text = os.pread(fd, 65536, 0).decode(errors="replace").strip()
        return json.loads(text) if text else None
    except (OSError, ValueError):
        return {"command": "unreadable lock file"}
