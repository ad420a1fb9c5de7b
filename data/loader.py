"""ShardedLoader: a DataLoader over a ShardedIterableDataset that accelerate treats as its own.

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

from concurrent.futures import ThreadPoolExecutor

import torch
from accelerate.data_loader import (
    BatchSamplerShard,
    DataLoaderDispatcher,
    DataLoaderShard,
    DataLoaderStateMixin,
    IterableDatasetShard,
)
from accelerate.state import GradientState
from accelerate.utils import gather_object, send_to_device
from torch.utils.data import DataLoader, DistributedSampler, default_convert

from data.errors import PlanError
from data.sharding import PREPARED_SHARDED, ShardedIterableDataset, check_same_plan
from data.workers import loader_workers


def pinned(device):
    """pin_memory for a DataLoader whose batches go to `device`: on a GPU, pinned batches are copied
    behind the steps queued before them (make_accelerator asks accelerate for non_blocking copies),
    while from pageable memory CUDA first waits for those steps (docs/gpu.md: the gain is not
    measured apart yet)."""
    return device is not None and torch.device(device).type == "cuda"


def sharded_loader(
    source,
    per_device_batch_size,
    *,
    rank,
    world_size,
    device,
    seed,
    train,
    num_workers=0,
    lengths=None,
    weights=None,
    accumulation_steps=1,
    gather=gather_object,
    last_batch_syncs=True,
):
    """This rank's batches of `source` (see data/sources.py): shuffled and `drop` for training, in
    order and `pad` (masked by `valid`) for evaluation; with `lengths` (one per row), grouped by
    length, by optimizer steps of `accumulation_steps` batches (data/sharding.py: group_by_length);
    with `weights` (one per row), each batch's `step_weight` is their sum over its optimizer step on
    every rank. `gather` is the one collective that checks every rank built the same plan
    (accelerate's gather_object). Never pass the result to accelerator.prepare, which would shard it
    a second time. `last_batch_syncs=False`: for batches that each hold whole optimizer steps (their
    micro-batches made by the script), the last batch does not make every micro-batch of it a step."""
    dataset = ShardedIterableDataset(
        source,
        per_device_batch_size * world_size,
        rank=rank,
        world_size=world_size,
        seed=seed,
        shuffle=train,
        policy="drop" if train else "pad",
        lengths=lengths,
        weights=weights,
        accumulation_steps=accumulation_steps,
    )
    check_same_plan(dataset.identity(), gather)
    return ShardedLoader(
        dataset, device, num_workers=num_workers, pin_memory=pinned(device), last_batch_syncs=last_batch_syncs
    )


class ShardedLoader(DataLoaderStateMixin):
    def __init__(self, dataset, device=None, num_workers=0, pin_memory=False, last_batch_syncs=True):
        self.dataset, self.device, self.last_batch_syncs = dataset, device, last_batch_syncs
        # a generator of its own: each pass's iterator draws a seed for its workers, and from torch's global
        # generator that draw would fall between a checkpoint and the next step only in a resumed run,
        # shifting every dropout mask after it (the plan itself draws nothing from torch)
        self.loader = DataLoader(
            dataset,
            batch_size=None,
            pin_memory=pin_memory,
            persistent_workers=False,
            generator=torch.Generator(),
            **loader_workers(num_workers, dataset),
        )
        self.gradient_state = GradientState()
        # begin() then leaves `remainder` at -1, so gather_for_metrics never trims: padded samples
        # are excluded through each batch's `valid` mask instead.
        self._drop_last = True
        self.next_batch = dataset.start_batch
        # read the next batch on a thread while the step runs: on a GPU (see __iter__)
        self.read_ahead = device is not None and torch.device(device).type == "cuda"

    def __len__(self):
        return len(self.dataset)

    def set_epoch(self, epoch):
        if epoch != self.dataset.epoch:  # the epoch a resume restored keeps its position
            self.dataset.set_epoch(epoch)
            self.next_batch = 0

    def __iter__(self):
        self.begin()
        # On a GPU the next batch is read on a thread while the step runs: parquet, numpy and torch
        # release the GIL, so the read hides behind the wait for the device (bench/host_overhead.py).
        # On a CPU it is read here, before the step: the cores are the training processes' already, and
        # a transform drawing from torch's global generator would race the step's draws (dropout), so
        # a rerun or a resume would differ. The plan's count flags the last batch.
        reader = ThreadPoolExecutor(1, thread_name_prefix="sharded_loader") if self.read_ahead else None
        try:
            start = self.next_batch = self.dataset.start_batch
            # with no reading workers and nothing to pin, the DataLoader would only pass the dataset's
            # batches through default_convert (numpy arrays to tensors), at ~40 µs a batch: do just that
            plain = self.loader.num_workers == 0 and not self.loader.pin_memory
            iterator = map(default_convert, self.dataset) if plain else iter(self.loader)
            total = len(self.dataset)

            def ahead():
                return reader.submit(next, iterator, None) if reader else next(iterator, None)

            following = ahead()
            for k in range(total):
                current = following.result() if reader else following
                if current is None:
                    break
                if k + 1 < total:
                    following = ahead()
                self.end_of_dataloader = self.last_batch_syncs and k + 1 == total
                self.next_batch = start + k + 1  # the batch being handed out counts as consumed
                yield send_to_device(current, self.device, non_blocking=True) if self.device is not None else current
            self.dataset.start_batch = 0  # a second pass over this epoch starts at its beginning
        finally:
            if reader:
                reader.shutdown(cancel_futures=True)
            self.end()

    def state_dict(self):
        return self.dataset.state_dict(self.next_batch)

    def load_state_dict(self, state):
        self.dataset.load_state_dict(state)
        self.next_batch = self.dataset.start_batch


def own_worker_seed(loader):
    """Give a map-style training DataLoader a generator of its own for its iterators' worker seed.
    Without one, each iterator draws that seed from torch's global generator, the one dropout draws
    from: a run resumed mid-epoch restores it at the checkpoint and then starts an iterator
    (accelerator.skip_first_batches keeps the loader's generator), one draw past the uninterrupted
    run. The shuffle has a generator of its own already, which accelerate seeds and synchronizes."""
    if isinstance(loader, DataLoader) and loader.generator is None:
        loader.generator = torch.Generator()


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
            raise PlanError(
                "a DataLoader with a DistributedSampler went through accelerator.prepare, which shards "
                f"it again: each of the {inner.num_replicas} processes would see 1/{inner.num_replicas} "
                "of its share; drop the DistributedSampler (prepare shards the data by itself) or do "
                "not prepare that loader"
            )
