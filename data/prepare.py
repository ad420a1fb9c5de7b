"""Turn data into parquet shards for the exactly-once streaming path (data/sharding.py), or write
Fashion-MNIST as image folders.

    # your files: csv/tsv, json/jsonl, parquet or text (one row per line), or an image folder
    python -m data.prepare --train_file data/train.csv --validation_split_percentage 5 --output_dir runs/shards/mine
    python -m data.prepare --train_file a.jsonl --validation_file b.jsonl --output_dir runs/shards/mine --num_shards 16
    python -m data.prepare --train_dir photos/train --validation_dir photos/val --output_dir runs/shards/photos
    # the project's own data
    python -m data.prepare --dataset fashion_mnist --output_dir runs/parquet/fashion_mnist
    python -m data.prepare --dataset fashion_mnist --format images --output_dir runs/images/fashion_mnist

Files are read with the Hugging Face `datasets` local loaders (offline; columns and types as
`datasets.load_dataset(...)` gives them). Image folders are scanned like train/image_classification.py
does (class = subfolder, same order, same checks) and stored as the files' encoded bytes plus a label.

Each split becomes NUM_SHARDS files `{split}-{i:05d}-of-{n:05d}.parquet` of whole row groups of
--rows_per_group rows, the sharded loader's read unit: pick a divisor of the per-process batch size so
each row group is read by one process only. `manifest.json` lists the inputs (with a content hash),
the arguments, every shard's rows and bytes, and a fingerprint of them: a second run with the same
inputs and arguments finds it and writes nothing; a shard changed since (checked by its sha256) is
refused by name, and --force writes the set again.

What it writes in --output_dir, and only that: the files its manifest.json lists. A folder without
that manifest (a user's own files, even ones named like shards) is never emptied, and a file the
manifest does not list is never deleted: either is refused with one line naming it. One prepare per
folder at a time (OUTPUT_DIR/.lock, data/locks.py). The new set is written to a hidden folder
beside it (.prepare-NAME-XXXXXXXX) and swapped in whole, so a crash never leaves a half-written set
looking complete; the next prepare of the folder removes what a killed one left there.

Image folders (--format images, Fashion-MNIST only): OUTPUT_DIR/{train,validation}/CLASS_NAME/NNNNN.png,
the layout train/image_classification.py reads (validation is the test split); --max_per_class N
writes a small slice, the first N of each class.
"""
import argparse
import contextlib
import errno
import hashlib
import io
import json
import math
import os
import re
import secrets
import shutil
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from data.locks import LOCK_NAME, FolderBusy, lock_folder
from data.mnist import DataError
from data.sharding import MANIFEST, WRITTEN_BY, prepared_manifest, read_manifest
from data.text import gcide_documents, token_dtype, write_token_shards

LOADERS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text",
           ".text": "text"}


def shard_ranges(num_rows, num_shards, rows_per_group):
    """(lo, hi) rows of each shard: whole row groups dealt contiguously, so only the very last row
    group of the split can be short (a shard may be empty when there are fewer groups than shards)."""
    group_starts = np.arange(0, num_rows, rows_per_group)
    for starts in np.array_split(group_starts, num_shards):
        if len(starts):
            yield int(starts[0]), int(min(starts[-1] + rows_per_group, num_rows))
        else:
            yield num_rows, num_rows


def shard_path(folder, split, i, num_shards):
    return os.path.join(folder, f"{split}-{i:05d}-of-{num_shards:05d}.parquet")


def write_shards(columns, folder, split, num_shards, rows_per_group=32):
    """Write dict-of-tensors `columns` as `num_shards` parquet files of whole row groups; return paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    num_rows = len(next(iter(columns.values())))
    paths = []
    os.makedirs(folder, exist_ok=True)
    for i, (lo, hi) in enumerate(shard_ranges(num_rows, num_shards, rows_per_group)):
        table = pa.table({name: to_arrow(t[lo:hi]) for name, t in columns.items()})
        paths.append(shard_path(folder, split, i, num_shards))
        # Statistics and dictionaries of 784-byte images are dead weight: they grew the footers to 7% of
        # the data, read again by every process that opens a shard.
        write_parquet(table, paths[-1], row_group_size=rows_per_group, compression="none", use_dictionary=False,
                      write_statistics=False, write_page_index=False)
    return paths


def write_table_shards(table, folder, split, num_shards, rows_per_group):
    """Write an Arrow table (or anything with num_rows and slice(lo, n)) as parquet shards; return paths."""
    paths = []
    for i, (lo, hi) in enumerate(shard_ranges(table.num_rows, num_shards, rows_per_group)):
        paths.append(shard_path(folder, split, i, num_shards))
        write_parquet(table.slice(lo, hi - lo), paths[-1], row_group_size=rows_per_group)
    return paths


WRITTEN = {}  # absolute path -> {"bytes", "sha256"} of each file written through HashingFile in this process


class HashingFile(io.RawIOBase):
    """A new file that hashes what is written to it: the manifest's sha256 without reading it back."""

    def __init__(self, path):
        super().__init__()
        self.path, self._file, self._hash, self.bytes = path, open(path, "wb"), hashlib.sha256(), 0

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
    return pa.BinaryArray.from_buffers(pa.binary(), len(flat), [None, offsets.buffers()[1], pa.py_buffer(flat.tobytes())])


@contextlib.contextmanager
def atomic_folder(output_dir, force=False):
    """A hidden folder beside output_dir to write the new set into (its manifest last); when the block
    ends without an error it takes output_dir's place in one step and the old set is removed. What is
    in output_dir must be this module's own (claim()), checked before anything is written, then again
    under the folder's lock, which is held throughout; a folder this call created is removed again
    if the block fails. OSErrors (a full disk, a read-only folder) are one line saying where."""
    claim(output_dir, force)
    created = not os.path.isdir(output_dir)
    try:
        lock = lock_folder(output_dir, what="a data folder being prepared", note=print)
    except FolderBusy as e:
        raise DataError(str(e)) from None
    except OSError as e:
        raise DataError(write_error(output_dir, e)) from None
    tmp, target = None, os.path.realpath(output_dir)  # a link to a folder: the folder is replaced, not the link
    try:
        claim(output_dir, force)  # again, holding the lock: it may have changed meanwhile
        remove_leftovers(target)
        tmp = make_temp_folder(target)
        yield tmp
        os.link(os.path.join(target, LOCK_NAME), os.path.join(tmp, LOCK_NAME))  # the held lock goes along
        exchange(tmp, target)  # tmp now holds the old set
    except OSError as e:
        raise DataError(write_error(output_dir, e)) from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if created and not folder_contents(output_dir) and not os.path.exists(os.path.join(output_dir, MANIFEST)):
            # a failed first write leaves nothing behind
            with contextlib.suppress(OSError):
                os.remove(os.path.join(output_dir, LOCK_NAME))
                os.rmdir(output_dir)
        lock.release()


WRITE_FIXES = {errno.ENOSPC: "free some space or pass an --output_dir on another disk",
               errno.EDQUOT: "free some space or pass an --output_dir on another disk",
               errno.EROFS: "pass an --output_dir on a writable disk",
               errno.EACCES: "pass an --output_dir you can write to", errno.EPERM: "pass an --output_dir you can write to"}


def write_error(output_dir, e):
    where = f" ({e.filename})" if e.filename else ""
    return (f"could not write --output_dir {output_dir}: {e.strerror or e}{where}; nothing there was changed; "
            f"{WRITE_FIXES.get(e.errno, 'check the folder and run again')}")


def make_temp_folder(output_dir):
    parent, name = os.path.split(os.path.abspath(output_dir))
    while True:
        tmp = os.path.join(parent, f".prepare-{name}-{secrets.token_hex(4)}")
        try:
            os.mkdir(tmp)
            return tmp
        except FileExistsError:
            continue


def remove_leftovers(output_dir):
    """Remove the temporary folders of earlier prepares of output_dir that were killed: their name
    says whose they are, and the caller holds output_dir's lock, so none is a live prepare's."""
    parent, name = os.path.split(os.path.abspath(output_dir))
    pattern = re.compile(rf"^\.prepare-{re.escape(name)}-[0-9a-f]{{8}}$")
    for entry in sorted(os.listdir(parent)):
        path = os.path.join(parent, entry)
        if pattern.match(entry) and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
            print(f"removed {path}, left behind by a data.prepare of {output_dir} that was stopped")


def exchange(a, b):
    """Swap folders a and b in one step, so b never stops existing (nor the lock file inside it that
    the holder holds). Linux's renameat2(RENAME_EXCHANGE) does it; the os module has no call for it.
    Where the system lacks it, two renames, with a moment without b between them."""
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        renameat2 = None
    if renameat2 is not None:
        at_fdcwd, rename_exchange = -100, 2
        if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise OSError(code, os.strerror(code), b)
    old = a + "-old"
    os.rename(b, old)
    os.rename(a, b)
    os.rename(old, a)


def prepare(dataset, output_dir, num_shards=8, rows_per_group=32, data_dir=None, force=False):
    """Write train and test shards of MNIST or Fashion-MNIST into output_dir (atomically); return output_dir."""
    from data.mnist import load_mnist

    train, test, source = load_mnist(dataset, data_dir)
    arguments = {"dataset": dataset, "num_shards": num_shards, "rows_per_group": rows_per_group}
    inputs = [{"dataset": dataset, "blake2b": _hash_tensors(train.images, train.labels, test.images, test.labels)}]
    if up_to_date(output_dir, inputs, arguments, force):
        return output_dir
    with atomic_folder(output_dir, force) as tmp:
        for split, ds in (("train", train), ("test", test)):
            write_shards({"image": ds.images, "label": ds.labels}, tmp, split, num_shards, rows_per_group)
        write_manifest(tmp, inputs, arguments, {"class_names": CLASS_NAMES[dataset]})
    print(f"wrote {num_shards} train + {num_shards} test shards of {dataset} ({source}) to {output_dir}")
    return output_dir


def _hash_tensors(*tensors):
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


CLASS_NAMES = {"mnist": [str(d) for d in range(10)],
               "fashion_mnist": ["T-shirt_top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
                                 "Bag", "Ankle_boot"]}


def write_image_folders(dataset, output_dir, data_dir=None, max_per_class=None, force=False):
    """Write train and validation (the test split) as folders of grayscale PNGs, one per class
    (atomically), and a manifest.json listing them; return output_dir."""
    from PIL import Image

    from data.mnist import load_mnist

    claim(output_dir, force)  # a folder of someone else's images: refused before the dataset is read
    train, test, source = load_mnist(dataset, data_dir)
    counts = {}
    with atomic_folder(output_dir, force) as tmp:
        for split, ds in (("train", train), ("validation", test)):
            written = [0] * 10
            for name in CLASS_NAMES[dataset]:
                os.makedirs(os.path.join(tmp, split, name))
            for i, (image, label) in enumerate(zip(ds.images.numpy(), ds.labels.tolist())):
                if max_per_class is None or written[label] < max_per_class:
                    Image.fromarray(image, mode="L").save(os.path.join(tmp, split, CLASS_NAMES[dataset][label],
                                                                       f"{i:05d}.png"))
                    written[label] += 1
            counts[split] = sum(written)
        save_manifest(tmp, {"written_by": WRITTEN_BY, "kind": "image_folders", "dataset": dataset,
                            "max_per_class": max_per_class, "files": file_entries(tmp, hashed=False)}, indent=None)
    print(f"wrote {counts['train']} train + {counts['validation']} validation PNGs of {dataset} ({source}) "
          f"to {output_dir}/{{train,validation}}/CLASS_NAME/")
    return output_dir


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
        split = name.split("-")[0]
        meta = pq.ParquetFile(os.path.join(folder, name)).metadata
        entry = splits.setdefault(split, {"rows": 0, "shards": []})
        entry["rows"] += meta.num_rows
        entry["shards"].append({"file": name, "rows": meta.num_rows, **files[name]})
        entry["columns"] = {f.name: str(f.type) for f in meta.schema.to_arrow_schema()}
    manifest = {"written_by": WRITTEN_BY, "fingerprint": fingerprint(inputs, arguments),
                "inputs": inputs, "arguments": arguments, "splits": splits, **(extra or {}), "files": files}
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


def listed_files(manifest):
    """{relative path: {"bytes", "sha256"}, either may be absent} of what a manifest says data.prepare
    wrote; manifests from before "files" existed list their shards and tokenizer.json."""
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


def claim(output_dir, force=False):
    """Refuse (DataError naming a file) unless output_dir is new, empty, or holds only what its
    data.prepare manifest lists, as it was written (with force: changed files may be replaced too).
    Never deletes anything."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise DataError(f"--output_dir {output_dir} is a file; pass a folder")
    present = folder_contents(output_dir) if os.path.isdir(output_dir) else []
    if os.path.isdir(output_dir) and os.path.isfile(os.path.join(output_dir, MANIFEST)):
        present.append(MANIFEST)
    if not present:
        return
    manifest = prepared_manifest(output_dir)  # an unreadable one: one line naming it
    if manifest is None:
        raise DataError(f"--output_dir {output_dir} holds files data.prepare did not write ({', '.join(present[:3])}) "
                        "and no manifest.json of data.prepare; pass a new or empty folder")
    listed = listed_files(manifest)
    if foreign := [f for f in present if f != MANIFEST and f not in listed]:
        raise DataError(f"--output_dir {output_dir} holds files data.prepare did not write ({', '.join(foreign[:3])}), "
                        "not in its manifest.json; move them away or pass another folder")
    missing, changed = check_files_written(output_dir, manifest)
    if changed and not force:
        rel, how = changed[0]
        raise DataError(f"{os.path.join(output_dir, rel)} changed since data.prepare wrote it ({how}); pass --force "
                        f"to write {output_dir} again, or move it away")
    if missing:
        print(f"{output_dir}: {len(missing)} file(s) data.prepare wrote are missing ({missing[0]}); writing the set "
              "again")


def up_to_date(output_dir, inputs, arguments, force=False):
    """True (and says so) if output_dir already holds these inputs written with these arguments,
    every file still there as written (size and sha256). Takes no lock and writes nothing; anything
    else is for claim() to judge, under the lock."""
    try:
        manifest = prepared_manifest(output_dir) if os.path.isdir(output_dir) else None
    except DataError:
        return False
    if force or manifest is None or manifest.get("fingerprint") != fingerprint(inputs, arguments):
        return False
    missing, changed = check_files_written(output_dir, manifest)
    if missing or changed or any(f not in listed_files(manifest) for f in folder_contents(output_dir)):
        return False
    rows = ", ".join(f"{split} {entry['rows']} rows" for split, entry in manifest["splits"].items())
    print(f"{output_dir} is up to date ({rows}, fingerprint {manifest['fingerprint']}); nothing written")
    return True


# ---------------------------------------------------------------------------------------- your files

def check_files(paths, flag):
    """The datasets loader for `paths` (one kind of file per flag), or DataError naming the problem."""
    kinds = set()
    for path in paths:
        if not os.path.isfile(path):
            raise DataError(f"{flag} {path} does not exist; pass a csv/tsv, json/jsonl, parquet or txt file")
        extension = os.path.splitext(path)[1].lower()
        if extension not in LOADERS:
            raise DataError(f"{flag} {path}: unknown file type {extension or '(none)'!r}; "
                            f"use one of {', '.join(LOADERS)} (or an image folder with --train_dir)")
        if os.path.getsize(path) == 0:
            raise DataError(f"{flag} {path} is empty; pass a file with at least one row")
        kinds.add((LOADERS[extension], extension == ".tsv"))
    return kinds


def file_kind(train_files, validation_files=None):
    """(datasets loader, tab-separated?) of the input files, which must all be of one kind."""
    kinds = check_files(train_files, "--train_file") | check_files(validation_files or [], "--validation_file")
    if len(kinds) > 1:
        raise DataError("--train_file and --validation_file are different kinds of file; convert one so both are "
                        "csv, tsv, json/jsonl, parquet or txt")
    return kinds.pop()


def load_files(train_files, validation_files=None, validation_split_percentage=None, seed=0, cache_dir=None):
    """{"train": datasets.Dataset, "validation": datasets.Dataset or None} from local files, through
    datasets' local loaders (offline). With validation_split_percentage, a seeded random P% of the
    training rows is held out."""
    import datasets

    datasets.disable_progress_bars()  # one line per split per run; our own line says what was written
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # a parse error is reported once, below
    builder, tsv = file_kind(train_files, validation_files)
    data_files = {"train": list(train_files), **({"validation": list(validation_files)} if validation_files else {})}
    try:
        loaded = datasets.load_dataset(builder, data_files=data_files, cache_dir=cache_dir,
                                       **({"delimiter": "\t"} if tsv else {}))
    except Exception as e:  # the loaders raise many types, wrapped; the innermost says what was wrong
        while e.__cause__ is not None:
            e = e.__cause__
        if isinstance(e, OSError) and e.errno in WRITE_FIXES:  # writing its cache (in the output's temporary
            raise e from None                                   # folder) failed: a disk fault, not the file's
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"could not read {', '.join(train_files + (validation_files or []))} as {builder}: "
                        f"{first}; check the file's format") from None
    train, validation = loaded["train"], loaded.get("validation")
    if len(train) == 0:
        raise DataError(f"--train_file {', '.join(train_files)} has no rows; pass a file with data")
    if validation_split_percentage is not None:
        held = max(1, round(len(train) * validation_split_percentage / 100))
        if held >= len(train):
            raise DataError(f"--validation_split_percentage {validation_split_percentage} of {len(train)} rows leaves "
                            "no training rows; pass a smaller percentage or more data")
        parts = train.train_test_split(test_size=held, seed=seed, shuffle=True)
        train, validation = parts["train"], parts["test"]
    return {"train": train, "validation": validation}


def prepare_files(train_files, output_dir, validation_files=None, validation_split_percentage=None, num_shards=8,
                  rows_per_group=32, seed=0, text_columns=("text",), force=False):
    """Local files → parquet shards + manifest in output_dir (atomically, unless already up to date).
    Every column must be able to become a tensor (check_columns) but `text_columns`, kept as strings."""
    file_kind(train_files, validation_files)  # bad input fails before the inputs are hashed
    inputs = hash_files(list(train_files) + list(validation_files or []))
    arguments = {"validation_split_percentage": validation_split_percentage, "num_shards": num_shards,
                 "rows_per_group": rows_per_group, "seed": seed, "kind": "files"}
    if up_to_date(output_dir, inputs, arguments, force):
        return read_manifest(output_dir)
    with atomic_folder(output_dir, force) as tmp:
        splits = load_files(list(train_files), list(validation_files or []) or None, validation_split_percentage,
                            seed, cache_dir=os.path.join(tmp, ".cache"))
        check_columns(splits, text_columns)
        for split, ds in splits.items():
            if ds is not None:  # with_format("arrow") slices are Arrow tables, indices mapping applied
                write_table_shards(ds.with_format("arrow")[:], tmp, split, num_shards, rows_per_group)
        shutil.rmtree(os.path.join(tmp, ".cache"), ignore_errors=True)
        manifest = write_manifest(tmp, inputs, arguments)
    report(output_dir, manifest)
    return manifest


def prepare_image_folder(train_dir, output_dir, validation_dir=None, validation_split_percentage=None, num_shards=8,
                         rows_per_group=32, seed=0, force=False):
    """An image folder → parquet shards of (image: the file's bytes, label, file) + manifest with the
    class names, in output_dir (atomically, unless already up to date)."""
    import pyarrow as pa

    from data.images import scan_image_folder

    train = scan_image_folder(train_dir, "--train_dir")
    validation = scan_image_folder(validation_dir, "--validation_dir", train.classes) if validation_dir else None
    if validation_split_percentage is not None:
        train, validation = train.split(validation_split_percentage / 100, seed)
    inputs = hash_files(train.files + (validation.files if validation else []))
    for entry, label in zip(inputs, train.labels + (validation.labels if validation else [])):
        entry["class"] = train.classes[label]  # a file moved to another class is other data
    arguments = {"validation_split_percentage": validation_split_percentage, "num_shards": num_shards,
                 "rows_per_group": rows_per_group, "seed": seed, "kind": "image_folder", "classes": train.classes}
    if up_to_date(output_dir, inputs, arguments, force):
        return read_manifest(output_dir)
    with atomic_folder(output_dir, force) as tmp:
        for split, images in (("train", train), ("validation", validation)):
            if images is None:
                continue
            root = train_dir if split == "train" or validation_dir is None else validation_dir
            table = pa.table({"image": pa.array([open(f, "rb").read() for f in images.files], pa.binary()),
                              "label": pa.array(images.labels, pa.int64()),
                              "file": pa.array([os.path.relpath(f, root) for f in images.files])})
            write_table_shards(table, tmp, split, num_shards, rows_per_group)
        manifest = write_manifest(tmp, inputs, arguments, {"class_names": train.classes})
    report(output_dir, manifest)
    return manifest


def prepare_tokens(documents, output_dir, tokenizer_spec, vocab_size, num_shards, rows_per_group, inputs,
                   arguments, block_size, force=False):
    """{split: [text, ...]} → token shards (data/text.py) + tokenizer.json (unless `bytes`) + manifest,
    atomically, unless already up to date. `documents` may be a function, called only when needed."""
    from data.text import load_tokenizer, train_bpe

    arguments = {**arguments, "tokenizer": tokenizer_spec, "vocab_size": vocab_size if tokenizer_spec == "bpe" else None,
                 "num_shards": num_shards, "rows_per_group": rows_per_group, "block_size": block_size}
    if tokenizer_spec not in ("bytes", "bpe"):
        tokenizer = load_tokenizer(tokenizer_spec)  # a bad file fails before any work
        inputs = inputs + hash_files([tokenizer_spec])
    if up_to_date(output_dir, inputs, arguments, force):
        return read_manifest(output_dir)
    claim(output_dir, force)  # someone else's folder: refused before the text is read and tokenized
    documents = documents() if callable(documents) else documents
    with atomic_folder(output_dir, force) as tmp:
        if tokenizer_spec == "bpe":
            tokenizer = train_bpe(documents["train"], vocab_size)
        elif tokenizer_spec == "bytes":
            tokenizer = load_tokenizer("bytes")
        if hasattr(tokenizer, "save"):
            tokenizer.save(os.path.join(tmp, "tokenizer.json"))
        counts = {split: write_token_shards(docs, tokenizer, tmp, split, num_shards, rows_per_group, block_size)
                  for split, docs in documents.items() if docs is not None}
        manifest = write_manifest(tmp, inputs, arguments, {
            "tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size, "eot_id": tokenizer.eot_id,
            "block_size": block_size, "token_dtype": np.dtype(token_dtype(tokenizer.vocab_size)).name, "text": counts})
    report(output_dir, manifest)
    return manifest


def prepare_text(train_files, output_dir, tokenizer, block_size, validation_files=None, validation_split_percentage=None,
                 text_column_name="text", vocab_size=8192, num_shards=8, rows_per_group=8, seed=0, force=False):
    """Local text files (txt, or csv/json/jsonl/parquet with a text column) → window shards."""
    file_kind(train_files, validation_files)  # bad input fails before the inputs are hashed
    inputs = hash_files(list(train_files) + list(validation_files or []))
    documents = lambda: text_column(load_files(list(train_files), list(validation_files or []) or None,  # noqa: E731
                                               validation_split_percentage, seed), text_column_name)
    return prepare_tokens(documents, output_dir, tokenizer, vocab_size, num_shards, rows_per_group, inputs,
                          {"kind": "text", "text_column": text_column_name, "seed": seed,
                           "validation_split_percentage": validation_split_percentage}, block_size, force)


def prepare_gcide(output_dir, tokenizer, block_size, vocab_size=8192, num_shards=8, rows_per_group=8, folder=None,
                  force=False):
    """The GCIDE dictionary (data/text.py) → window shards."""
    from data.text import find_gcide

    folder = find_gcide(folder)
    inputs = hash_files([os.path.join(folder, "gcide.index"), os.path.join(folder, "gcide.dict.dz")])
    return prepare_tokens(lambda: dict(zip(("train", "validation"), gcide_documents(folder))), output_dir, tokenizer,
                          vocab_size, num_shards, rows_per_group, inputs, {"kind": "gcide"}, block_size, force)


def check_columns(splits, text_columns):
    """The tabular path (--train_file without --tokenizer): its shards are read as tensors
    (ParquetSource's default decode), so a column that cannot become one is refused here, naming it,
    rather than failing in training: numbers (no empty values), lists of numbers and bytes pass;
    strings only where named by --text_column (default `text`), for a decode step that tokenizes them."""
    import pyarrow as pa

    def numeric(kind):
        return pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)

    for split, ds in splits.items():
        if ds is None:
            continue
        for field in ds.data.schema:
            name, kind = field.name, field.type
            if pa.types.is_string(kind) or pa.types.is_large_string(kind):
                if name in text_columns:
                    continue
                raise DataError(f"column {name!r} of the {split} data holds text, which cannot become a tensor; "
                                f"encode it as numbers (e.g. one id per category) before preparing, or pass "
                                f"--text_column {name} to keep it as strings for a decode step that tokenizes it")
            if numeric(kind) or ((pa.types.is_list(kind) or pa.types.is_large_list(kind) or
                                  pa.types.is_fixed_size_list(kind)) and numeric(kind.value_type)):
                if nulls := ds.data.column(name).null_count:
                    raise DataError(f"column {name!r} of the {split} data has {nulls} empty value(s), which a tensor "
                                    "cannot hold; fill them in or drop those rows")
            elif not (pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or
                      pa.types.is_fixed_size_binary(kind)):
                raise DataError(f"column {name!r} of the {split} data holds {kind}, which cannot become a tensor; "
                                "encode it as numbers before preparing")


def text_column(splits, column):
    """The `column` of each split as a list of strings, or DataError naming the columns there are."""
    out = {}
    for split, ds in splits.items():
        if ds is None:
            continue
        if column not in ds.column_names:
            raise DataError(f"no column {column!r} in the {split} data (columns: {', '.join(ds.column_names)}); "
                            "pass --text_column NAME")
        if str(ds.features[column]) not in ("Value('string')", "Value('large_string')"):
            raise DataError(f"column {column!r} holds {ds.features[column]}, not text; pass --text_column NAME of a "
                            "text column")
        out[split] = [t or "" for t in ds[column]]
    return out


def report(output_dir, manifest):
    rows = ", ".join(f"{split}: {entry['rows']} rows in {len(entry['shards'])} shards"
                     for split, entry in manifest["splits"].items())
    columns = ", ".join(f"{k} ({v})" for k, v in next(iter(manifest["splits"].values()))["columns"].items())
    print(f"wrote {output_dir}: {rows}; columns {columns}; fingerprint {manifest['fingerprint']}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    source = parser.add_argument_group("what to prepare (one of)")
    source.add_argument("--train_file", nargs="+", default=None,
                        help="Local csv/tsv, json/jsonl, parquet or txt file(s) of training rows.")
    source.add_argument("--train_dir", default=None, help="An image folder: one subfolder of images per class.")
    source.add_argument("--dataset", choices=["mnist", "fashion_mnist", "gcide"], default=None,
                        help="The project's own data (the default when no --train_file/--train_dir is given): "
                             "Fashion-MNIST, MNIST, or gcide (the GCIDE dictionary as text; needs --tokenizer).")
    split = parser.add_argument_group("validation")
    split.add_argument("--validation_file", nargs="+", default=None, help="Validation rows, the same kind of file.")
    split.add_argument("--validation_dir", default=None, help="An image folder with the same classes.")
    split.add_argument("--validation_split_percentage", type=float, default=None,
                       help="Hold out a seeded random P%% of the training rows (per class for image folders).")
    out = parser.add_argument_group("output")
    out.add_argument("--output_dir", required=True)
    out.add_argument("--num_shards", type=int, default=8)
    out.add_argument("--rows_per_group", type=int, default=None,
                     help="Rows per parquet row group, the read unit: a divisor of the per-process batch size "
                          "(default 32; 8 windows for token shards).")
    out.add_argument("--seed", type=int, default=0, help="Seed of --validation_split_percentage.")
    out.add_argument("--force", action="store_true",
                     help="Write the set again even if up to date, also over files of it changed since. Never "
                          "touches files data.prepare's manifest does not list.")
    text = parser.add_argument_group("text → token shards (language models)")
    text.add_argument("--tokenizer", default=None,
                      help="bytes (256 byte values + end-of-text), bpe (trained here on the training split), or the "
                           "path of a tokenizer.json; writes token shards instead of the files' columns.")
    text.add_argument("--vocab_size", type=int, default=8192, help="--tokenizer bpe: vocabulary size.")
    text.add_argument("--text_column", nargs="+", default=None,
                      help="The column holding the text (csv/json/parquet; default text). Without --tokenizer: the "
                           "string columns to keep as strings (any other string column is refused).")
    text.add_argument("--block_size", type=int, default=256, help="Tokens of context per training window.")
    mnist = parser.add_argument_group("--dataset only")
    mnist.add_argument("--data_dir", default=None, help="Folder with the idx files (see data/mnist.py).")
    mnist.add_argument("--format", choices=["parquet", "images"], default="parquet",
                       help="parquet shards (the streaming path of train/mnist.py) or image folders of PNGs.")
    mnist.add_argument("--max_per_class", type=int, default=None, help="images: write the first N of each class.")
    args = parser.parse_args(argv)
    given = [flag for flag, value in (("--train_file", args.train_file), ("--train_dir", args.train_dir),
                                      ("--dataset", args.dataset)) if value is not None]
    if len(given) > 1:
        parser.exit(2, f"error: pass one of {', '.join(given)}, not several\n")
    if args.rows_per_group is None:
        args.rows_per_group = 8 if args.tokenizer else 32
    if args.num_shards < 1 or args.rows_per_group < 1 or args.block_size < 1:
        parser.exit(2, "error: --num_shards, --rows_per_group and --block_size must be positive\n")
    if args.validation_split_percentage is not None and not 0 < args.validation_split_percentage < 100:
        parser.exit(2, f"error: --validation_split_percentage {args.validation_split_percentage:g} is not between 0 "
                       "and 100; pass e.g. 5\n")
    if args.validation_split_percentage is not None and (args.validation_file or args.validation_dir):
        parser.exit(2, "error: pass --validation_split_percentage or a validation file/folder, not both\n")
    if args.dataset == "gcide" and args.tokenizer is None:
        parser.exit(2, "error: --dataset gcide is text: pass --tokenizer bytes, bpe or a tokenizer.json\n")
    if args.tokenizer is not None and args.train_dir:
        parser.exit(2, "error: --tokenizer is for text; an image folder has none\n")
    if args.tokenizer is not None and len(args.text_column or []) > 1:
        parser.exit(2, "error: --tokenizer reads one --text_column; pass one name\n")
    text_columns = args.text_column or ["text"]
    try:
        if args.tokenizer and args.train_file:
            prepare_text(args.train_file, args.output_dir, args.tokenizer, args.block_size, args.validation_file,
                         args.validation_split_percentage, text_columns[0], args.vocab_size, args.num_shards,
                         args.rows_per_group, args.seed, args.force)
        elif args.dataset == "gcide":
            prepare_gcide(args.output_dir, args.tokenizer, args.block_size, args.vocab_size, args.num_shards,
                          args.rows_per_group, args.data_dir, args.force)
        elif args.train_file:
            prepare_files(args.train_file, args.output_dir, args.validation_file, args.validation_split_percentage,
                          args.num_shards, args.rows_per_group, args.seed, text_columns, args.force)
        elif args.train_dir:
            prepare_image_folder(args.train_dir, args.output_dir, args.validation_dir,
                                 args.validation_split_percentage, args.num_shards, args.rows_per_group, args.seed,
                                 args.force)
        elif args.format == "images":
            write_image_folders(args.dataset or "fashion_mnist", args.output_dir, args.data_dir, args.max_per_class,
                                args.force)
        else:
            prepare(args.dataset or "fashion_mnist", args.output_dir, args.num_shards, args.rows_per_group,
                    args.data_dir, args.force)
    except DataError as e:
        parser.exit(1, f"error: {e}\n")


if __name__ == "__main__":
    main()
