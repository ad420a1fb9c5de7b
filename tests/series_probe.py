"""Launched by the tests with `accelerate launch`: runs train/SCRIPT.py's main() for each case of
CASES.json, one after the other in the same ranks (one process group, an Accelerator of its own per
case), so that several runs of one config cost one launch's start-up (2.5 s of launcher and 5 s per
rank) instead of one each. The tests read each case's part of the output by its header line.

    accelerate launch --config_file accelerate_configs/CONFIG.yaml tests/series_probe.py CASES.json

CASES.json: [{"name": NAME, "script": SCRIPT, "args": [...], "copy": [RUN, STEP, NEW] (optional)}, ...]

"stale_latest": R (optional): rank R sees no checkpoint in any folder during the case, as
tests/fault_probe.py's --stale_latest (what a rank sees when a checkpoint lands between two ranks'
looks at the folder: only the main process's answer may count).

"copy": before the case, the main process makes NEW as a crash after checkpoint STEP of the run
folder RUN would have left it (test_checkpointing.resume_copy), for the case to resume from; RUN may
be an earlier case's folder. Each case prints `series case NAME` (the main process) before its run.
The last case runs under train.core.run.run, as the script's own `__main__` does, with its teardown;
the others end as an in-process run does (accelerate's state reset, the process group kept).
"""

import gc
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEADER = "series case "


def resume_copy(full_dir, step, new_dir):  # test_checkpointing.resume_copy, without importing the tests
    os.makedirs(os.path.join(new_dir, "checkpoints"))
    name = f"step_{step:08d}"
    shutil.copytree(os.path.join(full_dir, "checkpoints", name), os.path.join(new_dir, "checkpoints", name))


def split_output(stdout):
    """{case name: its part of the main process's output} (for the tests)."""
    parts, name = {}, None
    for line in stdout.splitlines(keepends=True):
        if line.startswith(HEADER):
            name = line[len(HEADER) :].strip()
            parts[name] = ""
        elif name is not None:
            parts[name] += line
    return parts


def main(path):
    import importlib

    import torch.distributed as dist
    from accelerate.state import AcceleratorState, GradientState, PartialState

    import train.core.checkpoint as checkpoint
    from train.core import process
    from train.core.output_dir import list_checkpoints
    from train.core.run import run

    with open(path) as f:
        cases = json.load(f)
    rank = int(os.environ.get("RANK", 0))
    for number, case in enumerate(cases):
        if rank == 0:
            print(f"{HEADER}{case['name']}", flush=True)
            if case.get("copy"):
                resume_copy(*case["copy"])
        if case.get("copy") and dist.is_initialized():
            dist.barrier()  # the copy is there before any rank looks for it
        if case.get("stale_latest") == rank:
            checkpoint.list_checkpoints = lambda output_dir: []
        module = importlib.import_module(f"train.{case['script']}")
        args = module.parse_args([str(a) for a in case["args"]])
        if number == len(cases) - 1:
            run(module.main, args)  # the script's own end: its teardown ends the process group
            break
        module.main(args)
        checkpoint.list_checkpoints = list_checkpoints
        # run()'s teardown, less the end of the process group, which the next case needs
        process._on_success.clear()
        process._on_failure.clear()
        gc.collect()  # DDP's reducer before anything else of the group (TrainingLoop.close)
        PartialState().wait_for_everyone()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()


if __name__ == "__main__":
    main(sys.argv[1])
