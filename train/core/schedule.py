"""How long a run is and how its learning rate moves: optimizer steps from the prepared loader's
length, warmup then constant, linear or cosine."""
import math

import torch

from data.errors import fail


def plan_steps(batches_per_epoch, gradient_accumulation_steps, num_train_epochs, max_train_steps=None):
    """(max_train_steps, num_train_epochs) from the per-process batch count of the prepared loader."""
    steps_per_epoch = math.ceil(batches_per_epoch / gradient_accumulation_steps)
    if steps_per_epoch == 0:
        fail("the training set is smaller than one global batch; lower "
             "--per_device_train_batch_size or use more training samples")
    max_train_steps = max_train_steps or num_train_epochs * steps_per_epoch
    return max_train_steps, math.ceil(max_train_steps / steps_per_epoch)


def make_scheduler(optimizer, name, num_warmup_steps, num_training_steps):
    """LambdaLR for `name` in (constant, linear, cosine) with linear warmup, in optimizer steps."""
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
