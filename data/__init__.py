"""Datasets for the training scripts. Rank, world size and worker count are always arguments."""
from data.mnist import (DATASETS, DataError, ImageClassificationTensors, augment_images, check_data_dir,
                        collate_batch, load_mnist, normalize_images)

__all__ = ["DATASETS", "DataError", "ImageClassificationTensors", "augment_images", "check_data_dir",
           "collate_batch", "load_mnist", "normalize_images"]
