"""The two Fashion-MNIST training setups that loop_overhead.py and step_phases.py put side by side in
their worker processes, built the same way for both:

- raw: bench/reference/raw_ddp_mnist.py's objects (DistributedSampler loader, torch DDP without
  buffer broadcast, the seed's ConvNet in channels_last, fused AdamW, autocast like accelerate's);
- ours: train/mnist.py's objects (make_accelerator; the prepared model, optimizer, loader and
  scheduler) inside train/core/loop.py's real TrainingLoop.

Same data, same initial weights, 50 samples per process. The steps themselves stay in each bench,
since each times them its own way. Imported by the workers only: it imports torch.
"""

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from bench.harness import MNIST_BATCH, Batches
from data import identity_collate, load_mnist, normalize_images
from train import mnist
from train.core.accelerator import make_accelerator
from train.core.loop import TrainingLoop


class MnistBench:
    """The accelerator, the data and the model recipe both loops share."""

    def __init__(self, data_dir, log_dir, mixed_precision, samples=None):
        # a run that never ends by itself: each bench decides how many steps to take
        self.script_args = mnist.parse_args(
            [
                "--mixed_precision",
                mixed_precision,
                "--output_dir",
                log_dir,
                "--max_train_steps",
                str(10**9),
                "--metric_for_best_model",
                "none",
                "--per_device_train_batch_size",
                str(MNIST_BATCH),
                "--lr_scheduler_type",
                "constant",
            ]
        )
        self.accelerator = make_accelerator(self.script_args)
        self.bf16 = self.accelerator.mixed_precision == "bf16"
        train_set, _, _ = load_mnist("fashion_mnist", data_dir)
        self.train_set = train_set.subset(samples) if samples else train_set

    def to_inputs(self, images):
        return normalize_images(images, self.train_set.mean, self.train_set.std).contiguous(
            memory_format=torch.channels_last
        )

    def autocast(self):
        """What accelerate's autocast does, for the raw loops."""
        return torch.autocast("cpu", dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()

    def model_and_optimizer(self):
        torch.manual_seed(42)  # the same initial weights for every loop
        model = mnist.ConvNet().to(memory_format=torch.channels_last)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, fused=True)

    def raw(self):
        """A raw DDP model, its optimizer, and its batches: (loader, sampler) and an endless Batches."""
        model, optimizer = self.model_and_optimizer()
        sampler = DistributedSampler(self.train_set, shuffle=True, seed=42, drop_last=True)
        loader = DataLoader(
            self.train_set, batch_size=MNIST_BATCH, sampler=sampler, drop_last=True, collate_fn=identity_collate
        )
        return DDP(model, broadcast_buffers=False), optimizer, loader, Batches(loader, sampler.set_epoch)

    def ours(self, script):
        """train/mnist.py's prepared model and optimizer, and the TrainingLoop that runs them."""
        model, optimizer = self.model_and_optimizer()
        loader = DataLoader(
            self.train_set, batch_size=MNIST_BATCH, shuffle=True, drop_last=True, collate_fn=identity_collate
        )
        model, optimizer, loader = self.accelerator.prepare(model, optimizer, loader)
        loop = TrainingLoop(
            self.accelerator, self.script_args, script, model, optimizer, loader, evaluate=dict
        )  # no evaluation at the epoch ends: the raw loops have none either
        loop.preemption.close()  # a bench saves nothing: a SIGTERM (a timeout's, the launcher's) ends it at once
        return model, optimizer, loop
