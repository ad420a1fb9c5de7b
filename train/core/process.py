"""How a script's process starts and ends under a launcher: which process speaks, the one line it
says (after the launcher's own report), dying with the launcher, and the command that resumes a run.

Every process of an `accelerate launch` parses the same argv and meets the same bad path, so an
error printed by each would appear N times; before any process group exists, the only way to pick
one printer is the LOCAL_RANK that torchrun sets (absent outside torchrun: a single process).
"""

import os
import shlex
import signal
import subprocess
import sys
import time


def first_local_process():
    """From the launcher's environment, not the accelerator: errors and Ctrl-C reach run() before an
    Accelerator exists (bad arguments) or after it is gone."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def exit_once(message, code, quiet_others=False):
    """Print `message` from the first local process and exit with `code`, at once (a process group
    left to interpreter exit can hang or abort; checkpoints are atomic, so nothing is half-written).
    The other processes wait first: torchrun stops every worker as soon as one exits with an error, so
    one that left before the first had printed would take the only line with it. If one
    is still alive after the wait, the error was its own, and it prints it. Under torchrun's agent
    the line is written once the agent has exited, after its report (_say_after_launcher). With
    `quiet_others` every process met the same end at the same point (a preemption), so the others
    leave at once, without a line."""
    if "LOCAL_RANK" not in os.environ:  # one process, no launcher: a plain exit, catchable in-process
        sys.stderr.write(message + "\n")
        sys.exit(code)
    if not first_local_process():
        if quiet_others:
            os._exit(code)
        time.sleep(5)
        message = f"[local rank {os.environ['LOCAL_RANK']}] {message}"
    sys.stdout.flush()
    if not _say_after_launcher(message):
        sys.stderr.write(message + "\n")
    sys.stderr.flush()
    os._exit(code)


# The line's echo: waits until the launcher (the process behind pid file descriptor argv[1]) has
# exited, at most 60 s (its shutdown gives other workers 30 s), then writes argv[2] to stderr.
_AFTER_LAUNCHER = "import select, sys; select.select([int(sys.argv[1])], [], [], 60); sys.stderr.write(sys.argv[2])"


def _under_elastic_agent():
    """Started by torch elastic's agent (torchrun, or accelerate launch with several processes)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and sys.platform.startswith("linux")


def _say_after_launcher(message):
    """Have `message` written after the launcher's own report, so the last line on the screen is
    ours: torch elastic's agent follows a failed worker with a 40-70 line ChildFailedError report,
    and a Ctrl-C with its SignalException traceback, and neither can be turned off. A tiny process
    (no torch, cwd /, only stderr and a pid fd open) waits for the launcher through a pid file
    descriptor and writes the line the moment it has exited. False (write it now) where that cannot
    be: no agent, no pidfd_open, or the agent will restart the workers rather than exit."""
    restarts_left = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) > int(
        os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)
    )
    if not _under_elastic_agent() or restarts_left or os.getppid() == 1:
        return False
    try:
        pidfd = os.pidfd_open(os.getppid())
    except (AttributeError, OSError):
        return False
    try:
        subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _AFTER_LAUNCHER, str(pidfd), message + "\n"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            pass_fds=(pidfd,),
            cwd="/",
            # out of this worker's process group: the agent ends a worker that outlives another's failure
            # with a SIGTERM to its whole group, which would take the line with it
            start_new_session=True,
        )
        return True
    except OSError:
        return False
    finally:
        os.close(pidfd)


def die_with_launcher():
    """Ask the kernel to signal this process when its launcher dies. Workers of torch elastic's agent
    run in their own sessions, so a `kill -9` or the OOM killer on the launcher otherwise leaves them
    training and writing into --output_dir, unseen, while the user starts the resume: they get
    SIGKILL (their peers are gone with the agent). Under accelerate's one-process launcher the
    child gets SIGTERM instead, the preemption path (train/core/preemption.py): it ends its step,
    saves a checkpoint and exits; after a Ctrl-C, which that launcher follows by exiting 0.25 s
    later, the child is already on its way out with the resume line (run() then ignores SIGTERM).
    PR_SET_PDEATHSIG fires when the parent *thread* that forked us exits: the agent starts (and
    restarts) workers from its main thread (torch/distributed/elastic/multiprocessing/api.py
    SubprocessContext._start, called from LocalElasticAgent._start_workers in agent.run()), which
    lives until the workers have been reaped, and the one-process launcher from its only thread.
    Our own children (DataLoader workers, the line's echo) do not inherit it."""
    if not sys.platform.startswith("linux"):
        return
    if _under_elastic_agent():
        signal_number = signal.SIGKILL
    elif "ACCELERATE_MIXED_PRECISION" in os.environ and (launcher_argv() or [None])[0] == "accelerate":
        signal_number = signal.SIGTERM
    else:  # python train/x.py: no launcher to outlive
        return
    import ctypes

    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, int(signal_number), 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
        return
    if parent == 1 or os.getppid() != parent:  # the launcher died before the request was in place
        sys.stderr.write("error: the launcher of this process has exited; stopping\n")
        os._exit(1)


def launcher_argv():
    """The argv of the `accelerate launch` or torchrun that started this process (its parent),
    tidied to `accelerate launch ...`; None when there is none, or no /proc to read it from."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            argv = [a.decode() for a in f.read().split(b"\0") if a]
    except OSError:
        return None
    script = os.path.realpath(sys.argv[0])
    cut = next((i for i, a in enumerate(argv) if os.path.realpath(a) == script), None)
    if cut is None:
        return None
    argv = argv[:cut]
    for i, a in enumerate(argv):
        if a == "-m" and argv[i + 1 : i + 2] == ["train.core.launch"]:  # a SLURM job's (launch_node.sh)
            return argv[i + 2 :]
        if (a == "-m" and argv[i + 1 : i + 2] == ["accelerate.commands.launch"]) or os.path.basename(
            a
        ) == "accelerate-launch":
            return ["accelerate", "launch", *argv[i + (2 if a == "-m" else 1) :]]
        if a == "-m" and argv[i + 1 : i + 2] == ["accelerate.commands.accelerate_cli"]:
            return ["accelerate", *argv[i + 2 :]]
        if os.path.basename(a) in ("accelerate", "torchrun"):
            return [os.path.basename(a), *argv[i + 1 :]]
    return None


# Set by accelerate_configs/slurm/train.sbatch for the processes of its job: the batch script as
# submitted, and a file on the job's first node that the script reads after a stop
SBATCH_SCRIPT, SBATCH_PROGRESS = "TRAIN_SBATCH_SCRIPT", "TRAIN_SBATCH_PROGRESS"


def resume_command():
    """This run's own command with --resume_from_checkpoint latest and without --overwrite_output_dir;
    inside train.sbatch's job, the sbatch command that submits it again."""
    args, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
        elif a == "--resume_from_checkpoint":
            skip = True
        elif not (a == "--overwrite_output_dir" or a.startswith("--resume_from_checkpoint=")):
            args.append(a)
    launcher = ["sbatch", os.environ[SBATCH_SCRIPT]] if os.environ.get(SBATCH_SCRIPT) else launcher_argv()
    return shlex.join([*(launcher or ["python"]), sys.argv[0], *args, "--resume_from_checkpoint", "latest"])


def after_a_stop(trained, first_of_its_node):
    """How a run stopped on SIGTERM with a checkpoint goes on, for the end of its one line. Inside
    train.sbatch's job the script requeues the job itself, but only after a start that trained: the
    first process of each node says so in the script's file, which exists on the first node only."""
    if not os.environ.get(SBATCH_SCRIPT):
        return f"resume with: {resume_command()}"
    progress = os.environ.get(SBATCH_PROGRESS, "")
    if trained and first_of_its_node and os.path.isfile(progress):
        with open(progress, "a") as f:
            f.write(f"trained, pid {os.getpid()}\n")
    job = os.environ.get("SLURM_JOB_ID", "")
    return f"SLURM job {job} goes on from there when requeued (time limit, preemption); by hand: {resume_command()}"


_on_failure, _on_success = [], []


def on_failure(undo):
    """Have run() call undo() when the script stops with one of its one-line errors or Ctrl-C."""
    _on_failure.append(undo)


def on_teardown(close):
    """Have run() call close() after the script's main() has returned and its objects are gone."""
    _on_success.append(close)


def run_failure_hooks():
    while _on_failure:
        _on_failure.pop()()


def run_teardown():
    _on_failure.clear()
    while _on_success:
        _on_success.pop()()
