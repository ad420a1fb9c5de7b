"""Helpers that more than one script in train/ needs. Plain functions, no Trainer."""
import argparse
import json
import math
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration


def positive_int(text):
    """argparse type: an int >= 1, so `--per_device_train_batch_size 0` fails at parse time."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def add_common_args(parser):
    """Flags every script shares, named as in transformers' run_*_no_trainer.py scripts."""
    parser.add_argument("--num_train_epochs", type=positive_int, default=3, help="Passes over the training data.")
    parser.add_argument("--max_train_steps", type=positive_int, default=None,
                        help="Optimizer steps to run; overrides --num_train_epochs when set.")
    parser.add_argument("--gradient_accumulation_steps", type=positive_int, default=1,
                        help="Micro-batches per optimizer step.")
    parser.add_argument("--seed", type=int, default=42, help="Seed for weights, shuffling and dropout.")
    parser.add_argument("--output_dir", type=str, default=None, help="Where weights and metrics are written.")
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None,
                        help="Overrides the accelerate config's mixed_precision.")
    parser.add_argument("--cpu", action="store_true",
                        help="Train on the CPU even when a GPU is visible (the default when none is).")


def make_accelerator(args, **kwargs):
    """The one Accelerator a script builds.

    cpu=True when no accelerator is visible: accelerate only forms a multi-process CPU group (gloo)
    when told cpu=True, and under torchrun (MULTI_GPU configs) the config's use_cpu never reaches the
    script, so without this a 2-process CPU launch trains two independent copies.
    The seedable sampler makes the shuffle a function of (seed, epoch) alone: the same on every rank
    and reproducible on resume.
    """
    return Accelerator(
        cpu=args.cpu or not torch.accelerator.is_available(),
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
        **kwargs,
    )


def announce(accelerator, global_batch_size):
    """One line per process, then a header from the main process: what is really running, so a
    wrong launch (two independent world-size-1 runs, say) shows at once."""
    # one write() per line, so lines from different processes do not interleave mid-line
    sys.stdout.write(f"process {accelerator.process_index}/{accelerator.num_processes} device={accelerator.device}\n")
    sys.stdout.flush()
    accelerator.wait_for_everyone()
    accelerator.print(f"world_size={accelerator.num_processes} device={accelerator.device.type} "
                      f"distributed_type={accelerator.distributed_type.value} "
                      f"mixed_precision={accelerator.mixed_precision} global_batch_size={global_batch_size} "
                      f"threads_per_process={torch.get_num_threads()}")


def plan_steps(args, batches_per_epoch):
    """(max_train_steps, num_train_epochs) from the per-process batch count of the prepared loader."""
    steps_per_epoch = math.ceil(batches_per_epoch / args.gradient_accumulation_steps)
    if steps_per_epoch == 0:
        raise SystemExit("error: the training set is smaller than one global batch; lower "
                         "--per_device_train_batch_size or use more training samples")
    max_train_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    return max_train_steps, math.ceil(max_train_steps / steps_per_epoch)


def make_scheduler(optimizer, name, num_warmup_steps, num_training_steps, num_processes):
    """LambdaLR for `name` in (constant, linear, cosine) with linear warmup, in optimizer steps.

    Once prepared, accelerate steps a scheduler num_processes times per optimizer step (it assumes
    schedules written for one process), so the lambda divides its tick count by num_processes.
    """
    def lr_lambda(tick):
        step = tick / num_processes
        if step < num_warmup_steps:
            return (step + 1) / (num_warmup_steps + 1)
        progress = min(1.0, (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps))
        if name == "linear":
            return 1.0 - progress
        if name == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)


def write_json(path, payload):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)  # readers never see a half-written file
