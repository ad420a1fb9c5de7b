"""Checkpoints for every script in train/: atomic, exact to resume, and safe to load.

Layout: OUTPUT_DIR/checkpoints/step_00000040/{model.safetensors, optimizer.pt, scheduler.pt,
[scaler.pt], rank_state_{rank}.pt, meta.json}; a sharded checkpoint (--checkpoint_format) holds
state/ (train/core/sharded_checkpoint.py) in place of model.safetensors and optimizer.pt. Either
holds the parameters that train: frozen ones (a pretrained body under LoRA) come back from where
the script built them.

A checkpoint is written under .tmp-step_N and renamed only when every rank has written its part,
so a folder named step_N is always complete.

accelerate's save_state/load_state is not used: it loads registered objects with
weights_only=False, i.e. it would execute a pickle planted in a checkpoint.
"""

import json
import os
import pickle
import random
import shutil

import numpy as np
import torch

from data.errors import fail
from train.core.output_dir import drop_replaced_run, list_checkpoints
from train.core.sharded_checkpoint import Checkpoint, load_sharded, save_sharded, with_frozen
from train.core.tracking import fsync_path, save_tensors, write_json

CHECKPOINT_FORMAT = 1


def find_checkpoint(accelerator, resume_from_checkpoint, output_dir):
    """The checkpoint to resume from, or None for a fresh start (check_output_dir has vetted the path).
    The main process resolves 'latest' and tells the others: each looking for itself, ranks could
    see different newest checkpoints when one lands in between (they then resume from different
    steps and hang)."""
    from accelerate.utils import broadcast_object_list

    if resume_from_checkpoint != "latest":
        return resume_from_checkpoint
    found = list_checkpoints(output_dir)[-1:] if accelerator.is_main_process else [None]
    if accelerator.num_processes > 1:
        found = broadcast_object_list(found or [None])
    if not found or found[0] is None:
        accelerator.print(f"no checkpoint in {output_dir}/checkpoints yet: starting fresh")
        return None
    return found[0]


def data_position(epoch, batches_done, batches_per_epoch):
    """A map-style loader's position after `batches_done` batches of `epoch`, as checkpoints store it:
    a finished epoch resumes at the start of the next."""
    if batches_done >= batches_per_epoch:
        return {"epoch": epoch + 1, "next_batch": 0}
    return {"epoch": epoch, "next_batch": batches_done}


def _rng_state():
    version, state, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(state), gauss],
        "torch": torch.get_rng_state(),
        "numpy": [torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def _set_rng_state(state):
    version, values, gauss = state["python"]
    random.setstate((version, tuple(values), gauss))
    keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _full_state_options(**kwargs):
    # Full (unsharded) state dicts through torch.distributed.checkpoint: one code path and one file
    # format for a plain module, DDP and FSDP2, where optimizer.state_dict() would be one rank's shard.
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def sharded_checkpoints(requested, accelerator):
    """--checkpoint_format: whether checkpoints are sharded. auto: under FSDP (accelerate's on GPUs,
    or FSDP2 on CPU processes) unless its config asks for FULL_STATE_DICT; otherwise full."""
    if requested != "auto":
        return requested == "sharded"
    fsdp = accelerator.distributed_type.value == "FSDP" or getattr(accelerator, "cpu_fsdp2", None) is not None
    return fsdp and os.environ.get("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT") != "FULL_STATE_DICT"


def save_checkpoint(
    accelerator,
    output_dir,
    step,
    model,
    optimizer,
    lr_scheduler,
    meta,
    keep_last=None,
    sharded=False,
    writer=None,
    group=None,
    add_files=None,
):
    """Write OUTPUT_DIR/checkpoints/step_N atomically, with `meta` (the script, the data position,
    the resolved arguments, ...) as its meta.json; keep the newest `keep_last`. `add_files(folder)`
    puts more files in, on the main process. With a `writer`
    thread (sharded only; `group` a process group of its own) the model and optimizer are written in
    the background: call the returned Checkpoint's wait() before the next save and the run's end."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    root = os.path.join(output_dir, "checkpoints")
    final, tmp = os.path.join(root, f"step_{step:08d}"), os.path.join(root, f".tmp-step_{step:08d}")
    if not sharded:  # collectives under FSDP2: every rank calls them; cpu_offload leaves the full dicts on rank 0
        weights = model_weights(model, trainable_only=True)
        optimizer_state = get_optimizer_state_dict(
            model, optimizer.optimizer, options=_full_state_options(cpu_offload=torch.distributed.is_initialized())
        )
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save
        os.makedirs(tmp)
    accelerator.wait_for_everyone()
    files = []

    def put(name, obj, write=torch_save):
        files.append(os.path.join(tmp, name))
        write(obj, files[-1])

    # per rank: its RNG streams and its BatchNorm running statistics, which differ between ranks
    # between evaluations (DDP's broadcast_buffers is off, see train/core/accelerator.py)
    buffers = {name: b.detach().cpu().clone() for name, b in accelerator.unwrap_model(model).named_buffers()}
    try:
        put(f"rank_state_{accelerator.process_index}.pt", {**_rng_state(), "buffers": buffers})
        if sharded and writer is None:  # every rank writes its part (a collective); DCP fsyncs
            save_sharded(tmp, model, optimizer.optimizer)
        if accelerator.is_main_process:
            if not sharded:
                put("model.safetensors", weights, save_tensors)
                put("optimizer.pt", optimizer_state)
            if lr_scheduler is not None:
                put("scheduler.pt", lr_scheduler.state_dict())
            if accelerator.scaler is not None:
                put("scaler.pt", accelerator.scaler.state_dict())
            if add_files is not None:
                add_files(tmp)
            put(
                "meta.json",
                {
                    "format": CHECKPOINT_FORMAT,
                    "step": step,
                    "world_size": accelerator.num_processes,
                    "checkpoint_format": "sharded" if sharded else "full",
                    **meta,
                },
                lambda obj, path: write_json(path, obj),
            )
        for path in files:  # on disk before the rename publishes them
            fsync_path(path)
        if writer is not None:  # after this rank's own files: the Future completes after all of them
            future = save_sharded(tmp, model, optimizer.optimizer, writer, group)
    except OSError:  # a full disk, say: the unpublished half goes, and with it the space it took
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    def publish():
        if os.path.isdir(final):  # the same step saved again after a resume
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_path(root)
        drop_replaced_run(output_dir)  # the run --overwrite_output_dir replaced: this one has a checkpoint now
        if keep_last:
            for old in list_checkpoints(output_dir)[:-keep_last]:
                shutil.rmtree(old)

    if writer is not None:
        return Checkpoint(final, future, tmp, publish if accelerator.is_main_process else None)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        publish()
    accelerator.wait_for_everyone()
    return Checkpoint(final)


class CheckpointWriter:
    """The loop's saves, one at a time: in the background (--checkpoint_async, sharded checkpoints
    only) on one writer thread and one process group of their own for the whole run, each save
    waiting for the one before."""

    def __init__(self, accelerator, sharded, background):
        from concurrent.futures import ThreadPoolExecutor

        if background and not sharded:
            fail(
                "--checkpoint_async writes sharded checkpoints only; add --checkpoint_format sharded (the default "
                "under FSDP)"
            )
        self.accelerator, self.sharded, self.pending = accelerator, sharded, None
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer") if background else None
        # every rank makes the group (a collective), here, at the same point of the run
        self.group = (
            torch.distributed.new_group(backend="gloo") if background and torch.distributed.is_initialized() else None
        )

    def save(self, output_dir, step, model, optimizer, lr_scheduler, meta, keep_last, add_files=None):
        self.wait()
        self.pending = save_checkpoint(
            self.accelerator,
            output_dir,
            step,
            model,
            optimizer,
            lr_scheduler,
            meta,
            keep_last,
            self.sharded,
            self.thread,
            self.group,
            add_files,
        )
        return self.pending.path

    def wait(self):
        """The checkpoint being written, on disk and published (on the main process) when this returns
        on every rank."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.wait()
            if self.thread is not None:
                self.accelerator.wait_for_everyone()

    def close(self):
        """Wait for the last save, then let the thread go (once nothing forks any more)."""
        self.wait()
        if self.thread is not None:
            self.thread.shutdown()


def torch_save(obj, path):
    """torch.save through a Python file, so a full disk is an OSError naming the file (ENOSPC), not
    torch's RuntimeError 'unexpected pos' from its own writer."""
    try:
        with open(path, "wb") as f:
            torch.save(obj, f)
    except OSError as e:
        raise OSError(e.errno, e.strerror, path) from None


def model_weights(model, trainable_only=False):
    """The whole model's weights for model.safetensors, on the main process (every rank must call it:
    a collective under FSDP2); `trainable_only`: the parameters that train, and the buffers. Tied
    weights (an LM's embedding and output layer) are stored once per name, since safetensors refuses
    tensors that share memory; loading writes the same values into the one parameter.
    (accelerator.save_model instead drops all but one name, with a warning per save.)"""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return _unshared(
        get_model_state_dict(
            model,
            options=_full_state_options(
                cpu_offload=torch.distributed.is_initialized(), ignore_frozen_params=trainable_only
            ),
        )
    )


def _unshared(state_dict):
    seen, out = set(), {}
    for name, tensor in state_dict.items():
        tensor = tensor.contiguous()
        where = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        out[name] = tensor.clone() if where in seen else tensor
        seen.add(where)
    return out


def _load_trusted(path):
    """torch.load that only reads tensors and plain containers: a planted pickle is refused, not run."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        reason = str(e).splitlines()[0]
        fail(
            f"refused to load {path}: it holds pickled objects other than tensors ({reason}); "
            "it was not written by these scripts; delete that checkpoint"
        )
    except Exception as e:  # a damaged file meets torch.load as any of OSError, EOFError, KeyError, RuntimeError, ...
        fail(f"{path} is unreadable ({type(e).__name__}); delete that checkpoint and resume from an earlier one")


def _load_full(path, model, optimizer):
    """The model and optimizer of a full checkpoint."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        weights = load_file(os.path.join(path, "model.safetensors"))
    except (SafetensorError, OSError, ValueError) as e:
        fail(
            f"{path}/model.safetensors is corrupt or missing ({e}); delete that checkpoint "
            "and resume from an earlier one"
        )
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    options = _full_state_options()  # every rank reads the full files; FSDP2 keeps its own shard of them
    try:
        set_model_state_dict(model, with_frozen(model, weights, options), options=options)
    except (RuntimeError, KeyError, ValueError) as e:
        detail = " ".join(str(e).split())[:200]
        fail(f"{path} does not fit this model ({detail}); resume with the model arguments it was saved with")
    optimizer_state = _load_trusted(os.path.join(path, "optimizer.pt"))
    if not optimizer_state["state"]:  # plain SGD keeps no tensors; the full-state loader needs one to find the device
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        options = StateDictOptions()
    set_optimizer_state_dict(model, optimizer.optimizer, optimizer_state, options=options)


def load_checkpoint(accelerator, path, task, model, optimizer, lr_scheduler):
    """Restore everything save_checkpoint wrote into the prepared objects; return its meta dict."""
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        fail(f"{path}/meta.json is unreadable ({e}); resume from another checkpoint")
    if meta.get("script") != task or meta.get("format") != CHECKPOINT_FORMAT:
        fail(
            f"{path} was written by train/{meta.get('script')}.py (format {meta.get('format')}), "
            f"not train/{task}.py (format {CHECKPOINT_FORMAT}); pass a checkpoint of this script"
        )
    if meta.get("checkpoint_format") == "sharded":
        load_sharded(path, model, optimizer.optimizer)
    else:
        _load_full(path, model, optimizer)
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(_load_trusted(os.path.join(path, "scheduler.pt")))
    if accelerator.scaler is not None and os.path.isfile(os.path.join(path, "scaler.pt")):
        accelerator.scaler.load_state_dict(_load_trusted(os.path.join(path, "scaler.pt")))
    rank_file = os.path.join(path, f"rank_state_{accelerator.process_index}.pt")
    if not os.path.isfile(rank_file):  # resumed with more processes than saved: reuse rank 0's state
        rank_file = os.path.join(path, "rank_state_0.pt")
    rank_state = _load_trusted(rank_file)
    _set_rng_state(rank_state)
    with torch.no_grad():
        for name, buffer in accelerator.unwrap_model(model).named_buffers():
            if name in rank_state["buffers"]:
                buffer.copy_(rank_state["buffers"][name])
    processes = f"{meta['world_size']} process" + ("es" if meta["world_size"] != 1 else "")
    accelerator.print(f"resumed from {path} (step {meta['step']}, saved with {processes})")
    return meta
