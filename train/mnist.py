"""Train a small ConvNet on MNIST or Fashion-MNIST with Hugging Face Accelerate.

The same file runs on a laptop CPU, one or many GPUs, or several nodes; the layout comes from the
accelerate config alone:

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml train/mnist.py \
        --dataset fashion_mnist --output_dir runs/fashion_mnist

Writes model.safetensors, all_results.json (final metrics) and args.json to --output_dir.
"""

import os
import sys

if __package__ in (None, ""):  # run as a file: Python put train/ on sys.path, not the repo root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate.utils import gather_object
from torch.utils.data import DataLoader

from data import DATASETS, augment_images, check_data_dir, identity_collate, load_mnist, mnist_on_disk, normalize_images
from data.loader import pinned, sharded_loader
from data.mnist import prepare_mnist_shards
from data.shards import shards_in
from data.sources import ParquetSource
from data.workers import loader_workers
from train.core.accelerator import main_process_first
from train.core.evaluation import evaluate_classifier
from train.core.flags import add_optimizer_args, make_parser
from train.core.fsdp import fsdp_launch
from train.core.loop import TrainingLoop
from train.core.parser import positive_int
from train.core.run import run, start_run

TASK = "mnist"  # the run's name in its checkpoints: another task's checkpoint is refused
METRICS = ["eval_accuracy", "eval_loss"]  # its evaluation's metrics, the headline first
MODELS = {
    "convnet": {"channels": (16, 32), "kernel_sizes": (5, 5)},  # the seed notes' model: 2.8 M multiply-adds
    "convnet_fast": {"channels": (16, 32), "kernel_sizes": (5, 3), "norm_after_pool": True},  # 1.2 M: the old recipe
    # 1.1 M: the recipe; a hidden layer and a narrower second convolution: more accuracy per multiply-add
    "convnet_mlp": {"channels": (16, 24), "kernel_sizes": (5, 3), "norm_after_pool": True, "hidden": 128},
    "convnet_wide": {"channels": (32, 64), "kernel_sizes": (3, 3)},
}  # 3.9 M: more accuracy for more compute (docs/speed.md)


def parse_args(argv=None):
    parser = make_parser(__doc__)
    data, model = parser.groups["data"], parser.groups["model"]
    data.add_argument("--dataset", choices=sorted(DATASETS), default="fashion_mnist", help="Which dataset.")
    data.add_argument(
        "--data_dir",
        type=str,
        default=None,
        help="Folder with the four idx files (raw or .gz); default: system copy, then download.",
    )
    data.add_argument(
        "--max_train_samples",
        type=positive_int,
        default=None,
        help="Train on the first N training samples only (quick runs, tests).",
    )
    data.add_argument(
        "--max_eval_samples", type=positive_int, default=None, help="Evaluate on the first N test samples only."
    )
    data.add_argument(
        "--streaming",
        action="store_true",
        help="Read parquet shards through the rank x worker sharded iterable path instead of "
        "in-memory tensors; writes the shards first if --parquet_dir has none.",
    )
    data.add_argument(
        "--parquet_dir", type=str, default=None, help="Parquet shards for --streaming (default: runs/parquet/DATASET)."
    )
    data.add_argument(
        "--dataloader_num_workers", type=int, default=0, help="DataLoader workers; 0 is fastest for in-memory tensors."
    )
    data.add_argument(
        "--augment",
        action="store_true",
        help="Random 2-pixel shifts and horizontal flips, applied to each batch as tensors.",
    )
    model.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="convnet",
        help="convnet: the seed's 5x5 16/32-channel ConvNet; convnet_fast: 5x5 then 3x3, BatchNorm "
        "after pooling (2.3x fewer multiply-adds); convnet_mlp: convnet_fast with 16/24 channels "
        "and a 128-unit hidden layer before the output (the recipe); convnet_wide: 3x3, 32/64.",
    )
    model.add_argument(
        "--no_channels_last",
        dest="channels_last",
        action="store_false",
        help="Keep the NCHW layout (NHWC convolutions are faster on CPUs: docs/speed.md).",
    )
    add_optimizer_args(parser, learning_rate=2e-3, train_batch_size=64, eval_batch_size=500, label_smoothing=0.0)
    parser.set_defaults(output_dir="runs/mnist")
    return parser.parse_args(argv)


class ConvNet(nn.Module):
    """2 x [conv, BN, ReLU, maxpool], then linear to 10 (or through a hidden ReLU layer of `hidden`
    units); by default the seed notes' model (5x5 convolutions, 16 -> 32 channels).

    Pooling runs before the ReLU: max commutes with a monotone function, so outputs and gradients are
    bitwise those of the seed's order (tested), and the ReLU touches 4x fewer values.
    norm_after_pool moves BatchNorm after the pooling too (not equivalent, a different model): the
    28x28 BatchNorm was a large part of a CPU step, and at 14x14 it touches a quarter of the values.
    The hidden layer is the cheapest accuracy found for the recipe (docs/speed.md): one linear map
    from the 7x7 features to 10 classes held it lower, and 128 units cost fewer multiply-adds than
    the 8 channels taken off the second convolution.
    """

    def __init__(self, channels=(16, 32), kernel_sizes=(5, 5), norm_after_pool=False, hidden=None, num_classes=10):
        super().__init__()
        (c1, c2), (k1, k2) = channels, kernel_sizes

        def block(c_in, c_out, k):
            conv, norm, pool = nn.Conv2d(c_in, c_out, k, padding=k // 2), nn.BatchNorm2d(c_out), nn.MaxPool2d(2)
            return [conv, pool, norm, nn.ReLU()] if norm_after_pool else [conv, norm, pool, nn.ReLU()]

        self.features = nn.Sequential(*block(1, c1, k1), *block(c1, c2, k2))
        features = 7 * 7 * c2
        self.classifier = (
            nn.Linear(features, num_classes)
            if hidden is None
            else nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))
        )

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


def main(args):
    # One task, top to bottom, in the sections every script shares (nanoGPT's train.py is the model):
    # longer than 60 lines because it holds both data paths, not because it hides anything.
    # ---------------------------------------------------------------- checks, accelerator
    if args.data_dir and not args.streaming:
        check_data_dir(args.dataset, args.data_dir)
    accelerator = start_run(args, TASK)

    # ---------------------------------------------------------------- data
    parquet_dir = args.parquet_dir or os.path.join("runs", "parquet", args.dataset)
    mean, std = DATASETS[args.dataset].mean, DATASETS[args.dataset].std

    def load():  # one process downloads or writes shards, the others then read
        if not args.streaming:
            return load_mnist(args.dataset, args.data_dir)
        if not shards_in(parquet_dir, "train") and accelerator.is_main_process:
            prepare_mnist_shards(args.dataset, parquet_dir, data_dir=args.data_dir)

    # idx files already on disk for every process: each reads its own copy at once (in turn, the last
    # one started training half a second late on 2 cores, and the first waited for it). Decided
    # together: a process that took the other path would wait in a different collective.
    on_disk = not args.streaming and all(gather_object([mnist_on_disk(args.dataset, args.data_dir)]))
    loaded = load() if on_disk else main_process_first(accelerator, load)
    if args.streaming:
        source = f"{parquet_dir} (parquet shards, sharded iterable)"
        train_loader = sharded_loader(
            ParquetSource(shards_in(parquet_dir, "train"), max_rows=args.max_train_samples),
            args.per_device_train_batch_size,
            rank=accelerator.process_index,
            world_size=accelerator.num_processes,
            device=accelerator.device,
            seed=args.seed,
            train=True,
            num_workers=args.dataloader_num_workers,
        )
        eval_loader = sharded_loader(
            ParquetSource(shards_in(parquet_dir, "test"), max_rows=args.max_eval_samples),
            args.per_device_eval_batch_size,
            rank=accelerator.process_index,
            world_size=accelerator.num_processes,
            device=accelerator.device,
            seed=args.seed,
            train=False,
            num_workers=args.dataloader_num_workers,
        )
        num_train, num_eval = train_loader.dataset.plan.num_samples, eval_loader.dataset.plan.num_samples
    else:
        train_set, eval_set, source = loaded
        train_set, eval_set = train_set.subset(args.max_train_samples), eval_set.subset(args.max_eval_samples)
        num_train, num_eval = len(train_set), len(eval_set)
        # drop_last: every optimizer step sees one full global batch; the dropped tail differs each epoch.
        pin = pinned(accelerator.device)
        # loader_workers: workers not forked from this process, and a SIGTERM that reaches the rank alone
        train_loader = DataLoader(
            train_set,
            batch_size=args.per_device_train_batch_size,
            shuffle=True,
            drop_last=True,
            collate_fn=identity_collate,
            pin_memory=pin,
            **loader_workers(args.dataloader_num_workers, train_set, identity_collate),
        )
        eval_loader = DataLoader(
            eval_set,
            batch_size=args.per_device_eval_batch_size,
            collate_fn=identity_collate,
            pin_memory=pin,
            **loader_workers(args.dataloader_num_workers, eval_set, identity_collate),
        )
    accelerator.print(f"dataset={args.dataset} train={num_train} test={num_eval} source={source}")

    # ---------------------------------------------------------------- model, optimizer, schedule
    # FSDP shards contiguous parameters only (torch 2.15 refuses channels_last ones, on GPUs too)
    memory_format = torch.channels_last if args.channels_last and not fsdp_launch() else torch.contiguous_format
    model = ConvNet(**MODELS[args.model]).to(memory_format=memory_format)

    def to_inputs(images):
        return normalize_images(images, mean, std).contiguous(memory_format=memory_format)

    # fused: one kernel for all parameters instead of a loop of small ops per parameter
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay, fused=True)
    if args.streaming:  # already sharded: prepare() would shard again or dispatch from rank 0
        model, optimizer = accelerator.prepare(model, optimizer)
    else:
        model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)

    # ---------------------------------------------------------------- train
    loop = TrainingLoop(
        accelerator,
        args,
        TASK,
        model,
        optimizer,
        train_loader,
        evaluate=lambda: evaluate_classifier(accelerator, model, eval_loader, to_inputs),
        headline=METRICS[0],
        metrics=METRICS,
    )
    for batch in loop.batches():
        with accelerator.accumulate(model):
            images = batch["image"]
            if args.augment:  # seeded by the data position, so a resumed run draws the same shifts and flips
                images = augment_images(
                    images, hash((args.seed, loop.epoch, loop.batches_done, accelerator.process_index))
                )
            loss = F.cross_entropy(model(to_inputs(images)), batch["label"], label_smoothing=args.label_smoothing)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        loop.after_batch(loss)

    # ---------------------------------------------------------------- save
    return loop.finish({"dataset": args.dataset, "data_source": source})


if __name__ == "__main__":
    run(main, parse_args())
