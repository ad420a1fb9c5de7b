"""A run told to stop by its cluster loses nothing: SIGTERM (what SLURM sends ahead of a time limit
or a preemption, what Kubernetes and `kill` send) to the launcher, which passes it to every worker,
or to any one rank. Every rank stops at the same optimizer step, the run saves a checkpoint there,
and the first process prints the command that resumes it.

The ranks agree through one small reduce: of each rank's flag and of its seconds per step since the
last check. Every rank gets the same numbers back, so every rank computes the same next check,
about half a second of training away and at most 10 steps (a reduce per step would cost a visible share
of a short CPU step: bench/loop_overhead.py measures it). A stop therefore comes within max(0.5 s, one
step) of training after the signal reaches a rank (up to 10 steps when steps slowed since the last
check, and an evaluation that falls in between), plus one checkpoint; torch elastic's
agent allows its workers 30 s after passing on a SIGTERM before it kills them. Its SIGTERM goes to
each rank's whole process group: DataLoader workers need a group of their own to survive it
(data.workers.own_process_group).
"""

import os
import signal
import threading
import time

import torch

from train.core.process import first_local_process


class Preempted(Exception):
    """The run stopped on a SIGTERM once its checkpoint was saved: run() prints the message (one line,
    with the resume command) from the first process and exits 143, as a process ended by SIGTERM."""

    exit_code = 128 + signal.SIGTERM


class Preemption:
    CHECK_SECONDS, MAX_STEPS_BETWEEN = 0.5, 10

    def __init__(self, accelerator):
        self.accelerator, self.requested = accelerator, False
        self._next_check, self._last_check = None, None  # the first call checks, on every rank alike
        self._previous = None
        if threading.current_thread() is threading.main_thread():  # signal handlers live there only
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame):
        # nothing but a flag: the step in progress ends, then the agreed stop saves; a second
        # SIGTERM during that save changes nothing (checkpoints are published only once complete)
        self.requested = True

    def agreed(self, step):
        """At every optimizer step, on every rank: True on all ranks at the same step once any rank
        has been asked to stop."""
        if self.accelerator.num_processes == 1:
            return self.requested
        now = time.perf_counter()
        if self._next_check is not None and step < self._next_check:
            return False
        last_step, last_time = self._last_check or (step - 1, now)
        per_step = (now - last_time) / max(step - last_step, 1)
        flag, slowest = self.accelerator.reduce(
            torch.tensor([float(self.requested), per_step], device=self.accelerator.device), reduction="max"
        ).tolist()
        self._last_check = step, now
        self._next_check = step + max(1, min(self.MAX_STEPS_BETWEEN, int(self.CHECK_SECONDS / max(slowest, 1e-9))))
        return flag > 0

    def stopping(self):
        """The checkpoint is saved and the process is on its way out: a further SIGTERM (the agent
        ending the other ranks) must not cut off the line that says how to resume."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            self._previous = None

    def failed(self):
        """The loop ends in an error. Under torch elastic's agent the first process ignores SIGTERM
        from here on: when another rank failed, this one learns it only as that rank exits and closes
        its sockets, and the agent's SIGTERM to the survivors follows within its monitor interval
        (0.1 s), often before this process has read the failure and printed the line that names the
        rank. The handler (a flag) covered the collective that failed; the default would end the
        process before that line. Any other process: SIGTERM does what it did before."""
        if self._previous is not None and first_local_process() and "TORCHELASTIC_RUN_ID" in os.environ:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            self._previous = None
        self.close()

    def close(self):
        """The end of the run: SIGTERM does what it did before."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
