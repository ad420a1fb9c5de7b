"""What a training image costs train/image_classification.py on the CPU before the model sees it:
decoding the file and drawing its augmentation every epoch (the way it was), against cropping the
pixels kept from the first epoch with a generator of the sample's own (the way it is), and the
model's step per image beside them.

    python bench/image_pipeline.py --train_dir runs/images/fashion_mnist/train     # ~1 minute
    python bench/image_pipeline.py --train_dir DIR --image_size 64 --images 500

One process, one thread (each of 2 training processes on 2 cores has one). The two data paths take
turns over the same images, one batch each, so the host's drift hits both; both give the same pixels
(tests/test_image_classification.py checks it for every sample). The step is the built-in convnet's
forward, backward and fused AdamW step on a batch of --batch_size at --image_size, channels_last.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train_dir", required=True, help="An image folder (make images writes Fashion-MNIST's).")
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--images", type=int, default=2048, help="Images timed (a random subset of the folder).")
    parser.add_argument("--batch_size", type=int, default=32)
    args = parser.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from data.image_pixels import image_transforms, normalize
    from data.images import ImageFolderDataset, load_image, scan_image_folder
    from train.models.vision import ConvNet

    torch.set_num_threads(1)
    images = scan_image_folder(args.train_dir, "--train_dir").subset(args.images, 0)
    if len(images) < args.batch_size:
        parser.error(f"{len(images)} images are fewer than one --batch_size {args.batch_size}; pass a smaller one")
    reference = image_transforms(args.image_size, True)

    def before(i, epoch):  # decode, then torchvision's transforms under the global generator, reseeded
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(hash((0, epoch, i)) & (2**63 - 1))
            return reference(load_image(images.files[i]))

    kept = ImageFolderDataset(images, args.image_size, train=True, cache=True)
    for i in range(len(images)):  # the first epoch's decode, which both paths pay
        kept[i]
    kept.set_epoch(1)
    paths = {
        "before: decode + transforms every epoch": lambda i: before(i, 1),
        "now: kept pixels, own generator": lambda i: kept[i]["image"],
    }
    per_image = {name: [] for name in paths}
    for start in range(0, len(images) - args.batch_size + 1, args.batch_size):
        order = list(paths) if start // args.batch_size % 2 == 0 else list(paths)[::-1]
        for name in order:
            t = time.perf_counter()
            torch.stack([paths[name](i) for i in range(start, start + args.batch_size)])
            per_image[name].append((time.perf_counter() - t) / args.batch_size)

    model = ConvNet(10).to(memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, fused=True)
    x = torch.randint(0, 256, (args.batch_size, 3, args.image_size, args.image_size), dtype=torch.uint8)
    y = torch.randint(0, 10, (args.batch_size,))
    steps = []
    for n in range(40):
        t = time.perf_counter()
        F.cross_entropy(model(normalize(x).contiguous(memory_format=torch.channels_last)), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if n >= 5:
            steps.append((time.perf_counter() - t) / args.batch_size)

    step = statistics.median(steps) * 1e6
    print(
        f"{len(images)} images of {args.train_dir}, --image_size {args.image_size}, batch {args.batch_size}, 1 thread\n"
    )
    print("| per training image | µs (median over batches) | with the model's step | images/s, one process |")
    print("|---|---|---|---|")
    totals = {}
    for name, times in per_image.items():
        data = statistics.median(times) * 1e6
        totals[name] = data + step
        print(f"| {name} | {data:.0f} | {data + step:.0f} | {1e6 / (data + step):.0f} |")
    print(f"| the model's step alone | {step:.0f} | | |")
    before_total, now_total = totals.values()
    print(
        f"\nRATIO images/s now / before = {before_total / now_total:.2f} (data path alone: "
        f"{statistics.median(per_image[list(paths)[0]]) / statistics.median(per_image[list(paths)[1]]):.1f}x)"
    )


if __name__ == "__main__":
    main()
