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

Shuffling is two-level: whole read units (parquet row groups, or chunks of an in-memory tensor) are
shuffled, then rows inside each unit. When the unit size divides the per-rank batch, every unit
belongs to exactly one rank and one worker, so each rank reads only its 1/W of the rows. Units
shorter than the others (a shard's tail) go last so they do not shift every later unit off that
alignment.
"""
import hashlib
import json
import math
import os
import sys

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from data.errors import UserError

POLICIES = ("drop", "pad")


class PlanError(UserError):
    """A plan or state that cannot be right; the message names the problem and the fix."""


PREPARED_SHARDED = ("a DataLoader over a ShardedIterableDataset went through accelerator.prepare, which splits it "
                    "by rank a second time (or dispatches rank 0's share to every rank) and loses part of the data; "
                    "wrap it in data.loader.ShardedLoader (or train.core.loop.sharded_loader) instead and do not prepare it")


def epoch_order(unit_sizes, seed, epoch, shuffle=True):
    """Sample ids of one epoch, in plan order: shuffled full units, then the short ones."""
    starts = np.concatenate([[0], np.cumsum(unit_sizes)[:-1]]).astype(np.int64) if len(unit_sizes) else []
    if not shuffle:
        return np.arange(int(np.sum(unit_sizes)), dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    full = max(unit_sizes) if len(unit_sizes) else 0
    order = [u for u in rng.permutation(len(unit_sizes)) if unit_sizes[u] == full]
    order += [u for u in range(len(unit_sizes)) if unit_sizes[u] != full]
    # a unit of 0 rows contributes nothing (it once contributed a phantom id: its start, which is the
    # next unit's first row, delivered twice per epoch); units of 1 row draw nothing from the generator
    pieces = [starts[u] + (rng.permutation(unit_sizes[u]) if unit_sizes[u] > 1 else np.zeros(unit_sizes[u], np.int64))
              for u in order]
    return np.concatenate(pieces) if pieces else np.zeros(0, np.int64)


class BatchPlan:
    """Which sample ids rank `rank` of `world_size` gets in each global batch of an epoch."""

    def __init__(self, unit_sizes, global_batch_size, world_size=1, rank=0, seed=0, shuffle=True, policy="drop"):
        if global_batch_size < 1 or global_batch_size % world_size:
            raise PlanError(f"global batch size {global_batch_size} is not divisible by world size {world_size}; "
                            f"use a multiple of {world_size}")
        if not 0 <= rank < world_size:
            raise PlanError(f"rank {rank} is outside world size {world_size}")
        if policy not in POLICIES:
            raise PlanError(f"unknown policy {policy!r}; use one of {POLICIES}")
        self.unit_sizes = [int(u) for u in unit_sizes]
        self.num_samples = sum(self.unit_sizes)
        if policy == "drop" and 0 < self.num_samples < global_batch_size:
            raise PlanError(f"{self.num_samples} samples are fewer than one global batch of {global_batch_size} "
                            "with policy 'drop' (nothing would be yielded); use policy 'pad' or a smaller batch")
        self.global_batch_size, self.world_size, self.rank = global_batch_size, world_size, rank
        self.seed, self.shuffle, self.policy = seed, shuffle, policy
        self.per_rank_batch_size = global_batch_size // world_size

    def num_batches(self):
        """Global batches per epoch, the same on every rank."""
        if self.policy == "drop":
            return self.num_samples // self.global_batch_size
        return math.ceil(self.num_samples / self.global_batch_size)

    def rank_batches(self, epoch, start=0):
        """Yield (global_batch_index, sample_ids, valid) for this rank, from global batch `start` on."""
        order = epoch_order(self.unit_sizes, self.seed, epoch, self.shuffle)
        n, g, b = self.num_samples, self.global_batch_size, self.per_rank_batch_size
        for batch in range(start, self.num_batches()):
            positions = np.arange(batch * g + self.rank * b, batch * g + (self.rank + 1) * b)
            valid = positions < n
            # pad: positions past the end wrap to the start of this epoch's order, as DistributedSampler does
            yield batch, torch.from_numpy(order[positions % max(n, 1)]), torch.from_numpy(valid)

    def identity(self):
        """What every rank must agree on for the plans to fit together."""
        return {"num_samples": self.num_samples, "global_batch_size": self.global_batch_size, "seed": self.seed,
                "shuffle": self.shuffle, "policy": self.policy, "world_size": self.world_size}


# ---------------------------------------------------------------------------------------- sources

class TensorSource:
    """Rows of in-memory tensors (all with the same first dimension), read by index."""

    def __init__(self, tensors, unit_size=1):
        lengths = {len(t) for t in tensors.values()}
        if len(lengths) != 1:
            raise PlanError(f"tensors have different lengths {sorted(lengths)}; give one row per sample in each")
        self.tensors, self.num_rows = tensors, lengths.pop()
        self.unit_sizes = [min(unit_size, self.num_rows - s) for s in range(0, self.num_rows, unit_size)]
        self.rows_read = 0
        self._fingerprint = None

    def read(self, ids):
        self.rows_read += len(ids)
        return {name: t[ids] for name, t in self.tensors.items()}

    def fingerprint(self):
        if self._fingerprint is None:
            h = hashlib.blake2b(digest_size=16)
            for name in sorted(self.tensors):
                t = self.tensors[name].contiguous()
                h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
                h.update(t.view(torch.uint8).reshape(-1).numpy().tobytes() if t.numel() else b"")
            self._fingerprint = h.hexdigest()
        return self._fingerprint


class ParquetSource:
    """Rows of parquet shards; the read unit is a row group. Only the row groups a rank's batches
    touch are read, and the counters say how much was (for tests and benchmarks)."""

    def __init__(self, paths, columns=None, decode=None, max_rows=None):
        import pyarrow.parquet as pq

        if not paths:
            raise PlanError("no parquet shards given; run `python -m data.prepare` to write them")
        self.paths, self.columns, self.decode = list(paths), columns, decode or table_to_tensors
        self._groups = []  # (path index, row group) per unit
        self.unit_sizes, self._metadata = [], []
        sizes, listed = [], _listed_rows(self.paths)
        for p, path in enumerate(self.paths):
            try:
                meta = pq.ParquetFile(path).metadata
            except Exception as e:  # pyarrow: ArrowInvalid, OSError, ... for a cut or garbled file
                raise _unreadable(path, e) from None
            if path in listed and meta.num_rows != listed[path]:
                raise PlanError(f"{path} holds {meta.num_rows} rows, not the {listed[path]} its manifest lists; "
                                f"{PREPARE_AGAIN}")
            self._metadata.append(meta)
            sizes.append((os.path.basename(path), meta.num_rows, os.path.getsize(path)))
            for g in range(meta.num_row_groups):
                self._groups.append((p, g))
                self.unit_sizes.append(meta.row_group(g).num_rows)
        if max_rows is not None:  # the first max_rows rows, like a map-style subset; the cut unit becomes short
            kept, total = [], 0
            for size in self.unit_sizes:
                if total >= max_rows:
                    break
                kept.append(min(size, max_rows - total))
                total += kept[-1]
            self.unit_sizes = kept
            sizes.append(("max_rows", max_rows))
        self.unit_starts = np.concatenate([[0], np.cumsum(self.unit_sizes)]).astype(np.int64)
        self.num_rows = int(self.unit_starts[-1])
        if self.num_rows == 0 and max_rows != 0:
            raise PlanError(f"the {len(self.paths)} parquet shard(s) hold no rows (first: {self.paths[0]}); "
                            "pass shards with data, or check the filter that wrote them")
        self._fingerprint = hashlib.blake2b(json.dumps(sizes).encode(), digest_size=16).hexdigest()
        self._files, self._cache = {}, (None, None)
        self.rows_read = self.bytes_read = 0

    def _unit_tensors(self, unit):
        """The decoded columns of one row group. The last one is kept: a unit cut by a batch
        boundary is read once, not twice."""
        if self._cache[0] == unit:
            return self._cache[1]
        import pyarrow.parquet as pq

        p, g = self._groups[unit]
        if p not in self._files:  # the footer parsed above is reused: no second read of it
            self._files[p] = pq.ParquetFile(self.paths[p], metadata=self._metadata[p])
        f = self._files[p]
        try:
            table = f.read_row_group(g, columns=self.columns)
        except Exception as e:  # a page garbled after the footer was read
            raise _unreadable(self.paths[p], e, g) from None
        meta = f.metadata.row_group(g)
        self.rows_read += table.num_rows
        self.bytes_read += sum(meta.column(c).total_compressed_size for c in range(meta.num_columns)
                               if self.columns is None or meta.column(c).path_in_schema in self.columns)
        self._cache = (unit, self.decode(table))
        return self._cache[1]

    def read(self, ids):
        # Decoded row groups are indexed with torch: pyarrow's Table.take would import pandas in
        # every process (~10 MB of libraries, 0.5 s) for no gain here.
        ids = ids.numpy()
        units = np.searchsorted(self.unit_starts, ids, side="right") - 1
        positions, parts = [], []
        for unit in np.unique(units):
            where = np.nonzero(units == unit)[0]
            rows = torch.from_numpy(ids[where] - self.unit_starts[unit])
            parts.append({name: _take(c, rows) for name, c in self._unit_tensors(int(unit)).items()})
            positions.append(where)
        if not parts:
            return {}
        inverse = torch.from_numpy(np.argsort(np.concatenate(positions), kind="stable"))  # back to plan order
        return {name: _take(_join([part[name] for part in parts]), inverse) for name in parts[0]}

    def fingerprint(self):
        return self._fingerprint


def _unreadable(path, error, row_group=None):
    where = f" (row group {row_group})" if row_group is not None else ""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:120]
    return PlanError(f"{path}{where} is not a readable parquet file ({first}); write it again (python -m data.prepare "
                     "with --force) or leave it out")


def _take(column, rows):
    return column[rows] if isinstance(column, torch.Tensor) else [column[i] for i in rows.tolist()]


def _join(columns):
    return torch.cat(columns) if isinstance(columns[0], torch.Tensor) else [v for c in columns for v in c]


def table_to_columns(table):
    """Numbers as tensors (also fixed-length lists of numbers, as [rows, length]); everything else
    (strings, bytes such as encoded images, ragged or nested values) as lists: for a decode step or a
    collate that tokenizes or decodes images."""
    import pyarrow as pa

    out = {}
    for name, column in zip(table.column_names, table.columns):
        column = column.combine_chunks()
        kind = column.type
        if (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)) and \
                column.null_count == 0:
            out[name] = table_to_tensors(table.select([name]))[name]
            continue
        if (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)) and \
                column.null_count == 0 and (pa.types.is_integer(kind.value_type) or pa.types.is_floating(kind.value_type)):
            lengths = np.asarray(column.value_lengths()) if len(column) else np.zeros(0)
            if len(lengths) and (lengths == lengths[0]).all() and column.flatten().null_count == 0:
                values = column.flatten().to_numpy(zero_copy_only=False)
                out[name] = torch.from_numpy(values.reshape(len(column), int(lengths[0])).copy())
                continue
        out[name] = column.to_pylist()
    return out


def table_to_tensors(table):
    """Default decoder: numeric columns as tensors; equal-length binary columns as uint8 [rows, bytes]."""
    import pyarrow as pa

    out = {}
    for name, column in zip(table.column_names, table.columns):
        column = column.combine_chunks()
        if pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):
            _, offset_buffer, data_buffer = column.buffers()
            offset_type = np.int64 if pa.types.is_large_binary(column.type) else np.int32
            offsets = np.frombuffer(offset_buffer, offset_type)[column.offset:column.offset + len(column) + 1]
            widths = np.diff(offsets)
            if len(widths) and (widths != widths[0]).any():
                raise PlanError(f"column {name!r} has values of different lengths; decode it with a custom `decode`")
            data = np.frombuffer(data_buffer, np.uint8)[offsets[0]:offsets[-1]] if len(widths) else np.zeros(0, np.uint8)
            out[name] = torch.from_numpy(data.reshape(len(column), -1).copy())
        elif str(column.type) in NUMPY_TYPES and column.null_count == 0:
            # straight from the Arrow buffer: pyarrow's to_numpy() imports pandas in every process
            dtype = np.dtype(NUMPY_TYPES[str(column.type)])
            values = np.frombuffer(column.buffers()[1], dtype)[column.offset:column.offset + len(column)]
            out[name] = torch.from_numpy(values.copy())
        else:
            try:
                out[name] = torch.from_numpy(column.to_numpy(zero_copy_only=False).copy())
            except (TypeError, ValueError, RuntimeError):
                kind = f"{column.type}" + (f", {column.null_count} null(s)" if column.null_count else "")
                raise PlanError(f"column {name!r} ({kind}) cannot become a tensor; read it with "
                                "ParquetSource(..., columns=[...]) without it, or pass a decode(table) function "
                                "that turns it into tensors (e.g. tokenize a string column)") from None
    return out


class DatasetsSource:
    """Rows of a Hugging Face `datasets.Dataset`, in memory or memory-mapped Arrow (`load_from_disk`,
    or `datasets.load_dataset("csv"|"json"|"parquet"|"text", data_files=...)` on local files). The row
    count is metadata; a read takes only the rows asked for, as Arrow, decoded by table_to_columns:
    numbers and fixed-length lists of numbers as tensors, strings and bytes as lists (datasets' own
    "torch" format strips trailing zero bytes from binary values, so it is not used);
    `transform(batch)` may turn them into tensors (tokenize, say). `unit_size` rows are read
    together (neighbours on disk); the default 1 shuffles row by row."""

    def __init__(self, dataset, columns=None, transform=None, unit_size=1):
        if columns is not None:
            dataset = dataset.select_columns(columns)
        self.dataset, self.transform = dataset.with_format("arrow"), transform
        self.num_rows = len(dataset)
        self.unit_sizes = [min(unit_size, self.num_rows - s) for s in range(0, self.num_rows, unit_size)]
        self.rows_read = 0
        self._fingerprint = None

    def read(self, ids):
        self.rows_read += len(ids)
        batch = table_to_columns(self.dataset[ids.tolist()])
        return self.transform(batch) if self.transform is not None else batch

    def fingerprint(self):
        """From metadata and two rows: the row count, the schema, the Arrow files behind it (names and
        sizes), the first and last row; the data itself is not read."""
        if self._fingerprint is None:
            files = [(os.path.basename(f["filename"]), os.path.getsize(f["filename"]))
                     for f in self.dataset.cache_files if os.path.exists(f["filename"])]
            ends = [repr(self.dataset.with_format(None)[i]) for i in {0, self.num_rows - 1} if self.num_rows]
            payload = json.dumps([self.num_rows, str(self.dataset.features), files, sorted(ends)])
            self._fingerprint = hashlib.blake2b(payload.encode(), digest_size=16).hexdigest()
        return self._fingerprint


def streaming_parquet_source(stream):
    """A streaming `datasets.IterableDataset` over local parquet files (`load_dataset("parquet",
    data_files=..., streaming=True)`) as a ParquetSource over the same files: row counts from the
    footers, each rank reads only its row groups, strings come as lists. Anything else is refused
    with what to pass instead: its row counts are unknown until read to the end."""
    hint = ("pass the parquet files as ParquetSource(paths), or load the dataset without streaming=True "
            "(memory-mapped Arrow, not held in memory) and apply map/filter there")
    # datasets has no public accessor for the files behind a stream; read (never change) the list its
    # parquet loader keeps, which is there only while no map/filter/shuffle wraps the stream.
    examples = getattr(stream, "_ex_iterable", None)
    inputs = getattr(examples, "kwargs", None) or {}
    files = [str(f) for f in inputs.get("files") or []]
    if type(examples).__name__ != "ArrowExamplesIterable" or not files or \
            any(not (f.endswith(".parquet") and os.path.isfile(f)) for f in files) or \
            any(groups is not None for groups in inputs.get("row_groups_list") or []):
        raise PlanError(f"this streaming datasets.IterableDataset is not plain local parquet files; {hint}")
    return ParquetSource(files, columns=list(stream.features) if stream.features else None, decode=table_to_columns)


def as_source(data):
    """`data` as a source of ShardedIterableDataset: our sources as they are, a `datasets.Dataset`
    through DatasetsSource; anything else is refused with what to pass instead."""
    if all(hasattr(data, a) for a in ("unit_sizes", "read", "fingerprint")):
        return data
    kind = f"{type(data).__module__}.{type(data).__name__}"
    if kind.startswith("datasets.") and type(data).__name__ == "Dataset":
        return DatasetsSource(data)
    if kind.startswith("datasets.") and "Iterable" in type(data).__name__:
        return streaming_parquet_source(data)
    raise PlanError(f"{kind} is not a source: pass a datasets.Dataset, ParquetSource, TensorSource, or an object "
                    "with unit_sizes, read(ids) and fingerprint()")


NUMPY_TYPES = {**{t: t for t in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")},
               "halffloat": "float16", "float": "float32", "double": "float64"}


# ---------------------------------------------------------------------------------------- dataset

class ShardedIterableDataset(IterableDataset):
    """Yields this rank's batches as dicts: the source's columns, `index` (sample ids) and `valid`.

    `source`: a ParquetSource, TensorSource, DatasetsSource, a `datasets.Dataset` (wrapped in a
    DatasetsSource), or any object with `unit_sizes`, `read(ids)` and `fingerprint()`.
    Rank and world size are arguments; the DataLoader worker is read inside `__iter__`. Use it with
    `DataLoader(dataset, batch_size=None, num_workers=K)` (it batches by itself), or through
    `ShardedLoader`, which also tracks the position and plugs into accelerate.
    """

    def __init__(self, source, global_batch_size, rank=0, world_size=1, seed=0, shuffle=True, policy="drop"):
        self.source = source = as_source(source)
        self.plan = BatchPlan(source.unit_sizes, global_batch_size, world_size, rank, seed, shuffle, policy)
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
        for batch_index, ids, valid in self.plan.rank_batches(self.epoch, self.start_batch):
            if (batch_index - self.start_batch) % num_workers != worker:
                continue  # whole batches per worker: the DataLoader returns them in plan order
            batch = self.source.read(ids)
            batch.update(index=ids, valid=valid)
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
        for key in ("fingerprint", "num_samples", "global_batch_size", "seed", "shuffle", "policy"):
            if state.get(key) != mine[key]:
                raise PlanError(f"data state does not match this dataset: {key} is {state.get(key)!r} in the "
                                f"state but {mine[key]!r} here; resume with the same data and "
                                "--seed/batch settings, or start fresh")
        self.set_epoch(state["epoch"], state["next_batch"])


def _refuse_resharding(dataset, worker_info):
    """The last line of defence for scripts that never call data.loader.check_loader: refuse to be
    read through accelerate's rank sharding. accelerate has no public way to mark an iterable as
    already sharded, so look at who is iterating: a wrapper dataset in a worker (public WorkerInfo),
    or one of accelerate's two rank-splitting iterators among the calling frames (read, never changed)."""
    if worker_info is not None and worker_info.dataset is not dataset:
        raise PlanError(PREPARED_SHARDED)
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            break
        caller = type(frame.f_locals.get("self")).__name__
        if caller in ("IterableDatasetShard", "DataLoaderDispatcher") and \
                frame.f_globals.get("__name__", "").startswith("accelerate."):
            raise PlanError(PREPARED_SHARDED)
        frame = frame.f_back


def check_same_plan(identity, gather_object):
    """Raise unless every rank built the same plan (same seed, data, batch size). `gather_object` is
    `accelerate.utils.gather_object`: one collective, once, before training."""
    identities = gather_object([identity])
    if any(other != identities[0] for other in identities):
        differing = sorted(k for k in identity if len({json.dumps(i.get(k)) for i in identities}) > 1)
        raise PlanError(f"ranks disagree on the data plan ({', '.join(differing)} differ across ranks); "
                        "pass the same --seed and data to every process")


MANIFEST = "manifest.json"
WRITTEN_BY = "python -m data.prepare"


def read_manifest(folder):
    """FOLDER/manifest.json, None where there is none; an unreadable one is one line naming it."""
    from data.mnist import DataError

    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is not a readable manifest ({type(e).__name__}: {' '.join(str(e).split())[:100]}); "
                        "prepare the folder again with python -m data.prepare, or move the file away") from None
    if not isinstance(manifest, dict):
        raise DataError(f"{path} is not a manifest (a JSON {type(manifest).__name__}, not an object); prepare the "
                        "folder again with python -m data.prepare, or move the file away")
    return manifest


def prepared_manifest(folder):
    """The manifest data.prepare wrote in `folder` (None: a folder of the user's own files)."""
    manifest = read_manifest(folder)
    return manifest if manifest is not None and manifest.get("written_by") == WRITTEN_BY else None


PREPARE_AGAIN = "prepare the folder again (python -m data.prepare with the same arguments and --force)"


def shards_in(folder, split):
    """The parquet shards of `split` in `folder`, sorted. Where data.prepare's manifest.json is there,
    they are the ones it lists, each still at its recorded size: a missing, cut or extra shard is one
    line naming it (no file is read: sizes are metadata; ParquetSource checks the row counts). A
    folder without one (a user's own parquet files) gives whatever matches `split-*.parquet`."""
    if not os.path.isdir(folder):
        return []
    found = sorted(f for f in os.listdir(folder) if f.startswith(split + "-") and f.endswith(".parquet"))
    manifest = prepared_manifest(folder)
    if manifest is None:
        return [os.path.join(folder, f) for f in found]
    from data.mnist import DataError

    listed = (manifest.get("splits") or {}).get(split, {}).get("shards", [])
    for shard in listed:
        path = os.path.join(folder, shard["file"])
        if not os.path.isfile(path):
            raise DataError(f"{path} is missing: {os.path.join(folder, MANIFEST)} lists it with {shard['rows']} "
                            f"rows; {PREPARE_AGAIN}")
        if "bytes" in shard and os.path.getsize(path) != shard["bytes"]:
            raise DataError(f"{path} has {os.path.getsize(path)} bytes, not the {shard['bytes']} data.prepare "
                            f"wrote: cut short or changed since; {PREPARE_AGAIN}")
    if extra := sorted(set(found) - {s["file"] for s in listed}):
        raise DataError(f"{os.path.join(folder, extra[0])} is not in {os.path.join(folder, MANIFEST)}, which "
                        f"lists the {split} shards data.prepare wrote; move it away or {PREPARE_AGAIN}")
    return [os.path.join(folder, s["file"]) for s in listed]


def _listed_rows(paths):
    """{path: rows} for the paths that sit in a prepared folder and are listed in its manifest."""
    from data.mnist import DataError

    rows = {}
    for folder in {os.path.dirname(p) for p in paths}:
        try:
            manifest = prepared_manifest(folder or ".")
        except DataError:  # files passed by path: an unreadable manifest beside them is shards_in's to refuse
            continue
        for entry in ((manifest or {}).get("splits") or {}).values():
            rows.update({os.path.join(folder, s["file"]): s["rows"] for s in entry.get("shards", [])})
    return rows


__all__ = ["BatchPlan", "DatasetsSource", "ParquetSource", "PlanError", "ShardedIterableDataset", "TensorSource",
           "as_source", "check_same_plan", "epoch_order", "read_manifest", "shards_in", "streaming_parquet_source",
           "table_to_columns", "table_to_tensors"]
