"""Loading speed and bytes read per rank, W processes, K DataLoader workers each, two pairs:
- parquet shards: our sharded iterable path (ParquetSource) vs `datasets` streaming with
  `split_dataset_by_node`, over the same files;
- a `datasets.Dataset` (the same shards loaded memory-mapped): ours (the object passed as the source,
  read in units of --unit_size rows) vs `datasets`' own `to_iterable_dataset` + `split_dataset_by_node`.

    python -m data.prepare --output_dir runs/parquet/fashion_mnist       # once
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml bench/sharded_loading.py \
        --parquet_dir runs/parquet/fashion_mnist --repeats 5

Both sides iterate one epoch of the train shards in batches of --per_device_batch_size per rank and
decode images to uint8 tensors (no model). Runs alternate A/B/A/B per worker count so drift hits
both; an epoch's time is the slowest rank's, since a DDP step waits for it. Bytes are measured with
K=0, where nothing is read in a child process: for files, the read()/pread() bytes of the rank's
process (`rchar` in /proc/self/io); the memory-mapped Dataset reads through page faults that its
loading already took, so there it is the rows each rank takes out of the Arrow table (counted in an
extra untimed epoch: our source's counter, a counting `map` before `datasets`' split) times the
Arrow bytes per row. Prints a markdown table of medians and the speed and bytes ratios.
"""

import argparse
import itertools
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

from data.sharding import ShardedIterableDataset
from data.shards import shards_in
from data.sources import DatasetsSource, ParquetSource


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


def columns_to_tensors(batch):
    """The Dataset's columns (image bytes as a list) -> the same uint8 image batch as every other path."""
    images = np.frombuffer(b"".join(batch["image"]), np.uint8).reshape(len(batch["image"]), -1)
    return {"image": torch.from_numpy(images.copy()), "label": batch["label"]}


def ours_dataset(data, rank, world, batch, workers, epoch, unit_size=32):
    source = DatasetsSource(data, transform=columns_to_tensors, unit_size=unit_size)
    dataset = ShardedIterableDataset(source, batch * world, rank, world, seed=0, policy="drop")
    dataset.set_epoch(epoch)
    return DataLoader(dataset, batch_size=None, num_workers=workers)


def hf_to_iterable(data, rank, world, batch, workers, epoch, count=None):
    from datasets.distributed import split_dataset_by_node

    # as many shards as our units would be too fine for datasets; its docs suggest a multiple of W x K
    stream = data.to_iterable_dataset(num_shards=64)
    if count is not None:  # rows taken out of the table, before the split keeps this rank's
        stream = stream.map(lambda row: count.append(1) or row)
    stream = stream.shuffle(seed=0, buffer_size=1000)
    stream = split_dataset_by_node(stream, rank=rank, world_size=world)
    stream.set_epoch(epoch)
    return DataLoader(stream, batch_size=batch, num_workers=workers, collate_fn=collate_bytes, drop_last=True)


def one_epoch(accelerator, make, paths, batch, workers, epoch):
    accelerator.wait_for_everyone()
    chars, start, samples = read_chars(), time.perf_counter(), 0
    for b in make(paths, accelerator.process_index, accelerator.num_processes, batch, workers, epoch):
        samples += len(b["image"])
    seconds, chars = time.perf_counter() - start, read_chars() - chars
    return gather_object([(seconds, samples, chars)])


def print_table(rows, world, args, total_bytes, num_files):
    """The markdown table of medians, with the speed and bytes ratios of ours against `datasets`."""
    print(
        f"\nW={world} processes, batch {args.per_device_batch_size}/rank, {args.repeats} alternating repeats, "
        f"shards {total_bytes / 1e6:.1f} MB in {num_files} files"
    )
    print(
        "| source | K workers | path | samples/s (median) | samples/epoch | bytes read per rank (K=0) | "
        "speed ratio | bytes ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for source, size, workers, medians in rows:
        speed_ratio = medians["ours"][0] / medians["datasets"][0]
        bytes_ratio = max(medians["ours"][2]) / max(max(medians["datasets"][2]), 1)
        for name in ("ours", "datasets"):
            speed, samples, per_rank = medians[name]
            bytes_text = " / ".join(f"{b / size:.2f}x" for b in per_rank) + " of the data" if workers == 0 else "n/a"
            print(
                f"| {source} | {workers} | {name} | {speed:,.0f} | {samples} | {bytes_text} | "
                f"{f'{speed_ratio:.2f}' if name == 'ours' else ''} | "
                f"{f'{bytes_ratio:.2f}' if name == 'ours' and workers == 0 else ''} |"
            )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--parquet_dir", default="runs/parquet/fashion_mnist")
    parser.add_argument("--per_device_batch_size", type=int, default=64)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sources", nargs="+", choices=["parquet", "datasets"], default=["parquet", "datasets"])
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True)
    paths = shards_in(args.parquet_dir, "train")
    if not paths:
        raise SystemExit(
            f"error: no train shards in {args.parquet_dir}; run python -m data.prepare --output_dir {args.parquet_dir}"
        )
    total_bytes = sum(os.path.getsize(p) for p in paths)
    pairs = []
    if "parquet" in args.sources:
        pairs.append(("parquet shards", paths, total_bytes, ours, hf_streaming))
    if "datasets" in args.sources:
        from datasets import load_dataset

        with accelerator.main_process_first():  # one Arrow cache, written once
            data = load_dataset("parquet", data_files=paths, split="train")  # memory-mapped, not in memory
        arrow_bytes = sum(os.path.getsize(f["filename"]) for f in data.cache_files)
        pairs.append(("datasets.Dataset", data, arrow_bytes, ours_dataset, hf_to_iterable))
    rank, world = accelerator.process_index, accelerator.num_processes
    for _, data, _, mine, theirs in pairs:  # untimed: one-time imports are not data reads
        for make in (mine, theirs):
            for _ in itertools.islice(make(data, rank, world, 8, 0, 0), 2):
                pass
    rows_taken = {}
    if "datasets" in args.sources:  # untimed, K=0: rows each rank takes out of the Arrow table
        counted = []
        for _ in hf_to_iterable(data, rank, world, args.per_device_batch_size, 0, 0, count=counted):
            pass
        loader = ours_dataset(data, rank, world, args.per_device_batch_size, 0, 0)
        for _ in loader:
            pass
        rows_taken = {
            "ours": gather_object([loader.dataset.source.rows_read]),
            "datasets": gather_object([len(counted)]),
        }
    rows = []
    for source, data, size, mine, theirs in pairs:
        for workers in args.workers:
            results = {"ours": [], "datasets": []}
            for repeat in range(args.repeats):
                for name, make in (("ours", mine), ("datasets", theirs)):  # alternating A/B
                    results[name].append(
                        one_epoch(accelerator, make, data, args.per_device_batch_size, workers, repeat)
                    )
            medians = {}
            for name, runs in results.items():
                seconds = statistics.median(max(s for s, _, _ in run) for run in runs)
                samples = sum(n for _, n, _ in runs[0])
                per_rank_bytes = [c for _, _, c in runs[0]]
                if source == "datasets.Dataset":
                    per_rank_bytes = [r * size / len(data) for r in rows_taken[name]]
                medians[name] = (samples / seconds, samples, per_rank_bytes)
            rows.append((source, size, workers, medians))
    if accelerator.is_main_process:
        print_table(rows, world, args, total_bytes, len(paths))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
