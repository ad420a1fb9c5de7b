"""Helpers that more than one script in train/ needs. Plain functions, no Trainer."""
import argparse
import json
import math
import os
import pickle
import random
import re
import shutil
import sys
from datetime import timedelta
from urllib.parse import urlparse

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs

CHECKPOINT_FORMAT = 1
RUN_FILES = ("all_results.json", "model.safetensors", "checkpoints")  # what makes a folder "hold a run"


def positive_int(text):
    """argparse type: an int >= 1, so `--per_device_train_batch_size 0` fails at parse time."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def steps_or_epoch(text):
    return "epoch" if text == "epoch" else positive_int(text)


def add_common_args(parser):
    """Flags every script shares, named as in transformers' run_*_no_trainer.py scripts."""
    parser.add_argument("--num_train_epochs", type=positive_int, default=3, help="Passes over the training data.")
    parser.add_argument("--max_train_steps", type=positive_int, default=None,
                        help="Optimizer steps to run; overrides --num_train_epochs when set.")
    parser.add_argument("--gradient_accumulation_steps", type=positive_int, default=1,
                        help="Micro-batches per optimizer step.")
    parser.add_argument("--seed", type=int, default=42, help="Seed for weights, shuffling and dropout.")
    parser.add_argument("--output_dir", type=str, default=None, help="Where weights, metrics and checkpoints go.")
    parser.add_argument("--overwrite_output_dir", action="store_true",
                        help="Replace a run already in --output_dir (its checkpoints are deleted).")
    parser.add_argument("--checkpointing_steps", type=steps_or_epoch, default=None,
                        help="Save a checkpoint every N optimizer steps, or 'epoch' at the end of each epoch.")
    parser.add_argument("--resume_from_checkpoint", type=str, default=None,
                        help="A checkpoint folder (OUTPUT_DIR/checkpoints/step_N) or 'latest': the newest "
                             "complete one in --output_dir, or a fresh start if there is none yet.")
    parser.add_argument("--checkpoints_total_limit", type=positive_int, default=None,
                        help="Keep only the newest N checkpoints.")
    parser.add_argument("--ddp_timeout", type=positive_int, default=300,
                        help="Seconds a collective may wait for a peer before the run fails (torch's default is "
                             "30 minutes, which is how long survivors of a dead rank would hang).")
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None,
                        help="Overrides the accelerate config's mixed_precision.")
    parser.add_argument("--cpu", action="store_true",
                        help="Train on the CPU even when a GPU is visible (the default when none is).")


def _env_rendezvous_per_attempt(url, timeout=None, **kwargs):
    """`env://` whose store keys carry torchrun's restart attempt.

    torch 2.15's elastic agent keeps one rendezvous store for its whole life and `env://` uses it
    without a per-attempt prefix, so after `--max_restarts` restarts the workers a rank can read its
    peer's address from the dead attempt and fail ("Gloo connectFullMesh failed ... Connection
    refused"; 3 of 3 restarts here, pytorch#135712 has the same root cause). A prefix per attempt
    gives every attempt fresh keys.
    """
    from torch.distributed import PrefixStore
    from torch.distributed.rendezvous import _env_rendezvous_handler

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    query = urlparse(url).query  # torch appends rank/world_size here when it knows them
    for store, rank, world_size in _env_rendezvous_handler(f"env://?{query}", timeout=timeout, **kwargs):
        yield PrefixStore(f"attempt_{attempt}/", store), rank, world_size


def _process_group_kwargs(args):
    kwargs = {"timeout": timedelta(seconds=args.ddp_timeout)}
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:  # launched by torchrun, so restarts are possible
        from torch.distributed.rendezvous import _rendezvous_handlers, register_rendezvous_handler

        if "envattempt" not in _rendezvous_handlers:
            register_rendezvous_handler("envattempt", _env_rendezvous_per_attempt)
        kwargs["init_method"] = "envattempt://"
    return InitProcessGroupKwargs(**kwargs)


def make_accelerator(args, **kwargs):
    """The one Accelerator a script builds.

    cpu=True when no accelerator is visible: accelerate only forms a multi-process CPU group (gloo)
    when told cpu=True, and under torchrun (MULTI_GPU configs) the config's use_cpu never reaches the
    script, so without this a 2-process CPU launch trains two independent copies.
    The seedable sampler makes the shuffle a function of (seed, epoch) alone: the same on every rank
    and reproducible on resume. The scheduler is stepped by the script once per optimizer step, so
    its state does not depend on the process count and survives a resume with another one.
    """
    return Accelerator(
        cpu=args.cpu or not torch.accelerator.is_available(),
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
        step_scheduler_with_optimizer=False,
        kwargs_handlers=[_process_group_kwargs(args)],
        **kwargs,
    )


def announce(accelerator, global_batch_size):
    """One line per process, then a header from the main process: what is really running, so a
    wrong launch (two independent world-size-1 runs, say) shows at once."""
    # one write() per line, so lines from different processes do not interleave mid-line
    sys.stdout.write(f"process {accelerator.process_index}/{accelerator.num_processes} pid={os.getpid()} "
                     f"device={accelerator.device}\n")
    sys.stdout.flush()
    accelerator.wait_for_everyone()
    accelerator.print(f"world_size={accelerator.num_processes} device={accelerator.device.type} "
                      f"distributed_type={accelerator.distributed_type.value} "
                      f"mixed_precision={accelerator.mixed_precision} global_batch_size={global_batch_size} "
                      f"threads_per_process={torch.get_num_threads()}")


def plan_steps(args, batches_per_epoch):
    """(max_train_steps, num_train_epochs) from the per-process batch count of the prepared loader."""
    steps_per_epoch = math.ceil(batches_per_epoch / args.gradient_accumulation_steps)
    if steps_per_epoch == 0:
        raise SystemExit("error: the training set is smaller than one global batch; lower "
                         "--per_device_train_batch_size or use more training samples")
    max_train_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    return max_train_steps, math.ceil(max_train_steps / steps_per_epoch)


def make_scheduler(optimizer, name, num_warmup_steps, num_training_steps):
    """LambdaLR for `name` in (constant, linear, cosine) with linear warmup, in optimizer steps."""
    def lr_lambda(step):
        if step < num_warmup_steps:
            return (step + 1) / (num_warmup_steps + 1)
        progress = min(1.0, (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps))
        if name == "linear":
            return 1.0 - progress
        if name == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)


def write_json(path, payload):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)  # readers never see a half-written file


# ------------------------------------------------------------------------------------ checkpoints
# Layout: OUTPUT_DIR/checkpoints/step_00000040/{model.safetensors, optimizer.pt, scheduler.pt,
# [scaler.pt], rng_state_{rank}.pt, meta.json}. A checkpoint is written under .tmp-step_N and renamed
# only when every rank has written its part, so a folder named step_N is always complete.
# accelerate's save_state/load_state is not used: it loads registered objects with
# weights_only=False, i.e. it would execute a pickle planted in a checkpoint.

def prepare_output_dir(accelerator, args):
    """Refuse to write over an earlier run unless the user resumes it or asks to replace it."""
    holds_run = any(os.path.exists(os.path.join(args.output_dir, name)) for name in RUN_FILES)
    if holds_run and args.overwrite_output_dir and args.resume_from_checkpoint:
        raise SystemExit("error: --overwrite_output_dir and --resume_from_checkpoint contradict each other; pass one")
    if holds_run and not (args.overwrite_output_dir or args.resume_from_checkpoint):
        raise SystemExit(f"error: --output_dir {args.output_dir} already holds a run; pass --resume_from_checkpoint "
                         "latest to continue it, --overwrite_output_dir to replace it, or another --output_dir")
    accelerator.wait_for_everyone()  # every rank has looked before anything is deleted
    if holds_run and args.overwrite_output_dir and accelerator.is_main_process:
        shutil.rmtree(os.path.join(args.output_dir, "checkpoints"), ignore_errors=True)
    accelerator.wait_for_everyone()


def list_checkpoints(output_dir):
    """Complete checkpoints in output_dir, oldest first."""
    root = os.path.join(output_dir, "checkpoints")
    names = os.listdir(root) if os.path.isdir(root) else []
    found = [(int(m.group(1)), os.path.join(root, n)) for n in names if (m := re.fullmatch(r"step_(\d+)", n))]
    return [path for _, path in sorted(found) if os.path.isfile(os.path.join(path, "meta.json"))]


def find_checkpoint(accelerator, args):
    """The checkpoint to resume from, or None for a fresh start."""
    if args.resume_from_checkpoint is None:
        return None
    if args.resume_from_checkpoint == "latest":
        found = list_checkpoints(args.output_dir)
        if not found:
            accelerator.print(f"no checkpoint in {args.output_dir}/checkpoints yet: starting fresh")
            return None
        return found[-1]
    path = args.resume_from_checkpoint
    if not os.path.isfile(os.path.join(path, "meta.json")):
        raise SystemExit(f"error: --resume_from_checkpoint {path} is not a checkpoint (no meta.json there); "
                         "pass an OUTPUT_DIR/checkpoints/step_N folder or 'latest'")
    return path


def _rng_state():
    version, state, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(state), gauss], "torch": torch.get_rng_state(),
            "numpy": [torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def _set_rng_state(state):
    version, values, gauss = state["python"]
    random.setstate((version, tuple(values), gauss))
    keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(accelerator, args, script, step, model, optimizer, lr_scheduler, data_state, extra=None):
    """Write checkpoints/step_N atomically; keep the newest --checkpoints_total_limit."""
    from safetensors.torch import save_file

    root = os.path.join(args.output_dir, "checkpoints")
    final, tmp = os.path.join(root, f"step_{step:08d}"), os.path.join(root, f".tmp-step_{step:08d}")
    state_dict = accelerator.get_state_dict(model)  # a collective under FSDP: every rank calls it
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save
        os.makedirs(tmp)
    accelerator.wait_for_everyone()
    files = [os.path.join(tmp, f"rng_state_{accelerator.process_index}.pt")]
    torch.save(_rng_state(), files[0])
    if accelerator.is_main_process:
        save_file({k: v.contiguous() for k, v in state_dict.items()}, os.path.join(tmp, "model.safetensors"))
        torch.save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
        files += [os.path.join(tmp, n) for n in ("model.safetensors", "optimizer.pt")]
        if lr_scheduler is not None:
            torch.save(lr_scheduler.state_dict(), os.path.join(tmp, "scheduler.pt"))
            files.append(os.path.join(tmp, "scheduler.pt"))
        if accelerator.scaler is not None:
            torch.save(accelerator.scaler.state_dict(), os.path.join(tmp, "scaler.pt"))
            files.append(os.path.join(tmp, "scaler.pt"))
        write_json(os.path.join(tmp, "meta.json"), {
            "format": CHECKPOINT_FORMAT, "script": script, "step": step, "world_size": accelerator.num_processes,
            "data": data_state, "args": vars(args), **(extra or {})})
        files.append(os.path.join(tmp, "meta.json"))
    for path in files:  # on disk before the rename publishes them
        _fsync(path)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if os.path.isdir(final):  # the same step saved again after a resume
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync(root)
        for old in list_checkpoints(args.output_dir)[:-args.checkpoints_total_limit or None] \
                if args.checkpoints_total_limit else []:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def _load_trusted(path):
    """torch.load that only reads tensors and plain containers: a planted pickle is refused, not run."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        reason = str(e).splitlines()[0]
        raise SystemExit(f"error: refused to load {path}: it holds pickled objects other than tensors ({reason}); "
                         "it was not written by these scripts; delete that checkpoint") from None
    except (OSError, RuntimeError, EOFError) as e:
        raise SystemExit(f"error: {path} is unreadable ({type(e).__name__}); delete that checkpoint and resume "
                         "from an earlier one") from None


def load_checkpoint(accelerator, path, script, model, optimizer, lr_scheduler):
    """Restore everything save_checkpoint wrote into the prepared objects; return its meta dict."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {path}/meta.json is unreadable ({e}); resume from another checkpoint") from None
    if meta.get("script") != script or meta.get("format") != CHECKPOINT_FORMAT:
        raise SystemExit(f"error: {path} was written by train/{meta.get('script')}.py (format {meta.get('format')}), "
                         f"not train/{script}.py (format {CHECKPOINT_FORMAT}); pass a checkpoint of this script")
    try:
        weights = load_file(os.path.join(path, "model.safetensors"))
    except (SafetensorError, OSError, ValueError) as e:
        raise SystemExit(f"error: {path}/model.safetensors is corrupt or missing ({e}); delete that checkpoint "
                         "and resume from an earlier one") from None
    try:
        accelerator.unwrap_model(model).load_state_dict(weights)
    except RuntimeError as e:
        detail = " ".join(str(e).split())[:200]
        raise SystemExit(f"error: {path} does not fit this model ({detail}); resume with the model arguments "
                         "it was saved with") from None
    optimizer.load_state_dict(_load_trusted(os.path.join(path, "optimizer.pt")))
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(_load_trusted(os.path.join(path, "scheduler.pt")))
    if accelerator.scaler is not None and os.path.isfile(os.path.join(path, "scaler.pt")):
        accelerator.scaler.load_state_dict(_load_trusted(os.path.join(path, "scaler.pt")))
    rng_file = os.path.join(path, f"rng_state_{accelerator.process_index}.pt")
    if not os.path.isfile(rng_file):  # resumed with more processes than saved: reuse rank 0's streams
        rng_file = os.path.join(path, "rng_state_0.pt")
    _set_rng_state(_load_trusted(rng_file))
    accelerator.print(f"resumed from {path} (step {meta['step']}, saved with {meta['world_size']} processes)")
    return meta
