"""Run train/SCRIPT.py's main() and SIGKILL this very process at a chosen moment, once (a marker
file remembers it happened, so a restarted run goes through). Used by tests/test_checkpointing.py
to crash runs for real, at exact points, without test hooks in the training code.

    kill_at_step.py SCRIPT --rank R --step K --marker FILE [--during_save [--keep DIR]] [--sigterm self|launcher]
        -- SCRIPT_ARGS...

Without --during_save: right after optimizer step K on rank R (before that step's checkpoint).
With --during_save: on rank R, when checkpoint step K is about to be renamed into place (rank 0 does
the rename); --keep DIR first copies that finished but unpublished checkpoint to DIR: the state of
the uninterrupted run at step K, for the resumed run's checkpoint K to be compared with.
With --sigterm: SIGTERM instead of SIGKILL, to rank R itself or to its launcher (which passes it on
to every rank), as a cluster asks a run to stop. The script runs under run(), as from its own file.
"""

import argparse
import os
import shutil
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch.optim.optimizer import register_optimizer_step_post_hook


def die(marker, sigterm=None):
    open(marker, "w").close()
    if sigterm is None:
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        os.kill(os.getppid() if sigterm == "launcher" else os.getpid(), signal.SIGTERM)


def arm(argv):
    """The kill of `argv` (--rank R --step K --marker FILE [--during_save [--keep DIR]] [--sigterm ...]) on
    this process if it is rank R and the marker is not there yet: its undo (the hook removed, os.replace
    put back), or None when unarmed. The step count starts now (tests/cases_probe.py arms one per case)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--step", type=int, required=True)
    parser.add_argument("--marker", required=True)
    parser.add_argument("--during_save", action="store_true")
    parser.add_argument("--keep")
    parser.add_argument("--sigterm", choices=["self", "launcher"])
    args = parser.parse_args([str(a) for a in argv])
    if int(os.environ.get("RANK", 0)) != args.rank or os.path.exists(args.marker):
        return None
    if args.during_save:
        real_replace = os.replace

        def replace(src, dst):  # every other rename passes through
            if os.path.basename(src) == f".tmp-step_{args.step:08d}":
                if args.keep:
                    shutil.copytree(src, args.keep)
                die(args.marker, args.sigterm)
            return real_replace(src, dst)

        os.replace = replace

        def undo():
            os.replace = real_replace

        return undo
    steps = [0]

    def after_step(optimizer, *_):
        if all(group["lr"] == 0 for group in optimizer.param_groups):
            return  # torch.distributed.checkpoint's state init for stateless SGD: a step at lr 0, not ours
        steps[0] += 1
        if steps[0] == args.step:
            die(args.marker, args.sigterm)

    return register_optimizer_step_post_hook(after_step).remove


def main():
    split = sys.argv.index("--")
    arm(sys.argv[2:split])

    from train.core.run import run

    module = __import__(f"train.{sys.argv[1]}", fromlist=["main"])
    run(module.main, module.parse_args(sys.argv[split + 1 :]))


if __name__ == "__main__":
    main()
