"""The on-disk shard format: parquet shards named by one rule, and the manifest.json that
data.prepare writes beside them and training checks them against.

A split is NUM_SHARDS files `{split}-{i:05d}-of-{n:05d}.parquet` (shard_name) of whole row groups,
the sharded loader's read unit; a folder of a user's own parquet files is read by the looser rule
`{split}-*.parquet` (is_shard_of). `manifest.json` lists the inputs (with a content hash), the
arguments, every file written (bytes, and a sha256 taken while writing: no second read) and every
shard's rows and columns, and a fingerprint of inputs and arguments. Training checks a prepared
folder against it without hashing (shards_in: sizes; ParquetSource: row counts from the footers).
Writing a whole set safely (temporary folder, lock, what may be replaced): data/atomic_folder.py.
"""

import hashlib
import io
import json
import math
import os

import numpy as np

from data.errors import DataError
from data.locks import LOCK_NAME

MANIFEST = "manifest.json"
WRITTEN_BY = "python -m data.prepare"
PREPARE_AGAIN = "prepare the folder again (python -m data.prepare with the same arguments and --force)"


# ---------------------------------------------------------------------------------------- names


def shard_name(split, index, num_shards):
    """The one name data.prepare gives shard `index` of `num_shards` of `split`."""
    return f"{split}-{index:05d}-of-{num_shards:05d}.parquet"


def is_shard_of(name, split):
    """Whether file `name` is read as a shard of `split`: ours, or a user's own `{split}-*.parquet`."""
    return name.startswith(split + "-") and name.endswith(".parquet")


def split_of(name):
    """The split a shard file belongs to (the part of its name before the first '-')."""
    return name.split("-")[0]


# ---------------------------------------------------------------------------------------- writing


def shard_ranges(num_rows, num_shards, rows_per_group):
    """(lo, hi) rows of each shard: whole row groups dealt contiguously, so only the very last row
    group of the split can be short (a shard may be empty when there are fewer groups than shards)."""
    group_starts = np.arange(0, num_rows, rows_per_group)
    for starts in np.array_split(group_starts, num_shards):
        if len(starts):
            yield int(starts[0]), int(min(starts[-1] + rows_per_group, num_rows))
        else:
            yield num_rows, num_rows


def write_shards(columns, folder, split, num_shards, rows_per_group=32):
    """Write dict-of-tensors `columns` as `num_shards` parquet files of whole row groups; return paths."""
    import pyarrow as pa

    num_rows = len(next(iter(columns.values())))
    paths = []
    os.makedirs(folder, exist_ok=True)
    for i, (lo, hi) in enumerate(shard_ranges(num_rows, num_shards, rows_per_group)):
        table = pa.table({name: to_arrow(t[lo:hi]) for name, t in columns.items()})
        paths.append(os.path.join(folder, shard_name(split, i, num_shards)))
        # Statistics and dictionaries of 784-byte images are dead weight: they grew the footers to a
        # visible part of the data, read again by every process that opens a shard.
        write_parquet(
            table,
            paths[-1],
            row_group_size=rows_per_group,
            compression="none",
            use_dictionary=False,
            write_statistics=False,
            write_page_index=False,
        )
    return paths


def write_table_shards(table, folder, split, num_shards, rows_per_group):
    """Write an Arrow table (or anything with num_rows and slice(lo, n)) as parquet shards; return paths."""
    paths = []
    for i, (lo, hi) in enumerate(shard_ranges(table.num_rows, num_shards, rows_per_group)):
        paths.append(os.path.join(folder, shard_name(split, i, num_shards)))
        write_parquet(table.slice(lo, hi - lo), paths[-1], row_group_size=rows_per_group)
    return paths


WRITTEN = {}  # absolute path -> {"bytes", "sha256"} of each file written through HashingFile in this process


class HashingFile(io.RawIOBase):
    """A new file that hashes what is written to it: the manifest's sha256 without reading it back."""

    def __init__(self, path):
        super().__init__()
        self.path = path
        self._file = open(path, "wb")
        self._hash = hashlib.sha256()
        self.bytes = 0

    def writable(self):
        return True

    def write(self, data):
        written = self._file.write(data)
        self._hash.update(memoryview(data)[:written])
        self.bytes += written
        return written

    def close(self):
        if not self.closed:
            self._file.flush()
            os.fsync(self._file.fileno())  # on disk before the manifest that vouches for it
            self._file.close()
            WRITTEN[os.path.abspath(self.path)] = {"bytes": self.bytes, "sha256": self._hash.hexdigest()}
        super().close()


def write_parquet(table, path, **options):
    import pyarrow.parquet as pq

    with HashingFile(path) as f:
        pq.write_table(table, f, **options)


def to_arrow(tensor):
    import pyarrow as pa

    if tensor.ndim == 1:
        return pa.array(tensor.numpy())
    # one fixed-size bytes value per row; the width from the shape, since a 0-row tensor cannot infer it
    flat = tensor.reshape(len(tensor), math.prod(tensor.shape[1:])).contiguous().numpy()
    width = flat.shape[1] * flat.itemsize
    offsets = pa.array(np.arange(0, (len(flat) + 1) * width, width, dtype=np.int32))
    return pa.BinaryArray.from_buffers(
        pa.binary(), len(flat), [None, offsets.buffers()[1], pa.py_buffer(flat.tobytes())]
    )


# ---------------------------------------------------------------------------------------- manifest


def hash_files(paths):
    """Content hash per input file (the files are read once; they are about to be read anyway)."""
    out = []
    for path in paths:
        h = hashlib.blake2b(digest_size=16)
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        out.append({"path": os.path.abspath(path), "bytes": os.path.getsize(path), "blake2b": h.hexdigest()})
    return out


def fingerprint(inputs, arguments):
    """Of the inputs' contents (not where they sit: a moved file is the same data) and the arguments."""
    contents = [{k: v for k, v in entry.items() if k != "path"} for entry in inputs]
    return hashlib.blake2b(json.dumps([contents, arguments], sort_keys=True).encode(), digest_size=16).hexdigest()


def write_manifest(folder, inputs, arguments, extra=None):
    """manifest.json: what was read, with which arguments, every file written (bytes, sha256) and
    what every shard holds. Written last: a folder with it is a complete set."""
    import pyarrow.parquet as pq

    files = file_entries(folder)
    splits = {}
    for name in sorted(f for f in files if f.endswith(".parquet")):
        meta = pq.ParquetFile(os.path.join(folder, name)).metadata
        entry = splits.setdefault(split_of(name), {"rows": 0, "shards": []})
        entry["rows"] += meta.num_rows
        entry["shards"].append({"file": name, "rows": meta.num_rows, **files[name]})
        entry["columns"] = {f.name: str(f.type) for f in meta.schema.to_arrow_schema()}
    manifest = {
        "written_by": WRITTEN_BY,
        "fingerprint": fingerprint(inputs, arguments),
        "inputs": inputs,
        "arguments": arguments,
        "splits": splits,
        **(extra or {}),
        "files": files,
    }
    save_manifest(folder, manifest)
    return manifest


def save_manifest(folder, manifest, indent=1):
    with HashingFile(os.path.join(folder, MANIFEST)) as f:
        f.write(json.dumps(manifest, indent=indent).encode())


def file_entries(folder, hashed=True):
    """{relative path: {"bytes", "sha256"}} of everything in folder; hashes from the writes themselves
    (HashingFile), else read once (tokenizer.json, saved by its library); hashed=False: sizes only."""
    out = {}
    for rel in folder_contents(folder):
        path = os.path.join(folder, rel)
        known = WRITTEN.get(os.path.abspath(path))
        if not hashed:
            out[rel] = {"bytes": os.path.getsize(path)}
        elif known and known["bytes"] == os.path.getsize(path):
            out[rel] = dict(known)
        else:
            out[rel] = {"bytes": os.path.getsize(path), "sha256": sha256_of(path)}
    return out


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def folder_contents(folder):
    """Everything under folder, as relative paths (files, links, empty folders), but its manifest and
    lock file."""
    out = []
    for root, dirs, files in os.walk(folder):
        rel = os.path.relpath(root, folder)
        links = [d for d in dirs if os.path.islink(os.path.join(root, d))]  # not walked into: listed as they are
        out += [os.path.normpath(os.path.join(rel, f)) for f in files + links]
        if not dirs and not files and root != folder:
            out.append(rel + "/")
    return sorted(f for f in out if f not in (MANIFEST, LOCK_NAME))


def read_manifest(folder):
    """FOLDER/manifest.json, None where there is none; an unreadable one is one line naming it."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(
            f"{path} is not a readable manifest ({type(e).__name__}: {' '.join(str(e).split())[:100]}); "
            "prepare the folder again with python -m data.prepare, or move the file away"
        ) from None
    if not isinstance(manifest, dict):
        raise DataError(
            f"{path} is not a manifest (a JSON {type(manifest).__name__}, not an object); prepare the "
            "folder again with python -m data.prepare, or move the file away"
        )
    return manifest


def prepared_manifest(folder):
    """The manifest data.prepare wrote in `folder` (None: a folder of the user's own files)."""
    manifest = read_manifest(folder)
    return manifest if manifest is not None and manifest.get("written_by") == WRITTEN_BY else None


def listed_files(manifest):
    """{relative path: {"bytes", "sha256"}, either may be absent} of what a manifest says data.prepare
    wrote; manifests without "files" list their shards and tokenizer.json."""
    if "files" in manifest:
        return manifest["files"]
    files = {s["file"]: s for split in manifest.get("splits", {}).values() for s in split["shards"]}
    if manifest.get("tokenizer", "bytes") != "bytes":
        files["tokenizer.json"] = {}
    return files


def check_files_written(folder, manifest):
    """(missing, changed): the files the manifest lists that are gone, and those whose size or
    sha256 differs from what was written."""
    missing, changed = [], []
    for rel, entry in sorted(listed_files(manifest).items()):
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            missing.append(rel)
        elif os.path.getsize(path) != entry.get("bytes", os.path.getsize(path)):
            changed.append((rel, f"{os.path.getsize(path)} bytes, not the {entry['bytes']} written"))
        elif "sha256" in entry and sha256_of(path) != entry["sha256"]:
            changed.append((rel, "same size, other content (sha256)"))
    return missing, changed


# ---------------------------------------------------------------------------------------- reading


def shards_in(folder, split):
    """The parquet shards of `split` in `folder`, sorted. Where data.prepare's manifest.json is there,
    they are the ones it lists, each still at its recorded size: a missing, cut or extra shard is one
    line naming it (no file is read: sizes are metadata; ParquetSource checks the row counts). A
    folder without one (a user's own parquet files) gives whatever matches `split-*.parquet`."""
    if not os.path.isdir(folder):
        return []
    found = sorted(f for f in os.listdir(folder) if is_shard_of(f, split))
    manifest = prepared_manifest(folder)
    if manifest is None:
        return [os.path.join(folder, f) for f in found]
    listed = (manifest.get("splits") or {}).get(split, {}).get("shards", [])
    for shard in listed:
        path = os.path.join(folder, shard["file"])
        if not os.path.isfile(path):
            raise DataError(
                f"{path} is missing: {os.path.join(folder, MANIFEST)} lists it with {shard['rows']} "
                f"rows; {PREPARE_AGAIN}"
            )
        if "bytes" in shard and os.path.getsize(path) != shard["bytes"]:
            raise DataError(
                f"{path} has {os.path.getsize(path)} bytes, not the {shard['bytes']} data.prepare "
                f"wrote: cut short or changed since; {PREPARE_AGAIN}"
            )
    if extra := sorted(set(found) - {s["file"] for s in listed}):
        raise DataError(
            f"{os.path.join(folder, extra[0])} is not in {os.path.join(folder, MANIFEST)}, which "
            f"lists the {split} shards data.prepare wrote; move it away or {PREPARE_AGAIN}"
        )
    return [os.path.join(folder, s["file"]) for s in listed]


def listed_rows(paths):
    """{path: rows} for the paths that sit in a prepared folder and are listed in its manifest."""
    rows = {}
    for folder in {os.path.dirname(p) for p in paths}:
        try:
            manifest = prepared_manifest(folder or ".")
        except DataError:  # files passed by path: an unreadable manifest beside them is shards_in's to refuse
            continue
        for entry in ((manifest or {}).get("splits") or {}).values():
            rows.update({os.path.join(folder, s["file"]): s["rows"] for s in entry.get("shards", [])})
    return rows
