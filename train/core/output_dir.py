"""What a run may do with its --output_dir: who owns it, who writes it, what it may replace.

- Ownership: a run writes OUTPUT_DIR/run.json, listing the entries a run of these scripts writes
  there. Only a folder with that marker is ever replaced, and only those entries: a user's own files
  beside them, or in a folder without the marker, are never deleted.
- One writer: the main process holds OUTPUT_DIR/.lock (data/locks.py) from before the first write
  to the end of the run; a second run on the folder is refused, naming the holder.
- --overwrite_output_dir moves the earlier run into OUTPUT_DIR/replaced_run and deletes it only
  once the new run has saved its first checkpoint or finished: a new run that fails early leaves
  the earlier one in reach.
"""

import contextlib
import json
import os
import re
import shutil
import sys
import time

from data.errors import UserError, fail
from data.locks import LOCK_NAME, lock_folder
from train.core.process import first_local_process, on_failure

MARKER = "run.json"
REPLACED = "replaced_run"
# every entry a run writes in its output folder (labels.json: image_classification.py's class names; the
# completions: answers of grpo.py, sft.py; then a Hugging Face model folder: config, adapter, the tokenizer's files)
RUN_ENTRIES = (
    "checkpoints",
    "tensorboard",
    "metrics.jsonl",
    "completions.jsonl",
    "eval_completions.jsonl",
    "curves.png",
    "all_results.json",
    "model.safetensors",
    "args.json",
    "labels.json",
    "best_model.safetensors",
    "confusion.png",
    "config.json",
    "generation_config.json",
    "adapter",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
)

_held = {}  # folder -> FolderLock held by this process


def list_checkpoints(output_dir):
    """Complete checkpoints in output_dir, oldest first (a folder step_N is complete once it has meta.json)."""
    root = os.path.join(output_dir, "checkpoints")
    names = os.listdir(root) if os.path.isdir(root) else []
    found = [(int(m.group(1)), os.path.join(root, n)) for n in names if (m := re.fullmatch(r"step_(\d+)", n))]
    return [path for _, path in sorted(found) if os.path.isfile(os.path.join(path, "meta.json"))]


def _entries(out):
    return [name for name in RUN_ENTRIES if os.path.lexists(os.path.join(out, name))]


def check_output_dir(out, resume=None, overwrite=False):
    """Before anything starts (no process group, no data yet): what --output_dir holds decides
    whether this run may go on. A finished run is never touched without --overwrite_output_dir:
    resuming it says so and exits 0, so a retry loop around a finished job ends well."""
    if resume not in (None, "latest") and not os.path.isfile(os.path.join(resume, "meta.json")):
        # a step typed without its zeros (step_20 for step_00000020), or the run's folder itself
        near = list_checkpoints(os.path.dirname(os.path.dirname(os.path.normpath(resume)))) or list_checkpoints(resume)
        fail(
            f"--resume_from_checkpoint {resume} is not a checkpoint (no meta.json there); pass "
            + (
                f"one of {', '.join(near[-3:])} (the newest last)"
                if near
                else "an OUTPUT_DIR/checkpoints/step_N folder"
            )
            + " or 'latest'"
        )
    if os.path.exists(out) and not os.path.isdir(out):
        fail(f"--output_dir {out} is a file, not a folder; pass another --output_dir")
    if overwrite and resume:
        fail("--overwrite_output_dir and --resume_from_checkpoint contradict each other; pass one")
    present = _entries(out)
    checkpoints = list_checkpoints(out)
    # complete checkpoints (a meta.json each) are these scripts' own, so a run from before the marker
    # existed is still recognised as one
    if present and not os.path.isfile(os.path.join(out, MARKER)) and not checkpoints:
        # not written by these scripts: never written over
        fail(
            f"--output_dir {out} holds {', '.join(present)} but no {MARKER}, so it is not a run of these scripts "
            "and nothing in it will be written over or deleted; pass another --output_dir, or move those away"
        )
    results = os.path.join(out, "all_results.json")
    weights = os.path.isfile(os.path.join(out, "model.safetensors"))
    holds_run = os.path.isfile(results) or weights or os.path.isdir(os.path.join(out, "checkpoints"))
    if not holds_run or overwrite:
        return
    aside = os.path.join(out, REPLACED)
    kept = f" (the run it replaced is kept in {aside})" if os.path.isdir(aside) else ""
    if os.path.isfile(results):
        try:
            with open(results) as f:
                step = f"step {json.load(f).get('step')}"
        except (OSError, ValueError):
            step = "unreadable all_results.json"
        if resume:
            if first_local_process():
                elsewhere = (
                    f"; to continue it elsewhere, --resume_from_checkpoint {checkpoints[-1]} with another --output_dir"
                    if checkpoints
                    else ""
                )
                print(
                    f"{out} holds a finished run ({step}); nothing to resume, nothing changed. To train it again "
                    f"pass --overwrite_output_dir{elsewhere}",
                    flush=True,
                )
            sys.exit(0)
        fail(
            f"--output_dir {out} holds a finished run ({step}); pass --overwrite_output_dir to replace it, or "
            "another --output_dir"
        )
    if checkpoints:
        if not resume:
            fail(
                f"--output_dir {out} holds an unfinished run with checkpoints up to {os.path.basename(checkpoints[-1])}"
                "; pass --resume_from_checkpoint latest to continue it, --overwrite_output_dir to replace it, or "
                "another --output_dir"
            )
    elif weights:
        fail(
            f"--output_dir {out} holds a run's weights (model.safetensors) but no checkpoint, so it cannot be "
            "resumed; pass --overwrite_output_dir to replace it, or another --output_dir"
        )
    elif not resume:
        fail(
            f"--output_dir {out} holds a run that stopped before its first checkpoint{kept}; pass "
            "--resume_from_checkpoint latest to start it again from step 0, --overwrite_output_dir to replace it, "
            "or another --output_dir"
        )


def claim_output_dir(accelerator, out, task, resume=None, overwrite=False):
    """Make this run the folder's one writer: the main process takes the lock, looks again at what
    the folder holds (another run may have finished or started since check_output_dir), removes
    what a killed save left, writes the marker and, with --overwrite_output_dir, moves the earlier
    run aside. Every rank stops with the same line if any of that fails."""
    from accelerate.utils import broadcast_object_list

    message, exit_code = None, None
    if accelerator.is_main_process:
        try:
            _claim(out, task, resume, overwrite)
        except UserError as e:  # FolderBusy, or what check_output_dir says of the folder now
            message = str(e)
        except SystemExit as e:  # the run finished meanwhile: nothing to resume, a clean exit on every rank
            exit_code = e.code
    if accelerator.num_processes > 1:
        message, exit_code = broadcast_object_list([message, exit_code])
    if message is not None:
        fail(message)
    if exit_code is not None:
        sys.exit(exit_code)


def _claim(out, task, resume, overwrite):
    if out in _held:  # an earlier in-process run on this folder that ended without close()
        _held.pop(out).release()
    created = not os.path.isdir(out)
    lock = lock_folder(out, what="the output folder of a training run")
    try:
        check_output_dir(out, resume, overwrite)
        root = os.path.join(out, "checkpoints")
        for name in os.listdir(root) if os.path.isdir(root) else []:
            if name.startswith(".tmp-step_"):  # a save killed midway: never published, ours to remove
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        if overwrite and _entries(out):
            _set_aside(out)
            on_failure(lambda: _put_back(out))
        from train.core.tracking import write_json

        if not os.path.isfile(os.path.join(out, MARKER)):
            write_json(
                os.path.join(out, MARKER),
                {
                    "written_by": f"train/{task}.py of the accelerate training recipes",
                    "created": time.time(),
                    "entries": list(RUN_ENTRIES),
                    "note": "--overwrite_output_dir replaces only these entries",
                },
            )
    except BaseException:
        lock.release()
        raise
    _held[out] = lock
    if created:
        on_failure(lambda: _remove_if_unused(out))


def _remove_if_unused(out):
    """A run that fails before writing anything (bad data, say) leaves no folder it created. All of it
    goes while the lock is held: a run that opens .lock meanwhile finds that file gone and tries again
    (data/locks.py), where after a release it would lock a file no longer in the folder, and a third
    run would get the folder too."""
    if out in _held and sorted(os.listdir(out)) == sorted([MARKER, LOCK_NAME]):
        for name in (MARKER, LOCK_NAME):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(out, name))
        with contextlib.suppress(OSError):  # another run made its .lock here meanwhile: the folder is its now
            os.rmdir(out)
        release_output_dir(out)


def _put_back(out):
    """A run that set an earlier one aside and fails before its first checkpoint (bad data, say) puts
    that run back: without a checkpoint, nothing it wrote is worth keeping in its place."""
    aside = os.path.join(out, REPLACED)
    if out not in _held or not os.path.isdir(aside) or list_checkpoints(out):
        return
    for name in _entries(out):
        path = os.path.join(out, name)
        shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
    for name in os.listdir(aside):
        os.replace(os.path.join(aside, name), os.path.join(out, name))
    os.rmdir(aside)
    release_output_dir(out)
    print(f"put the earlier run back in {out}", flush=True)


def _set_aside(out):
    aside = os.path.join(out, REPLACED)
    if os.path.isdir(aside):  # an earlier replacement never got to its first checkpoint: keep the older, finished run
        for name in _entries(out):
            path = os.path.join(out, name)
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
        print(
            f"removed the unfinished run in {out}; the run it replaced stays in {aside} until this one saves a "
            "checkpoint or finishes",
            flush=True,
        )
        return
    os.makedirs(aside + ".tmp", exist_ok=True)
    for name in _entries(out):
        os.replace(os.path.join(out, name), os.path.join(aside + ".tmp", name))
    os.replace(aside + ".tmp", aside)
    print(
        f"moved the earlier run to {aside}; it is deleted when this run saves its first checkpoint or finishes",
        flush=True,
    )


def size_in_words(count):
    """A byte count as people read it: 512 B, 3.4 MB, 1.20 GB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.{2 if unit in ('GB', 'TB') else 1}f} {unit}"
    return f"{count} B"


def check_room(accelerator, output_dir, parts, hint=""):
    """Before the first step: one line on every rank unless the disk of output_dir has room for what
    the run writes there, `parts` (what, bytes), else a full disk would meet the run at its end,
    everything trained in vain; `hint`: one more way out. The main process looks (it writes the
    final model) and every rank follows its answer."""
    from accelerate.utils import broadcast_object_list

    message = None
    if accelerator.is_main_process:
        disk = os.path.abspath(output_dir)
        while not os.path.isdir(disk) and os.path.dirname(disk) != disk:  # a loop driven without start_run
            disk = os.path.dirname(disk)
        free, need = shutil.disk_usage(disk).free, sum(count for _, count in parts)
        if need > free:
            message = (
                f"--output_dir {output_dir}: its disk has {size_in_words(free)} free, and this run writes about "
                f"{size_in_words(need)} there ({', '.join(what for what, _ in parts)}); free space or pass another "
                f"--output_dir{hint}"
            )
    if accelerator.num_processes > 1:
        message = broadcast_object_list([message])[0]
    if message is not None:
        fail(message)


# the weights of a model save_pretrained writes in several files
SHARDS = re.compile(r"model-\d+-of-\d+\.safetensors|model\.safetensors\.index\.json")


def remove_written_since(output_dir, before):
    """After the final write into output_dir failed: what it added of the run's entries (RUN_ENTRIES,
    a sharded model's files, their .tmp halves; `before` lists the folder before it) removed, so that
    half a model folder is not taken for a model and a full disk gets their space back."""
    for name in sorted(set(os.listdir(output_dir)) - set(before)):
        if name.removesuffix(".tmp") not in RUN_ENTRIES and not SHARDS.fullmatch(name):
            continue
        path = os.path.join(output_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(path)


def drop_replaced_run(output_dir):
    """On the main process, once this run has a checkpoint or its final outputs: the replaced run goes."""
    aside = os.path.join(output_dir, REPLACED)
    # only what _set_aside put there: a folder of that name holding anything else is not ours to delete
    if os.path.isdir(aside) and set(os.listdir(aside)) <= set(RUN_ENTRIES):
        shutil.rmtree(aside)


def release_output_dir(output_dir):
    """The end of the run: the next one may take the folder (a killed run's lock goes with its process)."""
    lock = _held.pop(output_dir, None)
    if lock is not None:
        lock.release()
