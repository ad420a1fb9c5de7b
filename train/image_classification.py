"""Train an image classifier on your own image folders with Hugging Face Accelerate.

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml train/image_classification.py \
        --train_dir IMAGES/train --validation_dir IMAGES/validation --output_dir runs/my_images
    python train/image_classification.py --predict IMAGE_OR_FOLDER --output_dir runs/my_images

Folders hold one subfolder of images per class (docs/images.md); labels.json keeps the class names.
"""

import math
import os
import sys

if __package__ in (None, ""):  # run as a file: Python put train/ on sys.path, not the repo root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from data.image_pixels import image_transforms, keep_budget, normalize
from data.images import ImageFileSource, ImageFolderDataset, decode_for_prediction, list_images, scan_image_folder
from data.loader import pinned, sharded_loader
from data.workers import loader_workers
from train.core.accelerator import main_process_first
from train.core.evaluation import evaluate_classifier
from train.core.flags import add_optimizer_args, make_parser, reading_workers
from train.core.fsdp import fsdp_launch
from train.core.loop import TrainingLoop
from train.core.parser import positive_float, positive_int
from train.core.run import run, start_run
from train.core.tracking import write_json
from train.models.vision import build_classifier, check_model_args, load_pretrained, load_trained_classifier

TASK = "image_classification"  # the run's name in its checkpoints: another task's checkpoint is refused
METRICS = ["eval_accuracy", "eval_loss"]  # its evaluation's metrics, the headline first

# Defaults that follow the data, when --image_size / --num_train_epochs are not passed. The fixed ones (64 px,
# 3 epochs) gave 8x8 digits (1,437 training images) 66 optimizer steps on 8x upsampled images, far from
# what 32 px and 1,000 steps reach (docs/images.md)
CONVNET_SIDES = (32, 64)  # below 32 its four 2x2 pools leave under 2x2; above 64 a CPU epoch costs 4x per doubling
MIN_OPTIMIZER_STEPS, EPOCHS_RANGE = 1000, (3, 50)  # digits still gain from 500 to 1,000 steps (docs/images.md)


def parse_args(argv=None):
    parser = make_parser(__doc__)
    data, model = parser.groups["data"], parser.groups["model"]
    data.add_argument("--train_dir", type=str, help="Training images, one subfolder per class.")
    data.add_argument("--validation_dir", type=str, help="Validation images, same class folders (a subset is fine).")
    data.add_argument(
        "--train_val_split",
        type=positive_float,
        default=0.15,
        help="Without --validation_dir: the fraction of each class held out for validation.",
    )
    data.add_argument(
        "--image_size",
        type=positive_int,
        default=None,
        help="Square side the images are cropped to. Default: for convnet, the median image's short "
        "side rounded to a multiple of 8, within 32..64 (8x8 digits train at 32, photos at 64: "
        "pixels beyond an image's own add cost, not detail); 224 for torchvision models.",
    )
    data.add_argument("--max_train_samples", type=positive_int, help="Train on a random N images only.")
    data.add_argument("--max_eval_samples", type=positive_int, help="Validate on a random N images only.")
    data.add_argument(
        "--streaming",
        action="store_true",
        help="Read through the exactly-once sharded iterable path (resumes with any process count).",
    )
    data.add_argument(
        "--dataloader_num_workers",
        type=int,
        default=None,
        help="Processes decoding images per rank (default 4 on a GPU, 0 on a CPU: in the training "
        "process, fastest there).",
    )
    model.add_argument(
        "--model",
        type=str,
        default="convnet",
        help="convnet (built in, small) or a torchvision classification model: resnet18, ...",
    )
    model.add_argument(
        "--pretrained_weights", type=str, help="A local state dict to start from (what does not fit starts fresh)."
    )
    model.add_argument(
        "--predict", type=str, help="Instead of training: classify an image or folder with --output_dir."
    )
    add_optimizer_args(
        parser, learning_rate=2e-3, train_batch_size=32, eval_batch_size=64, weight_decay=0.05, label_smoothing=0.1
    )
    # None: picked in main() from the training set's size, then recorded (args.json, checkpoints) as picked
    parser.set_defaults(output_dir="runs/image_classification", num_train_epochs=None)
    parser.epilog = (
        f"Without --num_train_epochs: enough epochs for {MIN_OPTIMIZER_STEPS} optimizer steps, within "
        f"{EPOCHS_RANGE[0]}..{EPOCHS_RANGE[1]} (--max_train_steps still decides when passed)."
    )
    args = parser.parse_args(argv)
    if not (args.train_dir or args.predict):
        parser.error("--train_dir is required (or --predict IMAGE_OR_FOLDER with a trained --output_dir)")
    return args


def pick_image_size(model, median_size):
    """(--image_size, why) for a run that does not pass it; `median_size` is the training folder's."""
    if model != "convnet":
        return 224, f"{model}'s usual input"  # what torchvision's weights and ViT patch grids are made for
    low, high = CONVNET_SIDES
    side = min(max(8 * round(min(median_size) / 8), low), high)
    return side, f"the median image is {median_size[0]}x{median_size[1]}; convnet takes {low} to {high}"


def pick_num_train_epochs(train_samples, steps_per_epoch):
    """(--num_train_epochs, why) for a run that does not pass it. It depends on the sample count and
    the global batch only, which a resume must keep (train/core/resume.py checks), so a resumed run
    picks what the saved run picked."""
    low, high = EPOCHS_RANGE
    epochs = min(max(math.ceil(MIN_OPTIMIZER_STEPS / steps_per_epoch), low), high)
    why = f"{train_samples:,} training images: {steps_per_epoch} optimizer step{'s' * (steps_per_epoch > 1)} per epoch"
    if epochs * steps_per_epoch < MIN_OPTIMIZER_STEPS:
        why += f", {epochs * steps_per_epoch} in {high} epochs: more images would help"
    return epochs, why


def main(args):
    # One task top to bottom; a line over 60 because it holds both data paths (map-style and --streaming).
    check_model_args(args.model, args.pretrained_weights)  # before a scan of the folders that can take minutes
    accelerator = start_run(args, TASK)
    args.dataloader_num_workers = reading_workers(args.dataloader_num_workers, accelerator.device, on_gpu=4)

    # ---------------------------------------------------------------- data: scanned once, shared with every rank
    def scan():  # on the main process only: the others receive its lists
        train = scan_image_folder(args.train_dir, "--train_dir")
        write_json(os.path.join(args.output_dir, "labels.json"), train.classes)
        if args.validation_dir:
            return train, scan_image_folder(args.validation_dir, "--validation_dir", train.classes)
        return train.split(args.train_val_split, args.seed)

    train_files, eval_files = main_process_first(accelerator, scan, share=True)
    accelerator.print(f"train: {train_files.summary()}; validation: {eval_files.summary()}")
    train_files, eval_files = (
        train_files.subset(args.max_train_samples, args.seed),
        eval_files.subset(args.max_eval_samples, args.seed),
    )
    picked = []  # the defaults taken from the data, said in one line once the epochs are known too
    if args.image_size is None:
        args.image_size, why = pick_image_size(args.model, train_files.median_size)
        picked.append(f"image_size={args.image_size} ({why}; pass --image_size to choose)")
    # each process keeps the images it decodes when all of them fit its share of the memory; else decodes anew
    needed = train_files.decoded_bytes() + eval_files.decoded_bytes(square=args.image_size)
    keep = needed <= keep_budget(accelerator.num_processes, args.dataloader_num_workers)
    accelerator.print(
        f"images: {needed / 2**20:,.0f} MB decoded, "
        + (
            "kept by each process as it decodes them"
            if keep
            else "decoded again each time ("
            + ("DataLoader workers" if args.dataloader_num_workers else "over a quarter of the free memory")
            + ")"
        )
    )
    train_set = ImageFolderDataset(train_files, args.image_size, train=True, seed=args.seed, cache=keep)
    eval_set = ImageFolderDataset(eval_files, args.image_size, cache=keep)
    if args.streaming:
        train_loader = sharded_loader(
            ImageFileSource(train_set),
            args.per_device_train_batch_size,
            rank=accelerator.process_index,
            world_size=accelerator.num_processes,
            device=accelerator.device,
            seed=args.seed,
            train=True,
            num_workers=args.dataloader_num_workers,
        )
        eval_loader = sharded_loader(
            ImageFileSource(eval_set),
            args.per_device_eval_batch_size,
            rank=accelerator.process_index,
            world_size=accelerator.num_processes,
            device=accelerator.device,
            seed=args.seed,
            train=False,
            num_workers=args.dataloader_num_workers,
        )
    else:
        pin = pinned(accelerator.device)
        # loader_workers: workers not forked from this process, and a SIGTERM that reaches the rank alone
        train_loader = DataLoader(
            train_set,
            args.per_device_train_batch_size,
            shuffle=True,
            drop_last=True,
            pin_memory=pin,
            **loader_workers(args.dataloader_num_workers, train_set),
        )
        eval_loader = DataLoader(
            eval_set,
            args.per_device_eval_batch_size,
            pin_memory=pin,
            **loader_workers(args.dataloader_num_workers, eval_set),
        )

    # ---------------------------------------------------------------- model, optimizer, schedule
    model = build_classifier(args.model, len(train_files.classes), args.image_size)
    if args.pretrained_weights:
        fresh = load_pretrained(model, args.pretrained_weights)
        accelerator.print(f"loaded {args.pretrained_weights}; fresh: {', '.join(fresh) or 'nothing'}")
    # NHWC convolutions are faster on CPUs and GPUs; FSDP shards contiguous parameters only
    memory_format = torch.contiguous_format if fsdp_launch() else torch.channels_last
    model = model.to(memory_format=memory_format)

    def to_inputs(images):
        return normalize(images).contiguous(memory_format=memory_format)

    # fused: one kernel for all parameters instead of a loop of small ops per parameter
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay, fused=True)
    if args.streaming:  # already sharded: prepare() would shard again
        model, optimizer = accelerator.prepare(model, optimizer)
    else:
        model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    if args.num_train_epochs is None:  # from the prepared loader's length, as the loop counts steps
        steps_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
        if args.max_train_steps or not steps_per_epoch:  # the epochs those steps take; 0: the loop refuses the set
            args.num_train_epochs = math.ceil((args.max_train_steps or 1) / max(steps_per_epoch, 1))
        else:
            args.num_train_epochs, why = pick_num_train_epochs(len(train_files), steps_per_epoch)
            picked.append(f"num_train_epochs={args.num_train_epochs} ({why}; pass --num_train_epochs to choose)")
    if picked:
        accelerator.print(" ".join(picked))

    # ---------------------------------------------------------------- train
    loop = TrainingLoop(
        accelerator,
        args,
        TASK,
        model,
        optimizer,
        train_loader,
        evaluate=lambda: evaluate_classifier(accelerator, model, eval_loader, to_inputs),
        headline=METRICS[0],
        metrics=METRICS,
    )
    for batch in loop.batches():
        with accelerator.accumulate(model):
            loss = F.cross_entropy(
                model(to_inputs(batch["image"])), batch["label"], label_smoothing=args.label_smoothing
            )
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        loop.after_batch(loss)
    return loop.finish({"classes": train_files.classes, "train_samples": len(train_files)})


def predict(args):
    """Print `path<TAB>class<TAB>probability` for each image, with the run saved in --output_dir."""
    model, classes, image_size = load_trained_classifier(args.output_dir)  # on the GPU if there is one
    files, transform = list_images(args.predict), image_transforms(image_size, train=False)
    with torch.inference_mode():
        for start in range(0, len(files), 64):
            chunk, images, warnings = decode_for_prediction(files[start : start + 64], transform)
            sys.stderr.write(warnings)
            probabilities = model(normalize(images.to(next(model.parameters()).device))).softmax(-1) if chunk else []
            for path, p in zip(chunk, probabilities, strict=True):
                print(f"{path}\t{classes[int(p.argmax())]}\t{float(p.max()):.3f}")


if __name__ == "__main__":
    arguments = parse_args()
    run(predict if arguments.predict else main, arguments)
