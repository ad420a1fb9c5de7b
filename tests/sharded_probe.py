"""Launched by tests/test_sharded_launch.py with `accelerate launch`: for each case of CASES.json,
trains a tiny DDP model from parquet shards (or a datasets.Dataset saved with save_to_disk, or a
streaming datasets.IterableDataset over the shards) through ShardedLoader with K DataLoader workers
and writes, on the main process, what every rank saw to the case's report file. The cases run one
after the other in one launch, each with an Accelerator and model of its own: a launch costs more
than all of them.

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml tests/sharded_probe.py CASES.json

CASES.json: [{"folder": FOLDER, "workers": K, "stream": false, "out": REPORT.json}, ...]

With a second argument, MISUSE.json, the same launch then runs tests/prepare_misuse_probe.py's cases,
which end the run with their error (a launch of their own cost 2 more processes' start-up).
"""

import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from data.loader import ShardedLoader
from data.sharding import ShardedIterableDataset, check_same_plan
from data.shards import shards_in
from data.sources import ParquetSource

PER_RANK_BATCH, ACCUMULATION, EPOCHS, CUT = 4, 4, 2, 5


def source(folder, stream):
    import datasets

    if os.path.isfile(os.path.join(folder, "dataset_info.json")):  # a datasets.Dataset from save_to_disk
        return datasets.load_from_disk(folder)  # memory-mapped Arrow, passed as it is
    if stream:  # a streaming datasets.IterableDataset over the same files, passed as it is
        return datasets.load_dataset("parquet", data_files=shards_in(folder, "train"), split="train", streaming=True)
    return ParquetSource(shards_in(folder, "train"))


def build(accelerator, folder, workers, stream):
    dataset = ShardedIterableDataset(
        source(folder, stream),
        PER_RANK_BATCH * accelerator.num_processes,
        accelerator.process_index,
        accelerator.num_processes,
        seed=7,
        policy="pad",
    )
    check_same_plan(dataset.identity(), gather_object)
    return ShardedLoader(dataset, accelerator.device, num_workers=workers)


def main(folder, out_path, workers, stream=False):
    # a new Accelerator per case: its own registered loader; the process group (PartialState) stays
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    loader = build(accelerator, folder, workers, stream)
    accelerator.register_for_checkpointing(loader)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    report = {"world_size": accelerator.num_processes, "epochs": [], "batches_per_rank": [], "optimizer_steps": []}
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        ids, batches, steps = [], 0, 0
        for batch in loader:
            assert batch["x"].device.type == accelerator.device.type
            with accelerator.accumulate(model):
                # the all-reduce in backward is where uneven batch counts would hang
                loss = model(batch["x"].float().unsqueeze(1)).mean()
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            steps += accelerator.sync_gradients
            batches += 1
            ids += accelerator.gather(torch.where(batch["valid"], batch["index"], -1)).tolist()
            if epoch == 1 and batches == CUT:
                accelerator.save_state(os.path.join(os.path.dirname(out_path), "ckpt"))
        report["epochs"].append([i for i in ids if i >= 0])
        report["batches_per_rank"].append(gather_object([batches]))
        report["optimizer_steps"].append(gather_object([steps]))
    # resume from the mid-epoch save: the registered loader, now at the end of epoch 1 in memory, must
    # take its position from the file and yield exactly the rest of epoch 1
    accelerator.load_state(os.path.join(os.path.dirname(out_path), "ckpt"))
    loader.set_epoch(1)
    rest = []
    for batch in loader:
        rest += accelerator.gather(torch.where(batch["valid"], batch["index"], -1)).tolist()
    report["resumed_rest"] = [i for i in rest if i >= 0]
    report["per_rank_batches_in_epoch"] = len(loader)
    if accelerator.is_main_process:
        json.dump(report, open(out_path, "w"))
    # DDP's reducer holds gloo state: left for interpreter exit, after the group is gone, it can abort a
    # finished run (SIGABRT, "terminate called without an active exception"; seen once in CI). The order
    # of TrainingLoop.close: the model first, then the group.
    del model, optimizer
    accelerator.free_memory()
    gc.collect()
    accelerator.wait_for_everyone()  # a rank that tears gloo down while its peer still works can abort
    return accelerator


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    for number, case in enumerate(cases):
        print(f"case {number}: {case}", flush=True)  # which case a hang or crash happened in
        last = main(case["folder"], case["out"], case["workers"], case["stream"])
    if len(sys.argv) > 2:
        import prepare_misuse_probe  # tests/, where this file is

        prepare_misuse_probe.main(sys.argv[2])  # raises: the run fails with its error
    last.end_training()
