"""Train a small ConvNet on MNIST or Fashion-MNIST with Hugging Face Accelerate.

The same file runs on a laptop CPU, one or many GPUs, or several nodes; the layout comes from the
accelerate config alone:

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml train/mnist.py \
        --dataset fashion_mnist --output_dir runs/fashion_mnist

Writes model.safetensors, all_results.json (final metrics) and args.json to --output_dir.
"""
import os
import sys
import time

if __package__ in (None, ""):  # run as a file: Python put train/ on sys.path, not the repo root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from accelerate.utils import gather_object

from data import DATASETS, DataError, augment_images, check_data_dir, collate_batch, load_dataset, normalize_images
from data.loader import ShardedLoader
from data.prepare import prepare
from data.sharding import ParquetSource, PlanError, ShardedIterableDataset, check_same_plan, shards_in
from train.checkpoint import (check_output_dir, data_position, find_checkpoint, load_checkpoint, prepare_output_dir,
                              save_checkpoint)
from train.cli import add_tracking_args, make_parser, positive_float, positive_int, run
from train.accelerator import announce, average_buffers, main_process_first, make_accelerator
from train.schedule import make_scheduler, plan_steps
from train.tracking import log_metrics, plot_metrics, save_final, start_tracking, tracking_kwargs

SCRIPT = "mnist"  # recorded in checkpoints, so another script's checkpoint is refused
USER_ERRORS = (DataError, PlanError)  # bad data or shards: one line for the user, not a traceback
MODELS = {"convnet": {"channels": (16, 32), "kernel_sizes": (5, 5)},  # the seed notes' model: 2.8 M multiply-adds
          "convnet_fast": {"channels": (16, 32), "kernel_sizes": (5, 3), "norm_after_pool": True},  # 1.2 M: the recipe
          "convnet_wide": {"channels": (32, 64), "kernel_sizes": (3, 3)}}  # 3.9 M: the >= 92% recipe (README)


def parse_args(argv=None):
    parser = make_parser(__doc__)
    data, model, optimization = parser.groups["data"], parser.groups["model"], parser.groups["optimization"]
    data.add_argument("--dataset", choices=sorted(DATASETS), default="fashion_mnist", help="Which dataset.")
    data.add_argument("--data_dir", type=str, default=None,
                      help="Folder with the four idx files (raw or .gz); default: system copy, then download.")
    data.add_argument("--max_train_samples", type=positive_int, default=None,
                      help="Train on the first N training samples only (quick runs, tests).")
    data.add_argument("--max_eval_samples", type=positive_int, default=None,
                      help="Evaluate on the first N test samples only.")
    data.add_argument("--streaming", action="store_true",
                      help="Read parquet shards through the rank x worker sharded iterable path instead of "
                           "in-memory tensors; writes the shards first if --parquet_dir has none.")
    data.add_argument("--parquet_dir", type=str, default=None,
                      help="Parquet shards for --streaming (default: runs/parquet/DATASET).")
    data.add_argument("--dataloader_num_workers", type=int, default=0,
                      help="DataLoader workers; 0 is fastest for in-memory tensors.")
    data.add_argument("--augment", action="store_true",
                      help="Random 2-pixel shifts and horizontal flips, applied to each batch as tensors.")
    model.add_argument("--model", choices=sorted(MODELS), default="convnet",
                       help="convnet: the seed's 5x5 16/32-channel ConvNet; convnet_fast: 5x5 then 3x3, BatchNorm "
                            "after pooling (2.3x fewer multiply-adds, the fast recipe); convnet_wide: 3x3, 32/64.")
    model.add_argument("--no_channels_last", dest="channels_last", action="store_false",
                       help="Keep the NCHW layout (NHWC convolutions are ~1.2x faster on CPU here).")
    optimization.add_argument("--per_device_train_batch_size", type=positive_int, default=64,
                              help="Batch size per process; the global batch is this x processes x accumulation.")
    optimization.add_argument("--per_device_eval_batch_size", type=positive_int, default=500,
                              help="Evaluation batch size per process.")
    optimization.add_argument("--learning_rate", type=positive_float, default=2e-3, help="Peak AdamW learning rate.")
    optimization.add_argument("--weight_decay", type=float, default=0.0, help="AdamW weight decay.")
    optimization.add_argument("--lr_scheduler_type", choices=["constant", "linear", "cosine"], default="cosine",
                              help="Learning-rate schedule after warmup.")
    optimization.add_argument("--num_warmup_steps", type=int, default=0, help="Linear warmup steps.")
    optimization.add_argument("--label_smoothing", type=float, default=0.0, help="Cross-entropy label smoothing.")
    parser.groups["tracking"].add_argument("--logging_steps", type=positive_int, default=20,
                                           help="Log the mean training loss every N optimizer steps (each log is a "
                                                "device sync).")
    add_tracking_args(parser)
    parser.set_defaults(output_dir="runs/mnist")
    return parser.parse_args(argv)


class ConvNet(nn.Module):
    """2 x [conv, BN, ReLU, maxpool], then linear to 10; by default the seed notes' model (5x5
    convolutions, 16 -> 32 channels).

    Pooling runs before the ReLU: max commutes with a monotone function, so outputs and gradients are
    bitwise those of the seed's order (tested), and the ReLU touches 4x fewer values (~12% of a step).
    norm_after_pool moves BatchNorm after the pooling too (not equivalent, a different model): on a
    2-core AVX2 CPU the 28x28 BatchNorm was 17% of a step, and at 14x14 it costs a quarter of that.
    """

    def __init__(self, channels=(16, 32), kernel_sizes=(5, 5), norm_after_pool=False, num_classes=10):
        super().__init__()
        (c1, c2), (k1, k2) = channels, kernel_sizes

        def block(c_in, c_out, k):
            conv, norm, pool = nn.Conv2d(c_in, c_out, k, padding=k // 2), nn.BatchNorm2d(c_out), nn.MaxPool2d(2)
            return [conv, pool, norm, nn.ReLU()] if norm_after_pool else [conv, norm, pool, nn.ReLU()]

        self.features = nn.Sequential(*block(1, c1, k1), *block(c1, c2, k2))
        self.classifier = nn.Linear(7 * 7 * c2, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


def evaluate(model, loader, accelerator, to_inputs):
    """Accuracy and loss over exactly the eval set, with BatchNorm statistics averaged over ranks.
    Both loaders repeat samples so every process gets the same number of batches:
    gather_for_metrics drops them for the prepared map-style loader, the `valid` mask for the
    sharded one."""
    average_buffers(accelerator, model)
    model.eval()
    correct = loss_sum = count = 0
    with torch.no_grad():
        for batch in loader:
            logits = model(to_inputs(batch["image"]))
            losses = F.cross_entropy(logits, batch["label"], reduction="none")
            valid = batch.get("valid", torch.ones_like(losses, dtype=torch.bool))
            preds, labels, losses, valid = accelerator.gather_for_metrics(
                (logits.argmax(-1), batch["label"], losses, valid))
            correct += ((preds == labels) & valid).sum()
            loss_sum += (losses * valid).sum()
            count += valid.sum()
    model.train()
    count = int(count)
    return {"eval_accuracy": (correct / count).item(), "eval_loss": (loss_sum / count).item(), "eval_samples": count}


def sharded_loader(accelerator, folder, split, batch_size, args, max_rows, train):
    """Parquet shards -> this rank's batches, sharded by our plan and never re-sharded by prepare()."""
    dataset = ShardedIterableDataset(ParquetSource(shards_in(folder, split), max_rows=max_rows),
                                     batch_size * accelerator.num_processes,
                                     rank=accelerator.process_index, world_size=accelerator.num_processes,
                                     seed=args.seed, shuffle=train, policy="drop" if train else "pad")
    check_same_plan(dataset.identity(), gather_object)
    return ShardedLoader(dataset, accelerator.device, num_workers=args.dataloader_num_workers)


def main(args):
    # ---------------------------------------------------------------- checks, accelerator
    t_launch = time.perf_counter()
    check_output_dir(args)  # bad paths fail here, in every process alike, before any of them waits on another
    if args.data_dir and not args.streaming:
        check_data_dir(args.dataset, args.data_dir)
    accelerator = make_accelerator(args, **tracking_kwargs(args))
    set_seed(args.seed)  # same initial weights on every process; DDP also broadcasts them
    global_batch_size = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    announce(accelerator, global_batch_size, args)
    prepare_output_dir(accelerator, args)

    # ---------------------------------------------------------------- data
    parquet_dir = args.parquet_dir or os.path.join("runs", "parquet", args.dataset)
    mean, std = DATASETS[args.dataset].mean, DATASETS[args.dataset].std

    def load():  # one process downloads or writes shards, the others then read
        if not args.streaming:
            return load_dataset(args.dataset, args.data_dir)
        if not shards_in(parquet_dir, "train") and accelerator.is_main_process:
            prepare(args.dataset, parquet_dir, data_dir=args.data_dir)

    loaded = main_process_first(accelerator, load, USER_ERRORS)
    if args.streaming:
        source = f"{parquet_dir} (parquet shards, sharded iterable)"
        train_loader = sharded_loader(accelerator, parquet_dir, "train", args.per_device_train_batch_size, args,
                                      args.max_train_samples, train=True)
        eval_loader = sharded_loader(accelerator, parquet_dir, "test", args.per_device_eval_batch_size, args,
                                     args.max_eval_samples, train=False)
        num_train, num_eval = train_loader.dataset.plan.num_samples, eval_loader.dataset.plan.num_samples
    else:
        train_set, eval_set, source = loaded
        train_set, eval_set = train_set.subset(args.max_train_samples), eval_set.subset(args.max_eval_samples)
        num_train, num_eval = len(train_set), len(eval_set)
        # drop_last: every optimizer step sees one full global batch; the dropped tail differs each epoch.
        train_loader = DataLoader(train_set, batch_size=args.per_device_train_batch_size, shuffle=True,
                                  drop_last=True, collate_fn=collate_batch, num_workers=args.dataloader_num_workers)
        eval_loader = DataLoader(eval_set, batch_size=args.per_device_eval_batch_size, collate_fn=collate_batch,
                                 num_workers=args.dataloader_num_workers)
    accelerator.print(f"dataset={args.dataset} train={num_train} test={num_eval} source={source}")

    # ---------------------------------------------------------------- model, optimizer, schedule
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model = ConvNet(**MODELS[args.model]).to(memory_format=memory_format)

    def to_inputs(images):
        return normalize_images(images, mean, std).contiguous(memory_format=memory_format)

    # fused: one kernel for all parameters instead of a loop of small ops per parameter
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay,
                                  fused=True)

    # ---------------------------------------------------------------- prepare
    if args.streaming:  # already sharded: prepare() would shard again or dispatch from rank 0
        model, optimizer = accelerator.prepare(model, optimizer)
    else:
        model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    max_train_steps, num_train_epochs = plan_steps(args, len(train_loader))
    lr_scheduler = accelerator.prepare(make_scheduler(optimizer, args.lr_scheduler_type, args.num_warmup_steps,
                                                      max_train_steps))
    accelerator.print(f"train_samples={num_train} eval_samples={num_eval} epochs={num_train_epochs} "
                      f"steps={max_train_steps} steps_per_epoch={len(train_loader) // args.gradient_accumulation_steps}")

    # ---------------------------------------------------------------- resume
    batches_per_epoch = len(train_loader)  # per process; taken before a resume shortens the sharded loader
    completed_steps, starting_epoch, skip_batches, history, epoch_seconds, resumed_seconds = 0, 0, 0, [], [], 0.0
    if resume_from := find_checkpoint(accelerator, args):
        meta = load_checkpoint(accelerator, resume_from, SCRIPT, model, optimizer, lr_scheduler)
        completed_steps, history, epoch_seconds = meta["step"], meta["history"], meta["epoch_seconds"]
        resumed_seconds = meta.get("epoch_elapsed", 0.0)  # the interrupted epoch's training time before the save
        starting_epoch, skip_batches = meta["data"]["epoch"], meta["data"]["next_batch"]
        if args.streaming:
            train_loader.load_state_dict(meta["data"])
    start_tracking(accelerator, args, SCRIPT, completed_steps)

    def position(epoch, batches_done):
        """Where the data stands after `batches_done` batches of `epoch`: saved in checkpoints."""
        if args.streaming:
            return train_loader.state_dict()
        return data_position(epoch, batches_done, batches_per_epoch)

    def save(epoch, batches_done):
        elapsed = time.perf_counter() - t_epoch if batches_done < batches_per_epoch else 0.0
        save_checkpoint(accelerator, args, SCRIPT, completed_steps, model, optimizer, lr_scheduler,
                        position(epoch, batches_done),
                        extra={"history": history, "epoch_seconds": epoch_seconds, "epoch_elapsed": elapsed})

    # ---------------------------------------------------------------- train
    progress = tqdm(total=max_train_steps * global_batch_size, initial=completed_steps * global_batch_size,
                    unit="samples", unit_scale=True, disable=not accelerator.is_local_main_process, dynamic_ncols=True,
                    mininterval=0.5)  # tqdm's 0.1 s redraws cost ~0.4% of a CPU step here (README, "Speed")
    t_start = t_log = time.perf_counter()
    losses = []  # detached, since the last log: no device sync and no tensor op per step
    for epoch in range(starting_epoch, num_train_epochs):
        if completed_steps >= max_train_steps:
            break
        train_loader.set_epoch(epoch)  # a new shuffle per epoch, identical on every rank
        batches_done = skip_batches if epoch == starting_epoch else 0
        epoch_loader = train_loader
        if batches_done and not args.streaming:  # the sharded loader resumes from its own state
            # after set_epoch, so the skipped batches are this epoch's (bit-identical resume)
            epoch_loader = accelerator.skip_first_batches(train_loader, batches_done)
        # a resumed epoch counts its time before the checkpoint too, so its seconds and the run's samples/s
        # describe the same work as an uninterrupted run's
        t_epoch = time.perf_counter() - (resumed_seconds if epoch == starting_epoch else 0.0)
        for batch in epoch_loader:
            batches_done += 1
            with accelerator.accumulate(model):
                images = batch["image"]
                if args.augment:  # seeded by the data position, so a resumed run draws the same shifts and flips
                    images = augment_images(images, hash((args.seed, epoch, batches_done, accelerator.process_index)))
                loss = F.cross_entropy(model(to_inputs(images)), batch["label"], label_smoothing=args.label_smoothing)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            if not accelerator.sync_gradients:
                continue
            completed_steps += 1
            lr = lr_scheduler.get_last_lr()[0]  # the rate this step used
            if not accelerator.optimizer_step_was_skipped:  # fp16 overflow: no step, no schedule tick
                lr_scheduler.step()
            progress.update(global_batch_size)
            if completed_steps % args.logging_steps == 0:  # mean loss of all processes since the last log
                train_loss = accelerator.reduce(torch.stack(losses).mean(), reduction="mean").item()
                samples_per_second = args.logging_steps * global_batch_size / (time.perf_counter() - t_log)
                log_metrics(accelerator, args, {"step": completed_steps, "train_loss": train_loss, "lr": lr,
                                                "samples_per_second": samples_per_second})
                progress.set_postfix(loss=f"{train_loss:.4f}", lr=f"{lr:.2e}", refresh=False)  # shown at the next redraw
                losses, t_log = [], time.perf_counter()
            save_now = isinstance(args.checkpointing_steps, int) and completed_steps % args.checkpointing_steps == 0
            if save_now and batches_done < batches_per_epoch:  # at an epoch's end: after its evaluation
                save(epoch, batches_done)
            if completed_steps >= max_train_steps:
                break
        epoch_seconds.append(time.perf_counter() - t_epoch)
        metrics = evaluate(model, eval_loader, accelerator, to_inputs)
        history.append({"epoch": epoch + 1, "step": completed_steps, "train_seconds": epoch_seconds[-1], **metrics})
        log_metrics(accelerator, args, {"step": completed_steps, "epoch": epoch + 1, **metrics})
        t_log = time.perf_counter()  # evaluation time is not training throughput
        if accelerator.is_main_process:
            progress.write(f"epoch {epoch + 1}: eval_accuracy={metrics['eval_accuracy']:.4f} "
                           f"eval_loss={metrics['eval_loss']:.4f} eval_samples={metrics['eval_samples']} "
                           f"epoch_seconds={epoch_seconds[-1]:.1f}")
        if args.checkpointing_steps == "epoch" or (save_now and batches_done >= batches_per_epoch):
            save(epoch, batches_done)
    progress.close()
    wall_seconds = time.perf_counter() - t_start
    if not history or history[-1]["step"] != completed_steps:  # resumed from the final checkpoint
        history.append({"epoch": num_train_epochs, "step": completed_steps, "train_seconds": 0.0,
                        **evaluate(model, eval_loader, accelerator, to_inputs)})

    # ---------------------------------------------------------------- save
    results = {**history[-1], "world_size": accelerator.num_processes, "global_batch_size": global_batch_size,
               "dataset": args.dataset, "data_source": source, "epoch_seconds": epoch_seconds,
               "wall_seconds": wall_seconds, "history": history,
               "train_samples_per_second": completed_steps * global_batch_size / max(sum(epoch_seconds), 1e-9)}
    save_final(accelerator, model, args, results)
    if accelerator.is_main_process:
        plot_metrics(args.output_dir)
    accelerator.print(f"final eval_accuracy={results['eval_accuracy']:.4f} eval_samples={results['eval_samples']} "
                      f"wall_seconds={time.perf_counter() - t_launch:.1f} (training {wall_seconds:.1f}) "
                      f"samples_per_second={results['train_samples_per_second']:.0f} -> {args.output_dir}")
    # DDP's reducer holds gloo state: left for interpreter exit, it can abort a finished run (SIGABRT,
    # "terminate called without an active exception"), so drop it before the group goes, after a barrier
    del model, optimizer
    accelerator.free_memory()  # the accelerator's own references to them
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return results


if __name__ == "__main__":
    run(main, parse_args(), USER_ERRORS)
