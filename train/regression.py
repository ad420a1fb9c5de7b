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
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

from train.checkpoint import (check_output_dir, data_position, find_checkpoint, load_checkpoint, prepare_output_dir,
                              save_checkpoint)
from train.cli import make_parser, positive_float, positive_int, run
from train.accelerator import announce, make_accelerator
from train.schedule import plan_steps
from train.tracking import save_final

SCRIPT = "regression"  # recorded in checkpoints, so another script's checkpoint is refused
NUM_FEATURES = 20


def parse_args(argv=None):
    parser = make_parser(__doc__)
    data, optimization = parser.groups["data"], parser.groups["optimization"]
    data.add_argument("--num_train_samples", type=positive_int, default=1024, help="Synthetic training samples.")
    data.add_argument("--num_eval_samples", type=positive_int, default=257, help="Synthetic held-out samples.")
    optimization.add_argument("--per_device_train_batch_size", type=positive_int, default=16,
                              help="Batch size per process.")
    optimization.add_argument("--per_device_eval_batch_size", type=positive_int, default=64,
                              help="Eval batch per process.")
    optimization.add_argument("--learning_rate", type=positive_float, default=0.05, help="SGD learning rate.")
    parser.set_defaults(num_train_epochs=2, output_dir="runs/regression")
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


def main(args):
    # ---------------------------------------------------------------- accelerator
    check_output_dir(args)  # before any process waits on another
    accelerator = make_accelerator(args)
    set_seed(args.seed)
    global_batch_size = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    announce(accelerator, global_batch_size, args)
    prepare_output_dir(accelerator, args)

    # ---------------------------------------------------------------- data
    train_set, eval_set = make_data(args.num_train_samples, args.num_eval_samples, args.seed)
    train_loader = DataLoader(train_set, batch_size=args.per_device_train_batch_size, shuffle=True, drop_last=True)
    eval_loader = DataLoader(eval_set, batch_size=args.per_device_eval_batch_size)

    # ---------------------------------------------------------------- model, optimizer
    model = nn.Linear(NUM_FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate)

    # ---------------------------------------------------------------- prepare
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    max_train_steps, num_train_epochs = plan_steps(args, len(train_loader))

    # ---------------------------------------------------------------- resume
    completed_steps, starting_epoch, skip_batches = 0, 0, 0
    if resume_from := find_checkpoint(accelerator, args):
        meta = load_checkpoint(accelerator, resume_from, SCRIPT, model, optimizer, None)
        completed_steps, starting_epoch, skip_batches = meta["step"], meta["data"]["epoch"], meta["data"]["next_batch"]

    def save(epoch, batches_done):
        save_checkpoint(accelerator, args, SCRIPT, completed_steps, model, optimizer, None,
                        data_position(epoch, batches_done, len(train_loader)))

    # ---------------------------------------------------------------- train
    for epoch in range(starting_epoch, num_train_epochs):
        if completed_steps >= max_train_steps:
            break
        train_loader.set_epoch(epoch)
        batches_done = skip_batches if epoch == starting_epoch else 0
        # after set_epoch, so the skipped batches are this epoch's (bit-identical resume)
        epoch_loader = accelerator.skip_first_batches(train_loader, batches_done) if batches_done else train_loader
        for x, y in epoch_loader:
            batches_done += 1
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(x), y)  # mean over this process's batch; DDP averages over processes
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if not accelerator.sync_gradients:
                continue
            completed_steps += 1
            if isinstance(args.checkpointing_steps, int) and completed_steps % args.checkpointing_steps == 0:
                save(epoch, batches_done)
            if completed_steps >= max_train_steps:
                break
        if args.checkpointing_steps == "epoch":
            save(epoch, batches_done)

    # ---------------------------------------------------------------- evaluate, save
    model.eval()
    squared_error, count = 0.0, 0
    with torch.no_grad():
        for x, y in eval_loader:
            errors = accelerator.gather_for_metrics((model(x) - y).pow(2))
            squared_error += errors.sum().item()
            count += errors.numel()
    results = {"eval_mse": squared_error / count, "eval_samples": count, "step": completed_steps,
               "epoch": num_train_epochs, "resumed_from": resume_from, "world_size": accelerator.num_processes,
               "global_batch_size": global_batch_size}
    save_final(accelerator, model, args, results)
    accelerator.print(f"final eval_mse={results['eval_mse']:.6f} eval_samples={count} steps={completed_steps} "
                      f"-> {args.output_dir}")
    # DDP's reducer holds gloo state: left for interpreter exit, it can abort a finished run (SIGABRT,
    # "terminate called without an active exception"), so drop it before the group goes, after a barrier
    del model, optimizer
    accelerator.free_memory()  # the accelerator's own references to them
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return results


if __name__ == "__main__":
    run(main, parse_args())
