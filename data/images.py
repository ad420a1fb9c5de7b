"""Image folders, the layout torchvision's ImageFolder and most image datasets use:

    DIR/CLASS_A/any/depth/img001.png
    DIR/CLASS_B/img002.jpg

Class names come from the subfolder names, sorted; a class's images may sit in nested folders.
PNG, JPEG, BMP and WebP files in any mode (RGB, grayscale, palette, with alpha) and any size are
read as RGB and resized or cropped to one square size by torchvision v2 transforms.

Images are decoded when a batch needs them (in DataLoader workers when there are any). Without
workers, and when the decoded pixels fit the budget of data.image_pixels.keep_budget(), each process
keeps what it decodes: an image it meets again is cropped and flipped from its kept uint8 pixels
instead of being decoded again (with 2 processes each meets half the images in an epoch, so the
second epoch still decodes about half of its share, the third a quarter).
The streaming source puts the same files behind the exactly-once sharded plan of data/sharding.py, and
prepare_image_folder writes a folder as parquet shards of the files' bytes (data.prepare --train_dir).

Random augmentation is seeded by (seed, epoch, sample), not by a global generator: a resumed run,
a different worker count, the streaming path, or a cached image draws the same crops and flips for
the same sample.
"""

import hashlib
import os
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch.utils.data import Dataset

from data.atomic_folder import atomic_folder, report, up_to_date
from data.errors import DataError
from data.image_pixels import crop_and_flip, image_transforms
from data.shards import fingerprint, hash_files, read_manifest, write_manifest, write_table_shards

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp")
TENSOR_OVERHEAD = 1536  # bytes a kept image takes beyond its pixels


@dataclass
class ImageFiles:
    """The images of a folder: paths, integer labels, class names (label i is classes[i]), what the
    scan left out (`ignored`: files without an image extension; `unreadable`: (path, reason)), and
    the folder's typical image size (`median_size`, from the headers the scan reads anyway)."""

    files: list
    labels: list
    classes: list
    ignored: int = 0
    unreadable: tuple = ()
    note: str = ""
    median_size: tuple = None  # (width, height) of the image with the median short side: --image_size's default
    sizes: list = None  # (width, height) of each file, from its header: what decoding it all would take

    def __len__(self):
        return len(self.files)

    def _take(self, ids):
        return replace(
            self,
            files=[self.files[i] for i in ids],
            labels=[self.labels[i] for i in ids],
            sizes=[self.sizes[i] for i in ids] if self.sizes else None,
        )

    def decoded_bytes(self, square=None):
        """The memory every image takes kept as a uint8 RGB tensor, at its own size or as a `square`
        (evaluation keeps its final squares): its pixels and TENSOR_OVERHEAD (3,605 bytes of RSS each
        for 28x28 images, 1.25 KB over the pixels; 1.5 KB leaves a margin)."""
        if square:
            return len(self) * (3 * square**2 + TENSOR_OVERHEAD)
        return sum(3 * w * h + TENSOR_OVERHEAD for w, h in self.sizes) if self.sizes else None

    def subset(self, max_samples, seed):
        """A random `max_samples` of the images (the same on every process), in folder order."""
        if max_samples is None or max_samples >= len(self):
            return self
        ids = np.random.default_rng(seed).permutation(len(self))[:max_samples]
        return self._take(sorted(ids))

    def split(self, fraction, seed):
        """(train, held out): a seeded random `fraction` of each class held out, at least one image."""
        if not 0 < fraction < 1:
            raise DataError(f"--train_val_split {fraction} is not a fraction between 0 and 1; pass e.g. 0.15")
        rng, held = np.random.default_rng(seed), []
        for label in range(len(self.classes)):
            ids = [i for i, y in enumerate(self.labels) if y == label]
            if len(ids) < 2:
                raise DataError(
                    f"class {self.classes[label]!r} has {len(ids)} image(s), too few to hold one out for "
                    "validation; add images or pass --validation_dir"
                )
            held += list(rng.choice(ids, size=max(1, round(fraction * len(ids))), replace=False))
        kept = sorted(set(range(len(self))) - set(held))
        held_out = replace(
            self._take(sorted(held)),
            ignored=0,
            unreadable=(),  # counted once, in the train part
            note=f"held out from --train_dir: {fraction:.0%} of each class",
        )
        return self._take(kept), held_out

    def summary(self):
        text = f"{len(self)} images in {len(self.classes)} classes" + (f" ({self.note})" if self.note else "")
        if self.ignored:
            text += f", ignored {self.ignored} file(s) without an image extension"
        if self.unreadable:
            path, reason = self.unreadable[0]
            text += f", skipped {len(self.unreadable)} unreadable file(s) (first: {path}: {reason})"
        return text


def _header(path):
    """((width, height), None) if PIL recognises the file as an image (it reads the header only),
    else (None, the reason)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.size, None
    except UnidentifiedImageError:
        return None, "not an image"
    except (OSError, ValueError, SyntaxError) as e:
        return None, " ".join(str(e).split())[:100] or type(e).__name__


def scan_image_folder(root, flag, classes=None):
    """The ImageFiles of `root`; `classes`, if given, are the training classes a validation folder
    must draw from. Bad layouts raise DataError naming `flag`, the folder and the fix. Files whose
    header PIL cannot read are left out and counted (summary() says so), so one stray file does not
    stop a run over thousands."""
    if not os.path.isdir(root):
        raise DataError(f"{flag} {root} is not a folder; pass a folder with one subfolder of images per class")
    names = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)) and not d.startswith("."))
    if not names:
        loose = any(f.lower().endswith(IMAGE_EXTENSIONS) for f in os.listdir(root))
        raise DataError(
            f"{flag} {root} has no class subfolders"
            + (" (its images sit directly in it)" if loose else " (it is empty)")
            + f"; put each class's images in {root}/CLASS_NAME/"
        )
    if classes is None and len(names) < 2:
        raise DataError(f"{flag} {root} has one class folder ({names[0]}); a classifier needs at least two classes")
    if classes is not None and (unknown := [n for n in names if n not in classes]):
        raise DataError(
            f"{flag} {root} has class folder(s) the training set does not have: {', '.join(unknown[:5])}; "
            f"the training classes are {', '.join(classes)}"
        )
    classes = classes if classes is not None else names
    files, labels, sizes, ignored, unreadable = [], [], [], 0, []
    for name in names:
        found, paths = 0, []
        for folder, subfolders, filenames in os.walk(os.path.join(root, name), followlinks=True):
            subfolders[:] = [d for d in subfolders if not d.startswith(".")]
            paths += [os.path.join(folder, f) for f in filenames if not f.startswith(".")]
        for path in sorted(paths):
            if not path.lower().endswith(IMAGE_EXTENSIONS):
                ignored += 1
                continue
            size, reason = _header(path)
            if reason:
                unreadable.append((path, reason))
            else:
                files.append(path)
                labels.append(classes.index(name))
                sizes.append(size)
                found += 1
        if not found:
            raise DataError(
                f"{flag}: class folder {os.path.join(root, name)} holds no readable images "
                f"({', '.join(IMAGE_EXTENSIONS)}); add images or remove the folder"
            )
    median_size = sorted(sizes, key=min)[len(sizes) // 2]  # sorted() is stable: the same pick on every run
    return ImageFiles(files, labels, list(classes), ignored, tuple(unreadable), median_size=median_size, sizes=sizes)


def list_images(path):
    """An image file, or the image files under a folder (recursively, sorted), for prediction."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise DataError(f"--predict {path} is neither an image file nor a folder")
    found = sorted(
        os.path.join(folder, f)
        for folder, _, names in os.walk(path, followlinks=True)
        for f in names
        if f.lower().endswith(IMAGE_EXTENSIONS) and not f.startswith(".")
    )
    if not found:
        raise DataError(f"--predict {path} holds no images ({', '.join(IMAGE_EXTENSIONS)})")
    return found


def decode_for_prediction(paths, transform):
    """(the paths that decoded, their images as one uint8 batch or None, one warning line per file that
    did not): prediction goes on past a bad file, as the training scan does."""
    kept, images, warnings = [], [], ""
    for path in paths:
        try:
            images.append(transform(load_image(path)))
            kept.append(path)
        except DataError as e:
            warnings += f"warning: skipped {e}\n"
    return kept, torch.stack(images) if images else None, warnings


def load_image(path):
    """An RGB PIL image; a file that fails to decode past its header raises DataError with its path."""
    from PIL import Image, ImageOps

    try:
        with Image.open(path) as image:
            image = ImageOps.exif_transpose(image)  # camera JPEGs store their rotation in EXIF
            if image.mode == "P" and "transparency" in image.info:
                image = image.convert("RGBA")  # a palette's transparency goes through RGBA without a warning
            return image.convert("RGB")
    except (OSError, ValueError, SyntaxError) as e:
        raise DataError(f"{path} cannot be decoded ({' '.join(str(e).split())[:100]}); delete or replace it") from None


class ImageFolderDataset(Dataset):
    """Map-style: sample i is {"image": uint8 [3, S, S], "label": int}. Training samples (`train`)
    are cropped and flipped by (seed, epoch, sample); evaluation samples resized and centre-cropped.
    With `cache`, what a sample needs is kept after its first decode: the full-size pixels for
    training (each epoch crops them anew), the final square for evaluation."""

    def __init__(self, images, image_size, train=False, seed=0, cache=False):
        self.images, self.image_size, self.train, self.seed = images, image_size, train, seed
        self.transform = None if train else image_transforms(image_size, train=False)
        self.cache, self.epoch = {} if cache else None, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.images)

    def _pixels(self, index):
        if self.cache is not None and index in self.cache:
            return self.cache[index]
        image = load_image(self.images.files[index])
        if self.train:
            from torchvision.transforms.v2 import functional as TF

            pixels = TF.pil_to_tensor(image)
        else:
            pixels = self.transform(image)
        if self.cache is not None:
            self.cache[index] = pixels
        return pixels

    def __getitem__(self, index):
        index = int(index)
        kept = pixels = self._pixels(index)
        if self.train:  # the draw depends on (seed, epoch, sample) only
            generator = torch.Generator().manual_seed(hash((self.seed, self.epoch, index)) & (2**63 - 1))
            pixels = crop_and_flip(pixels, self.image_size, generator)
        if self.cache is not None and pixels.untyped_storage().data_ptr() == kept.untyped_storage().data_ptr():
            pixels = pixels.clone()  # a whole-image crop is a view: what a caller does to it must not reach the cache
        return {"image": pixels, "label": self.images.labels[index]}


class ImageFileSource:
    """The same files as a source for data.sharding.ShardedIterableDataset: one file per read unit,
    so a rank decodes exactly the images of its own batches."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.unit_sizes = [1] * len(dataset)
        self.rows_read = 0
        self._fingerprint = None

    def set_epoch(self, epoch):
        self.dataset.set_epoch(epoch)

    def read(self, ids):
        self.rows_read += len(ids)
        samples = [self.dataset[i] for i in ids.tolist()]
        return {
            "image": torch.stack([s["image"] for s in samples]),
            "label": torch.tensor([s["label"] for s in samples], dtype=torch.long),
        }

    def fingerprint(self):
        if self._fingerprint is None:  # asked for at every checkpoint: hash the file list once
            h = hashlib.blake2b(digest_size=16)
            for path, label in zip(self.dataset.images.files, self.dataset.images.labels, strict=True):
                h.update(f"{os.path.basename(path)}:{label}\n".encode())
            self._fingerprint = h.hexdigest()
        return self._fingerprint


def prepare_image_folder(
    train_dir,
    output_dir,
    validation_dir=None,
    validation_split_percentage=None,
    num_shards=8,
    rows_per_group=32,
    seed=0,
    force=False,
):
    """An image folder → parquet shards of (image: the file's bytes, label, file) + manifest with the
    class names, in output_dir (atomically, unless already up to date)."""
    import pyarrow as pa

    train = scan_image_folder(train_dir, "--train_dir")
    validation = scan_image_folder(validation_dir, "--validation_dir", train.classes) if validation_dir else None
    if validation_split_percentage is not None:
        train, validation = train.split(validation_split_percentage / 100, seed)
    inputs = hash_files(train.files + (validation.files if validation else []))
    for entry, label in zip(inputs, train.labels + (validation.labels if validation else []), strict=True):
        entry["class"] = train.classes[label]  # a file moved to another class is other data
    arguments = {
        "validation_split_percentage": validation_split_percentage,
        "num_shards": num_shards,
        "rows_per_group": rows_per_group,
        "seed": seed,
        "kind": "image_folder",
        "classes": train.classes,
    }
    if up_to_date(output_dir, inputs, arguments, force):
        return read_manifest(output_dir)
    with atomic_folder(output_dir, force, fingerprint(inputs, arguments)) as tmp:
        for split, images in (("train", train), ("validation", validation)):
            if images is None:
                continue
            root = train_dir if split == "train" or validation_dir is None else validation_dir
            table = pa.table(
                {
                    "image": pa.array([open(f, "rb").read() for f in images.files], pa.binary()),
                    "label": pa.array(images.labels, pa.int64()),
                    "file": pa.array([os.path.relpath(f, root) for f in images.files]),
                }
            )
            write_table_shards(table, tmp, split, num_shards, rows_per_group)
        manifest = write_manifest(tmp, inputs, arguments, {"class_names": train.classes})
    report(output_dir, manifest)
    return manifest
