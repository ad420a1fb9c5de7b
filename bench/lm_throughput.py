"""train/lm.py's training loop against a raw PyTorch DDP loop, and against the machine's matmul peak.

    python bench/lm_throughput.py                    # the demo's model and batch (make train-lm), ~2 min on 2 cores
    python bench/lm_throughput.py --tiny --dataset_dir DIR   # seconds: checks the bench runs (tests)
    python bench/lm_throughput.py --config_file accelerate_configs/1gpu.yaml --mixed_precision bf16 --torch_compile

Both loops live in the same processes (accelerate_configs/cpu_2proc.yaml unless --config_file) and take
turns, one optimizer step each, the first of each pair alternating, so the host's drift hits them alike:

- raw: the classic DDP loop written with torch alone: the windows read from the same parquet shards
  into a TensorDataset, DistributedSampler + DataLoader, DistributedDataParallel (world size > 1),
  autocast when mixed precision is on, torch.compile when asked, clip_grad_norm_, AdamW, the same
  LambdaLR schedule, and `.item()` every --logging_steps steps;
- lm.py: train/lm.py's step with the objects it builds (make_accelerator with its dynamo backend,
  accelerator.prepare, the sharded parquet loader, accumulate, accelerator.backward,
  accelerator.clip_grad_norm_) inside train/core/loop.py's TrainingLoop (step count, schedule, tqdm, the
  loss all-reduced and logged every --logging_steps steps). No evaluation in either.

Same model (GPT of train/models/gpt.py, same initial weights), same optimizer, the same batch shapes of full
windows (labels all valid), so the same FLOPs. mfu = tokens/s × FLOPs per token (6N + attention, as
GPT.flops_per_token counts them) ÷ the square-matmul peak of train/tracking.matmul_peak, measured in
these processes before and after the turns (all of them busy at once, as in training; the mean of
the two is the denominator). Nothing of accelerate is patched or read from private attributes.
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness import (
    CPU_2PROC,
    REPO,
    Batches,
    Phases,
    add_worker_flags,
    flag,
    print_result,
    ratio_line,
    run_workers,
    time_turns,
)

# the demo of `make train-lm`: the Makefile's LM_RECIPE sizes
DEMO = {
    "dataset_dir": os.path.join("runs", "tokens", "gcide-bpe8192-b256"),
    "n_layer": 4,
    "n_head": 4,
    "n_embd": 192,
    "per_device_train_batch_size": 8,
}
TINY = {"n_layer": 2, "n_head": 2, "n_embd": 32, "per_device_train_batch_size": 4}


def worker(args):
    # One function on purpose: both loops are closures over objects built here, and the DDP models
    # must be deleted here, at the end, before loop.close() ends the process group (TrainingLoop.close).
    import contextlib

    import pyarrow.parquet as pq
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    from data.loader import sharded_loader
    from data.shards import read_manifest, shards_in
    from data.sources import ParquetSource
    from data.text import decode_windows
    from train import lm
    from train.core.accelerator import make_accelerator
    from train.core.flags import reading_workers
    from train.core.loop import TrainingLoop
    from train.core.schedule import make_scheduler
    from train.core.tracking import matmul_peak
    from train.models.gpt import GPT, GPTConfig, next_token_loss

    manifest = read_manifest(args.dataset_dir)
    block_size, batch_size = manifest["block_size"], args.per_device_train_batch_size
    script_args = lm.parse_args(
        [
            "--dataset_dir",
            args.dataset_dir,
            "--block_size",
            str(block_size),
            "--n_layer",
            str(args.n_layer),
            "--n_head",
            str(args.n_head),
            "--n_embd",
            str(args.n_embd),
            "--per_device_train_batch_size",
            str(batch_size),
            "--mixed_precision",
            args.mixed_precision,
            "--max_train_steps",
            str(10**9),
            "--metric_for_best_model",
            "none",
            "--output_dir",
            args.log_dir,
            "--logging_steps",
            str(args.logging_steps),
            *flag("torch_compile", args.torch_compile),
        ]
    )
    accelerator = make_accelerator(script_args, dynamo_backend="inductor" if args.torch_compile else "no")
    device, world = accelerator.device, accelerator.num_processes
    config = GPTConfig(manifest["vocab_size"], block_size, args.n_layer, args.n_head, args.n_embd, 0.0)
    decode = decode_windows(manifest["token_dtype"])

    def model_and_optimizer():
        torch.manual_seed(script_args.seed)
        model = GPT(config)
        return model, torch.optim.AdamW(
            model.param_groups(script_args.weight_decay), lr=script_args.learning_rate, betas=(0.9, 0.95), fused=True
        )  # as train/lm.py

    def scheduler(optimizer):
        return make_scheduler(optimizer, script_args.lr_scheduler_type, script_args.num_warmup_steps, 10**9)

    def loss_fn(model, batch):  # train/lm.py's loss
        return next_token_loss(model(batch["input_ids"]), batch["labels"])

    # ------------------------------------------------ raw: torch alone
    train_files = shards_in(args.dataset_dir, "train")
    rows = min(sum(pq.ParquetFile(p).metadata.num_rows for p in train_files), 64 * batch_size * world)
    windows = decode(pq.read_table(train_files).slice(0, rows))  # enough for the turns; epochs roll over
    raw_set = TensorDataset(windows["input_ids"], windows["labels"])
    sampler = DistributedSampler(
        raw_set, world, accelerator.process_index, shuffle=True, seed=script_args.seed, drop_last=True
    )
    raw_batches = Batches(
        DataLoader(raw_set, batch_size=batch_size, sampler=sampler, drop_last=True, pin_memory=device.type == "cuda"),
        sampler.set_epoch,
    )
    raw_model, raw_optimizer = model_and_optimizer()
    raw_model = raw_model.to(device)
    if world > 1:
        raw_model = DDP(
            raw_model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False
        )
    if args.torch_compile:
        raw_model = torch.compile(raw_model, backend="inductor")
    raw_scheduler = scheduler(raw_optimizer)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision)
    raw_scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    raw_state = {"step": 0}

    def autocast():
        return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()

    def raw_step():
        mark = phases["raw"].start()
        input_ids, labels = (t.to(device, non_blocking=True) for t in raw_batches.next())
        mark("data")
        with autocast():
            loss = loss_fn(raw_model, {"input_ids": input_ids, "labels": labels})
        mark("forward")
        raw_scaler.scale(loss).backward()
        mark("backward")
        raw_scaler.unscale_(raw_optimizer)
        torch.nn.utils.clip_grad_norm_(raw_model.parameters(), script_args.max_grad_norm)
        mark("clip")
        raw_scaler.step(raw_optimizer)
        raw_scaler.update()
        raw_optimizer.zero_grad(set_to_none=True)
        mark("optimizer")
        raw_scheduler.step()
        raw_state["step"] += 1
        if raw_state["step"] % args.logging_steps == 0:
            loss.item()
        mark("after")

    # ------------------------------------------------ lm.py: its objects, its step, TrainingLoop
    model, optimizer = model_and_optimizer()
    model, optimizer = accelerator.prepare(model, optimizer)
    workers = reading_workers(args.dataloader_num_workers, device, on_gpu=2)  # as train/lm.py decides
    train_loader = sharded_loader(
        ParquetSource(train_files, decode=decode),
        batch_size,
        rank=accelerator.process_index,
        world_size=accelerator.num_processes,
        device=accelerator.device,
        seed=script_args.seed,
        train=True,
        num_workers=workers,
    )
    loop = TrainingLoop(accelerator, script_args, "lm_throughput", model, optimizer, train_loader, evaluate=dict)
    loop.preemption.close()  # a bench saves nothing: a SIGTERM (a timeout's, the launcher's) ends it at once
    lm_batches = loop.batches()

    def lm_step():
        mark = phases["lm.py"].start()
        batch = next(lm_batches)
        mark("data")
        with accelerator.accumulate(model):
            loss = loss_fn(model, batch)
            mark("forward")
            accelerator.backward(loss)
            mark("backward")
            if accelerator.sync_gradients and script_args.max_grad_norm > 0:
                accelerator.clip_grad_norm_(model.parameters(), script_args.max_grad_norm)
            mark("clip")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        mark("optimizer")
        loop.after_batch(loss)
        mark("after")

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()
        accelerator.wait_for_everyone()

    peak_seconds = 0.1 if args.tiny else 1.0  # tiny: a rough peak, 4 CPU-seconds fewer of matmuls
    peak_before = matmul_peak(accelerator, seconds=peak_seconds)
    loops = {"raw": raw_step, "lm.py": lm_step}
    phases = {name: Phases() for name in loops}
    for step in loops.values():  # warm-up: DDP's bucket rebuild, kernels, compilation
        for _ in range(args.warmup):
            step()
    phases = {name: Phases() for name in loops}  # the timed turns only
    ms_per_step = time_turns(loops, args.turns, synchronize, sync_after=True)
    peak_after = matmul_peak(accelerator, seconds=peak_seconds)
    loop.progress.close()
    if accelerator.is_main_process:
        reference = accelerator.unwrap_model(model)
        print_result(
            {
                "world_size": world,
                "device": str(device),
                "mixed_precision": accelerator.mixed_precision,
                "torch_compile": args.torch_compile,
                "ms_per_step": ms_per_step,
                "block_size": block_size,
                "tokens_per_step": world * batch_size * block_size,
                "flops_per_token": reference.flops_per_token(),
                "parameters": sum(p.numel() for p in reference.parameters()),
                "vocab_size": manifest["vocab_size"],
                "matmul_peak": [peak_before, peak_after],
                "raw_steps": raw_state["step"],
                "lm_steps": loop.step,
                "reading_workers": workers,
                "phases": {name: p.means() for name, p in phases.items()},
                "phase_medians": {name: p.medians() for name, p in phases.items()},
                "phase_maxima": {name: p.maxima() for name, p in phases.items()},
            }
        )
    if dist.is_initialized():
        dist.barrier()
    # DDP reducers before the gloo group goes (TrainingLoop.close); the step closures share these names
    model = optimizer = raw_model = raw_optimizer = None
    loop.close()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dataset_dir", default=None, help="Window shards (default: the demo's, written by make train-lm)."
    )
    parser.add_argument("--config_file", default=CPU_2PROC)
    for name, value in DEMO.items():
        if name != "dataset_dir":
            parser.add_argument(
                f"--{name}", type=int, default=None, help=f"Default {value} ({TINY[name]} with --tiny)."
            )
    parser.add_argument("--turns", type=int, default=30, help="Steps each loop takes, alternating.")
    parser.add_argument("--warmup", type=int, default=2, help="Untimed steps of each loop first.")
    parser.add_argument("--logging_steps", type=int, default=20)
    parser.add_argument("--mixed_precision", choices=["auto", "no", "bf16", "fp16"], default="auto")
    parser.add_argument("--torch_compile", action="store_true")
    parser.add_argument(
        "--dataloader_num_workers",
        type=int,
        default=None,
        help="Processes reading lm.py's "
        "shards per rank (default: train/lm.py's, 2 on a GPU, 0 on a CPU; the raw loop reads from "
        "memory).",
    )
    parser.add_argument("--tiny", action="store_true", help="A tiny model, 6 turns: checks the bench runs.")
    add_worker_flags(parser)
    args = parser.parse_args(argv)
    sizes = TINY if args.tiny else DEMO
    for name in TINY:
        if getattr(args, name) is None:
            setattr(args, name, sizes[name])
    if args.tiny:
        args.turns, args.warmup, args.logging_steps = 6, 1, 4
    if args.worker:
        return worker(args)
    args.dataset_dir = args.dataset_dir or os.path.join(REPO, DEMO["dataset_dir"])
    if not os.path.isfile(os.path.join(args.dataset_dir, "manifest.json")):
        raise SystemExit(
            f"error: {args.dataset_dir} holds no token shards; run `make train-lm` once (it writes "
            "the demo's) or pass --dataset_dir with shards of python -m data.prepare --tokenizer ..."
        )
    result = run_workers(
        __file__,
        [
            "--dataset_dir",
            os.path.abspath(args.dataset_dir),
            "--turns",
            str(args.turns),
            "--warmup",
            str(args.warmup),
            "--logging_steps",
            str(args.logging_steps),
            "--mixed_precision",
            args.mixed_precision,
            *(
                []
                if args.dataloader_num_workers is None
                else ["--dataloader_num_workers", str(args.dataloader_num_workers)]
            ),
            *[f"--{name}={getattr(args, name)}" for name in TINY],
            *flag("torch_compile", args.torch_compile),
            *flag("tiny", args.tiny),
        ],
        config_file=args.config_file,
    )
    ms, tokens = result["ms_per_step"], result["tokens_per_step"]
    peak = statistics.mean(result["matmul_peak"])
    print(
        f"{args.turns} alternating steps per loop after {args.warmup} warm-up, world size {result['world_size']} "
        f"on {result['device']}, mixed_precision={result['mixed_precision']}, torch_compile={result['torch_compile']}; "
        f"GPT {args.n_layer}x{args.n_embd}, {args.n_head} heads, {result['parameters'] / 1e6:.2f}M parameters, "
        f"vocab {result['vocab_size']}, block {result['block_size']}, {args.per_device_train_batch_size} windows per "
        f"process ({tokens} tokens per step), {result['reading_workers']} reading workers for lm.py; steps taken: "
        f"raw {result['raw_steps']}, lm.py {result['lm_steps']}"
    )
    print(
        f"matmul peak: {result['matmul_peak'][0] / 1e9:.1f} GFLOP/s before, {result['matmul_peak'][1] / 1e9:.1f} "
        "after (all processes)"
    )
    print("| loop | ms/step (median) | ms/step (mean) | tokens/s | mfu |")
    print("|---|---|---|---|---|")
    for name, values in ms.items():
        tokens_per_second = tokens * len(values) / (sum(values) / 1000)
        print(
            f"| {name} | {statistics.median(values):.1f} | {statistics.mean(values):.1f} | {tokens_per_second:.0f} | "
            f"{tokens_per_second * result['flops_per_token'] / peak:.1%} |"
        )
    print(ratio_line("lm.py tokens/s / raw DDP tokens/s", ms, "lm.py", "raw"))
    # where each loop's step goes, as the CPU sees it (main process): on a GPU the phases are the time
    # to queue the work, and `wait` is the rest of the turn, the device finishing it
    # the mean and the median step's: a cost paid once in the timed turns (a first log line, a kernel
    # loaded at its first use) moves the one, not the other
    print(
        "| phase, ms per step (clock between phases, no sync) | raw mean | lm.py mean | lm.py - raw | raw median "
        "| lm.py median | lm.py slowest |"
    )
    print("|---|---|---|---|---|---|---|")
    raw_phases, lm_phases = result["phases"]["raw"], result["phases"]["lm.py"]
    raw_phases["wait"] = statistics.mean(ms["raw"]) - sum(raw_phases.values())
    lm_phases["wait"] = statistics.mean(ms["lm.py"]) - sum(lm_phases.values())
    medians, maxima = result["phase_medians"], result["phase_maxima"]
    for phase in raw_phases:
        raw_ms, lm_ms = raw_phases[phase], lm_phases[phase]
        extra = (
            " | | |"
            if phase == "wait"
            else f" | {medians['raw'][phase]:.2f} | {medians['lm.py'][phase]:.2f} | {maxima['lm.py'][phase]:.2f} |"
        )
        print(f"| {phase} | {raw_ms:.2f} | {lm_ms:.2f} | {lm_ms - raw_ms:+.2f}{extra}")
    for name, values in ms.items():
        print(
            f"MFU {name} = {tokens * len(values) / (sum(values) / 1000) * result['flops_per_token'] / peak:.3f} "
            f"of the measured matmul peak {peak / 1e9:.1f} GFLOP/s"
        )


if __name__ == "__main__":
    main()
