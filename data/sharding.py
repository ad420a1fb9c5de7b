"""Exact, even, elastic-deterministic, resumable sharding of one dataset across ranks and workers.

One idea covers every case: a plan maps (seed, epoch, dataset size, global batch size) to a list of
global batches. Rank r of W takes slice r of every global batch; the rank's batches are dealt
round-robin to its K DataLoader workers, and the DataLoader hands them back in the same order.
Because nothing in the plan depends on W or K:

- every sample appears exactly once per epoch (`drop` leaves out only the declared tail; `pad`
  repeats samples from the start of the epoch, marked `valid=False`);
- every rank yields the same number of batches, so no rank waits in an all-reduce for another;
- the samples of global batch b are the same for any W and K, and a rank's order does not depend on K;
- the shuffle changes per epoch and is the same on every rank without communication;
- a position (epoch, next global batch) resumes exactly, also with a different W.

With `lengths` (one per sample: tokens, say) the epoch's order is grouped by length before it is
cut into global batches (group_by_length), so a batch padded to its longest row pads little. The
grouping depends on the same four things plus the lengths, so all of the above still holds.

Shuffling is two-level: whole read units (parquet row groups, or chunks of an in-memory tensor) are
shuffled, then rows inside each unit. When the unit size divides the per-rank batch, every unit
belongs to exactly one rank and one worker, so each rank reads only its 1/W of the rows. Units
shorter than the others (a shard's tail) go last so they do not shift every later unit off that
alignment.

Reading through accelerate's rank splitting (`accelerator.prepare` on a DataLoader over this
dataset) would shard it a second time, or hand rank 0's share to every rank. data/loader.py's
check_loader refuses such a loader before training (TrainingLoop calls it on the training loader).
For scripts that do not, `__iter__` (only when W > 1) refuses to be read through it, from public
state only: the DataLoader worker's `WorkerInfo.dataset` must be this dataset (not a wrapper such as
accelerate's IterableDatasetShard), and the loader accelerate's GradientState says is being iterated
(`active_dataloader`, which accelerate's prepared loaders register and a plain torch DataLoader never
does) must not be a torch DataLoader reading this dataset, directly or through one wrapper. Our
ShardedLoader registers there too, but is not a DataLoader. No class names or calling frames of
accelerate are looked at.
"""

import json
import math

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from data.errors import PlanError
from data.sources import as_source

POLICIES = ("drop", "pad")
PREPARED_SHARDED = (
    "a DataLoader over a ShardedIterableDataset went through accelerator.prepare, which splits it "
    "by rank a second time (or dispatches rank 0's share to every rank) and loses part of the data; "
    "wrap it in data.loader.ShardedLoader (or use data.loader.sharded_loader) instead and do not "
    "prepare it"
)


def epoch_order(unit_sizes, seed, epoch, shuffle=True):
    """Sample ids of one epoch, in plan order: shuffled full units, then the short ones."""
    starts = np.concatenate([[0], np.cumsum(unit_sizes)[:-1]]).astype(np.int64) if len(unit_sizes) else []
    if not shuffle:
        return np.arange(int(np.sum(unit_sizes)), dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    full = max(unit_sizes) if len(unit_sizes) else 0
    order = [u for u in rng.permutation(len(unit_sizes)) if unit_sizes[u] == full]
    order += [u for u in range(len(unit_sizes)) if unit_sizes[u] != full]
    # a unit of 0 rows must contribute nothing: its start is the next unit's first row, which would
    # come twice per epoch (docs/data.md); units of 1 row draw nothing from the generator
    pieces = [
        starts[u] + (rng.permutation(unit_sizes[u]) if unit_sizes[u] > 1 else np.zeros(unit_sizes[u], np.int64))
        for u in order
    ]
    return np.concatenate(pieces) if pieces else np.zeros(0, np.int64)


MEGABATCH = 50  # global batches sorted together: HF's LengthGroupedSampler's mega-batch of 50 batches


def group_by_length(order, lengths, global_batch_size, num_batches, seed, epoch, shuffle, accumulation_steps=1):
    """`order` regrouped so each global batch holds rows of similar length. Training (shuffle): the rows
    the epoch uses, taken MEGABATCH optimizer steps at a time in their shuffled order, sorted longest
    first, cut into steps of `accumulation_steps` global batches, and the steps shuffled (seeded by seed
    and epoch; a last, shorter step stays last, as does the dropped tail). A whole step's rows are then
    the same whether it is one global batch or several accumulated. Evaluation: every row sorted longest
    first, the least padding possible."""
    lengths = np.asarray(lengths)
    if not shuffle:
        return order[np.argsort(-lengths[order], kind="stable")]
    step = accumulation_steps * global_batch_size
    full = num_batches // accumulation_steps  # whole optimizer steps; a shorter last one is sorted on its own
    stepped, last, tail = np.split(order, [full * step, num_batches * global_batch_size])
    stepped = np.concatenate(
        [
            chunk[np.argsort(-lengths[chunk], kind="stable")]
            for chunk in np.split(stepped, range(MEGABATCH * step, len(stepped), MEGABATCH * step))
        ]
        or [stepped]
    )
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, 1])))
    stepped = stepped.reshape(full, step)[rng.permutation(full)].reshape(-1)
    return np.concatenate([stepped, last[np.argsort(-lengths[last], kind="stable")], tail])


class BatchPlan:
    """Which sample ids rank `rank` of `world_size` gets in each global batch of an epoch; with
    `lengths`, batches of similar lengths (group_by_length), grouped by optimizer steps of
    `accumulation_steps` global batches."""

    def __init__(
        self,
        unit_sizes,
        global_batch_size,
        world_size=1,
        rank=0,
        seed=0,
        shuffle=True,
        policy="drop",
        lengths=None,
        accumulation_steps=1,
    ):
        if global_batch_size < 1 or global_batch_size % world_size:
            raise PlanError(
                f"global batch size {global_batch_size} is not divisible by world size {world_size}; "
                f"use a multiple of {world_size}"
            )
        if not 0 <= rank < world_size:
            raise PlanError(f"rank {rank} is outside world size {world_size}")
        if policy not in POLICIES:
            raise PlanError(f"unknown policy {policy!r}; use one of {POLICIES}")
        self.unit_sizes = [int(u) for u in unit_sizes]
        self.num_samples = sum(self.unit_sizes)
        if policy == "drop" and 0 < self.num_samples < global_batch_size:
            raise PlanError(
                f"{self.num_samples} samples are fewer than one global batch of {global_batch_size} "
                "with policy 'drop' (nothing would be yielded); use policy 'pad' or a smaller batch"
            )
        self.global_batch_size, self.world_size, self.rank = global_batch_size, world_size, rank
        self.seed, self.shuffle, self.policy = seed, shuffle, policy
        self.per_rank_batch_size = global_batch_size // world_size
        if lengths is not None and len(lengths) != self.num_samples:
            raise PlanError(f"{len(lengths)} lengths for {self.num_samples} samples; pass one length per sample")
        self.lengths = None if lengths is None else np.asarray(lengths)
        self.accumulation_steps = accumulation_steps  # global batches per optimizer step: the unit of grouping

    def num_batches(self):
        """Global batches per epoch, the same on every rank."""
        if self.policy == "drop":
            return self.num_samples // self.global_batch_size
        return math.ceil(self.num_samples / self.global_batch_size)

    def epoch_rows(self, epoch):
        """Sample ids of the epoch in plan order: global batch i is positions [i*G, (i+1)*G)."""
        order = epoch_order(self.unit_sizes, self.seed, epoch, self.shuffle)
        if self.lengths is not None:
            order = group_by_length(
                order,
                self.lengths,
                self.global_batch_size,
                self.num_batches(),
                self.seed,
                epoch,
                self.shuffle,
                self.accumulation_steps,
            )
        return order

    def step_totals(self, epoch, weights):
        """Per global batch of the epoch: the sum of `weights` (an array, one per sample) over every row
        of the optimizer step it belongs to, all ranks together. A step is `accumulation_steps`
        consecutive global batches from the epoch's start (its last step may have fewer: accelerate
        steps at the end of the loader); pad's repeats count 0. Every rank computes it alone, no
        communication."""
        order, n, g = self.epoch_rows(epoch), self.num_samples, self.global_batch_size
        positions = np.arange(self.num_batches() * g)
        per_batch = np.where(positions < n, weights[order[positions % max(n, 1)]], 0).reshape(-1, g).sum(1)
        step_of = np.arange(len(per_batch)) // self.accumulation_steps
        totals = np.bincount(step_of, weights=per_batch)[step_of] if len(per_batch) else per_batch
        return totals.astype(np.int64) if np.issubdtype(weights.dtype, np.integer) else totals

    def rank_batches(self, epoch, start=0):
        """Yield (global_batch_index, sample_ids, valid) for this rank, from global batch `start` on."""
        order = self.epoch_rows(epoch)
        n, g, b = self.num_samples, self.global_batch_size, self.per_rank_batch_size
        for batch in range(start, self.num_batches()):
            positions = np.arange(batch * g + self.rank * b, batch * g + (self.rank + 1) * b)
            valid = positions < n
            # pad: positions past the end wrap to the start of this epoch's order, as DistributedSampler does
            yield batch, torch.from_numpy(order[positions % max(n, 1)]), torch.from_numpy(valid)

    def identity(self):
        """What every rank must agree on for the plans to fit together."""
        return {
            "num_samples": self.num_samples,
            "global_batch_size": self.global_batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "policy": self.policy,
            "world_size": self.world_size,
            "group_by_length": self.lengths is not None,
        }


class ShardedIterableDataset(IterableDataset):
    """Yields this rank's batches as dicts: the source's columns, `index` (sample ids) and `valid`;
    with `weights` (one per sample: the tokens a row scores, say) also `step_weight`, their sum over
    the whole optimizer step the batch is part of (BatchPlan.step_totals), known before its first
    backward pass: a loss summed over a batch's rows divided by it weighs every row's weight unit the
    same, whatever the process count and accumulation steps.

    `source`: a ParquetSource, TensorSource, DatasetsSource, a `datasets.Dataset` (wrapped in a
    DatasetsSource), or any object with `unit_sizes`, `read(ids)` and `fingerprint()`.
    Rank and world size are arguments; the DataLoader worker is read inside `__iter__`. Use it with
    `DataLoader(dataset, batch_size=None, num_workers=K)` (it batches by itself), or through
    `ShardedLoader`, which also tracks the position and plugs into accelerate.
    """

    def __init__(
        self,
        source,
        global_batch_size,
        rank=0,
        world_size=1,
        seed=0,
        shuffle=True,
        policy="drop",
        lengths=None,
        weights=None,
        accumulation_steps=1,
    ):
        self.source = source = as_source(source)
        self.plan = BatchPlan(
            source.unit_sizes, global_batch_size, world_size, rank, seed, shuffle, policy, lengths, accumulation_steps
        )
        if weights is not None and len(weights) != self.plan.num_samples:
            raise PlanError(f"{len(weights)} weights for {self.plan.num_samples} samples; pass one weight per sample")
        self.weights = None if weights is None else np.asarray(weights)
        self.epoch, self.start_batch = 0, 0

    def set_epoch(self, epoch, start_batch=0):
        self.epoch, self.start_batch = epoch, start_batch
        if hasattr(self.source, "set_epoch"):  # a source with random transforms seeded by epoch
            self.source.set_epoch(epoch)

    def __len__(self):
        return self.plan.num_batches() - self.start_batch

    def __iter__(self):
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if self.plan.world_size > 1:
            _refuse_resharding(self, info)
        totals = None if self.weights is None else self.plan.step_totals(self.epoch, self.weights)
        for batch_index, ids, valid in self.plan.rank_batches(self.epoch, self.start_batch):
            if (batch_index - self.start_batch) % num_workers != worker:
                continue  # whole batches per worker: the DataLoader returns them in plan order
            batch = self.source.read(ids)
            batch.update(index=ids, valid=valid)
            if totals is not None:
                # integer weights stay integers (exact, and every device has int64; MPS has no float64)
                batch["step_weight"] = torch.tensor(totals[batch_index].item())
            yield batch

    def identity(self):
        return {**self.plan.identity(), "fingerprint": self.source.fingerprint()}

    def state_dict(self, next_batch):
        """Position before global batch `next_batch` of the current epoch, valid for any world size."""
        epoch = self.epoch
        if next_batch >= self.plan.num_batches():  # epoch finished: resume at the start of the next
            epoch, next_batch = epoch + 1, 0
        identity = self.identity()
        identity.pop("world_size")
        return {"epoch": epoch, "next_batch": next_batch, **identity}

    def load_state_dict(self, state):
        mine = self.identity()
        for key in ("fingerprint", "num_samples", "global_batch_size", "seed", "shuffle", "policy", "group_by_length"):
            if state.get(key, False) != mine[key]:
                raise PlanError(
                    f"data state does not match this dataset: {key} is {state.get(key)!r} in the "
                    f"state but {mine[key]!r} here; resume with the same data and "
                    "--seed/batch settings, or start fresh"
                )
        self.set_epoch(state["epoch"], state["next_batch"])


def _refuse_resharding(dataset, worker_info):
    """Raise PlanError if `dataset` is being read through accelerate's rank splitting (the module
    docstring says how that is seen)."""
    if worker_info is not None and worker_info.dataset is not dataset:
        raise PlanError(PREPARED_SHARDED)
    from accelerate.state import GradientState

    reader = GradientState().active_dataloader
    if isinstance(reader, DataLoader):
        read = reader.dataset
        if read is dataset or getattr(read, "dataset", None) is dataset:  # directly, or IterableDatasetShard
            raise PlanError(PREPARED_SHARDED)


def check_same_plan(identity, gather_object):
    """Raise unless every rank built the same plan (same seed, data, batch size). `gather_object` is
    `accelerate.utils.gather_object`: one collective, once, before training."""
    identities = gather_object([identity])
    if any(other != identities[0] for other in identities):
        differing = sorted(k for k in identity if len({json.dumps(i.get(k)) for i in identities}) > 1)
        raise PlanError(
            f"ranks disagree on the data plan ({', '.join(differing)} differ across ranks); "
            "pass the same --seed and data to every process"
        )
