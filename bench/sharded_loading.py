"""Loading speed and bytes read per rank: our sharded iterable path vs `datasets` streaming with
`split_dataset_by_node`, over the same parquet shards, W processes, K DataLoader workers each.

    python -m data.prepare --output_dir runs/parquet/fashion_mnist       # once
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml bench/sharded_loading.py \
        --parquet_dir runs/parquet/fashion_mnist --repeats 5

Both sides iterate one epoch of the train shards in batches of --per_device_batch_size per rank and
decode images to uint8 tensors (no model). Runs alternate A/B/A/B per worker count so drift hits
both; an epoch's time is the slowest rank's, since a DDP step waits for it. Bytes are the
read()/pread() bytes of the rank's process (`rchar` in /proc/self/io), measured with K=0 where
nothing is read in a child process. Prints a markdown table of medians and the speed ratio.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from torch.utils.data import DataLoader

from data.sharding import ParquetSource, ShardedIterableDataset, shards_in


def read_chars():
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def ours(paths, rank, world, batch, workers, epoch):
    dataset = ShardedIterableDataset(ParquetSource(paths), batch * world, rank, world, seed=0, policy="drop")
    dataset.set_epoch(epoch)
    return DataLoader(dataset, batch_size=None, num_workers=workers)


def collate_bytes(rows):
    """Per-sample dicts from `datasets` -> the same uint8 image batch our path yields."""
    images = np.frombuffer(b"".join(r["image"] for r in rows), np.uint8).reshape(len(rows), -1)
    return {"image": torch.from_numpy(images.copy()), "label": torch.tensor([r["label"] for r in rows])}


def hf_streaming(paths, rank, world, batch, workers, epoch):
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node

    stream = load_dataset("parquet", data_files=paths, split="train", streaming=True)
    stream = split_dataset_by_node(stream.shuffle(seed=0, buffer_size=1000), rank=rank, world_size=world)
    stream.set_epoch(epoch)
    return DataLoader(stream, batch_size=batch, num_workers=workers, collate_fn=collate_bytes, drop_last=True)


def one_epoch(accelerator, make, paths, batch, workers, epoch):
    accelerator.wait_for_everyone()
    chars, start, samples = read_chars(), time.perf_counter(), 0
    for b in make(paths, accelerator.process_index, accelerator.num_processes, batch, workers, epoch):
        samples += len(b["image"])
    seconds, chars = time.perf_counter() - start, read_chars() - chars
    return gather_object([(seconds, samples, chars)])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--parquet_dir", default="runs/parquet/fashion_mnist")
    parser.add_argument("--per_device_batch_size", type=int, default=64)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True)
    paths = shards_in(args.parquet_dir, "train")
    if not paths:
        raise SystemExit(f"error: no train shards in {args.parquet_dir}; run python -m data.prepare --output_dir "
                         f"{args.parquet_dir}")
    total_bytes = sum(os.path.getsize(p) for p in paths)
    for make in (ours, hf_streaming):  # untimed: one-time imports are not data reads
        for _, _ in zip(range(2), make(paths, accelerator.process_index, accelerator.num_processes, 8, 0, 0)):
            pass
    rows = []
    for workers in args.workers:
        results = {"ours": [], "datasets": []}
        for repeat in range(args.repeats):
            for name, make in (("ours", ours), ("datasets", hf_streaming)):  # alternating A/B
                results[name].append(one_epoch(accelerator, make, paths, args.per_device_batch_size, workers, repeat))
        medians = {}
        for name, runs in results.items():
            seconds = statistics.median(max(s for s, _, _ in run) for run in runs)
            samples = sum(n for _, n, _ in runs[0])
            per_rank_bytes = [c for _, _, c in runs[0]]
            medians[name] = (samples / seconds, samples, per_rank_bytes)
        rows.append((workers, medians))
    if accelerator.is_main_process:
        world = accelerator.num_processes
        print(f"\nW={world} processes, batch {args.per_device_batch_size}/rank, {args.repeats} alternating repeats, "
              f"shards {total_bytes / 1e6:.1f} MB in {len(paths)} files")
        print("| K workers | path | samples/s (median) | samples/epoch | bytes read per rank (K=0) | ratio |")
        print("|---|---|---|---|---|---|")
        for workers, medians in rows:
            ratio = medians["ours"][0] / medians["datasets"][0]
            for name in ("ours", "datasets"):
                speed, samples, per_rank = medians[name]
                bytes_text = " / ".join(f"{b / total_bytes:.2f}x" for b in per_rank) if workers == 0 else "n/a"
                print(f"| {workers} | {name} | {speed:,.0f} | {samples} | {bytes_text} of all shards | "
                      f"{f'{ratio:.1f}x' if name == 'ours' else ''} |")
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
