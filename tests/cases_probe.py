"""Several runs of train/ scripts in one `accelerate launch`: each case is SCRIPT's main() under run(), as
from its own file, one after the other in the same processes (a launch costs ~15 core-seconds before
any work: the launcher's imports, then each rank's torch, transformers and dynamo). Each case has an
Accelerator of its own (accelerate's state is reset between cases; the process group stays, and the
last case's teardown ends it). Used by the tests of the post-training scripts (tests/test_dpo.py...).

    accelerate launch [--max_restarts N] tests/cases_probe.py CASES.json

CASES.json: [{"name": NAME, "script": SCRIPT, "args": [...], "out": FOLDER, "kill": [...] or null,
"copy": [RUN, STEP, NEW] (optional), "stale_latest": R (optional)}, ...]; FOLDER defaults to the args'
--output_dir.

Under torch elastic's restart (`--max_restarts`), a case whose FOLDER holds all_results.json is finished
and skipped, so a case that was stopped resumes (its args hold --resume_from_checkpoint latest) after the
finished ones are passed over. "copy": before the case, the main process makes NEW as a crash after
checkpoint STEP of the run folder RUN would have left it (test_checkpointing.resume_copy), for the case to
resume from; RUN may be an earlier case's folder. "stale_latest": rank R sees no checkpoint in any folder
during the case, as tests/fault_probe.py's --stale_latest (what a rank sees when a checkpoint lands
between two ranks' looks at the folder: only the main process's answer may count). "kill" is
tests/kill_at_step.py's arguments (--rank R --step K --marker FILE [--during_save [--keep DIR]]
[--sigterm self|launcher]), armed for that case alone: its step count starts with the case, and its
hook goes with it.

Before each case rank 0 writes `CASE_MARK NAME` on a line of its own to stdout and stderr: `case_output`
cuts a launch's output into each case's part (every attempt's), the rank-0 lines in order.
"""

import gc
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASE_MARK = "=== cases_probe case"


def reset_accelerate_state():
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def resume_copy(full_dir, step, new_dir):  # test_checkpointing.resume_copy, without importing the tests
    os.makedirs(os.path.join(new_dir, "checkpoints"))
    name = f"step_{step:08d}"
    shutil.copytree(os.path.join(full_dir, "checkpoints", name), os.path.join(new_dir, "checkpoints", name))


def main(path):
    import torch.distributed as dist

    import train.core.checkpoint as checkpoint
    from kill_at_step import arm
    from train.core import process
    from train.core.run import run

    cases = json.load(open(path))
    rank, restarted = int(os.environ.get("RANK", 0)), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
    list_checkpoints = checkpoint.list_checkpoints
    for k, case in enumerate(cases):
        last = k == len(cases) - 1
        if rank == 0:
            for stream in (sys.stdout, sys.stderr):
                stream.write(f"\n{CASE_MARK} {case['name']}\n")
                stream.flush()
        if restarted and os.path.exists(os.path.join(case["out"], "all_results.json")):
            continue  # finished before the restart
        if case.get("copy"):
            if rank == 0 and not os.path.isdir(case["copy"][2]):
                resume_copy(*case["copy"])
            if dist.is_initialized():
                dist.barrier()  # the copy is there before any rank looks for it
        if case.get("stale_latest") == rank:
            checkpoint.list_checkpoints = lambda output_dir: []
        module = __import__(f"train.{case['script']}", fromlist=["main"])
        undo = arm(case["kill"]) if case.get("kill") else None  # kill_at_step.py's kill, for this case alone

        def one_case(args, module=module, last=last):
            result = module.main(args)
            if not last:  # the process group stays for the next case: only the last one's teardown ends it
                process._on_success.clear()
            return result

        run(one_case, module.parse_args([str(a) for a in case["args"]]))
        if undo is not None:
            undo()
        checkpoint.list_checkpoints = list_checkpoints
        if not last:
            gc.collect()
            reset_accelerate_state()


def case_output(text, name):
    """The part of a launch's output (stdout or stderr) that rank 0 wrote during case NAME, over every
    attempt of the launch."""
    parts, mine = [], False
    for line in text.splitlines(keepends=True):
        if line.startswith(CASE_MARK + " "):
            mine = line[len(CASE_MARK) + 1 :].strip() == name
        elif mine:
            parts.append(line)
    return "".join(parts)


def launch_cases(config, cases, max_restarts=None, timeout=900, launch_args=()):
    """`accelerate launch --config_file accelerate_configs/CONFIG.yaml [LAUNCH_ARGS] tests/cases_probe.py
    CASES.json` (cases: dicts as above, their args' paths as they are); the CompletedProcess."""
    import tempfile

    from conftest import CONFIGS, clean_env, run_or_dump

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(
            [
                {
                    **c,
                    "args": [*map(str, c["args"])],
                    "kill": [*map(str, c.get("kill") or [])],
                    "out": str(c.get("out") or c["args"][[str(a) for a in c["args"]].index("--output_dir") + 1]),
                    **({"copy": [str(c["copy"][0]), int(c["copy"][1]), str(c["copy"][2])]} if c.get("copy") else {}),
                }
                for c in cases
            ],
            f,
        )
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", os.path.join(CONFIGS, config + ".yaml")]
    cmd += [*map(str, launch_args)]
    if max_restarts is not None:
        cmd += ["--max_restarts", str(max_restarts), "--monitor_interval", "0.5"]
    cmd += [os.path.join("tests", "cases_probe.py"), f.name]
    try:
        return run_or_dump(cmd, timeout, env=clean_env())
    finally:
        os.unlink(f.name)


def run_case(name, script, out, *args):
    """A case that runs to the end."""
    return {"name": name, "script": script, "out": out, "args": [*args, "--output_dir", out]}


def sigterm_case(name, script, folder, *args):
    """test_checkpointing.sigterm_at_step_one_and_resume's run as a case: SIGTERM to rank 1 right after
    its optimizer step 1, every rank stops and saves there, and the restart (the launch's
    --max_restarts) resumes it to the end. Its folder: FOLDER/stopped."""
    from test_checkpointing import sigterm_kill

    out, kill = sigterm_kill(folder)
    args = [*args, "--resume_from_checkpoint", "latest", "--output_dir", out]
    return {"name": name, "script": script, "out": out, "args": args, "kill": kill}


def check_sigterm_case(proc, name, folder, steps):
    """sigterm_at_step_one_and_resume's checks of the case NAME's launch; the case's run folder. Its stop
    line (written once the launcher has exited, after every case) is the only one of the launch; a
    crash case's restart in the same launch finds its own lock left by a killed process, so the lock
    check reads the case's own output."""
    from test_checkpointing import check_sigterm

    return check_sigterm(proc, steps, folder, case_output(proc.stdout, name))


def crash_case(name, script, step, folder, *args):
    """test_checkpointing.crash_during_save_and_resume's run as a case: rank 0 SIGKILLed as checkpoint
    `step` is about to be published (its finished files kept aside as the uninterrupted run's state
    there), the restart resumes from the checkpoint before and saves `step` again. Its folder:
    FOLDER/crashed."""
    from test_checkpointing import crash_kill

    out, kill = crash_kill(step, folder)
    args = [*args, "--resume_from_checkpoint", "latest", "--output_dir", out]
    return {"name": name, "script": script, "out": out, "args": args, "kill": kill}


def check_crash_case(proc, folder, step):
    """crash_during_save_and_resume's checks of the case's launch; the case's run folder."""
    from test_checkpointing import check_crash

    return check_crash(proc, step, folder)


if __name__ == "__main__":
    main(sys.argv[1])
