"""Train an image classifier on your own image folders with Hugging Face Accelerate.

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml train/image_classification.py \
        --train_dir IMAGES/train --validation_dir IMAGES/validation --output_dir runs/my_images
    python train/image_classification.py --predict IMAGE_OR_FOLDER --output_dir runs/my_images

Folders hold one subfolder of images per class (docs/images.md); labels.json keeps the class names.
"""
import os
import sys

if __package__ in (None, ""):  # run as a file: Python put train/ on sys.path, not the repo root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from data.images import (ImageFileSource, ImageFolderDataset, decode_for_prediction, image_transforms, list_images,
                         normalize, scan_image_folder)
from data.loader import own_process_group, sharded_loader
from train.core.accelerator import main_process_first
from train.core.cli import add_optimizer_args, make_parser, positive_float, positive_int
from train.core.evaluation import evaluate_classifier
from train.core.fsdp import fsdp_launch
from train.core.loop import TrainingLoop
from train.core.run import run, start_run
from train.core.tracking import write_json
from train.models.vision import build_classifier, check_model_args, load_pretrained, load_trained_classifier

TASK = "image_classification"  # the run's name in its checkpoints: another task's checkpoint is refused


def parse_args(argv=None):
    parser = make_parser(__doc__)
    data, model = parser.groups["data"], parser.groups["model"]
    data.add_argument("--train_dir", type=str, help="Training images, one subfolder per class.")
    data.add_argument("--validation_dir", type=str, help="Validation images, same class folders (a subset is fine).")
    data.add_argument("--train_val_split", type=positive_float, default=0.15,
                      help="Without --validation_dir: the fraction of each class held out for validation.")
    data.add_argument("--image_size", type=positive_int, default=None,
                      help="Square side the images are cropped to (default: 64 for convnet, 224 otherwise).")
    data.add_argument("--max_train_samples", type=positive_int, help="Train on a random N images only.")
    data.add_argument("--max_eval_samples", type=positive_int, help="Validate on a random N images only.")
    data.add_argument("--streaming", action="store_true",
                      help="Read through the exactly-once sharded iterable path (resumes with any process count).")
    data.add_argument("--dataloader_num_workers", type=int, default=4 if torch.cuda.is_available() else 0,
                      help="Processes decoding images per rank (0: in the training process, fastest on a CPU).")
    model.add_argument("--model", type=str, default="convnet",
                       help="convnet (built in, small) or a torchvision classification model: resnet18, ...")
    model.add_argument("--pretrained_weights", type=str, help="A local state dict to start from (what does not fit "
                       "starts fresh).")
    model.add_argument("--predict", type=str, help="Instead of training: classify an image or folder with --output_dir.")
    add_optimizer_args(parser, learning_rate=2e-3, train_batch_size=32, eval_batch_size=64, weight_decay=0.05,
                       label_smoothing=0.1)
    parser.set_defaults(output_dir="runs/image_classification")
    args = parser.parse_args(argv)
    if not (args.train_dir or args.predict):
        parser.error("--train_dir is required (or --predict IMAGE_OR_FOLDER with a trained --output_dir)")
    args.image_size = args.image_size or (64 if args.model == "convnet" else 224)
    return args


def main(args):
    # One task top to bottom; a line over 60 because it holds both data paths (map-style and --streaming).
    check_model_args(args.model, args.pretrained_weights)  # before a scan of the folders that can take minutes
    accelerator = start_run(args, TASK)

    # ---------------------------------------------------------------- data: scanned once, shared with every rank
    def scan():  # on the main process only: the others receive its lists
        train = scan_image_folder(args.train_dir, "--train_dir")
        write_json(os.path.join(args.output_dir, "labels.json"), train.classes)
        if args.validation_dir:
            return train, scan_image_folder(args.validation_dir, "--validation_dir", train.classes)
        return train.split(args.train_val_split, args.seed)

    train_files, eval_files = main_process_first(accelerator, scan, share=True)
    accelerator.print(f"train: {train_files.summary()}; validation: {eval_files.summary()}")
    train_files, eval_files = train_files.subset(args.max_train_samples, args.seed), \
        eval_files.subset(args.max_eval_samples, args.seed)
    train_set = ImageFolderDataset(train_files, image_transforms(args.image_size, True), args.seed, random=True)
    eval_set = ImageFolderDataset(eval_files, image_transforms(args.image_size, False))
    if args.streaming:
        train_loader = sharded_loader(ImageFileSource(train_set), args.per_device_train_batch_size,
                                      rank=accelerator.process_index, world_size=accelerator.num_processes,
                                      device=accelerator.device, seed=args.seed, train=True,
                                      num_workers=args.dataloader_num_workers)
        eval_loader = sharded_loader(ImageFileSource(eval_set), args.per_device_eval_batch_size,
                                     rank=accelerator.process_index, world_size=accelerator.num_processes,
                                     device=accelerator.device, seed=args.seed, train=False,
                                     num_workers=args.dataloader_num_workers)
    else:
        train_loader = DataLoader(train_set, args.per_device_train_batch_size, shuffle=True, drop_last=True,
                                  num_workers=args.dataloader_num_workers,
                                  worker_init_fn=own_process_group)  # a SIGTERM must reach the rank alone
        eval_loader = DataLoader(eval_set, args.per_device_eval_batch_size, num_workers=args.dataloader_num_workers,
                                 worker_init_fn=own_process_group)

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

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    if args.streaming:  # already sharded: prepare() would shard again
        model, optimizer = accelerator.prepare(model, optimizer)
    else:
        model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)

    # ---------------------------------------------------------------- train
    loop = TrainingLoop(accelerator, args, TASK, model, optimizer, train_loader,
                        evaluate=lambda: evaluate_classifier(accelerator, model, eval_loader, to_inputs),
                        headline="eval_accuracy")
    for batch in loop.batches():
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(to_inputs(batch["image"])), batch["label"],
                                   label_smoothing=args.label_smoothing)
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
            chunk, images, warnings = decode_for_prediction(files[start:start + 64], transform)
            sys.stderr.write(warnings)
            probabilities = model(normalize(images.to(next(model.parameters()).device))).softmax(-1) if chunk else []
            for path, p in zip(chunk, probabilities):
                print(f"{path}\t{classes[int(p.argmax())]}\t{float(p.max()):.3f}")


if __name__ == "__main__":
    arguments = parse_args()
    run(predict if arguments.predict else main, arguments)
