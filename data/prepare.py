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

This module is the command line only: arguments and dispatch. The work: data/local_files.py (your
files), data/images.py (image folders), data/text.py (token shards), data/mnist.py (MNIST);
data/shards.py (names, writing, manifest) and data/atomic_folder.py (lock, ownership, swap).

Image folders (--format images, Fashion-MNIST only): OUTPUT_DIR/{train,validation}/CLASS_NAME/NNNNN.png,
the layout train/image_classification.py reads (validation is the test split); --max_per_class N
writes a small slice, the first N of each class.
"""

import argparse
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data.errors import DataError
from data.images import prepare_image_folder
from data.local_files import prepare_files
from data.mnist import prepare_mnist_shards, write_image_folders
from data.text import prepare_gcide, prepare_text


def make_parser():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    source = parser.add_argument_group("what to prepare (one of)")
    source.add_argument(
        "--train_file",
        nargs="+",
        default=None,
        help="Local csv/tsv, json/jsonl, parquet or txt file(s) of training rows.",
    )
    source.add_argument("--train_dir", default=None, help="An image folder: one subfolder of images per class.")
    source.add_argument(
        "--dataset",
        choices=["mnist", "fashion_mnist", "gcide"],
        default=None,
        help="The project's own data (the default when no --train_file/--train_dir is given): "
        "Fashion-MNIST, MNIST, or gcide (the GCIDE dictionary as text; needs --tokenizer).",
    )
    split = parser.add_argument_group("validation")
    split.add_argument("--validation_file", nargs="+", default=None, help="Validation rows, the same kind of file.")
    split.add_argument("--validation_dir", default=None, help="An image folder with the same classes.")
    split.add_argument(
        "--validation_split_percentage",
        type=float,
        default=None,
        help="Hold out a seeded random P%% of the training rows (per class for image folders).",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--output_dir", required=True)
    out.add_argument("--num_shards", type=int, default=8)
    out.add_argument(
        "--rows_per_group",
        type=int,
        default=None,
        help="Rows per parquet row group, the read unit: a divisor of the per-process batch size "
        "(default 32; 8 windows for token shards).",
    )
    out.add_argument("--seed", type=int, default=0, help="Seed of --validation_split_percentage.")
    out.add_argument(
        "--force",
        action="store_true",
        help="Write the set again even if up to date, also over files of it changed since. Never "
        "touches files data.prepare's manifest does not list.",
    )
    text = parser.add_argument_group("text → token shards (language models)")
    text.add_argument(
        "--tokenizer",
        default=None,
        help="bytes (256 byte values + end-of-text), bpe (trained here on the training split), or the "
        "path of a tokenizer.json; writes token shards instead of the files' columns.",
    )
    text.add_argument("--vocab_size", type=int, default=8192, help="--tokenizer bpe: vocabulary size.")
    text.add_argument(
        "--text_column",
        nargs="+",
        default=None,
        help="The column holding the text (csv/json/parquet; default text). Without --tokenizer: the "
        "string columns to keep as strings (any other string column is refused).",
    )
    text.add_argument("--block_size", type=int, default=256, help="Tokens of context per training window.")
    mnist = parser.add_argument_group("--dataset only")
    mnist.add_argument("--data_dir", default=None, help="Folder with the idx files (see data/mnist.py).")
    mnist.add_argument(
        "--format",
        choices=["parquet", "images"],
        default="parquet",
        help="parquet shards (the streaming path of train/mnist.py) or image folders of PNGs.",
    )
    mnist.add_argument("--max_per_class", type=int, default=None, help="images: write the first N of each class.")
    return parser


def check_args(parser, args):
    """Combinations argparse cannot refuse by itself: exit 2 with one line."""
    given = [
        flag
        for flag, value in (
            ("--train_file", args.train_file),
            ("--train_dir", args.train_dir),
            ("--dataset", args.dataset),
        )
        if value is not None
    ]
    if len(given) > 1:
        parser.exit(2, f"error: pass one of {', '.join(given)}, not several\n")
    if args.rows_per_group is None:
        args.rows_per_group = 8 if args.tokenizer else 32
    if args.num_shards < 1 or args.rows_per_group < 1 or args.block_size < 1:
        parser.exit(2, "error: --num_shards, --rows_per_group and --block_size must be positive\n")
    if args.validation_split_percentage is not None and not 0 < args.validation_split_percentage < 100:
        parser.exit(
            2,
            f"error: --validation_split_percentage {args.validation_split_percentage:g} is not between 0 "
            "and 100; pass e.g. 5\n",
        )
    if args.validation_split_percentage is not None and (args.validation_file or args.validation_dir):
        parser.exit(2, "error: pass --validation_split_percentage or a validation file/folder, not both\n")
    if args.dataset == "gcide" and args.tokenizer is None:
        parser.exit(2, "error: --dataset gcide is text: pass --tokenizer bytes, bpe or a tokenizer.json\n")
    if args.tokenizer is not None and args.train_dir:
        parser.exit(2, "error: --tokenizer is for text; an image folder has none\n")
    if args.tokenizer is not None and len(args.text_column or []) > 1:
        parser.exit(2, "error: --tokenizer reads one --text_column; pass one name\n")


def main(argv=None):
    parser = make_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    text_columns = args.text_column or ["text"]
    try:
        if args.tokenizer and args.train_file:
            prepare_text(
                args.train_file,
                args.output_dir,
                args.tokenizer,
                args.block_size,
                args.validation_file,
                args.validation_split_percentage,
                text_columns[0],
                args.vocab_size,
                args.num_shards,
                args.rows_per_group,
                args.seed,
                args.force,
            )
        elif args.dataset == "gcide":
            prepare_gcide(
                args.output_dir,
                args.tokenizer,
                args.block_size,
                args.vocab_size,
                args.num_shards,
                args.rows_per_group,
                args.data_dir,
                args.force,
            )
        elif args.train_file:
            prepare_files(
                args.train_file,
                args.output_dir,
                args.validation_file,
                args.validation_split_percentage,
                args.num_shards,
                args.rows_per_group,
                args.seed,
                text_columns,
                args.force,
            )
        elif args.train_dir:
            prepare_image_folder(
                args.train_dir,
                args.output_dir,
                args.validation_dir,
                args.validation_split_percentage,
                args.num_shards,
                args.rows_per_group,
                args.seed,
                args.force,
            )
        elif args.format == "images":
            write_image_folders(
                args.dataset or "fashion_mnist", args.output_dir, args.data_dir, args.max_per_class, args.force
            )
        else:
            prepare_mnist_shards(
                args.dataset or "fashion_mnist",
                args.output_dir,
                args.num_shards,
                args.rows_per_group,
                args.data_dir,
                args.force,
            )
    except DataError as e:
        parser.exit(1, f"error: {e}\n")


if __name__ == "__main__":
    main()
