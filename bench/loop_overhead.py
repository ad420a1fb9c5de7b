"""What accelerate and our loop cost per step, measured inside the same two processes as a raw DDP loop.

    python bench/loop_overhead.py                  # ~2 minutes on 2 cores
    python bench/loop_overhead.py --tiny           # seconds; what the test suite runs

compare_reference.py times whole runs one after another, which the host's drift makes too rough
for a 1-3% question; here the loops take turns in the same two processes (bench/harness.py) and
over 1500 turns the ratio of total times is the overhead. The loops:

- raw: bench/reference/raw_ddp_mnist.py's step (DistributedSampler loader, torch DDP without buffer
  broadcast, autocast around the forward, fused AdamW, `.item()` every 20 steps);
- raw_logged: raw plus the bookkeeping our loop does and raw does not, in plain torch: the scheduler
  tick, the losses kept for logging, a tqdm bar, and every 20 steps the mean loss all-reduced
  (torch.distributed) and appended to a JSONL file. Ours against it is accelerate's cost alone;
- ours: train/mnist.py's step with the objects it builds (make_accelerator; prepared model, optimizer,
  loader and scheduler; accumulate, accelerator.backward) inside train/core/loop.py's TrainingLoop (its
  batches() generator and after_batch: the step count, scheduler tick, tqdm, and every 20 steps the
  mean loss reduced over ranks and appended to a metrics.jsonl);

Same data (Fashion-MNIST), the seed's ConvNet, channels_last, 50 samples per process, in the precision
`--mixed_precision auto` picks on this CPU (bf16 with native bf16, else fp32; --mixed_precision to
force one). How far to trust the instrument, and the history of the figures: docs/speed.md.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness import (
    FASHION_DIR,
    MNIST_BATCH,
    add_worker_flags,
    flag,
    print_result,
    ratio_line,
    run_workers,
    speed_ratio,
    time_turns,
)

LOG_EVERY = 20  # train/mnist.py's --logging_steps default, which the raw_logged loop copies


def worker(args):
    # One function on purpose: the three loops are closures over objects built here, and the DDP
    # models must be let go here, at the end, before loop.close() ends the gloo group (a reference
    # that outlives it can abort the finished run: TrainingLoop.close).
    import json

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from tqdm.auto import tqdm

    from bench.mnist_loops import MnistBench
    from train.core.schedule import make_scheduler

    bench = MnistBench(args.data_dir, args.log_dir, args.mixed_precision, samples=1000 if args.tiny else None)
    accelerator, to_inputs, autocast = bench.accelerator, bench.to_inputs, bench.autocast
    world = accelerator.num_processes

    # ------------------------------------------------ raw: as bench/reference/raw_ddp_mnist.py
    raw_model, raw_optimizer, _, raw_batches = bench.raw()
    raw_state = {"step": 0}

    def raw_steps(n):
        for _ in range(n):
            batch = raw_batches.next()
            with autocast():
                logits = raw_model(to_inputs(batch["image"])).float()
            loss = F.cross_entropy(logits, batch["label"])
            loss.backward()
            raw_optimizer.step()
            raw_optimizer.zero_grad(set_to_none=True)
            raw_state["step"] += 1
            if raw_state["step"] % LOG_EVERY == 0:
                loss.item()

    # ------------------------------------------------ raw_logged: raw with our loop's bookkeeping, no accelerate
    logged_model, logged_optimizer, _, logged_batches = bench.raw()  # its own: the scheduler wraps optimizer.step
    logged_scheduler = make_scheduler(logged_optimizer, "constant", 0, 10**9)
    logged_progress = tqdm(total=10**9, unit="samples", unit_scale=True, disable=dist.get_rank() != 0, mininterval=0.5)
    logged_state = {"step": 0, "losses": [], "t_log": time.perf_counter()}

    def raw_logged_steps(n):
        losses, t_log = logged_state["losses"], logged_state["t_log"]
        for _ in range(n):
            batch = logged_batches.next()
            with autocast():
                logits = logged_model(to_inputs(batch["image"])).float()
            loss = F.cross_entropy(logits, batch["label"], label_smoothing=0.0)
            loss.backward()
            logged_optimizer.step()
            logged_optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            logged_state["step"] += 1
            lr = logged_scheduler.get_last_lr()[0]
            logged_scheduler.step()
            logged_progress.update(MNIST_BATCH * world)
            if logged_state["step"] % LOG_EVERY == 0:
                mean_loss = torch.stack(losses).mean()
                dist.all_reduce(mean_loss)
                train_loss = mean_loss.item() / world
                if dist.get_rank() == 0:
                    with open(os.path.join(args.log_dir, "raw_metrics.jsonl"), "a") as f:
                        f.write(
                            json.dumps(
                                {
                                    "step": logged_state["step"],
                                    "train_loss": train_loss,
                                    "lr": lr,
                                    "samples_per_second": LOG_EVERY
                                    * MNIST_BATCH
                                    * world
                                    / (time.perf_counter() - t_log),
                                }
                            )
                            + "\n"
                        )
                logged_progress.set_postfix(loss=f"{train_loss:.4f}", lr=f"{lr:.2e}", refresh=False)
                losses, t_log = [], time.perf_counter()
        logged_state.update(losses=losses, t_log=t_log)

    # ------------------------------------------------ ours: train/mnist.py's step in TrainingLoop (train/core/loop.py)
    model, optimizer, loop = bench.ours("loop_overhead")
    ours_batches = loop.batches()

    def our_steps(n):
        for _ in range(n):
            batch = next(ours_batches)
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(to_inputs(batch["image"])), batch["label"], label_smoothing=0.0)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            loop.after_batch(loss)

    loops = {"raw": raw_steps, "raw_logged": raw_logged_steps, "ours": our_steps}
    for run in loops.values():  # warm-up: DDP's first-iteration bucket rebuild, oneDNN kernel creation
        run(args.block)
    ms_per_step = time_turns(
        {name: lambda run=run: run(args.block) for name, run in loops.items()},
        args.blocks,
        accelerator.wait_for_everyone,
        steps_per_turn=args.block,
    )
    loop.progress.close()
    logged_progress.close()
    if accelerator.is_main_process:
        logged_steps = {}
        for name, file in (("ours", "metrics.jsonl"), ("raw_logged", "raw_metrics.jsonl")):
            with open(os.path.join(args.log_dir, file)) as f:
                logged_steps[name] = [r["step"] for r in map(json.loads, f) if "train_loss" in r]
        print_result(
            {
                "world_size": world,
                "ms_per_step": ms_per_step,
                "mixed_precision": accelerator.mixed_precision,
                "logged_steps": logged_steps,
            }
        )
    # DDP reducers before the gloo group goes (TrainingLoop.close); the step closures share these names
    model = optimizer = raw_model = raw_optimizer = logged_model = logged_optimizer = None
    loop.close()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=1500, help="Turns each loop takes.")
    parser.add_argument("--block", type=int, default=1, help="Steps per turn.")
    parser.add_argument("--data_dir", default=FASHION_DIR)
    parser.add_argument("--mixed_precision", choices=["auto", "no", "bf16"], default="auto")
    parser.add_argument("--tiny", action="store_true", help="1000 samples, 19 turns: checks the bench runs")
    add_worker_flags(parser)
    args = parser.parse_args(argv)
    if args.tiny:
        args.blocks, args.block = 19, 1  # with the warm-up 20 steps: epochs roll over, the loss is logged at step 20
    if args.worker:
        return worker(args)
    result = run_workers(
        __file__,
        [
            "--data_dir",
            args.data_dir,
            "--blocks",
            str(args.blocks),
            "--block",
            str(args.block),
            "--mixed_precision",
            args.mixed_precision,
            *flag("tiny", args.tiny),
        ],
    )
    ms = result["ms_per_step"]
    print(
        f"{args.blocks} alternating turns of {args.block} step(s) per loop, world size {result['world_size']}, "
        f"mixed_precision={result['mixed_precision']}, {MNIST_BATCH} samples per process"
        f"{' (tiny)' if args.tiny else ''}; logged steps: "
        + ", ".join(
            f"{name} {steps[0]}..{steps[-1]} ({len(steps)} records)" for name, steps in result["logged_steps"].items()
        )
    )
    print("| loop | ms/step (median) | ms/step (mean) | throughput vs raw (total time) | vs raw, median of turns |")
    print("|---|---|---|---|---|")
    for name, values in ms.items():
        totals, per_turn = speed_ratio(ms, name, "raw")
        print(
            f"| {name} | {statistics.median(values):.3f} | {statistics.mean(values):.3f} | {totals:.3f} | "
            f"{per_turn:.3f} |"
        )
    for name, base, label in [(name, "raw", "raw DDP") for name in ms if name != "raw"] + [
        ("ours", "raw_logged", "raw_logged (accelerate's cost alone)")
    ]:
        print(ratio_line(f"{name} throughput / {label} throughput", ms, name, base))


if __name__ == "__main__":
    main()
