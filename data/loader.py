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
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import select
import signal
import site
import sys
import sysconfig
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


# CPython gh-112275: a fork while another thread creates its thread state can hang the child forever
FORK_CAN_HANG = sys.version_info < (3, 12) and sys.version_info[2] < {(3, 8): 20, (3, 9): 20, (3, 10): 15,
                                                                      (3, 11): 10}.get(sys.version_info[:2], 99)


SERVER_MAIN = "DATA_WORKER_SERVER_MAIN"  # the script's path, for data/worker_server.py
_server = None  # the forkserver context, once its server is started


def loader_workers(num_workers, dataset, collate_fn=None):
    """DataLoader keyword arguments for `num_workers` worker processes: `num_workers`, how they start
    (`multiprocessing_context`) and `worker_init_fn`. Pass them as `DataLoader(dataset, ...,
    **loader_workers(n, dataset, collate_fn))`.

    The workers are not forked from the training process. Its gloo threads (NCCL's on GPUs) take the
    GIL from C++ whenever they free a finished collective, creating a Python thread state under the
    interpreter's lock of thread states; a fork at that instant leaves the child waiting forever for
    that lock on CPython before 3.12, 3.11.10 and 3.10.15 (gh-112275; docs/data.md), and Python warns
    against forking a threaded process on every version since. The workers start instead from
    multiprocessing's forkserver: one single-threaded server per training process, started at once
    here, which has imported torch and the script (data/worker_server.py) and forks each worker in
    milliseconds. What a worker needs (the dataset, the collate function) travels to it pickled,
    tensors through shared memory. Where that cannot work the workers are forked as before, with a
    warning on the Pythons that can hang, saying why and what would fix it: a script without
    `if __name__ == "__main__":` (every worker imports the script), something that does not pickle,
    tensors larger than the free shared memory."""
    if not num_workers:
        return {"num_workers": 0}
    return {"num_workers": num_workers, "multiprocessing_context": _start_method(dataset, collate_fn),
            "worker_init_fn": functools.partial(own_process_group, rank=os.getpid())}


def _start_method(*sent):
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return None  # Windows: spawn, the only method there
    problem = _main_problem() or _pickle_problem(sent)
    if not problem:
        return _worker_server()
    if FORK_CAN_HANG:
        warnings.warn(f"DataLoader workers are forked from the training process because {problem[0]}; on this "
                      f"Python such a fork can hang a worker forever (docs/data.md). Fix: {problem[1]}",
                      RuntimeWarning, stacklevel=3)
    return multiprocessing.get_context("fork")


def _main_problem():
    """Why the training script cannot be imported again by each worker, as forkserver needs, or None."""
    main = sys.modules["__main__"]
    path = getattr(main, "__file__", None)
    if path is None:
        return ("this process has no script file to start them from (an interactive session)",
                "run the training from a script")
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None  # a zipapp, a frozen or compiled main: multiprocessing imports it as it can
    for node in tree.body:
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and {ast.dump(node.test.left), ast.dump(node.test.comparators[0])}
                == {ast.dump(ast.Name("__name__", ast.Load())), ast.dump(ast.Constant("__main__"))}):
            return None
    return (f"{path} runs its code at import (it has no `if __name__ == \"__main__\":`), and every worker "
            "imports the script", "put the script's top-level code under `if __name__ == \"__main__\":`")


class _Discard:
    def write(self, data):  # bytes, or a PickleBuffer (protocol 5)
        pass


class _Probe(pickle.Pickler):
    """Pickles what the workers are sent, into nothing: tensors are counted, not written (they travel
    through shared memory, and the ones already there travel as a file descriptor)."""

    def __init__(self):
        super().__init__(_Discard(), protocol=pickle.HIGHEST_PROTOCOL)
        self.storages, self.new_bytes = set(), 0

    def persistent_id(self, obj):
        if not isinstance(obj, torch.Tensor):
            return None
        storage = obj.untyped_storage()
        if storage.data_ptr() not in self.storages:
            self.storages.add(storage.data_ptr())
            if storage.device.type == "cpu" and not storage.is_shared():
                self.new_bytes += storage.nbytes()
        return storage.data_ptr()


def _pickle_problem(sent):
    """Why `sent` cannot go to workers that are not forked, or None."""
    probe = _Probe()
    for obj in sent:
        try:
            probe.dump(obj)
        except Exception as e:  # noqa: BLE001  pickle raises many kinds (PicklingError, TypeError, AttributeError)
            return (f"{type(obj).__name__} cannot be pickled ({type(e).__name__}: {e})",
                    "keep the dataset's state picklable (module-level functions and classes, no open files "
                    "or lambdas)")
    try:
        free = os.statvfs("/dev/shm")
        free = free.f_bavail * free.f_frsize
    except OSError:
        return None
    if probe.new_bytes > free // 2:
        return (f"its tensors ({probe.new_bytes / 2 ** 20:,.0f} MiB) do not fit in the free shared memory "
                f"(/dev/shm: {free / 2 ** 20:,.0f} MiB)", "give the machine more shared memory "
                "(docker run --shm-size=...), or use 0 workers for data held in memory")
    return None


def _worker_server():
    """multiprocessing's forkserver context, its server started (once per process) with what
    data/worker_server.py imports. The server is a new interpreter: it finds the project's modules and
    the script only through its environment, which holds them just while it starts."""
    global _server
    if _server is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["data.worker_server"])
        env = {"PYTHONPATH": os.pathsep.join(_import_path() + [p for p in os.environ.get("PYTHONPATH", "").split(
            os.pathsep) if p])}
        main = getattr(sys.modules["__main__"], "__file__", None)
        if main:
            env[SERVER_MAIN] = os.path.normpath(os.path.abspath(main))  # as multiprocessing names it
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            multiprocessing.forkserver.ensure_running()  # starts it now; it imports while this process goes on
        finally:
            for name, value in saved.items():
                if value is None:
                    del os.environ[name]
                else:
                    os.environ[name] = value
        _server = context
    return _server


def _import_path():
    """The entries of sys.path that a new interpreter would not have: the script's folder, the
    project's root a script added, PYTHONPATH's; not the standard library or site-packages."""
    standard = [os.path.normpath(p) for p in {*(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib",
                                                                                  "platlib")),
                                              *site.getsitepackages(), site.getusersitepackages()}]
    return [p for p in dict.fromkeys(os.path.abspath(p or os.curdir) for p in sys.path)
            if os.path.isdir(p) and not any(p == s or p.startswith(s + os.sep) for s in standard)]


def own_process_group(worker_id=None, rank=None):
    """worker_init_fn for the DataLoaders here (loader_workers passes `rank`, the training process's
    pid): each worker in a process group of its own, deaf to a SIGTERM from anyone but its rank, and
    gone within a second of its rank.

    On a SIGTERM torch elastic's agent signals every rank's whole process group (os.killpg), and
    SLURM's `scancel --signal` every process of a job step: a worker that dies of it makes its rank
    fail ("DataLoader worker ... is killed by signal: Terminated") instead of saving the checkpoint
    the signal asks for (train/core/preemption.py). Its rank's own SIGTERM (multiprocessing ends
    workers with one when the rank exits, torch a stuck one) still ends it: ignoring that one too hung
    a rank exiting on an error (tests/test_image_classification.py). torch's workers end when their
    parent does, which for a worker from the worker server is the server, not the rank; the server
    in turn lives as long as a worker does, so a rank killed with SIGKILL would leave both behind."""
    rank = os.getppid() if rank is None else rank  # a forked worker's parent is its rank; a served one's is not
    os.setpgid(0, 0)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # taken by the thread below, with its sender
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the worker server ignores it (data/worker_server.py)
    try:
        rank_fd = os.pidfd_open(rank)  # readable once the rank has exited; immune to pid reuse
    except (AttributeError, OSError):  # Linux before 5.3
        rank_fd = None

    def rank_is_gone():
        if rank_fd is not None:
            return bool(select.select([rank_fd], [], [], 0)[0])
        try:
            os.kill(rank, 0)
        except ProcessLookupError:
            return True
        return False

    def follow_rank():
        while True:
            sender = signal.sigtimedwait({signal.SIGTERM}, 1.0)
            if sender is not None and sender.si_pid == rank:
                os._exit(128 + signal.SIGTERM)
            if rank_is_gone():
                os._exit(1)

    threading.Thread(target=follow_rank, name="follow-rank", daemon=True).start()


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
