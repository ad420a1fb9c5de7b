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
inputs and arguments finds it and writes nothing. Everything is written to a temporary folder and
renamed, so a crash never leaves a half-written set behind; a folder that holds anything else is
never overwritten.

Image folders (--format images, Fashion-MNIST only): OUTPUT_DIR/{train,validation}/CLASS_NAME/NNNNN.png,
the layout train/image_classification.py reads (validation is the test split); --max_per_class N
writes a small slice, the first N of each class.
"""
import argparse
import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import sys
import tempfile

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from data.mnist import DataError
from data.text import gcide_documents, token_dtype, write_token_shards

LOADERS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text",
           ".text": "text"}
OUR_FILES = re.compile(r"^([\w.]+-\d{5}-of-\d{5}\.parquet|manifest\.json|tokenizer\.json)$")


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
        pq.write_table(table, paths[-1], row_group_size=rows_per_group, compression="none", use_dictionary=False,
                       write_statistics=False, write_page_index=False)
    return paths


def write_table_shards(table, folder, split, num_shards, rows_per_group):
    """Write an Arrow table (or anything with num_rows and slice(lo, n)) as parquet shards; return paths."""
    import pyarrow.parquet as pq

    paths = []
    for i, (lo, hi) in enumerate(shard_ranges(table.num_rows, num_shards, rows_per_group)):
        paths.append(shard_path(folder, split, i, num_shards))
        pq.write_table(table.slice(lo, hi - lo), paths[-1], row_group_size=rows_per_group)
    return paths


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
def atomic_folder(output_dir, ours=OUR_FILES):
    """A temporary folder beside output_dir to write into; it replaces output_dir only if the block
    ends without an error, so a crash never leaves a half-written set behind. An output_dir holding
    anything but what this module writes is refused before any work."""
    if os.path.isdir(output_dir) and (foreign := [f for f in os.listdir(output_dir) if not ours.match(f)]):
        raise DataError(f"--output_dir {output_dir} holds files data.prepare did not write ({', '.join(foreign[:3])}); "
                        "pass a new or empty folder")
    parent = os.path.dirname(os.path.abspath(output_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".prepare-", dir=parent)
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        if os.path.isdir(output_dir):
            shutil.rmtree(output_dir)
        os.replace(tmp, output_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def prepare(dataset, output_dir, num_shards=8, rows_per_group=32, data_dir=None):
    """Write train and test shards of MNIST or Fashion-MNIST into output_dir (atomically); return output_dir."""
    from data.mnist import load_mnist

    train, test, source = load_mnist(dataset, data_dir)
    arguments = {"dataset": dataset, "num_shards": num_shards, "rows_per_group": rows_per_group}
    inputs = [{"dataset": dataset, "blake2b": _hash_tensors(train.images, train.labels, test.images, test.labels)}]
    if up_to_date(output_dir, inputs, arguments):
        return output_dir
    with atomic_folder(output_dir) as tmp:
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


def write_image_folders(dataset, output_dir, data_dir=None, max_per_class=None):
    """Write train and validation (the test split) as folders of grayscale PNGs, one per class
    (atomically); return output_dir."""
    from PIL import Image

    from data.mnist import load_mnist

    train, test, source = load_mnist(dataset, data_dir)
    counts = {}
    with atomic_folder(output_dir, ours=re.compile(r"^(train|validation)$")) as tmp:
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
    """manifest.json: what was read, with which arguments, and what every shard holds."""
    import pyarrow.parquet as pq

    splits = {}
    for name in sorted(f for f in os.listdir(folder) if f.endswith(".parquet")):
        split = name.split("-")[0]
        meta = pq.ParquetFile(os.path.join(folder, name)).metadata
        entry = splits.setdefault(split, {"rows": 0, "shards": []})
        entry["rows"] += meta.num_rows
        entry["shards"].append({"file": name, "rows": meta.num_rows, "bytes": os.path.getsize(os.path.join(folder, name))})
        entry["columns"] = {f.name: str(f.type) for f in meta.schema.to_arrow_schema()}
    manifest = {"written_by": "python -m data.prepare", "fingerprint": fingerprint(inputs, arguments),
                "inputs": inputs, "arguments": arguments, "splits": splits, **(extra or {})}
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def read_manifest(folder):
    path = os.path.join(folder, "manifest.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def up_to_date(output_dir, inputs, arguments):
    """True (and says so) if output_dir already holds these inputs written with these arguments,
    every shard still there at its recorded size."""
    manifest = read_manifest(output_dir)
    if manifest is None or manifest.get("fingerprint") != fingerprint(inputs, arguments):
        return False
    shards = [s for split in manifest["splits"].values() for s in split["shards"]]
    if any(not os.path.isfile(os.path.join(output_dir, s["file"])) or
           os.path.getsize(os.path.join(output_dir, s["file"])) != s["bytes"] for s in shards):
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
                  rows_per_group=32, seed=0):
    """Local files → parquet shards + manifest in output_dir (atomically, unless already up to date)."""
    file_kind(train_files, validation_files)  # bad input fails before the inputs are hashed
    inputs = hash_files(list(train_files) + list(validation_files or []))
    arguments = {"validation_split_percentage": validation_split_percentage, "num_shards": num_shards,
                 "rows_per_group": rows_per_group, "seed": seed, "kind": "files"}
    if up_to_date(output_dir, inputs, arguments):
        return read_manifest(output_dir)
    with atomic_folder(output_dir) as tmp:
        splits = load_files(list(train_files), list(validation_files or []) or None, validation_split_percentage,
                            seed, cache_dir=os.path.join(tmp, ".cache"))
        for split, ds in splits.items():
            if ds is not None:  # with_format("arrow") slices are Arrow tables, indices mapping applied
                write_table_shards(ds.with_format("arrow")[:], tmp, split, num_shards, rows_per_group)
        shutil.rmtree(os.path.join(tmp, ".cache"), ignore_errors=True)
        manifest = write_manifest(tmp, inputs, arguments)
    report(output_dir, manifest)
    return manifest


def prepare_image_folder(train_dir, output_dir, validation_dir=None, validation_split_percentage=None, num_shards=8,
                         rows_per_group=32, seed=0):
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
    if up_to_date(output_dir, inputs, arguments):
        return read_manifest(output_dir)
    with atomic_folder(output_dir) as tmp:
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
                   arguments, block_size):
    """{split: [text, ...]} → token shards (data/text.py) + tokenizer.json (unless `bytes`) + manifest,
    atomically, unless already up to date. `documents` may be a function, called only when needed."""
    from data.text import load_tokenizer, train_bpe

    arguments = {**arguments, "tokenizer": tokenizer_spec, "vocab_size": vocab_size if tokenizer_spec == "bpe" else None,
                 "num_shards": num_shards, "rows_per_group": rows_per_group, "block_size": block_size}
    if tokenizer_spec not in ("bytes", "bpe"):
        tokenizer = load_tokenizer(tokenizer_spec)  # a bad file fails before any work
        inputs = inputs + hash_files([tokenizer_spec])
    if up_to_date(output_dir, inputs, arguments):
        return read_manifest(output_dir)
    documents = documents() if callable(documents) else documents
    with atomic_folder(output_dir) as tmp:
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
                 text_column_name="text", vocab_size=8192, num_shards=8, rows_per_group=8, seed=0):
    """Local text files (txt, or csv/json/jsonl/parquet with a text column) → window shards."""
    file_kind(train_files, validation_files)  # bad input fails before the inputs are hashed
    inputs = hash_files(list(train_files) + list(validation_files or []))
    documents = lambda: text_column(load_files(list(train_files), list(validation_files or []) or None,  # noqa: E731
                                               validation_split_percentage, seed), text_column_name)
    return prepare_tokens(documents, output_dir, tokenizer, vocab_size, num_shards, rows_per_group, inputs,
                          {"kind": "text", "text_column": text_column_name, "seed": seed,
                           "validation_split_percentage": validation_split_percentage}, block_size)


def prepare_gcide(output_dir, tokenizer, block_size, vocab_size=8192, num_shards=8, rows_per_group=8, folder=None):
    """The GCIDE dictionary (data/text.py) → window shards."""
    from data.text import find_gcide

    folder = find_gcide(folder)
    inputs = hash_files([os.path.join(folder, "gcide.index"), os.path.join(folder, "gcide.dict.dz")])
    return prepare_tokens(lambda: dict(zip(("train", "validation"), gcide_documents(folder))), output_dir, tokenizer,
                          vocab_size, num_shards, rows_per_group, inputs, {"kind": "gcide"}, block_size)


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
    text = parser.add_argument_group("text → token shards (language models)")
    text.add_argument("--tokenizer", default=None,
                      help="bytes (256 byte values + end-of-text), bpe (trained here on the training split), or the "
                           "path of a tokenizer.json; writes token shards instead of the files' columns.")
    text.add_argument("--vocab_size", type=int, default=8192, help="--tokenizer bpe: vocabulary size.")
    text.add_argument("--text_column", default="text", help="The column holding the text (csv/json/parquet).")
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
    try:
        if args.tokenizer and args.train_file:
            prepare_text(args.train_file, args.output_dir, args.tokenizer, args.block_size, args.validation_file,
                         args.validation_split_percentage, args.text_column, args.vocab_size, args.num_shards,
                         args.rows_per_group, args.seed)
        elif args.dataset == "gcide":
            prepare_gcide(args.output_dir, args.tokenizer, args.block_size, args.vocab_size, args.num_shards,
                          args.rows_per_group, args.data_dir)
        elif args.train_file:
            prepare_files(args.train_file, args.output_dir, args.validation_file, args.validation_split_percentage,
                          args.num_shards, args.rows_per_group, args.seed)
        elif args.train_dir:
            prepare_image_folder(args.train_dir, args.output_dir, args.validation_dir,
                                 args.validation_split_percentage, args.num_shards, args.rows_per_group, args.seed)
        elif args.format == "images":
            write_image_folders(args.dataset or "fashion_mnist", args.output_dir, args.data_dir, args.max_per_class)
        else:
            prepare(args.dataset or "fashion_mnist", args.output_dir, args.num_shards, args.rows_per_group,
                    args.data_dir)
    except DataError as e:
        parser.exit(1, f"error: {e}\n")


if __name__ == "__main__":
    main()
