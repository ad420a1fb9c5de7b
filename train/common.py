"""Helpers that more than one script in train/ needs. Plain functions, no Trainer."""
import argparse
import functools
import inspect
import json
import math
import os
import sys
from datetime import timedelta
from urllib.parse import urlparse

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, DistributedDataParallelKwargs, InitProcessGroupKwargs


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
    DDP's broadcast_buffers is off: broadcasting BatchNorm statistics before every forward cost 20-25%
    of a CPU step here; scripts average them over ranks with average_buffers() before evaluating.
    """
    _cache_per_step_lookups()
    return Accelerator(
        cpu=args.cpu or not torch.accelerator.is_available(),
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
        step_scheduler_with_optimizer=False,
        kwargs_handlers=[_process_group_kwargs(args), DistributedDataParallelKwargs(broadcast_buffers=False)],
        **kwargs,
    )


def _cache_per_step_lookups():
    """accelerate 1.15 looks up, at every optimizer step, answers that cannot change during a run
    (README, "Speed"; 2-process CPU step here ~12 ms):
    - AcceleratedOptimizer.step() asks importlib twice whether lomo_optim is installed, a find_spec
      over every sys.path entry: ~0.2 ms (transformers caches the same check);
    - AcceleratedOptimizer.zero_grad() runs inspect.signature on the wrapped optimizer: ~0.07 ms.
    Both are computed once. Each is replaced only where accelerate still has that code."""
    import accelerate.optimizer

    lookup = getattr(accelerate.optimizer, "is_lomo_available", None)
    if lookup is not None and not hasattr(lookup, "cache_info"):
        accelerate.optimizer.is_lomo_available = functools.cache(lookup)
    optimizer_class = accelerate.optimizer.AcceleratedOptimizer
    if "signature" in getattr(optimizer_class.zero_grad, "__code__", _zero_grad.__code__).co_names:
        optimizer_class.zero_grad = _zero_grad


@functools.cache
def _accepts_set_to_none(zero_grad):
    return "set_to_none" in inspect.signature(zero_grad).parameters


def _zero_grad(self, set_to_none=None):
    """AcceleratedOptimizer.zero_grad of accelerate 1.15 with its signature check cached: the same
    branches and the same error."""
    if self.gradient_state.sync_gradients:
        zero_grad = self.optimizer.zero_grad
        if _accepts_set_to_none(getattr(zero_grad, "__func__", zero_grad)):
            zero_grad(set_to_none=True if set_to_none is None else set_to_none)
        elif set_to_none is not None:
            raise ValueError("`set_to_none` for Optimizer.zero_grad` is not supported by this optimizer.")
        else:
            zero_grad()


def average_buffers(accelerator, model):
    """Set floating-point buffers (BatchNorm running statistics) to their mean over ranks, so every
    rank evaluates and saves the same model, with statistics from all ranks' data."""
    if accelerator.num_processes > 1:
        with torch.no_grad():
            for buffer in accelerator.unwrap_model(model).buffers():
                if buffer.is_floating_point():
                    buffer.copy_(accelerator.reduce(buffer, reduction="mean"))


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
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and accelerator.distributed_type.value != "FSDP":
        # accelerate 1.15 turns an FSDP config into plain DDP when cpu=True, without a word
        accelerator.print("warning: the config asks for FSDP, but accelerate runs FSDP on GPUs only: this run is "
                          f"{accelerator.distributed_type.value} (plain data parallel, unsharded)")


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


def save_final(accelerator, model, args, results):
    """The run's outputs: model.safetensors, all_results.json and args.json in --output_dir."""
    accelerator.wait_for_everyone()
    accelerator.save_model(model, args.output_dir)  # written by the main process
    if accelerator.is_main_process:
        write_json(os.path.join(args.output_dir, "all_results.json"), results)
        write_json(os.path.join(args.output_dir, "args.json"), vars(args))


def add_tracking_args(parser):
    parser.add_argument("--with_tracking", action="store_true",
                        help="Send metrics to the --report_to trackers (files under OUTPUT_DIR/tensorboard).")
    parser.add_argument("--report_to", type=str, default="tensorboard",
                        help="accelerate tracker(s) for --with_tracking: tensorboard, wandb, ..., or all.")


def tracking_kwargs(args):
    """Accelerator arguments for --with_tracking: trackers write under OUTPUT_DIR/tensorboard/."""
    if not args.with_tracking:
        return {}
    return {"log_with": args.report_to, "project_dir": os.path.join(args.output_dir, "tensorboard")}


def start_tracking(accelerator, args, project_name, completed_steps):
    """Start the trackers and cut metrics.jsonl back to `completed_steps`, so a resumed run neither
    repeats nor loses lines (the steps logged after the checkpoint are logged again)."""
    if args.with_tracking:
        # hparams must be scalars: tensorboard rejects None
        config = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))}
        accelerator.init_trackers(project_name, config=config)
    path = os.path.join(args.output_dir, "metrics.jsonl")
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
        records = _read_jsonl(path) if completed_steps else []
        with open(path + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records if r["step"] <= completed_steps)
        os.replace(path + ".tmp", path)  # a crash now leaves the old log, never half of it
    accelerator.wait_for_everyone()


def log_metrics(accelerator, args, record):
    """One record (a dict with "step") to OUTPUT_DIR/metrics.jsonl and, with --with_tracking, the trackers."""
    if args.with_tracking:
        accelerator.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
    if accelerator.is_main_process:
        with open(os.path.join(args.output_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")


def _read_jsonl(path):
    """The records of a metrics.jsonl; a line torn by a crash mid-write is dropped."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return records


def plot_metrics(output_dir):
    """OUTPUT_DIR/curves.png: training loss and eval accuracy against optimizer steps, from metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    records = _read_jsonl(os.path.join(output_dir, "metrics.jsonl"))
    train = [r for r in records if "train_loss" in r]
    evals = [r for r in records if "eval_accuracy" in r]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot([r["step"] for r in train], [r["train_loss"] for r in train], label="train")
    ax_loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval")
    ax_loss.set(xlabel="optimizer step", ylabel="loss", title="loss")
    ax_loss.legend()
    ax_acc.plot([r["step"] for r in evals], [100 * r["eval_accuracy"] for r in evals], "o-")
    ax_acc.set(xlabel="optimizer step", ylabel="accuracy (%)", title="eval accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = os.path.join(output_dir, "curves.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
