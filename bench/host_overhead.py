"""Host time per step: train/lm.py's and train/mnist.py's loops against a raw loop with the same
model step, on models so small that a step is nearly all host work.

    python bench/host_overhead.py           # ~1 minute on 2 cores
    python bench/host_overhead.py --tiny    # seconds: what the test suite runs
    python bench/host_overhead.py --device_ms 2   # each step also waits 2 ms for a stand-in GPU

On a GPU the host queues a step's kernels while the device runs the previous ones; whatever the host
spends beyond a raw loop (reading, wrappers, bookkeeping) shows as lost throughput once it exceeds the
device's time, and every step pays it where the host waits for the device (a sync). Here compute is
~0, so a step's time is its host time, measurable on any CPU; --device_ms adds that wait (a sleep, the
GIL released, as in a CUDA sync), which work on other threads can overlap.

One process (world size 1, one intra-op thread), the objects built as the scripts build them: make_accelerator,
accelerator.prepare, the sharded parquet loader (lm.py) or the prepared DataLoader (mnist.py),
TrainingLoop. Per task the variants take turns of --logging_steps steps (one log each), in alternating
order (bench/harness.py), all with the same data, model and optimizer (lm.py: the demo's batches of
8 windows of 256 tokens, whole through the data path, into a model that reads one token of each:
embedding, then logits; mnist.py: 64 images, one linear layer; fused AdamW):

- raw: a DataLoader over the same rows in memory, forward, backward, (clip,) step, zero_grad, the
  schedule, and every --logging_steps steps the mean loss `.item()`-ed and appended to a JSONL file;
- reader: raw with our loader's batches (lm.py: ShardedLoader; mnist.py: accelerate's prepared DataLoader);
- accelerate: raw with accelerate's prepared model, optimizer and scheduler, `accumulate`,
  `accelerator.backward` (and `clip_grad_norm_`), as the scripts step;
- after_batch: raw with TrainingLoop.after_batch in place of raw's bookkeeping and logging;
- after_batch_nolog: the same, never logging: after_batch minus it is the logging's share;
- ours: the script's loop whole.

Each row is the median over turns of (variant - raw), in ms per step; `EXTRA_MS task` is ours' row.
The pieces need not add up to ours: each is paid alone beside raw's version of it. `accelerate's
calls` splits accelerate's row by call of the step (every step clocks the time between its calls):
the accelerate variant's mean per call minus raw's.
"""

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness import FASHION_DIR, Batches, Phases, time_turns

VARIANTS = ["raw", "reader", "accelerate", "after_batch", "after_batch_nolog", "ours"]
# the step's calls that accelerate wraps; accumulate is its context (the entry and the exit)
ACCELERATE_CALLS = ["accumulate", "forward", "backward", "clip", "step", "zero_grad"]


def lm_shards(folder, block_size, windows):
    """Token shards (bytes tokenizer) of made-up text, `windows` training windows or so."""
    from data.prepare import main as prepare_main

    words = "the of and a to in is was he for it with as his on be at by had not are but from or".split()
    rng = random.Random(0)
    text = os.path.join(folder, "text.txt")
    with open(text, "w") as f:
        for _ in range(windows * block_size // 60):
            f.write(" ".join(rng.choice(words) for _ in range(16)) + "\n")
    prepare_main(
        [
            "--train_file",
            text,
            "--validation_split_percentage",
            "5",
            "--tokenizer",
            "bytes",
            "--block_size",
            str(block_size),
            "--output_dir",
            os.path.join(folder, "shards"),
        ]
    )
    return os.path.join(folder, "shards")


def task_loops(task, accelerator, args, tmp, phases):
    """name -> one step, for each variant of `task`, and the TrainingLoops to close afterwards. Each
    step clocks the time between its calls in phases[name] (bench/harness.py's Phases), looked up at
    every step: a new Phases there starts the count again."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from train.core.loop import TrainingLoop
    from train.core.schedule import make_scheduler

    def script_args(name, logging_steps):
        out = os.path.join(tmp, task, name)
        common = [
            "--output_dir",
            out,
            "--max_train_steps",
            str(10**9),
            "--metric_for_best_model",
            "none",
            "--logging_steps",
            str(logging_steps),
            "--mixed_precision",
            args.mixed_precision,
        ]
        if task == "lm":
            return lm.parse_args(
                [
                    "--dataset_dir",
                    dataset_dir,
                    "--block_size",
                    str(block_size),
                    "--per_device_train_batch_size",
                    str(batch_size),
                    *common,
                ]
            )
        return mnist.parse_args(["--per_device_train_batch_size", str(batch_size), *common])

    if task == "lm":
        import pyarrow.parquet as pq

        from data.loader import sharded_loader
        from data.shards import read_manifest, shards_in
        from data.sources import ParquetSource
        from data.text import decode_windows
        from train import lm

        block_size, batch_size = (32, 4) if args.tiny else (256, 8)  # the demo's windows (make train-lm)
        dataset_dir = lm_shards(tmp, block_size, 200 if args.tiny else 4000)
        manifest = read_manifest(dataset_dir)
        decode = decode_windows(manifest["token_dtype"])
        files = shards_in(dataset_dir, "train")
        windows = decode(pq.read_table(files))
        raw_set = TensorDataset(windows["input_ids"], windows["labels"])
        clip = True

        def new_model():  # GPT's ends alone: the first token's embedding to the next token's logits
            return nn.Sequential(nn.Embedding(manifest["vocab_size"], 8), nn.Linear(8, manifest["vocab_size"]))

        def loss_fn(model, batch):  # the whole windows go through the step; the model looks at one token
            ids, labels = batch if isinstance(batch, list) else (batch["input_ids"], batch["labels"])
            return F.cross_entropy(model(ids[:, 0]), labels[:, 0])

        def our_loader():  # as train/lm.py builds it; with a stand-in GPU, reading ahead as on a GPU
            loader = sharded_loader(
                ParquetSource(files, decode=decode),
                batch_size,
                rank=accelerator.process_index,
                world_size=accelerator.num_processes,
                device=accelerator.device,
                seed=42,
                train=True,
                num_workers=args.dataloader_num_workers,
            )
            loader.read_ahead = loader.read_ahead or args.device_ms > 0
            return loader
    else:
        from data import identity_collate, load_mnist, normalize_images
        from train import mnist

        batch_size, clip = 64, False  # train/mnist.py's default batch
        train_set, _, _ = load_mnist("fashion_mnist", args.data_dir)
        raw_set = train_set.subset(2000 if args.tiny else None)

        def new_model():
            return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10)).to(memory_format=torch.channels_last)

        def loss_fn(model, batch):  # train/mnist.py's step, its to_inputs included
            inputs = normalize_images(batch["image"], raw_set.mean, raw_set.std).contiguous(
                memory_format=torch.channels_last
            )
            return F.cross_entropy(model(inputs), batch["label"], label_smoothing=0.0)

        def our_loader():  # as train/mnist.py builds it; prepared below, with the model for ours
            return DataLoader(raw_set, batch_size=batch_size, shuffle=True, drop_last=True, collate_fn=identity_collate)

    def device_wait():  # a GPU's time for the step, as the host sees it at a sync: waiting, the GIL released
        if args.device_ms:
            time.sleep(args.device_ms / 1000)

    device = accelerator.device  # a GPU's when there is one: then every variant's step runs there

    def model_and_optimizer():
        torch.manual_seed(0)  # the same initial weights for every variant
        model = new_model().to(device)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, fused=True)

    def raw_batches():  # on a GPU, pinned and copied without waiting, as a raw GPU loop would
        collate = {"collate_fn": identity_collate} if task == "mnist" else {}
        loader = DataLoader(
            raw_set, batch_size=batch_size, shuffle=True, drop_last=True, pin_memory=device.type == "cuda", **collate
        )
        batches = Batches(loader, lambda epoch: None).next
        if device.type == "cpu":
            return batches

        def on_device():
            batch = batches()
            if isinstance(batch, dict):
                return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            return [t.to(device, non_blocking=True) for t in batch]

        return on_device

    def raw_log(optimizer, name):
        """Raw's bookkeeping: the schedule, the losses, and every --logging_steps steps one line."""
        scheduler = make_scheduler(optimizer, "cosine", 0, 10**9)
        state = {"step": 0, "losses": []}
        path = os.path.join(tmp, task, f"{name}_raw.jsonl")

        def after(loss):
            state["losses"].append(loss.detach())
            state["step"] += 1
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            if state["step"] % args.logging_steps == 0:
                train_loss = torch.stack(state["losses"]).mean().item()
                with open(path, "a") as f:
                    f.write(json.dumps({"step": state["step"], "train_loss": train_loss, "lr": lr}) + "\n")
                state["losses"] = []

        return after

    def raw_step(model, optimizer, next_batch, after, name):
        def step():
            mark = phases[name].start()
            batch = next_batch()
            mark("batch")
            loss = loss_fn(model, batch)
            mark("forward")
            device_wait()
            mark("device")
            loss.backward()
            mark("backward")
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            mark("clip")
            optimizer.step()
            mark("step")
            optimizer.zero_grad(set_to_none=True)
            mark("zero_grad")
            after(loss)
            mark("after")

        return step

    def accelerated_step(model, optimizer, next_batch, after, name):  # the scripts' step
        def step():
            mark = phases[name].start()
            batch = next_batch()
            mark("batch")
            with accelerator.accumulate(model):
                mark("accumulate")
                loss = loss_fn(model, batch)
                mark("forward")
                device_wait()
                mark("device")
                accelerator.backward(loss)
                mark("backward")
                if clip and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                mark("clip")
                optimizer.step()
                mark("step")
                optimizer.zero_grad(set_to_none=True)
                mark("zero_grad")
            mark("accumulate")
            after(loss)
            mark("after")

        return step

    def training_loop(name, model, optimizer, loader, logging_steps):
        loop = TrainingLoop(
            accelerator, script_args(name, logging_steps), f"host_{task}", model, optimizer, loader, evaluate=dict
        )
        loop.preemption.close()  # a bench saves nothing: a SIGTERM ends it at once
        return loop

    steps, loops = {}, []
    model, optimizer = model_and_optimizer()
    steps["raw"] = raw_step(model, optimizer, raw_batches(), raw_log(optimizer, "raw"), "raw")
    model, optimizer = model_and_optimizer()
    loader = accelerator.prepare(our_loader()) if task == "mnist" else our_loader()
    steps["reader"] = raw_step(
        model, optimizer, Batches(loader, loader.set_epoch).next, raw_log(optimizer, "reader"), "reader"
    )
    model, optimizer = accelerator.prepare(*model_and_optimizer())
    steps["accelerate"] = accelerated_step(
        model, optimizer, raw_batches(), raw_log(optimizer, "accelerate"), "accelerate"
    )
    for name, every in (("after_batch", args.logging_steps), ("after_batch_nolog", 10**9)):
        model, optimizer = model_and_optimizer()
        loops.append(training_loop(name, model, optimizer, DataLoader(raw_set, batch_size, drop_last=True), every))
        steps[name] = raw_step(model, optimizer, raw_batches(), loops[-1].after_batch, name)
    model, optimizer = model_and_optimizer()
    if task == "lm":  # the loaders are sharded already
        loader = our_loader()
        model, optimizer = accelerator.prepare(model, optimizer)
    else:
        model, optimizer, loader = accelerator.prepare(model, optimizer, our_loader())
    loops.append(training_loop("ours", model, optimizer, loader, args.logging_steps))
    batches = loops[-1].batches()
    steps["ours"] = accelerated_step(model, optimizer, lambda: next(batches), loops[-1].after_batch, "ours")
    return steps, loops


def measure(task, accelerator, args, tmp):
    import torch

    phases = {name: Phases() for name in VARIANTS}
    steps, loops = task_loops(task, accelerator, args, tmp, phases)
    turns = {name: (lambda step=step: [step() for _ in range(args.logging_steps)]) for name, step in steps.items()}
    for turn in turns.values():  # warm-up
        turn()
    phases.update({name: Phases() for name in VARIANTS})  # the timed turns only
    cuda = accelerator.device.type == "cuda"  # each turn's kernels finish inside its own clock
    ms = time_turns(
        turns,
        args.turns,
        torch.cuda.synchronize if cuda else lambda: None,
        steps_per_turn=args.logging_steps,
        sync_after=cuda,
    )
    for loop in loops:
        loop.progress.close()
        loop.close()
    return ms, {name: p.means() for name, p in phases.items()}


def report(task, ms, phases):
    raw = ms["raw"]
    print(f"\n{task}: ms per step, {len(raw)} turns")
    print("| variant | median | extra vs raw (median of turns) | extra, mean of turns |")
    print("|---|---|---|---|")
    extra = {}
    for name, values in ms.items():
        diffs = [v - r for v, r in zip(values, raw, strict=True)]
        extra[name] = statistics.median(diffs)
        print(f"| {name} | {statistics.median(values):.3f} | {extra[name]:+.3f} | {statistics.mean(diffs):+.3f} |")
    print(
        f"breakdown {task}: reading {extra['reader']:+.3f}, accelerate's wrappers {extra['accelerate']:+.3f}, "
        f"after_batch {extra['after_batch']:+.3f} (of which logging "
        f"{extra['after_batch'] - extra['after_batch_nolog']:+.3f}) ms per step"
    )
    calls = {
        phase: phases["accelerate"][phase] - phases["raw"].get(phase, 0.0)  # raw has no accumulate
        for phase in ACCELERATE_CALLS
    }  # the same batches and bookkeeping: the calls alone differ
    print(
        f"accelerate's calls {task}: "
        + ", ".join(f"{phase} {1000 * value:+.0f}" for phase, value in calls.items())
        + " µs per step (clocked between the calls, mean of every step)"
    )
    return extra["ours"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=60, help="Turns per variant, alternating order.")
    parser.add_argument("--logging_steps", type=int, default=20, help="Steps per turn; every loop logs once a turn.")
    parser.add_argument("--tasks", default="lm,mnist")
    parser.add_argument("--data_dir", default=FASHION_DIR, help="Fashion-MNIST's idx files (mnist).")
    parser.add_argument(
        "--device_ms",
        type=float,
        default=0.0,
        help="Each step also waits this long with the GIL released, as a host waits for its GPU (0: host time alone).",
    )
    parser.add_argument(
        "--dataloader_num_workers",
        type=int,
        default=0,
        help="lm.py's reading processes (0 as on a CPU; lm.py takes 2 on a GPU).",
    )
    parser.add_argument("--mixed_precision", choices=["no", "bf16"], default="no")
    parser.add_argument("--tiny", action="store_true", help="Tiny data, 3 turns of 4 steps: checks the bench runs.")
    args = parser.parse_args(argv)
    if args.tiny:
        args.turns, args.logging_steps = 3, 4
    import torch

    from train import lm
    from train.core.accelerator import make_accelerator

    torch.set_num_threads(1)  # host work is one thread; a second only adds the other test runs' noise
    with tempfile.TemporaryDirectory() as tmp:
        accelerator = make_accelerator(lm.parse_args(["--output_dir", tmp, "--mixed_precision", args.mixed_precision]))
        extra = {}
        for task in args.tasks.split(","):
            extra[task] = report(task, *measure(task, accelerator, args, tmp))
    print(
        f"\ntorch {torch.__version__}, accelerate {__import__('accelerate').__version__}, "
        f"{accelerator.device}, mixed_precision={accelerator.mixed_precision}, {args.logging_steps} steps per turn, "
        f"device_ms={args.device_ms:g}, {args.dataloader_num_workers} reading workers"
    )
    for task, value in extra.items():
        print(f"EXTRA_MS {task} = {value:.3f}")


if __name__ == "__main__":
    main()
