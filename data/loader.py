"""ShardedLoader: a DataLoader over a ShardedIterableDataset that accelerate treats as its own; and
loader_workers: how every DataLoader of the project starts its worker processes.

Why not `accelerator.prepare(loader)`: accelerate 1.15 has no way to say "already sharded". A
prepared loader over an IterableDataset is either dispatched from rank 0 (only rank 0's shard is
ever used) or wrapped in IterableDatasetShard (sharded a second time: half the data silently lost).
This wrapper does the three things prepare would have done for us, and nothing else:
- puts batches on the device;
- registers with accelerate's GradientState and flags the last batch, so `accelerator.accumulate`
  syncs and steps at the end of the loader even when the batch count is not a multiple of the
  accumulation steps;
- tracks the position (state_dict/load_state_dict): train/core/loop.py stores it in our checkpoints, and
  in a script that uses accelerate's save_state, `accelerator.register_for_checkpointing` carries it.
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
from accelerate.data_loader import (BatchSamplerShard, DataLoaderDispatcher, DataLoaderShard, DataLoaderStateMixin,
                                    IterableDatasetShard)
from accelerate.state import GradientState
from accelerate.utils import gather_object, send_to_device
from torch.utils.data import DataLoader, DistributedSampler

from data.errors import PlanError
from data.sharding import PREPARED_SHARDED, ShardedIterableDataset, check_same_plan


# CPython gh-112275: a fork while another thread creates its thread state can hang the child forever.
# The first fixed release of each line; 3.12 and later have the fix.
FIXED_IN = {(3, 8): 20, (3, 9): 20, (3, 10): 15, (3, 11): 10}
FORK_CAN_HANG = sys.version_info < (3, 12) and sys.version_info[2] < FIXED_IN.get(sys.version_info[:2], 1 << 30)
MAX_PICKLED = 256 * 2 ** 20  # bytes of state (besides tensors) copied to every worker at every epoch
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
    return {"num_workers": num_workers, "multiprocessing_context": _start_method(dataset, collate_fn, init),
            "worker_init_fn": init}


def _start_method(*sent):
    problem = _main_problem() or _flags_problem() or _pickle_problem(sent)
    if not problem:
        _start_server()  # now: it imports while this process builds its model
        return multiprocessing.get_context("forkserver")
    if FORK_CAN_HANG:
        warnings.warn(f"DataLoader workers are forked from the training process because {problem[0]}; on this "
                      f"Python such a fork can hang a worker forever (docs/data.md). Fix: {problem[1]}",
                      RuntimeWarning, stacklevel=3)
    return multiprocessing.get_context("fork")


def _is_main_guard(node):
    """`if __name__ == "__main__":` (either way round)."""
    if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1
            and isinstance(node.test.ops[0], ast.Eq)):
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
    if path is None:
        return ("this process has no script file to start them from (an interactive session)",
                "run the training from a script")
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
    guard = "`if __name__ == \"__main__\":`"
    where = f"has no {guard}" if not guards else f"builds the DataLoader outside {guard}"
    return (f"{path} {where}, and a worker server runs the script's other code once more",
            "put the script's training code under `if __name__ == \"__main__\":`")


def _flags_problem():
    if sys.flags.ignore_environment or sys.flags.isolated:
        return ("Python runs with -E or -I, and the worker server would not find the project's modules",
                "run Python without -E and -I")
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
            return (f"{type(obj).__name__} cannot be pickled ({type(e).__name__}: {e})",
                    "keep the dataset's state picklable (module-level functions and classes, no open files "
                    "or lambdas)")
    if probe.file.size > MAX_PICKLED:
        return (f"what the workers need pickles to {probe.file.size / 2 ** 20:,.0f} MiB besides tensors, copied to "
                "each worker at every epoch", "hold large arrays as torch tensors (they travel through shared "
                "memory), and open big files (np.memmap) in the dataset's __getitem__ or __iter__")
    if len(probe.storages) > MAX_STORAGES and torch.multiprocessing.get_sharing_strategy() == "file_descriptor":
        return (f"its {len(probe.storages)} tensors would each take a file descriptor to reach a worker, more "
                "than a worker's start can pass", "keep the data in a few large tensors (torch.stack), or call "
                "torch.multiprocessing.set_sharing_strategy(\"file_system\")")
    try:
        free = os.statvfs("/dev/shm")
    except OSError:
        return None
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # the other ranks of this machine do the same
    budget = free.f_bavail * free.f_frsize // 2 // max(1, local_processes)
    if _shared_memory_planned + probe.new_bytes > budget:
        return (f"its tensors ({probe.new_bytes / 2 ** 20:,.0f} MiB, {local_processes} process(es) on this machine) "
                f"do not fit in the free shared memory (/dev/shm: {free.f_bavail * free.f_frsize / 2 ** 20:,.0f} MiB)",
                "give the machine more shared memory (docker run --shm-size=...), or use 0 workers for data held "
                "in memory")
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


def pinned(device):
    """pin_memory for a DataLoader whose batches go to `device`: on a GPU, pinned batches are copied
    behind the steps queued before them (make_accelerator asks accelerate for non_blocking copies),
    while from pageable memory CUDA first waits for those steps (docs/gpu.md: the gain is not
    measured apart yet)."""
    return device is not None and torch.device(device).type == "cuda"


def sharded_loader(source, per_device_batch_size, *, rank, world_size, device, seed, train, num_workers=0,
                   gather=gather_object):
    """This rank's batches of `source` (see data/sources.py): shuffled and `drop` for training, in
    order and `pad` (masked by `valid`) for evaluation. `gather` is the one collective that checks
    every rank built the same plan (accelerate's gather_object). Never pass the result to
    accelerator.prepare, which would shard it a second time."""
    dataset = ShardedIterableDataset(source, per_device_batch_size * world_size, rank=rank, world_size=world_size,
                                     seed=seed, shuffle=train, policy="drop" if train else "pad")
    check_same_plan(dataset.identity(), gather)
    return ShardedLoader(dataset, device, num_workers=num_workers, pin_memory=pinned(device))


class ShardedLoader(DataLoaderStateMixin):
    def __init__(self, dataset, device=None, num_workers=0, pin_memory=False):
        self.dataset, self.device = dataset, device
        self.loader = DataLoader(dataset, batch_size=None, pin_memory=pin_memory, persistent_workers=False,
                                 **loader_workers(num_workers, dataset))
        self.gradient_state = GradientState()
        # begin() then leaves `remainder` at -1, so gather_for_metrics never trims: padded samples
        # are excluded through each batch's `valid` mask instead.
        self._drop_last = True
        self.next_batch = dataset.start_batch

    def __len__(self):
        return len(self.dataset)

    def set_epoch(self, epoch):
        if epoch != self.dataset.epoch:  # the epoch a resume restored keeps its position
            self.dataset.set_epoch(epoch)
            self.next_batch = 0

    def __iter__(self):
        self.begin()
        try:
            start = self.next_batch = self.dataset.start_batch
            iterator = iter(self.loader)
            current = next(iterator, None)
            k = 0
            while current is not None:
                following = next(iterator, None)  # look ahead one batch to flag the last one
                self.end_of_dataloader = following is None
                self.next_batch = start + k + 1  # the batch being handed out counts as consumed
                yield send_to_device(current, self.device, non_blocking=True) if self.device is not None else current
                current, k = following, k + 1
            self.dataset.start_batch = 0  # a second pass over this epoch starts at its beginning
        finally:
            self.end()

    def state_dict(self):
        return self.dataset.state_dict(self.next_batch)

    def load_state_dict(self, state):
        self.dataset.load_state_dict(state)
        self.next_batch = self.dataset.start_batch


def check_loader(loader):
    """Raise PlanError if `loader` is what `accelerator.prepare` made of data that was already split
    by rank, which loses (W-1)/W of it without an error: a DataLoader over a ShardedIterableDataset
    (dispatched from rank 0's shard, or sharded again), or a DataLoader with a DistributedSampler
    (sharded again by BatchSamplerShard). Only public attributes of the prepared loader are read."""
    if not isinstance(loader, (DataLoaderShard, DataLoaderDispatcher)):
        return  # not prepared (a ShardedLoader, a plain DataLoader): nothing was sharded twice
    dataset = loader.dataset.dataset if isinstance(loader.dataset, IterableDatasetShard) else loader.dataset
    if isinstance(dataset, ShardedIterableDataset) and dataset.plan.world_size > 1:
        raise PlanError(PREPARED_SHARDED)
    if isinstance(loader.batch_sampler, BatchSamplerShard):
        inner = loader.batch_sampler.batch_sampler
        inner = getattr(inner, "sampler", inner)  # BatchSampler(DistributedSampler) or the sampler itself
        if isinstance(inner, DistributedSampler) and inner.num_replicas > 1:
            raise PlanError("a DataLoader with a DistributedSampler went through accelerator.prepare, which shards "
                            f"it again: each of the {inner.num_replicas} processes would see 1/{inner.num_replicas} "
                            "of its share; drop the DistributedSampler (prepare shards the data by itself) or do "
                            "not prepare that loader")
