"""MNIST and Fashion-MNIST held in memory as uint8 tensors, and written as parquet shards or as
folders of PNGs (python -m data.prepare --dataset).

The idx files are parsed here (torchvision only downloads); batches are sliced from the in-memory tensors
(`__getitems__`) and normalised on the batch, on the training device, so the hot loop has no
per-sample Python and no PIL round trip (docs/speed.md measures what that saves).

Where the files come from, in order:
  1. `data_dir`, if given: the four idx files (raw or .gz) directly in it, or in torchvision's layout
     `data_dir/MNIST/raw/` / `data_dir/FashionMNIST/raw/`. A data_dir that is given but unusable is an
     error, never a silent fallback to other data.
  2. Fashion-MNIST only: Debian's `dataset-fashion-mnist` package, /usr/share/datasets/fashion-mnist.
  3. torchvision's download into `download_root` (needs the network).
"""

import gzip
import hashlib
import math
import os
import struct
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from data.atomic_folder import atomic_folder, claim, up_to_date
from data.errors import DataError
from data.shards import WRITTEN_BY, file_entries, fingerprint, save_manifest, write_manifest, write_shards

SPLIT_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
DEFAULT_DOWNLOAD_ROOT = os.path.join(os.path.expanduser("~"), ".cache", "mnist_idx")


@dataclass(frozen=True)
class DatasetSpec:
    torchvision_name: str  # class in torchvision.datasets, and its folder name under root
    mean: float  # over the training images, pixel values in [0, 1]
    std: float
    system_dir: str | None  # where a distribution package installs the idx files
    how_to_get: str


DATASETS = {
    "mnist": DatasetSpec(
        "MNIST",
        0.1307,
        0.3081,
        None,
        "pass --data_dir DIR holding the four MNIST idx files (from a machine with network: "
        "python -c \"import torchvision; torchvision.datasets.MNIST('DIR', download=True)\"), "
        "or use --dataset fashion_mnist",
    ),
    "fashion_mnist": DatasetSpec(
        "FashionMNIST",
        0.2860,
        0.3530,
        "/usr/share/datasets/fashion-mnist",
        "install it with `apt-get install dataset-fashion-mnist`, or pass --data_dir DIR holding the "
        "four Fashion-MNIST idx files",
    ),
}


class ImageClassificationTensors(Dataset):
    """uint8 images [N, H, W] and int64 labels [N] in memory; indexing with a list returns a batch."""

    def __init__(self, images, labels, mean, std):
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images, self.labels, self.mean, self.std = images, labels, mean, std

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return {"image": self.images[index], "label": self.labels[index]}

    def __getitems__(self, indices):
        # DataLoader's fetcher calls this with a whole batch of indices: one gather instead of a
        # Python call and a stack per sample. Same keys as the parquet shards' batches.
        index = torch.as_tensor(indices, dtype=torch.long)
        return {"image": self.images[index], "label": self.labels[index]}

    def subset(self, max_samples):
        """The first `max_samples` samples (deterministic, so every process agrees)."""
        if max_samples is None or max_samples >= len(self):
            return self
        return ImageClassificationTensors(self.images[:max_samples], self.labels[:max_samples], self.mean, self.std)


def identity_collate(batch):
    """`collate_fn` for ImageClassificationTensors, handing on unchanged the batch `__getitems__`
    already built (torch's default collate would try to index the dict as a list of samples)."""
    return batch


def normalize_images(images, mean, std):
    """uint8 [B, 28, 28] (in memory) or [B, 784] (parquet bytes) -> float [B, 1, 28, 28], standardised;
    runs on whatever device the batch is on."""
    return (images.reshape(len(images), 1, 28, 28).float() / 255.0 - mean) / std


def augment_images(images, seed, max_shift=2):
    """Light augmentation on a uint8 batch [B, 28, 28] or [B, 784] -> [B, 28, 28]: each image shifted
    by up to `max_shift` pixels in x and y (zero fill) and flipped left-right with probability 1/2.

    One gather for the whole batch instead of a transform per sample. The randomness comes only from
    `seed`, so a caller that derives it from the data position gets the same augmentation again after
    a resume.
    """
    generator = torch.Generator().manual_seed(seed)
    images = images.reshape(len(images), 28, 28)
    n, device = len(images), images.device
    shifts = torch.randint(-max_shift, max_shift + 1, (2, n, 1), generator=generator).to(device)
    flip = (torch.rand(n, 1, generator=generator) < 0.5).to(device)
    base = torch.arange(28, device=device)
    rows = base + shifts[0]  # [n, 28]: source row of each output row
    cols = torch.where(flip, 27 - base, base) + shifts[1]
    padded = torch.nn.functional.pad(images, (max_shift,) * 4)  # out-of-range sources read the zero border
    rows, cols = rows + max_shift, cols + max_shift
    return padded[torch.arange(n, device=device)[:, None, None], rows[:, :, None], cols[:, None, :]]


def _find_split_files(folder, split):
    """Paths of (images, labels) for `split` in `folder` (raw or .gz), or None if either is missing."""
    found = []
    for stem in SPLIT_FILES[split]:
        candidates = [os.path.join(folder, stem + suffix) for suffix in ("", ".gz")]
        path = next((p for p in candidates if os.path.isfile(p)), None)
        if path is None:
            return None
        found.append(path)
    return tuple(found)


def _find_idx_folder(root, spec):
    """The folder under `root` that holds all four idx files, trying torchvision's layout too."""
    for folder in (root, os.path.join(root, spec.torchvision_name, "raw")):
        if all(_find_split_files(folder, split) for split in SPLIT_FILES):
            return folder
    return None


def _read_idx(path, ndim):
    """One uint8 idx file (raw or .gz) as a tensor with `ndim` dimensions.

    Our own reader: torchvision's is a slow import, paid once per process (docs/speed.md), and only
    the download needs torchvision. Format: two zero bytes, type 0x08 (uint8), the number of
    dimensions, each dimension as a big-endian uint32, then the data.
    """
    try:
        with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
            payload = f.read()
    except (OSError, EOFError) as e:  # not gzip, or a gzip stream cut short
        raise DataError(
            f"{path} is not a valid idx file ({type(e).__name__}: {e}); delete it and fetch the dataset again"
        ) from None
    header_size = 4 + 4 * ndim
    if len(payload) < header_size or payload[:4] != bytes([0, 0, 0x08, ndim]):
        raise DataError(
            f"{path} is not a valid idx file (bad header: expected a uint8 array of {ndim} "
            "dimensions); delete it and fetch the dataset again"
        )
    shape = struct.unpack(f">{ndim}I", payload[4:header_size])
    if len(payload) - header_size != math.prod(shape):
        raise DataError(
            f"{path} is not a valid idx file (header says {shape}, {math.prod(shape)} bytes, but "
            f"{len(payload) - header_size} follow); delete it and fetch the dataset again"
        )
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8, offset=header_size).reshape(shape)


def _load_folder(folder, spec):
    splits = {}
    for split in SPLIT_FILES:
        images_path, labels_path = _find_split_files(folder, split)
        images, labels = _read_idx(images_path, 3), _read_idx(labels_path, 1).long()
        if len(images) != len(labels) or len(images) == 0:
            raise DataError(
                f"{images_path} has {len(images)} images but {labels_path} has {len(labels)} "
                "labels; the files are truncated or from different datasets, fetch them again"
            )
        if images.shape[1:] != (28, 28):
            raise DataError(
                f"{images_path} holds {tuple(images.shape[1:])} images, not 28x28; it is not an MNIST-style image file"
            )
        if labels.min() < 0 or labels.max() > 9:
            raise DataError(f"{labels_path} has labels outside 0..9; it is not an MNIST-style label file")
        splits[split] = ImageClassificationTensors(images, labels, spec.mean, spec.std)
    return splits["train"], splits["test"]


def _download(spec, download_root):
    import torchvision

    cls = getattr(torchvision.datasets, spec.torchvision_name)
    try:
        cls(download_root, train=True, download=True)
    except Exception as e:  # torchvision raises RuntimeError/URLError/OSError depending on what failed
        # torchvision's message is one block per mirror; its last line is the underlying cause
        return f"download failed: {[line for line in str(e).splitlines() if line.strip()][-1].strip()}"
    return None


def check_data_dir(name, data_dir):
    """The folder under `data_dir` that holds the four idx files of dataset `name`, found without
    reading them (cheap enough to run before any process starts training); DataError if none."""
    spec = DATASETS[name]
    if not os.path.isdir(data_dir):
        raise DataError(f"--data_dir {data_dir} does not exist; fix the path, or to get the data: {spec.how_to_get}")
    folder = _find_idx_folder(data_dir, spec)
    if folder is None:
        wanted = ", ".join(stem + "[.gz]" for stems in SPLIT_FILES.values() for stem in stems)
        raise DataError(
            f"no {name} idx files in {data_dir} (looked for {wanted} there and in "
            f"{os.path.join(data_dir, spec.torchvision_name, 'raw')}); {spec.how_to_get}"
        )
    return folder


def _on_disk(spec, download_root):
    """(folder, where it is) of idx files already on disk, in load_mnist's order, or (None, None)."""
    for root, where in (
        (spec.system_dir, "Debian package dataset-fashion-mnist"),
        (download_root, "torchvision download cache"),
    ):
        folder = _find_idx_folder(root, spec) if root is not None else None
        if folder is not None:
            return folder, where
    return None, None


def mnist_on_disk(name, data_dir=None, download_root=DEFAULT_DOWNLOAD_ROOT):
    """True when load_mnist(name, data_dir, download_root) would read files already there and download
    nothing: then every process can read its own copy at once instead of waiting for the first."""
    if name not in DATASETS:
        return False
    if data_dir is not None:
        return _find_idx_folder(data_dir, DATASETS[name]) is not None
    return _on_disk(DATASETS[name], download_root)[0] is not None


def load_mnist(name, data_dir=None, download_root=DEFAULT_DOWNLOAD_ROOT):
    """Return (train, test, source): two ImageClassificationTensors and a line saying where they came from.

    Raises DataError with a one-line message when nothing usable is found.
    """
    if name not in DATASETS:
        raise DataError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}")
    spec = DATASETS[name]
    if data_dir is not None:
        folder = check_data_dir(name, data_dir)
        train, test = _load_folder(folder, spec)
        return train, test, f"{folder} (--data_dir)"

    folder, where = _on_disk(spec, download_root)
    why = None
    if folder is None:
        why = _download(spec, download_root)
        folder, where = _find_idx_folder(download_root, spec), "torchvision download cache"
    if folder is None:
        looked = ", ".join(root for root in (spec.system_dir, download_root) if root is not None)
        raise DataError(f"{name} not found (looked in {looked}; {why or 'download gave no files'}); {spec.how_to_get}")
    train, test = _load_folder(folder, spec)
    return train, test, f"{folder} ({where})"


# ---------------------------------------------------------------------------------------- written out

CLASS_NAMES = {
    "mnist": [str(d) for d in range(10)],
    "fashion_mnist": [
        "T-shirt_top",
        "Trouser",
        "Pullover",
        "Dress",
        "Coat",
        "Sandal",
        "Shirt",
        "Sneaker",
        "Bag",
        "Ankle_boot",
    ],
}


def prepare_mnist_shards(dataset, output_dir, num_shards=8, rows_per_group=32, data_dir=None, force=False):
    """Write train and test shards of MNIST or Fashion-MNIST into output_dir (atomically, unless
    already up to date); return output_dir."""
    train, test, source = load_mnist(dataset, data_dir)
    arguments = {"dataset": dataset, "num_shards": num_shards, "rows_per_group": rows_per_group}
    inputs = [{"dataset": dataset, "blake2b": _hash_tensors(train.images, train.labels, test.images, test.labels)}]
    if up_to_date(output_dir, inputs, arguments, force):
        return output_dir
    with atomic_folder(output_dir, force, fingerprint(inputs, arguments)) as tmp:
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


def write_image_folders(dataset, output_dir, data_dir=None, max_per_class=None, force=False):
    """Write train and validation (the test split) as folders of grayscale PNGs, one per class
    (atomically), and a manifest.json listing them; return output_dir."""
    from PIL import Image

    claim(output_dir, force)  # a folder of someone else's images: refused before the dataset is read
    train, test, source = load_mnist(dataset, data_dir)
    counts = {}
    with atomic_folder(output_dir, force) as tmp:
        for split, ds in (("train", train), ("validation", test)):
            written = [0] * 10
            for name in CLASS_NAMES[dataset]:
                os.makedirs(os.path.join(tmp, split, name))
            for i, (image, label) in enumerate(zip(ds.images.numpy(), ds.labels.tolist(), strict=True)):
                if max_per_class is None or written[label] < max_per_class:
                    Image.fromarray(image, mode="L").save(
                        os.path.join(tmp, split, CLASS_NAMES[dataset][label], f"{i:05d}.png")
                    )
                    written[label] += 1
            counts[split] = sum(written)
        save_manifest(
            tmp,
            {
                "written_by": WRITTEN_BY,
                "kind": "image_folders",
                "dataset": dataset,
                "max_per_class": max_per_class,
                "files": file_entries(tmp, hashed=False),
            },
            indent=None,
        )
    print(
        f"wrote {counts['train']} train + {counts['validation']} validation PNGs of {dataset} ({source}) "
        f"to {output_dir}/{{train,validation}}/CLASS_NAME/"
    )
    return output_dir
