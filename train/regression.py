"""Linear regression (20 random features -> 1 target) with plain SGD: the smallest script, and the
testbed for exact data-parallel math. With the same global batch, W processes average their
gradients into exactly the gradient one process computes, so the final weights agree to float
rounding whatever the process count:

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml train/regression.py \
        --per_device_train_batch_size 16 --output_dir runs/regression_2proc
    accelerate launch --config_file accelerate_configs/cpu.yaml train/regression.py \
        --per_device_train_batch_size 32 --output_dir runs/regression_1proc

Writes model.safetensors, all_results.json and args.json to --output_dir.
"""

import os
import sys

if __package__ in (None, ""):  # run as a file: Python put train/ on sys.path, not the repo root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from train.core.flags import make_parser
from train.core.loop import TrainingLoop
from train.core.parser import positive_float, positive_int
from train.core.run import run, start_run

TASK = "regression"  # the run's name in its checkpoints: another task's checkpoint is refused
METRICS = ["eval_mse"]  # its evaluation's metrics, the headline first
NUM_FEATURES = 20


def parse_args(argv=None):
    parser = make_parser(__doc__)
    data, optimization = parser.groups["data"], parser.groups["optimization"]
    data.add_argument("--num_train_samples", type=positive_int, default=1024, help="Synthetic training samples.")
    data.add_argument("--num_eval_samples", type=positive_int, default=257, help="Synthetic held-out samples.")
    optimization.add_argument(
        "--per_device_train_batch_size", type=positive_int, default=16, help="Batch size per process."
    )
    optimization.add_argument(
        "--per_device_eval_batch_size", type=positive_int, default=64, help="Eval batch per process."
    )
    optimization.add_argument("--learning_rate", type=positive_float, default=0.05, help="SGD learning rate.")
    parser.set_defaults(num_train_epochs=2, logging_steps=8, output_dir="runs/regression")
    return parser.parse_args(argv)


def make_data(num_train_samples, num_eval_samples, seed):
    """Train and held-out sets of y = x . w + b + noise with one true (w, b), drawn from a generator
    of their own so the data never depends on the process count or on the global RNG."""
    g = torch.Generator().manual_seed(seed)
    true_w, true_b = torch.randn(NUM_FEATURES, generator=g), 0.5

    def draw(n):
        x = torch.randn(n, NUM_FEATURES, generator=g)
        return TensorDataset(x, (x @ true_w + true_b + 0.1 * torch.randn(n, generator=g)).unsqueeze(1))

    return draw(num_train_samples), draw(num_eval_samples)


def evaluate(accelerator, model, loader):
    """Mean squared error over exactly the held-out set: gather_for_metrics drops the samples the
    prepared loader repeats to give every process the same number of batches."""
    model.eval()
    squared_error, count = 0.0, 0
    with torch.no_grad():
        for x, y in loader:
            errors = accelerator.gather_for_metrics((model(x) - y).pow(2))
            squared_error += errors.sum().item()
            count += errors.numel()
    model.train()
    return {"eval_mse": squared_error / count, "eval_samples": count}


def main(args):
    # ---------------------------------------------------------------- accelerator
    accelerator = start_run(args, TASK)

    # ---------------------------------------------------------------- data, model, optimizer
    train_set, eval_set = make_data(args.num_train_samples, args.num_eval_samples, args.seed)
    train_loader = DataLoader(train_set, batch_size=args.per_device_train_batch_size, shuffle=True, drop_last=True)
    eval_loader = DataLoader(eval_set, batch_size=args.per_device_eval_batch_size)
    model = nn.Linear(NUM_FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)

    # ---------------------------------------------------------------- train
    loop = TrainingLoop(
        accelerator,
        args,
        TASK,
        model,
        optimizer,
        train_loader,
        schedule=False,
        evaluate=lambda: evaluate(accelerator, model, eval_loader),
        headline=METRICS[0],
    )
    for x, y in loop.batches():
        with accelerator.accumulate(model):
            loss = F.mse_loss(model(x), y)  # mean over this process's batch; DDP averages over processes
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        loop.after_batch(loss)

    # ---------------------------------------------------------------- save
    return loop.finish()


if __name__ == "__main__":
    run(main, parse_args())
