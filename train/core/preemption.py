"""A run told to stop by its cluster loses nothing: SIGTERM (what SLURM sends ahead of a time limit
or a preemption, what Kubernetes and `kill` send) to the launcher, which passes it to every worker,
or to any one rank. Every rank stops at the same optimizer step, the run saves a checkpoint there,
and the first process prints the command that resumes it.

The ranks agree through one small reduce per optimizer step, read one step later: the reduce of
step N is looked at after step N+1's work was queued, so on a GPU no step waits for it, and every
rank reads the same sum at the same step. torch elastic's agent gives its workers 30 s after a
SIGTERM before it kills them: one step and one checkpoint must fit in that.
"""
import signal
import threading

import torch


class Preempted(Exception):
    """The run stopped on a SIGTERM once its checkpoint was saved: run() prints the message (one line,
    with the resume command) from the first process and exits 143, as a process ended by SIGTERM."""

    exit_code = 128 + signal.SIGTERM


class Preemption:
    def __init__(self, accelerator):
        self.accelerator, self.requested, self._pending = accelerator, False, None
        self._previous = None
        if threading.current_thread() is threading.main_thread():  # signal handlers live there only
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame):
        # nothing but a flag: the step in progress ends, then the agreed stop saves; a second
        # SIGTERM during that save changes nothing (checkpoints are published only once complete)
        self.requested = True

    def agreed(self):
        """At every optimizer step, on every rank: True on all ranks at the same step once any rank
        has been asked to stop."""
        if self.accelerator.num_processes == 1:
            return self.requested
        flag = torch.tensor([float(self.requested)], device=self.accelerator.device)
        previous, self._pending = self._pending, self.accelerator.reduce(flag, reduction="sum")
        return previous is not None and previous.item() > 0

    def close(self):
        """The end of the run: SIGTERM does what it did before."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
