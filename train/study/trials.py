"""One trial of a sweep as a real `accelerate launch` run, and who owns which running trial.

A trial runs in a session of its own, so a Ctrl-C meant for the sweep does not reach it: the sweep
passes on a SIGTERM instead, which every rank answers by saving a checkpoint at one step
(train/core/preemption.py). If the sweep itself is killed, the kernel sends the launcher SIGTERM
(PR_SET_PDEATHSIG), the same stop. Every sweep process holds a lock file for its whole life
(SWEEP_DIR/workers/HOST-PID-RANDOM.lock, an flock the kernel releases however the process dies); a
RUNNING trial whose owner's lock is free was interrupted, and the next sweep command resumes it
from its latest checkpoint (train/sweep.py).
"""

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid


class WorkerLock:
    """This sweep process, alive: an flock on SWEEP_DIR/workers/NAME held until it exits. `name` is
    what trials record: relative to the sweep folder (machines may mount it at other paths), and
    unique (a container's sweep is PID 1 on a fixed hostname every time)."""

    def __init__(self, sweep_dir):
        os.makedirs(os.path.join(sweep_dir, "workers"), exist_ok=True)
        self.name = os.path.join("workers", f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}.lock")
        self.path = os.path.join(sweep_dir, self.name)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def release(self, remove):
        """With a trial left RUNNING the file stays: its free lock tells the next sweep it was interrupted.
        The file goes while still locked, so no sweep takes it for a dead worker's meanwhile."""
        if remove:
            with contextlib.suppress(FileNotFoundError):  # removed by hand, or with the whole sweep folder
                os.remove(self.path)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def owner_gone(lock_file):
    """Whether the sweep process that holds (held) lock_file has exited. A file this machine cannot
    see belongs to a sweep elsewhere whose folder is not shared with this one: never taken over."""
    return os.path.exists(lock_file) and is_free(lock_file)


def is_free(lock_file):
    """True when no live process holds an flock on lock_file (or it does not exist)."""
    try:
        fd = os.open(lock_file, os.O_RDWR)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # closing drops the probe's lock
    return True


def wait_until_free(output_dir, seconds=300):
    """An interrupted trial's processes may still be saving their last checkpoint: its run holds
    OUTPUT_DIR/.lock until then (train/core/output_dir.py). Wait for it, at most `seconds`."""
    deadline = time.monotonic() + seconds
    while not is_free(os.path.join(output_dir, ".lock")):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def _die_with_parent():
    import ctypes

    ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG


class TrialRun:
    """`accelerate launch` of the script for one trial, its output in a log file."""

    def __init__(self, command, output_dir, log_path):
        self.output_dir, self.log_path, self.seen = output_dir, log_path, 0
        # torch elastic's agent kills its workers 30 s after passing on a SIGTERM; a checkpoint may take longer
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "100"}
        with open(log_path, "a") as log:
            log.write(f"$ {' '.join(command)}\n")
            log.flush()
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )
        self.started = time.monotonic()

    def evaluations(self, metric):
        """(step, value) of each evaluation the run wrote to metrics.jsonl since the last call; a
        resumed run rewrites the file from its checkpoint on, so it is read whole each time."""
        path = os.path.join(self.output_dir, "metrics.jsonl")
        found = []
        try:
            with open(path) as f:
                for line in f:
                    try:
                        record = json.loads(line)
                    except ValueError:  # a line being written
                        continue
                    if metric in record and record[metric] is not None:
                        found.append((record["step"], record[metric]))
        except FileNotFoundError:
            pass
        return found

    def stop(self, signum):
        """SIGTERM: save a checkpoint and stop (resumable); SIGINT: stop at once (pruned)."""
        try:
            os.killpg(self.process.pid, signum)
        except ProcessLookupError:
            pass

    def poll(self):
        return self.process.poll()

    def wait(self):
        code = self.process.wait()
        wait_until_free(self.output_dir)  # the ranks, after the launcher
        return code

    def seconds(self):
        return time.monotonic() - self.started

    def last_line(self):
        """The line that says why a failed trial failed: the log's last line that is not a traceback's."""
        with open(self.log_path, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
        errors = [line for line in lines if line.startswith(("error:", "[local rank"))] or lines
        return errors[-1][:300] if errors else "no output"
