"""Where the time of a training step goes: each phase timed, ours beside the raw DDP loop, on both ranks.

    python bench/step_phases.py            # under a minute on 2 cores: one epoch of each loop
    python bench/step_phases.py --tiny     # seconds; what the test suite runs

loop_overhead.py measures how much slower our step is; this shows where the difference sits. The
raw loop of bench/reference/raw_ddp_mnist.py and train/mnist.py's loop run in the same two processes
(accelerate_configs/cpu_2proc.yaml) and alternate step by step, the first of each pair alternating
too. A clock is read between the phases:

- data: the next batch;
- forward: model and loss (ours: entering `accumulate` too);
- backward: includes DDP's gradient all-reduce, so also the wait for the other rank;
- step, zero_grad: the optimizer (ours: leaving `accumulate` with zero_grad);
- ours only, the bookkeeping the raw loop does not do: the loss kept for logging, the scheduler
  tick, tqdm (drawn on rank 0), and every 20 steps the loss all-reduce and the log line.

µs per step, mean over the epoch. A phase is rough to ~±10 µs and the host drifts between runs:
this locates costs, loop_overhead.py measures the total.
"""
import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
FASHION_DIR = "/usr/share/datasets/fashion-mnist"
PHASES = ["data", "forward", "backward", "step", "zero_grad", "loss kept", "scheduler", "tqdm", "loss all-reduce",
          "log line"]


def worker(args):
    import torch
    import torch.nn.functional as F
    from accelerate.utils import gather_object
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler
    from tqdm.auto import tqdm

    from data import identity_collate, load_mnist, normalize_images
    from train import mnist
    from train.accelerator import make_accelerator
    from train.schedule import make_scheduler
    from train.tracking import log_metrics

    script_args = mnist.parse_args(["--mixed_precision", "bf16", "--output_dir", args.log_dir])
    accelerator = make_accelerator(script_args)
    train_set, _, _ = load_mnist("fashion_mnist", args.data_dir)
    if args.tiny:
        train_set = train_set.subset(2000)  # 20 steps: one log line
    mean, std, batch_size = train_set.mean, train_set.std, 50

    def to_inputs(images):
        return normalize_images(images, mean, std).contiguous(memory_format=torch.channels_last)

    def model_and_optimizer():
        torch.manual_seed(42)
        model = mnist.ConvNet().to(memory_format=torch.channels_last)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, fused=True)

    raw_model, raw_optimizer = model_and_optimizer()
    raw_model = DDP(raw_model, broadcast_buffers=False)
    sampler = DistributedSampler(train_set, shuffle=True, seed=42, drop_last=True)
    raw_loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler, drop_last=True, collate_fn=identity_collate)
    model, optimizer = model_and_optimizer()
    loader = DataLoader(train_set, batch_size=batch_size, shuffle=True, drop_last=True, collate_fn=identity_collate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    lr_scheduler = accelerator.prepare(make_scheduler(optimizer, "constant", 0, 10**9))
    progress = tqdm(total=10**9, unit="samples", unit_scale=True, disable=not accelerator.is_local_main_process,
                    mininterval=0.5)
    global_batch_size = batch_size * accelerator.num_processes
    seconds = {"raw": dict.fromkeys(PHASES, 0.0), "ours": dict.fromkeys(PHASES, 0.0)}
    clock = time.perf_counter

    def add(spent, t):
        for phase, start, end in zip(PHASES, t, t[1:]):
            spent[phase] += end - start

    def raw_step(batches, spent):
        t = [clock()]
        batch = next(batches)
        t.append(clock())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = raw_model(to_inputs(batch["image"])).float()
        loss = F.cross_entropy(logits, batch["label"])
        t.append(clock())
        loss.backward()
        t.append(clock())
        raw_optimizer.step()
        t.append(clock())
        raw_optimizer.zero_grad(set_to_none=True)
        t.append(clock())
        add(spent, t)

    state = {"completed_steps": 0, "losses": [], "t_log": clock()}

    def our_step(batches, spent):  # train/mnist.py's loop body, with clocks between the phases
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
        state["losses"].append(loss.detach())
        t.append(clock())
        state["completed_steps"] += 1
        lr = lr_scheduler.get_last_lr()[0]
        if not accelerator.optimizer_step_was_skipped:
            lr_scheduler.step()
        t.append(clock())
        progress.update(global_batch_size)
        t.append(clock())
        if state["completed_steps"] % 20 == 0:
            train_loss = accelerator.reduce(torch.stack(state["losses"]).mean(), reduction="mean").item()
            t.append(clock())
            log_metrics(accelerator, script_args, {"step": state["completed_steps"], "train_loss": train_loss,
                                                   "lr": lr, "samples_per_second": 20 * global_batch_size /
                                                   (time.perf_counter() - state["t_log"])})
            progress.set_postfix(loss=f"{train_loss:.4f}", lr=f"{lr:.2e}", refresh=False)
            state.update(losses=[], t_log=time.perf_counter())
            t.append(clock())
        add(spent, t)

    sampler.set_epoch(0)
    loader.set_epoch(0)
    raw_batches, our_batches = iter(raw_loader), iter(loader)
    steps = len(raw_loader)
    for i in range(steps):
        pair = [(raw_step, raw_batches, seconds["raw"]), (our_step, our_batches, seconds["ours"])]
        for step, batches, spent in (pair if i % 2 == 0 else pair[::-1]):
            step(batches, spent)
    progress.close()
    per_rank = gather_object([{"rank": accelerator.process_index, "steps": steps,
                               "us_per_step": {loop: {phase: 1e6 * s / steps for phase, s in spent.items()}
                                               for loop, spent in seconds.items()}}])
    if accelerator.is_main_process:
        print("RESULT " + json.dumps(per_rank), flush=True)
    del model, optimizer, raw_model, raw_optimizer  # DDP reducers before the gloo group goes (see train/mnist.py)
    accelerator.free_memory()
    accelerator.wait_for_everyone()
    accelerator.end_training()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data_dir", default=FASHION_DIR)
    parser.add_argument("--tiny", action="store_true", help="2000 samples (20 steps): checks the bench runs")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--log_dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    from bench.loop_overhead import run_workers

    ranks = sorted(run_workers(__file__, ["--data_dir", args.data_dir, *["--tiny"] * args.tiny]),
                   key=lambda r: r["rank"])
    print(f"{ranks[0]['steps']} steps of each loop, alternating, world size {len(ranks)}, bf16, 50 samples per "
          f"process{' (tiny)' if args.tiny else ''}; µs per step, mean")
    columns = [(f"{loop} rank {r['rank']}", r["us_per_step"][loop]) for r in ranks for loop in ("raw", "ours")]
    print("| phase | " + " | ".join(name for name, _ in columns) + " | ours - raw, rank 0 |")
    print("|---" * (len(columns) + 2) + "|")
    for phase in PHASES + ["total"]:
        values = [sum(us.values()) if phase == "total" else us[phase] for _, us in columns]
        print(f"| {phase} | " + " | ".join(f"{v:.1f}" for v in values) + f" | {values[1] - values[0]:+.1f} |")


if __name__ == "__main__":
    main()
