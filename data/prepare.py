"""Write MNIST / Fashion-MNIST as parquet shards for the streaming path, or as image folders of PNGs.

    python -m data.prepare --dataset fashion_mnist --output_dir runs/parquet/fashion_mnist --num_shards 8
    python -m data.prepare --dataset fashion_mnist --format images --output_dir runs/images/fashion_mnist

Image folders: OUTPUT_DIR/{train,validation}/CLASS_NAME/NNNNN.png, the layout train/image_classification.py
reads (validation is the test split); --max_per_class N writes a small slice, the first N of each class.

Each split becomes NUM_SHARDS files `{split}-{i:05d}-of-{n:05d}.parquet` with columns `image` (784
raw bytes) and `label` (int64). Rows go into row groups of --rows_per_group rows, the sharded
loader's read unit: pick a divisor of the per-process batch size so each row group is read by one
process only. Shards are written to a temporary folder and renamed, so a crash never leaves a
half-written set behind.
"""
import argparse
import contextlib
import math
import os
import shutil
import sys
import tempfile

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np


def write_shards(columns, folder, split, num_shards, rows_per_group=32):
    """Write dict-of-tensors `columns` as `num_shards` parquet files of whole row groups; return paths.
    Row groups are dealt to shards contiguously, so only the very last row group can be short."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    num_rows = len(next(iter(columns.values())))
    group_starts = np.arange(0, num_rows, rows_per_group)
    paths = []
    os.makedirs(folder, exist_ok=True)
    for i, starts in enumerate(np.array_split(group_starts, num_shards)):
        lo = int(starts[0]) if len(starts) else num_rows
        hi = int(min(starts[-1] + rows_per_group, num_rows)) if len(starts) else num_rows
        table = pa.table({name: to_arrow(t[lo:hi]) for name, t in columns.items()})
        path = os.path.join(folder, f"{split}-{i:05d}-of-{num_shards:05d}.parquet")
        # Statistics and dictionaries of 784-byte images are dead weight: they grew the footers to 7% of
        # the data, read again by every process that opens a shard.
        pq.write_table(table, path, row_group_size=rows_per_group, compression="none", use_dictionary=False,
                       write_statistics=False, write_page_index=False)
        paths.append(path)
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
def atomic_folder(output_dir):
    """A temporary folder beside output_dir to write into; it replaces output_dir only if the block
    ends without an error, so a crash never leaves a half-written set behind."""
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
    """Write train and test shards of `dataset` into output_dir (atomically); return output_dir."""
    from data.mnist import load_mnist

    train, test, source = load_mnist(dataset, data_dir)
    with atomic_folder(output_dir) as tmp:
        for split, ds in (("train", train), ("test", test)):
            write_shards({"image": ds.images, "label": ds.labels}, tmp, split, num_shards, rows_per_group)
    print(f"wrote {num_shards} train + {num_shards} test shards of {dataset} ({source}) to {output_dir}")
    return output_dir


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
    with atomic_folder(output_dir) as tmp:
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", choices=["mnist", "fashion_mnist"], default="fashion_mnist")
    parser.add_argument("--data_dir", default=None, help="Folder with the idx files (see data/mnist.py).")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--format", choices=["parquet", "images"], default="parquet",
                        help="parquet shards (the streaming path of train/mnist.py) or image folders of PNGs.")
    parser.add_argument("--max_per_class", type=int, default=None, help="images: write the first N of each class.")
    parser.add_argument("--num_shards", type=int, default=8)
    parser.add_argument("--rows_per_group", type=int, default=32)
    args = parser.parse_args(argv)
    if args.num_shards < 1 or args.rows_per_group < 1:
        raise SystemExit("error: --num_shards and --rows_per_group must be positive")
    from data.mnist import DataError
    try:
        if args.format == "images":
            write_image_folders(args.dataset, args.output_dir, args.data_dir, args.max_per_class)
        else:
            prepare(args.dataset, args.output_dir, args.num_shards, args.rows_per_group, args.data_dir)
    except DataError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
