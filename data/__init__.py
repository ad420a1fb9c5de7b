"""The data side of the training scripts. Rank, world size and worker count are always arguments.

Layout (arrows point down; tests/test_imports.py keeps them so):
  prepare.py       python -m data.prepare: the command line only
  local_files.py, images.py, text.py, mnist.py: each kind of input, read and written as shards
  labelled_text.py text and labels for a classifier, tokenized once; wordnet.py the demo's labelled text
  loader.py        ShardedLoader, sharded_loader, check_loader: the sharded dataset under accelerate
  workers.py       loader_workers: how every DataLoader's workers start (not forked from the rank)
  worker_server.py imported only by the server those workers start from
  sharding.py      BatchPlan, epoch_order, ShardedIterableDataset, check_same_plan
  sources.py       TensorSource, ParquetSource, DatasetsSource, as_source, Arrow -> columns
  atomic_folder.py the prepare's output folder: ownership, lock, swap in one step
  shards.py        the on-disk format: shard names, writing, manifest.json, shards_in
  locks.py, errors.py  one writer per folder; UserError, DataError, PlanError
"""

from data.errors import DataError, PlanError, UserError
from data.mnist import (
    DATASETS,
    ImageClassificationTensors,
    augment_images,
    check_data_dir,
    identity_collate,
    load_mnist,
    mnist_on_disk,
    normalize_images,
)
from data.sharding import BatchPlan, ShardedIterableDataset, check_same_plan
from data.shards import read_manifest, shards_in
from data.sources import DatasetsSource, ParquetSource, TensorSource, as_source

__all__ = [
    "BatchPlan",
    "DATASETS",
    "DataError",
    "DatasetsSource",
    "ImageClassificationTensors",
    "ParquetSource",
    "PlanError",
    "ShardedIterableDataset",
    "ShardedLoader",
    "TensorSource",
    "UserError",
    "as_source",
    "augment_images",
    "check_data_dir",
    "check_loader",
    "check_same_plan",
    "identity_collate",
    "load_mnist",
    "mnist_on_disk",
    "normalize_images",
    "read_manifest",
    "shards_in",
    "sharded_loader",
]


def __getattr__(name):
    # data.loader imports accelerate, which `python -m data.prepare` and DataLoader workers never need:
    # its names are imported on first use
    if name in ("ShardedLoader", "check_loader", "sharded_loader"):
        from data import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'data' has no attribute {name!r}")
