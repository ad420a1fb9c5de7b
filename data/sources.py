"""Sources: what the batch plan (data/sharding.py) reads rows from. A source says how many rows each
of its read units holds (`unit_sizes`), reads rows by id (`read(ids)` -> dict of columns) and
fingerprints its data (`fingerprint()`, compared on resume and across ranks).

- TensorSource: in-memory tensors, units of `unit_size` rows.
- ParquetSource: parquet shards; a unit is a row group, counts come from the footers, and each rank
  reads only the row groups its batches touch.
- DatasetsSource: a Hugging Face `datasets.Dataset` (in memory or memory-mapped Arrow), read through
  Arrow, not datasets' own "torch" format.
- streaming_parquet_source: a streaming `datasets.IterableDataset` over local parquet files, read
  as a ParquetSource over the same files.
- as_source: any of these, or a `datasets` object, as a source.

table_to_tensors and table_to_columns turn Arrow tables into columns (tensors, or lists for
strings, bytes and ragged values).
"""

import hashlib
import json
import os

import numpy as np
import torch

from data.errors import PlanError
from data.shards import PREPARE_AGAIN, listed_rows


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
        sizes = []
        listed = listed_rows(self.paths)
        for p, path in enumerate(self.paths):
            try:
                meta = pq.ParquetFile(path).metadata
            except Exception as e:  # pyarrow: ArrowInvalid, OSError, ... for a cut or garbled file
                raise _unreadable(path, e) from None
            if path in listed and meta.num_rows != listed[path]:
                raise PlanError(
                    f"{path} holds {meta.num_rows} rows, not the {listed[path]} its manifest lists; {PREPARE_AGAIN}"
                )
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
            raise PlanError(
                f"the {len(self.paths)} parquet shard(s) hold no rows (first: {self.paths[0]}); "
                "pass shards with data, or check the filter that wrote them"
            )
        self._fingerprint = hashlib.blake2b(json.dumps(sizes).encode(), digest_size=16).hexdigest()
        self._files, self._cache = {}, (None, None)
        self.rows_read = self.bytes_read = 0

    def __getstate__(self):
        # open files and the last row group stay behind: DataLoader workers that are not forked get
        # this source pickled (data.workers.loader_workers), and a ParquetFile does not pickle
        return {**self.__dict__, "_files": {}, "_cache": (None, None)}

    def _unit_tensors(self, unit):
        """The decoded columns of one row group. The last one is kept: a unit cut by a batch
        boundary is read once, not twice."""
        if self._cache[0] == unit:
            return self._cache[1]
        import pyarrow.parquet as pq

        p, g = self._groups[unit]
        if p not in self._files:  # the footer parsed above is reused: no second read of it
            # no pre_buffer, no threads: one row group of a local file is read faster on the thread that
            # asks (pyarrow's defaults are made for remote files and wide tables; docs/speed.md has the figures)
            self._files[p] = pq.ParquetFile(self.paths[p], metadata=self._metadata[p], pre_buffer=False)
        f = self._files[p]
        try:
            table = f.read_row_group(g, columns=self.columns, use_threads=False)
        except Exception as e:  # a page garbled after the footer was read
            raise _unreadable(self.paths[p], e, g) from None
        meta = f.metadata.row_group(g)
        self.rows_read += table.num_rows
        self.bytes_read += sum(
            meta.column(c).total_compressed_size
            for c in range(meta.num_columns)
            if self.columns is None or meta.column(c).path_in_schema in self.columns
        )
        self._cache = (unit, self.decode(table))
        return self._cache[1]

    def read(self, ids):
        # Decoded row groups are indexed with torch: pyarrow's Table.take would import pandas in
        # every process, a large import for no gain here.
        ids = ids.numpy()
        units = np.searchsorted(self.unit_starts, ids, side="right") - 1
        if len(units) and units[0] == units[-1] and (units == units[0]).all():  # one row group (aligned shards)
            rows = torch.from_numpy(ids - self.unit_starts[units[0]])
            return {name: _take(c, rows) for name, c in self._unit_tensors(int(units[0])).items()}
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
    return PlanError(
        f"{path}{where} is not a readable parquet file ({first}); write it again (python -m data.prepare "
        "with --force) or leave it out"
    )


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
    for name, column in zip(table.column_names, table.columns, strict=True):
        column = one_array(column)
        kind = column.type
        if (
            pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)
        ) and column.null_count == 0:
            out[name] = table_to_tensors(table.select([name]))[name]
            continue
        if (
            (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind))
            and column.null_count == 0
            and (pa.types.is_integer(kind.value_type) or pa.types.is_floating(kind.value_type))
        ):
            lengths = np.asarray(column.value_lengths()) if len(column) else np.zeros(0)
            if len(lengths) and (lengths == lengths[0]).all() and column.flatten().null_count == 0:
                values = column.flatten().to_numpy(zero_copy_only=False)
                out[name] = torch.from_numpy(values.reshape(len(column), int(lengths[0])).copy())
                continue
        out[name] = column.to_pylist()
    return out


NUMPY_TYPES = {
    **{t: t for t in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")},
    "halffloat": "float16",
    "float": "float32",
    "double": "float64",
}


def one_array(column):
    """A ChunkedArray as one Array: its only chunk as it is (combine_chunks would copy it)."""
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


def table_to_tensors(table):
    """Default decoder: numeric columns as tensors; equal-length binary columns as uint8 [rows, bytes]."""
    return {name: torch.from_numpy(values.copy()) for name, values in table_to_arrays(table).items()}


def table_to_arrays(table):
    """table_to_tensors' columns as numpy arrays over Arrow's buffers, read-only and not copied: for a
    decoder that converts them anyway (data/text.py's windows)."""
    import pyarrow as pa

    out = {}
    for name, column in zip(table.column_names, table.columns, strict=True):
        column = one_array(column)
        if pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):
            _, offset_buffer, data_buffer = column.buffers()
            offset_type = np.int64 if pa.types.is_large_binary(column.type) else np.int32
            offsets = np.frombuffer(offset_buffer, offset_type)[column.offset : column.offset + len(column) + 1]
            widths = np.diff(offsets)
            if len(widths) and (widths != widths[0]).any():
                raise PlanError(f"column {name!r} has values of different lengths; decode it with a custom `decode`")
            data = (
                np.frombuffer(data_buffer, np.uint8)[offsets[0] : offsets[-1]] if len(widths) else np.zeros(0, np.uint8)
            )
            out[name] = data.reshape(len(column), -1)
        elif str(column.type) in NUMPY_TYPES and column.null_count == 0:
            # straight from the Arrow buffer: pyarrow's to_numpy() imports pandas in every process
            dtype = np.dtype(NUMPY_TYPES[str(column.type)])
            out[name] = np.frombuffer(column.buffers()[1], dtype)[column.offset : column.offset + len(column)]
        else:
            try:
                out[name] = column.to_numpy(zero_copy_only=False)
                if out[name].dtype.kind not in "biuf":  # strings, nested values: objects, not a tensor
                    raise TypeError
            except (TypeError, ValueError, RuntimeError):
                kind = f"{column.type}" + (f", {column.null_count} null(s)" if column.null_count else "")
                raise PlanError(
                    f"column {name!r} ({kind}) cannot become a tensor; read it with "
                    "ParquetSource(..., columns=[...]) without it, or pass a decode(table) function "
                    "that turns it into tensors (e.g. tokenize a string column)"
                ) from None
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
            files = [
                (os.path.basename(f["filename"]), os.path.getsize(f["filename"]))
                for f in self.dataset.cache_files
                if os.path.exists(f["filename"])
            ]
            ends = [repr(self.dataset.with_format(None)[i]) for i in {0, self.num_rows - 1} if self.num_rows]
            payload = json.dumps([self.num_rows, str(self.dataset.features), files, sorted(ends)])
            self._fingerprint = hashlib.blake2b(payload.encode(), digest_size=16).hexdigest()
        return self._fingerprint


def streaming_parquet_source(stream):
    """A streaming `datasets.IterableDataset` over local parquet files (`load_dataset("parquet",
    data_files=..., streaming=True)`) as a ParquetSource over the same files: row counts from the
    footers, each rank reads only its row groups, strings come as lists. Anything else is refused
    with what to pass instead: its row counts are unknown until read to the end."""
    hint = (
        "pass the parquet files as ParquetSource(paths), or load the dataset without streaming=True "
        "(memory-mapped Arrow, not held in memory) and apply map/filter there"
    )
    # datasets has no public accessor for the files behind a stream; read (never change) the list its
    # parquet loader keeps, which is there only while no map/filter/shuffle wraps the stream.
    examples = getattr(stream, "_ex_iterable", None)
    inputs = getattr(examples, "kwargs", None) or {}
    files = [str(f) for f in inputs.get("files") or []]
    if (
        type(examples).__name__ != "ArrowExamplesIterable"
        or not files
        or any(not (f.endswith(".parquet") and os.path.isfile(f)) for f in files)
        or any(groups is not None for groups in inputs.get("row_groups_list") or [])
    ):
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
    raise PlanError(
        f"{kind} is not a source: pass a datasets.Dataset, ParquetSource, TensorSource, or an object "
        "with unit_sizes, read(ids) and fingerprint()"
    )
