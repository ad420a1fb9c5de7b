"""Pixels after decoding: torchvision's transforms, the training crop and flip drawn from a
generator of the sample's own, normalisation on the batch's device, and how many decoded pixels a
training process may keep (data/images.py keeps them)."""

import math
import os

import torch

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # what torchvision's weights expect
CROP_SCALE, CROP_RATIO = (0.35, 1.0), (3 / 4, 4 / 3)  # the fraction of the area a training crop keeps; its aspect
LOG_RATIO = torch.log(torch.tensor(CROP_RATIO)).tolist()  # in float32, as torchvision computes it


def image_transforms(image_size, train):
    """torchvision v2 transforms from a PIL image to a uint8 tensor [3, image_size, image_size]:
    a random resized crop and flip for training; resize the short side and crop the centre for
    evaluation. uint8 keeps worker-to-process transfers 4x smaller; normalize() makes floats.
    ImageFolderDataset draws the training pair with a generator of its own (crop_and_flip), with
    the same results as these transforms under a global generator seeded alike."""
    from torchvision.transforms import v2

    if train:
        return v2.Compose(
            [
                v2.PILToTensor(),
                v2.RandomResizedCrop(image_size, scale=CROP_SCALE, antialias=True),
                v2.RandomHorizontalFlip(),
            ]
        )
    return v2.Compose([v2.PILToTensor(), v2.Resize(image_size, antialias=True), v2.CenterCrop(image_size)])


def crop_and_flip(pixels, image_size, generator):
    """The training augmentation of image_transforms(image_size, True) after its PILToTensor, drawn
    from `generator` in the order torchvision's RandomResizedCrop and RandomHorizontalFlip draw from
    the global one (area, aspect ratio, up to 10 tries, else a centred crop; then the flip), so a
    seed gives the same crop either way. A generator of its own per sample costs microseconds where
    forking and reseeding the global one costs a third of a millisecond, about as much as decoding
    a small PNG."""
    from torchvision.transforms.v2 import functional as TF

    height, width = pixels.shape[-2:]
    area = height * width
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(*CROP_SCALE, generator=generator).item()
        aspect = torch.exp(torch.empty(1).uniform_(*LOG_RATIO, generator=generator)).item()
        w, h = int(round(math.sqrt(target_area * aspect))), int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = torch.randint(0, height - h + 1, size=(1,), generator=generator).item()
            left = torch.randint(0, width - w + 1, size=(1,), generator=generator).item()
            break
    else:  # no try fitted: the largest centred crop within the aspect ratios, as torchvision falls back
        w, h = width, height
        if width / height < CROP_RATIO[0]:
            h = int(round(w / CROP_RATIO[0]))
        elif width / height > CROP_RATIO[1]:
            w = int(round(h * CROP_RATIO[1]))
        top, left = (height - h) // 2, (width - w) // 2
    pixels = TF.resized_crop(pixels, top, left, h, w, size=[image_size, image_size], antialias=True)
    return TF.horizontal_flip(pixels) if torch.rand(1, generator=generator).item() < 0.5 else pixels


def normalize(images, mean=IMAGENET_MEAN, std=IMAGENET_STD):
    """uint8 [B, 3, H, W] -> float, standardised per channel, on the batch's device."""
    mean = torch.tensor(mean, device=images.device).view(1, -1, 1, 1)
    std = torch.tensor(std, device=images.device).view(1, -1, 1, 1)
    return (images.float() / 255.0 - mean) / std


def available_memory():
    """Bytes this process could still use: the machine's available memory, or less under a cgroup
    limit (a SLURM job's or a container's), which /proc/meminfo does not show."""
    try:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):  # not Linux: half the physical memory, where POSIX tells it
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2 if hasattr(os, "sysconf") else 0
    for limit, usage in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2, then v1
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit) as f, open(usage) as g:
                free = min(free, int(f.read()) - int(g.read()))  # "max" (no limit) fails int(): skipped
        except (OSError, ValueError):
            continue
    return max(free, 0)


def keep_budget(processes, num_workers, free=None):
    """Bytes of decoded images each training process may keep: a quarter of the memory free now,
    shared by `processes` (this machine's, or all of them when that is unknown: on several machines
    the budget only errs low); 0 with DataLoader workers, whose copies of the dataset would each keep
    their own and lose it with the epoch."""
    if num_workers:
        return 0
    return (available_memory() if free is None else free) // 4 // max(1, processes)
