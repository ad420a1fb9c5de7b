"""How long a run is and how its learning rate moves: optimizer steps from the prepared loader's
length, linear warmup, then the schedule --lr_scheduler_type names.

constant, linear and cosine are written here (every script has them without transformers): warmup
starts at lr/(W+1), not at 0 as transformers' does (a step at lr 0 changes nothing), and constant
keeps its warmup (transformers calls that constant_with_warmup). Every other name of transformers'
schedules is transformers.get_scheduler's, with --lr_scheduler_kwargs for the ones that take more."""

import math

import torch

from data.errors import fail

OURS = ("constant", "linear", "cosine")
# transformers' SchedulerType names but the two stepped by a metric (reduce_lr_on_plateau, greedy)
TRANSFORMERS = (
    "constant_with_warmup",
    "cosine_with_restarts",
    "polynomial",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
)
SCHEDULES = OURS + TRANSFORMERS


def plan_steps(batches_per_epoch, gradient_accumulation_steps, num_train_epochs, max_train_steps=None):
    """(max_train_steps, num_train_epochs) from the per-process batch count of the prepared loader."""
    steps_per_epoch = math.ceil(batches_per_epoch / gradient_accumulation_steps)
    if steps_per_epoch == 0:
        fail(
            "the training set is smaller than one global batch; lower "
            "--per_device_train_batch_size or use more training samples"
        )
    max_train_steps = max_train_steps or num_train_epochs * steps_per_epoch
    return max_train_steps, math.ceil(max_train_steps / steps_per_epoch)


def warmup_steps(num_warmup_steps, warmup_ratio, num_training_steps):
    """--num_warmup_steps, else --warmup_ratio of the run's steps (rounded up, as transformers does)."""
    return num_warmup_steps or math.ceil((warmup_ratio or 0.0) * num_training_steps)


def make_scheduler(optimizer, name, num_warmup_steps, num_training_steps, kwargs=None):
    """A LambdaLR stepped once per optimizer step: `name` one of SCHEDULES, after linear warmup."""
    if name not in OURS:
        from transformers import get_scheduler

        try:
            return get_scheduler(
                name,
                optimizer,
                num_warmup_steps=num_warmup_steps,
                num_training_steps=num_training_steps,
                scheduler_specific_kwargs=kwargs or {},
            )
        except (TypeError, ValueError) as e:
            fail(
                f"--lr_scheduler_type {name}: {' '.join(str(e).split())[:200]}; pass what it needs as "
                "--lr_scheduler_kwargs '{\"name\": value}' (transformers' scheduler arguments)"
            )
    if kwargs:
        fail(f"--lr_scheduler_kwargs: --lr_scheduler_type {name} takes none; leave them out")

    def lr_lambda(step):
        if step < num_warmup_steps:
            return (step + 1) / (num_warmup_steps + 1)
        progress = min(1.0, (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps))
        if name == "linear":
            return 1.0 - progress
        if name == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
