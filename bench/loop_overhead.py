"""What accelerate and our loop cost per step, measured inside the same two processes as a raw DDP loop.

    python bench/loop_overhead.py                  # ~2 minutes on 2 cores
    python bench/loop_overhead.py --tiny           # seconds; what the test suite runs

compare_reference.py times whole runs one after another; this host's speed drifts by 10-20% within
a minute, so its ours/raw ratio moves by several percent between runs of the bench and cannot settle
a 1-3% question. Here the loops live in the same two processes (launched with
accelerate_configs/cpu_2proc.yaml) and take turns, one step each by default, so drift hits them alike;
over 1500 turns the ratio of total times is the overhead. The loops:

- raw: bench/reference/raw_ddp_mnist.py's step (DistributedSampler loader, torch DDP without buffer
  broadcast, autocast around the forward, fused AdamW, `.item()` every 20 steps);
- raw_logged: raw plus the bookkeeping our loop does and raw does not, in plain torch: the scheduler
  tick, the losses kept for logging, a tqdm bar, and every 20 steps the mean loss all-reduced
  (torch.distributed) and appended to a JSONL file. Ours against it is accelerate's cost alone;
- ours: train/mnist.py's step with the objects it builds (make_accelerator; prepared model, optimizer,
  loader and scheduler; accumulate, accelerator.backward) inside train/loop.py's TrainingLoop (its
  batches() generator and after_batch: the step count, scheduler tick, tqdm, and every 20 steps the
  mean loss reduced over ranks and appended to a metrics.jsonl);

Same data (Fashion-MNIST), the seed's ConvNet, channels_last, 50 samples per process, in the precision
`--mixed_precision auto` picks on this CPU (bf16 with native bf16, else fp32; --mixed_precision to
force one). A check of the instrument: with ours' pieces swapped for raw's one by one, the last variant
(all swapped) came out at 1.000. Nothing of accelerate is patched: until 2026-11 make_accelerator
cached two of accelerate's per-step lookups by replacing its functions (about 1.5% of a step), which
would break on accelerate's next release.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
FASHION_DIR = "/usr/share/datasets/fashion-mnist"


def worker(args):
    import contextlib

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler
    from tqdm.auto import tqdm

    from data import identity_collate, load_mnist, normalize_images
    from train import mnist
    from train.accelerator import make_accelerator
    from train.loop import TrainingLoop
    from train.schedule import make_scheduler

    script_args = mnist.parse_args(["--mixed_precision", args.mixed_precision, "--output_dir", args.log_dir,
                                    "--max_train_steps", str(10**9), "--per_device_train_batch_size", "50"])
    accelerator = make_accelerator(script_args)
    bf16 = accelerator.mixed_precision == "bf16"

    def autocast():  # what accelerate's autocast does, for the raw loops
        return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    train_set, _, _ = load_mnist("fashion_mnist", args.data_dir)
    if args.tiny:
        train_set = train_set.subset(1000)
    mean, std = train_set.mean, train_set.std
    batch_size, channels_last = 50, torch.channels_last

    def to_inputs(images):
        return normalize_images(images, mean, std).contiguous(memory_format=channels_last)

    def model_and_optimizer():
        torch.manual_seed(42)
        model = mnist.ConvNet().to(memory_format=channels_last)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, fused=True)

    class Batches:
        """An endless stream of one loader's batches, a new epoch (set_epoch) when one runs out."""

        def __init__(self, loader, set_epoch):
            self.loader, self.set_epoch, self.epoch, self.it = loader, set_epoch, 0, iter(())

        def next(self):
            try:
                return next(self.it)
            except StopIteration:
                self.set_epoch(self.epoch)
                self.epoch, self.it = self.epoch + 1, iter(self.loader)
                return next(self.it)

    # ------------------------------------------------ raw: as bench/reference/raw_ddp_mnist.py
    raw_model, raw_optimizer = model_and_optimizer()
    raw_model = DDP(raw_model, broadcast_buffers=False)
    sampler = DistributedSampler(train_set, shuffle=True, seed=42, drop_last=True)
    raw_batches = Batches(DataLoader(train_set, batch_size=batch_size, sampler=sampler, drop_last=True,
                                     collate_fn=identity_collate), sampler.set_epoch)
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
            if raw_state["step"] % 20 == 0:
                loss.item()

    # ------------------------------------------------ raw_logged: raw with our loop's bookkeeping, no accelerate
    logged_model, logged_optimizer = model_and_optimizer()  # its own: the scheduler wraps optimizer.step
    logged_model = DDP(logged_model, broadcast_buffers=False)
    logged_sampler = DistributedSampler(train_set, shuffle=True, seed=42, drop_last=True)
    logged_batches = Batches(DataLoader(train_set, batch_size=batch_size, sampler=logged_sampler, drop_last=True,
                                        collate_fn=identity_collate), logged_sampler.set_epoch)
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
            logged_progress.update(batch_size * dist.get_world_size())
            if logged_state["step"] % 20 == 0:
                mean_loss = torch.stack(losses).mean()
                dist.all_reduce(mean_loss)
                train_loss = mean_loss.item() / dist.get_world_size()
                if dist.get_rank() == 0:
                    with open(os.path.join(args.log_dir, "raw_metrics.jsonl"), "a") as f:
                        f.write(json.dumps({"step": logged_state["step"], "train_loss": train_loss, "lr": lr,
                                            "samples_per_second": 20 * batch_size * dist.get_world_size() /
                                            (time.perf_counter() - t_log)}) + "\n")
                logged_progress.set_postfix(loss=f"{train_loss:.4f}", lr=f"{lr:.2e}", refresh=False)
                losses, t_log = [], time.perf_counter()
        logged_state.update(losses=losses, t_log=t_log)

    # ------------------------------------------------ ours: train/mnist.py's step inside train/loop.py's TrainingLoop
    model, optimizer = model_and_optimizer()
    loader = DataLoader(train_set, batch_size=batch_size, shuffle=True, drop_last=True, collate_fn=identity_collate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    lr_scheduler = accelerator.prepare(make_scheduler(optimizer, "constant", 0, 10**9))
    loop = TrainingLoop(accelerator, script_args, "loop_overhead", model, optimizer, lr_scheduler, loader,
                        evaluate=dict)  # no evaluation at the epoch ends: raw has none either
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
    ms_per_step = {name: [] for name in loops}
    for block in range(args.blocks):  # A/B/C/D, D/C/B/A, ...
        for name, run in (list(loops.items()) if block % 2 == 0 else list(loops.items())[::-1]):
            accelerator.wait_for_everyone()
            start = time.perf_counter()
            run(args.block)
            ms_per_step[name].append(1000 * (time.perf_counter() - start) / args.block)
    loop.progress.close()
    logged_progress.close()
    if accelerator.is_main_process:
        logged_steps = {}
        for name, file in (("ours", "metrics.jsonl"), ("raw_logged", "raw_metrics.jsonl")):
            with open(os.path.join(args.log_dir, file)) as f:
                logged_steps[name] = [r["step"] for r in map(json.loads, f) if "train_loss" in r]
        print("RESULT " + json.dumps({"world_size": accelerator.num_processes, "ms_per_step": ms_per_step,
                                      "mixed_precision": accelerator.mixed_precision,
                                      "logged_steps": logged_steps}), flush=True)
    # DDP reducers before the gloo group goes (see train/mnist.py)
    del model, optimizer, raw_model, raw_optimizer, logged_model, logged_optimizer
    loop.close()


def run_workers(script, worker_args, config_file=os.path.join(REPO, "accelerate_configs", "cpu_2proc.yaml")):
    """`script --worker` in the processes of `config_file` (2 CPU processes unless told) with a scratch
    --log_dir: what its main process printed after RESULT, parsed."""
    import tempfile

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config_file,
               os.path.abspath(script), "--worker",
               "--log_dir", tmp, *worker_args]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"error: the bench workers failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=1500, help="Turns each loop takes.")
    parser.add_argument("--block", type=int, default=1, help="Steps per turn.")
    parser.add_argument("--data_dir", default=FASHION_DIR)
    parser.add_argument("--mixed_precision", choices=["auto", "no", "bf16"], default="auto")
    parser.add_argument("--tiny", action="store_true", help="1000 samples, 30 turns: checks the bench runs")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--log_dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tiny:
        args.blocks, args.block = 30, 1  # 30 steps: epochs roll over, the loss is logged at step 20
    if args.worker:
        return worker(args)
    result = run_workers(__file__, ["--data_dir", args.data_dir, "--blocks", str(args.blocks),
                                    "--block", str(args.block), "--mixed_precision", args.mixed_precision,
                                    *["--tiny"] * args.tiny])
    ms = result["ms_per_step"]
    print(f"{args.blocks} alternating turns of {args.block} step(s) per loop, world size {result['world_size']}, "
          f"mixed_precision={result['mixed_precision']}, 50 samples per process{' (tiny)' if args.tiny else ''}; "
          "logged steps: " +
          ", ".join(f"{name} {steps[0]}..{steps[-1]} ({len(steps)} records)"
                    for name, steps in result["logged_steps"].items()))
    print("| loop | ms/step (median) | ms/step (mean) | throughput vs raw (total time) | vs raw, median of turns |")
    print("|---|---|---|---|---|")
    for name, values in ms.items():
        paired = statistics.median(r / v for r, v in zip(ms["raw"], values))
        print(f"| {name} | {statistics.median(values):.3f} | {statistics.mean(values):.3f} | "
              f"{sum(ms['raw']) / sum(values):.3f} | {paired:.3f} |")
    for name, base, label in [(name, "raw", "raw DDP") for name in ms if name != "raw"] + [
            ("ours", "raw_logged", "raw_logged (accelerate's cost alone)")]:
        print(f"RATIO {name} throughput / {label} throughput = {sum(ms[base]) / sum(ms[name]):.3f} "
              f"(median of turns {statistics.median(b / v for b, v in zip(ms[base], ms[name])):.3f})")

if __name__ == "__main__":
    main()
