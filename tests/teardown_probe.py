"""Run train/SCRIPT.py's main() under run(), as from its own file, and print, once run() has made its
collection and before it ends the process group, the prepared models and accelerators still alive:

    teardown_probe.py SCRIPT SCRIPT_ARGS...

Every one must be gone by then: DDP's reducer holds gloo state, and one left for interpreter exit can
abort a finished run (SIGABRT). Used by tests/test_exits.py, without test hooks in the training code."""

import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from accelerate import Accelerator
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from train.core.process import on_teardown
from train.core.run import run

HOLDERS = (Accelerator, DistributedDataParallel, FSDPModule)


def alive():
    # issubclass(type(o)): isinstance would read __class__, which warns on torch's deprecated aliases
    return sorted(type(o).__name__ for o in gc.get_objects() if issubclass(type(o), HOLDERS))


def main():
    module = __import__(f"train.{sys.argv[1]}", fromlist=["main"])

    def probed(args):
        result = module.main(args)
        # teardown runs its hooks last-in first-out: this one before the loop's, which ends the group
        on_teardown(lambda: print(f"alive before the group ends: {alive()}", flush=True))
        return result

    run(probed, module.parse_args(sys.argv[2:]))


if __name__ == "__main__":
    main()
