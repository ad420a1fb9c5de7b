"""What a checkpoint costs: seconds to save and bytes each process writes, full against sharded, and
the sharded save synchronous against asynchronous (--checkpoint_async), for the GPT at two sizes on 2 CPU processes,
under DDP (cpu_2proc.yaml) and under FSDP2 (fsdp2_cpu_2proc.yaml).

    python bench/checkpoint_save.py            # ~2 minutes on 2 cores
    python bench/checkpoint_save.py --tiny     # one tiny model under DDP; what the test suite runs

Each save is the one TrainingLoop makes (train/core/checkpoint.py: gather or shard, write, fsync,
rename), of a model and an AdamW that has taken a step, so the optimizer state is there; the
formats take turns (full, sharded, async) and each figure is the median over --repeats, the
slowest rank's time. The asynchronous save is --checkpoint_async's: a copy of the state, written
by a thread: `blocking` is what the training loop waits for (the copy of the state),
`total` until every file is written and the checkpoint published.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness import REPO, add_worker_flags, print_result, run_workers

SIZES = {"small": (4, 256), "large": (8, 512)}  # (layers, width): lm.py's default, and 4x its parameters
TINY_SIZES = {"small": (1, 32)}
VOCAB, BLOCK = 8192, 256


def folder_bytes(folder, rank):
    """Bytes of the files this rank wrote into a checkpoint folder."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            mine = (
                name == f"rank_state_{rank}.pt"
                or name == f"__{rank}_0.distcp"
                or (rank == 0 and not name.startswith(("rank_state_", "__")))
            )
            total += os.path.getsize(os.path.join(root, name)) if mine else 0
    return total


def worker(args):
    from concurrent.futures import ThreadPoolExecutor

    import torch
    import torch.distributed as dist

    from train.core.accelerator import Accelerator
    from train.core.checkpoint import save_checkpoint
    from train.models.gpt import GPT, GPTConfig, next_token_loss

    accelerator = Accelerator(cpu=True)
    rank, sizes = accelerator.process_index, TINY_SIZES if args.tiny else SIZES
    rows = []
    for size, (layers, width) in sizes.items():
        torch.manual_seed(0)
        model = GPT(GPTConfig(VOCAB, BLOCK, layers, max(1, width // 64), width))
        parameters = sum(p.numel() for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, optimizer = accelerator.prepare(model, optimizer)
        tokens = torch.randint(0, VOCAB, (2, BLOCK + 1))
        next_token_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
        out = os.path.join(args.log_dir, size)
        seconds = {"full": [], "sharded": [], "async_blocking": [], "async_total": []}
        written = {}
        writer = ThreadPoolExecutor(1)  # --checkpoint_async's writer thread and process group
        group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        for repeat in range(args.repeats):
            for k, form in enumerate(("full", "sharded", "async")):
                accelerator.wait_for_everyone()
                t = time.perf_counter()
                checkpoint = save_checkpoint(
                    accelerator,
                    out,
                    3 * repeat + k + 1,
                    model,
                    optimizer,
                    None,
                    {"script": "bench"},
                    keep_last=1,
                    sharded=form != "full",
                    writer=writer if form == "async" else None,
                    group=group,
                )
                if form == "async":
                    seconds["async_blocking"].append(time.perf_counter() - t)
                checkpoint.wait()
                accelerator.wait_for_everyone()
                seconds["async_total" if form == "async" else form].append(time.perf_counter() - t)
                written[form] = folder_bytes(checkpoint.path, rank)
        # the slowest rank's time is the save's time
        medians = {k: statistics.median(v) for k, v in seconds.items()}
        slowest = torch.tensor(list(medians.values()), dtype=torch.float64)
        if accelerator.num_processes > 1:
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        per_rank = torch.tensor([written["full"], written["sharded"], written["async"]], dtype=torch.float64)
        gathered = accelerator.gather(per_rank[None]).tolist()
        rows.append(
            {
                "size": size,
                "parameters": parameters,
                "layers": layers,
                "width": width,
                "seconds": dict(zip(medians, slowest.tolist(), strict=True)),
                "bytes": gathered,
            }
        )
        writer.shutdown()
        del model, optimizer
        accelerator.free_memory()
    if accelerator.is_main_process:
        print_result(
            {"layout": accelerator.distributed_type.value if accelerator.cpu_fsdp2 is None else "FSDP2", "rows": rows}
        )
    accelerator.wait_for_everyone()
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_worker_flags(parser)
    parser.add_argument("--tiny", action="store_true", help="A tiny model, one repeat, DDP alone: that the bench runs.")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.tiny:
        args.repeats = 1
    worker_args = ["--repeats", str(args.repeats), *(["--tiny"] if args.tiny else [])]
    print(
        "| layout | model | parameters | full s | sharded s | async blocking s | async total s | "
        "full MB rank 0 / 1 | sharded MB rank 0 / 1 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    # tiny: one launch (DDP's; both layouts' rows come from the same worker and table code)
    for config in ("cpu_2proc",) if args.tiny else ("cpu_2proc", "fsdp2_cpu_2proc"):
        result = run_workers(__file__, worker_args, os.path.join(REPO, "accelerate_configs", config + ".yaml"))
        for row in result["rows"]:
            s, b = row["seconds"], row["bytes"]
            print(
                f"| {result['layout']} | {row['layers']}x{row['width']} | {row['parameters'] / 1e6:.1f}M | "
                f"{s['full']:.2f} | {s['sharded']:.2f} | {s['async_blocking']:.2f} | {s['async_total']:.2f} | "
                f"{b[0][0] / 1e6:.1f} / {b[1][0] / 1e6:.1f} | {b[0][1] / 1e6:.1f} / {b[1][1] / 1e6:.1f} |"
            )
            print(f"RATIO {result['layout']} {row['size']} sharded/full save seconds = {s['sharded'] / s['full']:.3f}")
            print(
                f"RATIO {result['layout']} {row['size']} async blocking/sharded save seconds = "
                f"{s['async_blocking'] / s['sharded']:.3f}"
            )


if __name__ == "__main__":
    main()
