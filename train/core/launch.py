"""`accelerate launch` or torchrun for a batch job, where a stop speaks in the ranks' own lines.

    python -m train.core.launch accelerate launch --config_file accelerate_configs/2node_8gpu.yaml ... train/x.py ...
    python -m train.core.launch torchrun --nnodes 1:2 ... train/x.py ...

SLURM signals every process of a job step, so the launcher on each node gets the SIGTERM its ranks
get. torch elastic's agent then passes it on to its workers, waits for them (they save a checkpoint
and print one line: train/core/preemption.py) and raises SignalException, which accelerate and
torchrun leave to the interpreter: a 40-line traceback per node in the job's log, after the lines
that matter. Here that exception ends the launcher as the signal would have, exit code 128 + the
signal's number, and everything else is the launcher's own behaviour (accelerate_configs/slurm/
launch_node.sh starts every node's launcher this way). A SIGTERM to the ranks alone (`kill` of one
rank, a container's stop) ends them the same way, each with exit code 143 after saving; the launcher
reports that as a failure of its workers, with a traceback. Here it ends with 143 too, and quietly.
"""

import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

STOPPED = 128 + signal.SIGTERM  # a rank's exit code after a SIGTERM stop (train/core/preemption.py)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:2] == ["accelerate", "launch"]:
            from accelerate.commands.launch import launch_command, launch_command_parser

            launch_command(launch_command_parser().parse_args(argv[2:]))
        elif argv[:1] == ["torchrun"]:
            from torch.distributed.run import main as torchrun

            torchrun(argv[1:])
        else:
            sys.exit("usage: python -m train.core.launch {accelerate launch | torchrun} ARGS...")
    except SignalException as e:
        # the workers have had the signal and their time to stop; each rank said what it did
        sys.exit(128 + int(e.sigval))
    except ChildFailedError as e:
        if {failure.exitcode for failure in e.failures.values()} != {STOPPED}:
            raise  # a rank failed: torch elastic's report says which and why
        sys.exit(STOPPED)  # every rank that ended stopped on SIGTERM, saved, and said so


if __name__ == "__main__":
    main()
