"""train/mnist.py's hot loop written against torch.distributed directly: no accelerate.

The yardstick for framework overhead: the same in-memory data path (our dataset's batched
`__getitems__`, normalisation on the batch), the same ConvNet in channels_last, bf16 autocast around
the forward only (as accelerate does), fused AdamW, DDP without the per-forward buffer broadcast
(as make_accelerator sets it), one `.item()` every 20 steps. Only the wrapping
differs: DistributedSampler + DDP here, accelerate's prepared loader, DDP and loop helpers there.

    torchrun --standalone --nproc_per_node 2 bench/reference/raw_ddp_mnist.py --data_dir DIR --epochs 1

Prints one RESULT line per epoch: train seconds of that epoch (no evaluation) and test accuracy.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from data import identity_collate, load_mnist, normalize_images
from train.mnist import ConvNet

parser = argparse.ArgumentParser()
parser.add_argument("--data_dir", required=True)
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--per_device_train_batch_size", type=int, default=50)
parser.add_argument("--learning_rate", type=float, default=1e-3)
parser.add_argument("--mixed_precision", choices=["no", "bf16"], default="bf16")
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
torch.manual_seed(42)
train_set, eval_set, _ = load_mnist("fashion_mnist", args.data_dir)
mean, std = train_set.mean, train_set.std
sampler = DistributedSampler(train_set, shuffle=True, seed=42, drop_last=True)
train_loader = DataLoader(
    train_set, batch_size=args.per_device_train_batch_size, sampler=sampler, drop_last=True, collate_fn=identity_collate
)
eval_loader = DataLoader(
    eval_set, batch_size=500, sampler=DistributedSampler(eval_set, shuffle=False), collate_fn=identity_collate
)
model = DDP(ConvNet().to(memory_format=torch.channels_last), broadcast_buffers=False)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0, fused=True)
bf16 = args.mixed_precision == "bf16"


def logits_of(images):
    inputs = normalize_images(images, mean, std).contiguous(memory_format=torch.channels_last)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return model(inputs).float()


for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    model.train()
    start = time.perf_counter()
    for step, batch in enumerate(train_loader):
        loss = F.cross_entropy(logits_of(batch["image"]), batch["label"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % 20 == 0:
            loss.item()
    epoch_seconds = time.perf_counter() - start
    model.eval()
    counts = torch.zeros(2)
    with torch.no_grad():
        for batch in eval_loader:
            counts += torch.tensor(
                [(logits_of(batch["image"]).argmax(-1) == batch["label"]).sum(), len(batch["label"])]
            )
    dist.all_reduce(counts)  # 10000 (and the tiny 500) divide by 2: DistributedSampler pads nothing
    if rank == 0:
        print(
            f"RESULT epoch={epoch + 1} epoch_s={epoch_seconds:.3f} acc={counts[0] / counts[1]:.4f} "
            f"n_eval={int(counts[1])}",
            flush=True,
        )
model = optimizer = None  # DDP's reducer holds gloo work; freeing it at interpreter exit can abort
dist.barrier()  # gloo teardown while a peer still reduces can abort
dist.destroy_process_group()
