"""How every DataLoader of the project starts its worker processes: loader_workers gives a DataLoader
its `num_workers`, `multiprocessing_context` and `worker_init_fn`. Rank and worker count are arguments
or come from multiprocessing itself; nothing here imports accelerate.

The workers start from multiprocessing's forkserver, whose server imports data/worker_server.py,
not by fork() of the training process: docs/data.md says why (CPython gh-112275) and what it costs.
"""

import ast
import functools
import inspect
import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.spawn
import os
import pickle
import signal
import sys
import tempfile
import threading
import warnings

import torch

# CPython gh-112275: a fork while another thread creates its thread state can hang the child forever.
# The first fixed release of each line; 3.12 and later have the fix.
FIXED_IN = {(3, 8): 20, (3, 9): 20, (3, 10): 15, (3, 11): 10}
FORK_CAN_HANG = sys.version_info < (3, 12) and sys.version_info[2] < FIXED_IN.get(sys.version_info[:2], 1 << 30)
MAX_PICKLED = 256 * 2**20  # bytes of state (besides tensors) copied to every worker at every epoch
MAX_STORAGES = 200  # forkserver passes at most 252 file descriptors to a new process, one per shared tensor
SERVER = "DATA_WORKER_SERVER"  # what the worker server is started with (data/worker_server.py reads it)
_server_started = False
_shared_memory_planned = 0  # bytes of tensors this process's loaders will move to /dev/shm


def loader_workers(num_workers, dataset, collate_fn=None, worker_init_fn=None):
    """DataLoader keyword arguments for `num_workers` worker processes: `num_workers`, how they start
    (`multiprocessing_context`) and `worker_init_fn` (own_process_group, then yours). Pass them as
    `DataLoader(dataset, ..., **loader_workers(n, dataset, collate_fn))`.

    The workers are not forked from the training process. Its gloo threads (NCCL's on GPUs) take the
    GIL from C++ whenever they free a finished collective, creating a Python thread state under the
    interpreter's lock of thread states; a fork at that instant leaves the child waiting forever for
    that lock on CPython before 3.12, 3.11.10 and 3.10.15 (gh-112275; docs/data.md). The workers start
    instead from multiprocessing's forkserver: a server process per training process, started here,
    which imports torch, the script and what the training process has imported by now
    (data/worker_server.py), and forks each worker in milliseconds. What a worker needs (the dataset,
    the collate function) travels to it pickled at every epoch, tensors through shared memory; like
    spawned workers, it sees the script as it was at import, not globals the training process
    changed later. Where that cannot work the workers are
    forked as before, with a warning on the Pythons that can hang, saying why and what would fix it."""
    if not num_workers:
        return {"num_workers": 0}
    if os.name != "posix":  # Windows: spawn, and none of own_process_group's signals
        return {"num_workers": num_workers, "worker_init_fn": worker_init_fn}
    init = functools.partial(own_process_group, then=worker_init_fn) if worker_init_fn else own_process_group
    return {
        "num_workers": num_workers,
        "multiprocessing_context": _start_method(dataset, collate_fn, init),
        "worker_init_fn": init,
    }


def _start_method(*sent):
    problem = _main_problem() or _flags_problem() or _pickle_problem(sent)
    if not problem:
        _start_server()  # now: it imports while this process builds its model
        return multiprocessing.get_context("forkserver")
    if FORK_CAN_HANG:
        warnings.warn(
            f"DataLoader workers are forked from the training process because {problem[0]}; on this "
            f"Python such a fork can hang a worker forever (docs/data.md). Fix: {problem[1]}",
            RuntimeWarning,
            stacklevel=3,
        )
    return multiprocessing.get_context("fork")


def _is_main_guard(node):
    """`if __name__ == "__main__":` (either way round)."""
    if not (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and len(node.test.ops) == 1
        and isinstance(node.test.ops[0], ast.Eq)
    ):
        return False
    sides = [node.test.left, node.test.comparators[0]]
    names = [side.id for side in sides if isinstance(side, ast.Name)]
    values = [side.value for side in sides if isinstance(side, ast.Constant)]
    return names == ["__name__"] and values == ["__main__"]


def _main_problem():
    """Why the worker server cannot import the training script, or None. It runs the script's code
    outside `if __name__ == "__main__":` once more, as each spawned worker would: the loader must be
    built under that guard, or the server would build it (and train) too."""
    main = sys.modules["__main__"]
    path = getattr(main, "__file__", None)
    # python -c, an interactive session, a notebook kernel: no file; `python - < script`: "<stdin>"
    if path is None or (path.startswith("<") and not os.path.exists(path)):
        return (
            "this process has no script file to start them from (standard input, python -c, an interactive "
            "session or a notebook)",
            "run the training from a script file",
        )
    try:
        with open(path, "rb") as f:  # bytes: ast reads the file's own coding declaration
            guards = [node for node in ast.parse(f.read()).body if _is_main_guard(node)]
    except (OSError, SyntaxError, ValueError):
        return None  # a zipapp, a frozen or compiled main: multiprocessing imports it as it can
    frame = inspect.currentframe()
    while frame is not None and not (frame.f_globals is vars(main) and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if guards and (frame is None or any(g.body[0].lineno <= frame.f_lineno <= g.end_lineno for g in guards)):
        return None
    guard = '`if __name__ == "__main__":`'
    where = f"has no {guard}" if not guards else f"builds the DataLoader outside {guard}"
    return (
        f"{path} {where}, and a worker server runs the script's other code once more",
        'put the script\'s training code under `if __name__ == "__main__":`',
    )


def _flags_problem():
    if sys.flags.ignore_environment or sys.flags.isolated:
        return (
            "Python runs with -E or -I, and the worker server would not find the project's modules",
            "run Python without -E and -I",
        )
    return None


class _Discard:
    """A file that keeps only the count of what was written to it."""

    def __init__(self):
        self.size = 0

    def write(self, data):  # bytes, or a PickleBuffer (protocol 5)
        self.size += memoryview(data).nbytes


class _Probe(pickle.Pickler):
    """Pickles what the workers are sent, into nothing: tensors are counted, not written (they travel
    through shared memory, each as a file descriptor), and multiprocessing's own locks, queues and
    shared values, which pickle only while a process starts, are taken as they are."""

    def __init__(self):
        self.file = _Discard()
        super().__init__(self.file, protocol=pickle.HIGHEST_PROTOCOL)
        self.storages, self.new_bytes = set(), 0

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor):
            if obj.layout == torch.strided and obj.device.type == "cpu":
                storage = obj.untyped_storage()
                if storage.data_ptr() not in self.storages:
                    self.storages.add(storage.data_ptr())
                    self.new_bytes += 0 if storage.is_shared() else storage.nbytes()
            return id(obj)
        if type(obj).__module__.startswith("multiprocessing."):
            return id(obj)
        return None


def _pickle_problem(sent):
    """Why `sent` cannot go to workers that are not forked, or None."""
    global _shared_memory_planned
    probe = _Probe()
    for obj in sent:
        try:
            probe.dump(obj)
        except Exception as e:  # noqa: BLE001  pickle raises many kinds (PicklingError, TypeError, AttributeError)
            return (
                f"{type(obj).__name__} cannot be pickled ({type(e).__name__}: {e})",
                "keep the dataset's state picklable (module-level functions and classes, no open files or lambdas)",
            )
    if probe.file.size > MAX_PICKLED:
        return (
            f"what the workers need pickles to {probe.file.size / 2**20:,.0f} MiB besides tensors, copied to "
            "each worker at every epoch",
            "hold large arrays as torch tensors (they travel through shared "
            "memory), and open big files (np.memmap) in the dataset's __getitem__ or __iter__",
        )
    if len(probe.storages) > MAX_STORAGES and torch.multiprocessing.get_sharing_strategy() == "file_descriptor":
        return (
            f"its {len(probe.storages)} tensors would each take a file descriptor to reach a worker, more "
            "than a worker's start can pass",
            "keep the data in a few large tensors (torch.stack), or call "
            'torch.multiprocessing.set_sharing_strategy("file_system")',
        )
    try:
        free = os.statvfs("/dev/shm")
    except OSError:
        return None
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # the other ranks of this machine do the same
    budget = free.f_bavail * free.f_frsize // 2 // max(1, local_processes)
    if _shared_memory_planned + probe.new_bytes > budget:
        return (
            f"its tensors ({probe.new_bytes / 2**20:,.0f} MiB, {local_processes} process(es) on this machine) "
            f"do not fit in the free shared memory (/dev/shm: {free.f_bavail * free.f_frsize / 2**20:,.0f} MiB)",
            "give the machine more shared memory (docker run --shm-size=...), or use 0 workers for data held in memory",
        )
    _shared_memory_planned += probe.new_bytes
    return None


def _start_server():
    """Start this process's worker server (once) to import data/worker_server.py. The server is a new
    interpreter: it finds that module, learns what multiprocessing tells every new process about this
    one (import path, argv, working folder, script), and which modules this one has imported, through
    its environment, which holds them just while the server starts."""
    global _server_started
    if _server_started:
        return
    _server_started = True
    # data/worker_server.py, imported as a top-level module: a folder named data in the working
    # folder, which comes first on the server's path, cannot hide it
    multiprocessing.get_context("forkserver").set_forkserver_preload(["worker_server"])
    keep = ("sys_path", "sys_argv", "dir", "orig_dir", "init_main_from_path", "init_main_from_name")
    start = {k: v for k, v in multiprocessing.spawn.get_preparation_data("worker-server").items() if k in keep}
    start["python_path"] = os.environ.get("PYTHONPATH")  # the server puts it back for its workers
    # the workers need most of what is imported by now (the data's modules, some imported on first
    # use: torchvision's transforms, PIL, pyarrow): imported by the server, not by each worker at
    # every epoch. Taken before the model is built and prepared, which import torch._dynamo.
    with tempfile.NamedTemporaryFile("w", prefix="worker-server-", suffix=".json", delete=False) as f:
        json.dump(sorted(sys.modules), f)
    start["modules"] = f.name
    here = os.path.dirname(os.path.abspath(__file__))
    env = {"PYTHONPATH": os.pathsep.join([here, *filter(None, [start["python_path"]])]), SERVER: json.dumps(start)}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)  # once per process: children started meanwhile would see it too
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def own_process_group(worker_id=None, then=None):
    """worker_init_fn for the DataLoaders here (then `then(worker_id)`): each worker in a process
    group of its own, deaf to a SIGTERM from anyone but its rank, and gone within a second of its
    rank.

    On a SIGTERM torch elastic's agent signals every rank's whole process group (os.killpg), and
    SLURM's `scancel --signal` every process of a job step: a worker that dies of it makes its rank
    fail ("DataLoader worker ... exited unexpectedly") instead of saving the checkpoint the signal
    asks for (train/core/preemption.py). Its rank's own SIGTERM (multiprocessing ends workers with one
    when the rank exits, torch a stuck one) still ends it: ignoring that one too hung a rank exiting
    on an error (tests/test_image_classification.py). torch's workers end when their parent does,
    which for a worker from the worker server is the server, not the rank; and the server lives while
    a worker does, so a rank killed with SIGKILL would leave both behind. Without sigtimedwait
    (macOS) a worker keeps SIGTERM's default: it cannot tell who sent one."""
    rank = multiprocessing.parent_process()  # the training process, however the worker started
    os.setpgid(0, 0)
    if hasattr(signal, "sigtimedwait"):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # taken by the thread below, with its sender
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the worker server ignores it (data/worker_server.py)
    if rank is not None:
        threading.Thread(target=_follow_rank, args=(rank,), name="follow-rank", daemon=True).start()
    if then is not None:
        then(worker_id)


def _follow_rank(rank):
    try:
        while True:
            if hasattr(signal, "sigtimedwait"):
                sender = signal.sigtimedwait({signal.SIGTERM}, 1.0)
                if sender is not None and sender.si_pid == rank.pid:
                    os._exit(128 + signal.SIGTERM)
            if multiprocessing.connection.wait([rank.sentinel], 0 if hasattr(signal, "sigtimedwait") else 1.0):
                os._exit(1)  # the rank's end of the pipe closed: it exited
    except BaseException:  # noqa: BLE001  a worker that cannot follow its rank must not outlive it either
        os._exit(1)
