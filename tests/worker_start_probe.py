"""Run by tests/test_loader_workers.py: starts DataLoader workers through data.workers.loader_workers
for EPOCHS epochs, each epoch a new iterator (new workers), while a native thread keeps taking the
GIL from C the way gloo's threads do when they free a finished collective (a new thread state each
time). Prints one JSON line: the start method, this process's pid, and for every worker its pid,
parent, process group and whether it ignores SIGTERM, and the parent's.

    python tests/worker_start_probe.py EPOCHS [--unpicklable]    (or python -m tests.worker_start_probe ...)
    python tests/worker_start_probe.py --sigkill_midway     # prints the first worker's sample, then SIGKILLs itself
"""

import ctypes
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch.utils.data import DataLoader, Dataset

from data.workers import loader_workers

SIGTERM_BIT = 1 << 14  # SIGTERM (15) in /proc/PID/status's signal masks
BODY_RAN_IN = os.getpid()  # which process ran this module's code: a worker sees the server's, not its own


def ignores_sigterm(pid):
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return bool(int(fields["SigIgn"], 16) & SIGTERM_BIT)


class WhoAmI(Dataset):
    def __init__(self, size, unpicklable=False):
        self.size = size
        self.hook = (lambda: None) if unpicklable else None

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        pid, parent = os.getpid(), os.getppid()
        return {
            "pid": pid,
            "parent": parent,
            "group": os.getpgid(0),
            "ignores_sigterm": ignores_sigterm(pid),
            "parent_ignores_sigterm": ignores_sigterm(parent),
            "body_ran_in": BODY_RAN_IN,
            "argv": sys.argv[1:],
            "own_init_ran": os.environ.get("PROBE_INIT") == str(pid),
        }


def own_init(worker_id):
    os.environ["PROBE_INIT"] = str(os.getpid())


def take_the_gil_from_c(stop):
    """A new native thread per call of a ctypes callback: PyGILState_Ensure creates its thread state."""
    libc = ctypes.CDLL(None)
    callback = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(lambda arg: None)
    thread = ctypes.c_ulong()
    while not stop.is_set():
        libc.pthread_create(ctypes.byref(thread), None, callback, None)
        libc.pthread_join(thread, None)


def fork_until_a_child_hangs(seconds):
    forks, deadline = 0, time.time() + seconds
    while time.time() < deadline:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        forks, forked = forks + 1, time.time()
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.time() - forked > 5:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                return f"HUNG after {forks:,} forks (Python {sys.version.split()[0]})", 1
            time.sleep(0.001)
    return f"no child hung in {forks:,} forks (Python {sys.version.split()[0]})", 0


if __name__ == "__main__":
    if sys.argv[1] == "--raw_fork":
        stop = threading.Event()
        threading.Thread(target=take_the_gil_from_c, args=(stop,), daemon=True).start()
        verdict, code = fork_until_a_child_hangs(float(sys.argv[2]))
        stop.set()
        print(verdict)
        sys.exit(code)
    if sys.argv[1] == "--sigkill_midway":  # a rank killed with its iterator open: its workers must not outlive it
        dataset = WhoAmI(100)
        print(json.dumps(next(iter(DataLoader(dataset, batch_size=None, **loader_workers(1, dataset))))), flush=True)
        os.kill(os.getpid(), 9)
    epochs, unpicklable = int(sys.argv[1]), "--unpicklable" in sys.argv
    dataset = WhoAmI(2, unpicklable)
    kwargs = loader_workers(1, dataset, worker_init_fn=own_init)
    loader = DataLoader(dataset, batch_size=None, **kwargs)
    stop = threading.Event()
    threading.Thread(target=take_the_gil_from_c, args=(stop,), daemon=True).start()
    workers = [sample for _ in range(epochs) for sample in loader]
    stop.set()
    context = kwargs["multiprocessing_context"]
    print(
        json.dumps({"method": context.get_start_method() if context else None, "pid": os.getpid(), "workers": workers})
    )
