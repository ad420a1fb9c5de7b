"""Launched by tests/test_sharded_launch.py in 2 real processes: the two ways of sharding data twice
through `accelerator.prepare`. Each rank records what check_loader says about them; then rank 0
reads a prepared DataLoader over a ShardedIterableDataset the way a user script would, which must
stop the run with the error instead of training on half the data.

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml tests/prepare_misuse_probe.py OUT.json

The test runs it after tests/sharded_probe.py's cases, in the same launch (sharded_probe.py's second argument).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from data.errors import PlanError
from data.loader import ShardedLoader, check_loader
from data.sharding import ShardedIterableDataset
from data.sources import TensorSource


def verdict(loader):
    try:
        check_loader(loader)
        return "accepted"
    except PlanError as e:
        return str(e)


def main(out_path):
    accelerator = Accelerator(cpu=True)
    rank, world = accelerator.process_index, accelerator.num_processes
    sharded = ShardedIterableDataset(TensorSource({"x": torch.arange(64)}), 8, rank=rank, world_size=world)
    rows = TensorDataset(torch.arange(64))
    report = {
        "world_size": world,
        "prepared_sharded": gather_object([verdict(accelerator.prepare(DataLoader(sharded, batch_size=None)))]),
        "prepared_distributed_sampler": gather_object(
            [
                verdict(
                    accelerator.prepare(
                        DataLoader(rows, batch_size=4, sampler=DistributedSampler(rows, num_replicas=world, rank=rank))
                    )
                )
            ]
        ),
        "prepared_plain": gather_object([verdict(accelerator.prepare(DataLoader(rows, batch_size=4)))]),
        "sharded_loader": gather_object([verdict(accelerator.prepare(ShardedLoader(sharded)))]),
    }
    if accelerator.is_main_process:
        json.dump(report, open(out_path, "w"))
    accelerator.wait_for_everyone()
    for batch in accelerator.prepare(DataLoader(sharded, batch_size=None)):  # must raise, not train
        print("trained on", batch["x"].tolist(), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
