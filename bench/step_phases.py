"""Where the time of a training step goes: each phase timed, ours beside the raw DDP loop, on both ranks.

    python bench/step_phases.py            # under a minute on 2 cores: one epoch of each loop
    python bench/step_phases.py --tiny     # seconds; what the test suite runs

loop_overhead.py measures how much slower our step is; this shows where the difference sits. The
raw loop of bench/reference/raw_ddp_mnist.py and train/mnist.py's step inside the real
train/core/loop.py TrainingLoop run in the same two processes (accelerate_configs/cpu_2proc.yaml) and
alternate step by step, the first of each pair alternating too (bench/harness.py). A clock is read
between the phases:

- data: the next batch (ours: from TrainingLoop.batches(), the generator train/mnist.py iterates);
- forward: model and loss (ours: entering `accumulate` too);
- backward: includes DDP's gradient all-reduce, so also the wait for the other rank;
- step, zero_grad: the optimizer (ours: leaving `accumulate` with zero_grad);
- after_batch, ours only: TrainingLoop.after_batch, the bookkeeping the raw loop does not do (the
  loss kept for logging, the step count, the scheduler tick, tqdm drawn on rank 0, and every 20
  steps the loss all-reduce and the log line). It is one public call, timed whole; a line below the
  table splits it into logging steps and the others. Finer rows need a hook in TrainingLoop
  (docs/speed.md).

µs per step, mean over the epoch, in the precision train/mnist.py's `auto` picks (bf16 where the CPU
has it natively, fp32 elsewhere; --mixed_precision to choose). A phase is rough to ~±10 µs and the
host drifts between runs: this locates costs, loop_overhead.py measures the total.
"""

import argparse
import itertools
import os
import sys
import time

import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness import FASHION_DIR, MNIST_BATCH, add_worker_flags, flag, print_result, run_workers, turn_order

PHASES = ["data", "forward", "backward", "step", "zero_grad", "after_batch"]
clock = time.perf_counter


def add(spent, t):
    """Add the clock readings `t`, one between each two phases, to the seconds `spent` per phase; a raw
    step has no after_batch, so its readings stop one phase short."""
    for phase, (start, end) in zip(PHASES, itertools.pairwise(t), strict=False):
        spent[phase] += end - start


def raw_step(model, optimizer, to_inputs, autocast, batches, spent):  # bench/reference/raw_ddp_mnist.py's step
    t = [clock()]
    batch = next(batches)
    t.append(clock())
    with autocast():
        logits = model(to_inputs(batch["image"])).float()
    loss = F.cross_entropy(logits, batch["label"])
    t.append(clock())
    loss.backward()
    t.append(clock())
    optimizer.step()
    t.append(clock())
    optimizer.zero_grad(set_to_none=True)
    t.append(clock())
    add(spent, t)


def our_step(accelerator, model, optimizer, loop, to_inputs, batches, spent):
    """train/mnist.py's loop body, with clocks between the phases; returns after_batch's seconds and
    whether this step logged."""
    t = [clock()]
    batch = next(batches)
    t.append(clock())
    with accelerator.accumulate(model):
        loss = F.cross_entropy(model(to_inputs(batch["image"])), batch["label"], label_smoothing=0.0)
        t.append(clock())
        accelerator.backward(loss)
        t.append(clock())
        optimizer.step()
        t.append(clock())
        optimizer.zero_grad(set_to_none=True)
    t.append(clock())
    stepped = loop.after_batch(loss)
    t.append(clock())
    add(spent, t)
    return t[-1] - t[-2], stepped and loop.step % loop.args.logging_steps == 0


def worker(args):
    from accelerate.utils import gather_object

    from bench.mnist_loops import MnistBench

    # tiny: 20 steps
    bench = MnistBench(args.data_dir, args.log_dir, args.mixed_precision, samples=2000 if args.tiny else None)
    accelerator, to_inputs = bench.accelerator, bench.to_inputs
    raw_model, raw_optimizer, raw_loader, _ = bench.raw()
    model, optimizer, loop = bench.ours("step_phases")
    seconds = {"raw": dict.fromkeys(PHASES, 0.0), "ours": dict.fromkeys(PHASES, 0.0)}
    after_batch = {"logging": [0, 0.0], "other": [0, 0.0]}  # calls, seconds
    raw_batches, our_batches = iter(raw_loader), loop.batches()
    steps = len(raw_loader)
    for i in range(steps):  # one epoch each: the loop's end-of-epoch evaluation is never reached
        for name in turn_order(("raw", "ours"), i):
            if name == "raw":
                raw_step(raw_model, raw_optimizer, to_inputs, bench.autocast, raw_batches, seconds["raw"])
                continue
            spent, logged = our_step(accelerator, model, optimizer, loop, to_inputs, our_batches, seconds["ours"])
            calls = after_batch["logging" if logged else "other"]
            calls[0], calls[1] = calls[0] + 1, calls[1] + spent
    loop.progress.close()
    per_rank = gather_object(
        [
            {
                "rank": accelerator.process_index,
                "steps": steps,
                "precision": accelerator.mixed_precision,
                "us_per_step": {
                    name: {phase: 1e6 * s / steps for phase, s in spent.items()} for name, spent in seconds.items()
                },
                "after_batch_us": {kind: [n, 1e6 * s / max(n, 1)] for kind, (n, s) in after_batch.items()},
            }
        ]
    )
    if accelerator.is_main_process:
        print_result(per_rank)
    del model, optimizer, raw_model, raw_optimizer  # DDP reducers before the gloo group goes (TrainingLoop.close)
    loop.close()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data_dir", default=FASHION_DIR)
    parser.add_argument("--tiny", action="store_true", help="2000 samples (20 steps): checks the bench runs")
    # auto, as train/mnist.py: bf16 where the CPU has it natively; emulated bf16 (AVX2) times emulation
    parser.add_argument("--mixed_precision", choices=["auto", "no", "bf16"], default="auto")
    add_worker_flags(parser)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    ranks = sorted(
        run_workers(
            __file__, ["--data_dir", args.data_dir, "--mixed_precision", args.mixed_precision, *flag("tiny", args.tiny)]
        ),
        key=lambda r: r["rank"],
    )
    print(
        f"{ranks[0]['steps']} steps of each loop, alternating, world size {len(ranks)}, "
        f"mixed_precision={ranks[0]['precision']}, {MNIST_BATCH} samples "
        f"per process{' (tiny)' if args.tiny else ''}; µs per step, mean"
    )
    columns = [(f"{loop} rank {r['rank']}", r["us_per_step"][loop]) for r in ranks for loop in ("raw", "ours")]
    print("| phase | " + " | ".join(name for name, _ in columns) + " | ours - raw, rank 0 |")
    print("|---" * (len(columns) + 2) + "|")
    for phase in PHASES + ["total"]:
        values = [sum(us.values()) if phase == "total" else us[phase] for _, us in columns]
        print(f"| {phase} | " + " | ".join(f"{v:.1f}" for v in values) + f" | {values[1] - values[0]:+.1f} |")
    print(
        "after_batch of ours, µs per call: "
        + "; ".join(
            f"rank {r['rank']}: "
            + ", ".join(f"{kind} steps {n} x {us:.1f}" for kind, (n, us) in r["after_batch_us"].items())
            for r in ranks
        )
    )


if __name__ == "__main__":
    main()
