"""The life of a run: one call sets it up (start_run), and run() is how it ends, whatever happens:
a result and a clean teardown, one line for a user's error or a full disk, the resume command for
Ctrl-C. Scripts only declare `main(args)` and call `run(main, parse_args())`."""

import errno
import gc
import os
import re
import signal
import socket
import sys

import torch
from accelerate.utils import set_seed

from data.errors import UserError, fail
from train.core.accelerator import announce, make_accelerator
from train.core.failures import error_line, first_failure, record_failure
from train.core.output_dir import check_output_dir, claim_output_dir, list_checkpoints
from train.core.preemption import Preempted
from train.core.process import (
    die_with_launcher,
    exit_once,
    first_local_process,
    resume_command,
    run_failure_hooks,
    run_teardown,
)


def start_run(args, task, **accelerator_kwargs):
    """Everything before the data, in the order it must happen: the output folder is checked (before
    any process waits on another), the accelerator built, the seed set (the same initial weights on
    every process), the header printed, and the folder claimed (its one writer from here on)."""
    for flag in ("train_file", "validation_file"):  # a typo: one line before anything is written
        for path in getattr(args, flag, None) or []:
            if not os.path.exists(path):
                fail(f"--{flag} {path}: no such file or folder")
    check_output_dir(args.output_dir, args.resume_from_checkpoint, args.overwrite_output_dir)
    if args.full_determinism:
        use_deterministic_kernels()
    accelerator = make_accelerator(args, dynamo_plugin=dynamo_plugin(args), **accelerator_kwargs)
    set_seed(args.seed)
    if args.global_batch_size:
        per_step = accelerator.num_processes * args.gradient_accumulation_steps
        if args.global_batch_size % per_step:
            fail(
                f"--global_batch_size {args.global_batch_size} is not a multiple of {accelerator.num_processes} "
                f"processes x {args.gradient_accumulation_steps} accumulation steps; pass a multiple of {per_step}"
            )
        args.per_device_train_batch_size = args.global_batch_size // per_step
    announce(accelerator, args.per_device_train_batch_size, args.gradient_accumulation_steps, args.mixed_precision)
    if args.full_determinism:
        accelerator.print("full_determinism: deterministic kernels only (slower on GPUs)")
    compiled = accelerator.state.dynamo_plugin
    if compiled.backend.value != "NO":
        decided = "--torch_compile" if args.torch_compile or args.torch_compile_mode else "the accelerate config"
        accelerator.print(
            f"torch_compile: {compiled.backend.value.lower()}, mode {compiled.mode} ({decided}); "
            "the first steps wait for the compiler"
        )
    claim_output_dir(accelerator, args.output_dir, task, args.resume_from_checkpoint, args.overwrite_output_dir)
    return accelerator


def use_deterministic_kernels():
    """--full_determinism. On a GPU several kernels sum in an order that changes from run to run (the
    fp32 attention backward splits its keys, atomics in cuDNN's convolution backward), so two runs, or
    a run and its resume, part in the last bits after a step and then further. torch refuses an op
    with no deterministic kernel instead of running it; cuBLAS needs its workspace setting before
    its first call, which is why this runs before the accelerator exists."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False


def dynamo_plugin(args):
    """--torch_compile / --torch_compile_mode as accelerate's plugin; without them None, and accelerate
    follows the launch's config (the wizard's torch dynamo answer), as --mixed_precision auto does."""
    from accelerate.utils import TorchDynamoPlugin

    if not (args.torch_compile or args.torch_compile_mode):
        return None
    return TorchDynamoPlugin(backend="inductor", mode=args.torch_compile_mode or "default")


NO_DETERMINISTIC_KERNEL = "does not have a deterministic implementation"  # torch's words


# a file the run could not write, in words, by errno; EACCES/EPERM may also be a read (of --data_dir, say)
DISK_FAULTS = {
    errno.ENOSPC: "no space left on device writing {}",
    errno.EDQUOT: "disk quota exceeded writing {}",
    errno.EROFS: "read-only file system: cannot write {}",
    errno.EACCES: "permission denied: {}",
    errno.EPERM: "operation not permitted: {}",
}


def disk_fault(error, output_dir):
    """The one line for an OSError in DISK_FAULTS: what, where, and what to do."""
    path = error.filename or error.filename2 or output_dir
    inside = (
        output_dir is not None
        and path is not None
        and os.path.commonpath([os.path.abspath(path), os.path.abspath(output_dir)]) == os.path.abspath(output_dir)
    )
    advice = (
        "free space or pass another --output_dir"
        if error.errno in (errno.ENOSPC, errno.EDQUOT)
        else "pass another --output_dir"
        if inside
        else "check its permissions"
    )
    return f"error: {DISK_FAULTS[error.errno].format(path)}; {advice}"


def resume_point(args):
    """The newest checkpoint and the command that resumes from it, for a run that stops unsaved."""
    found = list_checkpoints(args.output_dir) if args.output_dir else []
    where = (
        f"last checkpoint {found[-1]}"
        if found
        else "no checkpoint yet (--checkpointing_steps saves them), so a resume starts from step 0"
    )
    return f"{where}; resume with: {resume_command()}"


# gloo's words for a connection to a peer that closed or broke, and the peer's address
PEER_LOST = re.compile(r"(?:closed by peer|Read error|Write error|Connection reset)[^\[]*\[([0-9a-fA-F.:]+)\]:\d+")


def lost_peer(error):
    """'host (address)' when `error` is gloo's for a peer whose connection closed or broke, else None."""
    found = PEER_LOST.search(str(error))
    if not found:
        return None
    try:
        host = socket.gethostbyaddr(found[1])[0]
    except OSError:
        host = None
    if host == socket.gethostname():  # most often one that ended first, on losing another node
        return f"another process of this node ({host})"
    return f"{host} ({found[1]})" if host else found[1]


def tell_the_others(error, args):
    """Leave this rank's one line where the other ranks look when they lose contact with it
    (train/core/failures.py), as this rank's own line says it (a user's error, a disk fault) or as
    the error's type and first line. Not for a stop every rank makes together (a preemption), nor for a rank that only
    lost contact itself: the first failure is the cause."""
    if isinstance(error, Preempted) or PEER_LOST.search(str(error)) or not torch.distributed.is_initialized():
        return
    if isinstance(error, OSError) and error.errno in DISK_FAULTS:
        line = disk_fault(error, getattr(args, "output_dir", None)).removeprefix("error: ")
    else:
        line = error_line(error)
    record_failure(torch.distributed.get_rank(), line[:300])


def run(main, args):
    """main(args), then the teardown, and main's result, with the ways out that users meet most made
    short. A user's error (data.errors.UserError and its kinds) or a full, read-only or unwritable
    disk is one line from one process and exit 1; Ctrl-C is one line with the last checkpoint and the
    command that resumes from it, and exit 130. Under a launcher that line comes after the launcher's
    own report, and this process dies with the launcher."""
    die_with_launcher()
    quiet_others = False
    try:
        try:
            result = main(args)
        except Exception as e:
            tell_the_others(e, args)
            raise
    except Preempted as e:  # every rank saved the same step and stops: one line, from the first process
        message, code, quiet_others = str(e), e.exit_code, True
    except UserError as e:  # its str() is one line, also when a DataLoader worker raised it
        message, code = f"error: {e}", 1
    except BrokenPipeError:  # printing into a pipe that closed (`... | head`): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail again
        sys.exit(141)
    except OSError as e:
        if e.errno not in DISK_FAULTS:
            raise
        message, code = disk_fault(e, getattr(args, "output_dir", None)), 1
    except RuntimeError as e:
        peer = lost_peer(e)  # a process of another node died, or the link to it: no traceback per rank
        # the first process under a launcher: the agent's SIGTERM to the survivors must not cut off its line
        if peer and os.environ.get("LOCAL_RANK") == "0":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        failed = first_failure() if peer else None  # or it raised, and said so before it exited
        if failed:
            rank, line = failed
            message, code = f"error: rank {rank} failed: {line}; stopped without saving; {resume_point(args)}", 1
        elif peer:
            message, code = (
                (
                    f"error: lost contact with {peer} in a collective: its process died or the network to "
                    f"it failed; stopped without saving; {resume_point(args)}"
                ),
                1,
            )
        elif getattr(args, "full_determinism", False) and NO_DETERMINISTIC_KERNEL in str(e):
            op = str(e).split(NO_DETERMINISTIC_KERNEL)[0].strip()
            message, code = (
                (
                    f"error: --full_determinism: {op} has no deterministic kernel on this device; run "
                    "without --full_determinism (a rerun then agrees to rounding, not to the bit)"
                ),
                1,
            )
        else:
            raise
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher forwards a second SIGINT
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # and the one-process launcher's exit sends SIGTERM
        if not first_local_process():  # torchrun's agent got the SIGINT too and waits for every worker
            os._exit(130)
        message, code = f"interrupted; {resume_point(args)}", 130
    else:
        # main's frame is gone, and with it the script's model: DDP's reducer holds gloo state and must
        # go before the process group, or interpreter exit can abort a finished run
        gc.collect()
        run_teardown()
        return result
    run_failure_hooks()  # e.g. an output folder this run created and never wrote a result into
    exit_once(message, code, quiet_others)
