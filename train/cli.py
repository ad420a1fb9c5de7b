"""The command line of every script in train/: argument types, grouped --help with defaults, the
shared flags, one-line errors printed once per launch (a full or read-only disk included, and last
on the screen), Ctrl-C that says how to resume, and workers that die with their launcher.

Every process of an `accelerate launch` parses the same argv and meets the same bad path, so an
error printed by each would appear N times; before any process group exists, the only way to pick
one printer is the LOCAL_RANK that torchrun sets (absent outside torchrun: a single process).
"""
import argparse
import difflib
import errno
import math
import os
import shlex
import signal
import subprocess
import sys
import time

GROUPS = (("data", "data"), ("model", "model"), ("optimization", "optimization"),
          ("checkpoints", "output and checkpoints"), ("tracking", "logging and tracking"),
          ("hardware", "hardware and precision"))


def first_local_process():
    """From the launcher's environment, not the accelerator: errors and Ctrl-C reach run() before an
    Accelerator exists (bad arguments) or after it is gone."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def exit_once(message, code):
    """Print `message` from the first local process and exit with `code`, at once (a process group
    left to interpreter exit can hang or abort; checkpoints are atomic, so nothing is half-written).
    The other processes wait first: torchrun stops every worker as soon as one exits with an error, so
    one that left before the first had printed would take the only line with it (seen here). If one
    is still alive after the wait, the error was its own, and it prints it. Under torchrun's agent
    the line is written once the agent has exited, after its report (_say_after_launcher)."""
    if "LOCAL_RANK" not in os.environ:  # one process, no launcher: a plain exit, catchable in-process
        sys.stderr.write(message + "\n")
        sys.exit(code)
    if not first_local_process():
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
        os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if not _under_elastic_agent() or restarts_left or os.getppid() == 1:
        return False
    try:
        pidfd = os.pidfd_open(os.getppid())
    except (AttributeError, OSError):
        return False
    try:
        subprocess.Popen([sys.executable, "-I", "-S", "-c", _AFTER_LAUNCHER, str(pidfd), message + "\n"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, pass_fds=(pidfd,), cwd="/")
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
    child gets SIGINT instead, the Ctrl-C path: that launcher waits only 0.25 s for its child after
    a Ctrl-C, and the child must still print its resume line (run() ignores a second SIGINT).
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
        signal_number = signal.SIGINT
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


# what other scripts call our flags: `--lr` is too far from `--learning_rate` for a spelling match
ALIASES = {"--lr": "--learning_rate", "--epochs": "--num_train_epochs", "--num_epochs": "--num_train_epochs",
           "--batch_size": "--per_device_train_batch_size", "--train_batch_size": "--per_device_train_batch_size",
           "--eval_batch_size": "--per_device_eval_batch_size", "--warmup_steps": "--num_warmup_steps",
           "--max_steps": "--max_train_steps", "--num_workers": "--dataloader_num_workers",
           "--resume": "--resume_from_checkpoint", "--fp16": "--mixed_precision", "--bf16": "--mixed_precision"}


class _HelpFormatter(argparse.HelpFormatter):
    """Shows each flag's default, except for switches and unset values, where it says nothing."""

    def _get_help_string(self, action):
        if action.default in (None, True, False, argparse.SUPPRESS) or "%(default)" in (action.help or ""):
            return action.help
        return f"{action.help} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse with the flags grouped (`parser.groups["data"]`, ...), defaults in --help, no
    abbreviations (`--lr` must not silently mean `--lr_scheduler_type`), and errors as one line."""

    def __init__(self, doc):
        super().__init__(description=doc.split("\n")[0], allow_abbrev=False,
                         formatter_class=_HelpFormatter)
        self.groups = {key: self.add_argument_group(title) for key, title in GROUPS}

    def error(self, message):
        if message.startswith("unrecognized arguments:"):
            known = [s for action in self._actions for s in action.option_strings if s not in ("-h", "--help")]
            for word in message.split(":", 1)[1].split():
                flag = word.split("=")[0]
                close = [ALIASES[flag]] if ALIASES.get(flag) in known else \
                    difflib.get_close_matches(flag, known, n=1, cutoff=0.75) if word.startswith("--") else []
                if close:
                    message += f" (did you mean {close[0]}?)"
                    break
        exit_once(f"error: {message}; see {self.prog} --help", 2)


def make_parser(doc):
    """The parser of a script in train/, with the flags every script shares, named as in
    transformers' run_*_no_trainer.py scripts; the script adds its own to `parser.groups`."""
    parser = Parser(doc)
    g = parser.groups
    g["optimization"].add_argument("--num_train_epochs", type=positive_int, default=3,
                                   help="Passes over the training data.")
    g["optimization"].add_argument("--max_train_steps", type=positive_int, default=None,
                                   help="Optimizer steps to run; overrides --num_train_epochs when set.")
    g["optimization"].add_argument("--gradient_accumulation_steps", type=positive_int, default=1,
                                   help="Micro-batches per optimizer step.")
    g["optimization"].add_argument("--seed", type=int, default=42, help="Seed for weights, shuffling and dropout.")
    g["checkpoints"].add_argument("--output_dir", type=str, default=None,
                                  help="Where weights, metrics and checkpoints go.")
    g["checkpoints"].add_argument("--overwrite_output_dir", action="store_true",
                                  help="Replace a run already in --output_dir (its checkpoints are deleted).")
    g["checkpoints"].add_argument("--checkpointing_steps", type=steps_or_epoch, default=None,
                                  help="Save a checkpoint every N optimizer steps, or 'epoch' at each epoch's end.")
    g["checkpoints"].add_argument("--resume_from_checkpoint", type=str, default=None,
                                  help="A checkpoint folder (OUTPUT_DIR/checkpoints/step_N) or 'latest': the newest "
                                       "complete one in --output_dir, or a fresh start if there is none yet.")
    g["checkpoints"].add_argument("--checkpoints_total_limit", type=positive_int, default=None,
                                  help="Keep only the newest N checkpoints.")
    g["optimization"].add_argument("--nonfinite_loss", choices=["stop", "skip"], default="stop",
                                   help="A NaN or infinite training loss: stop the run (no final model; the last "
                                        "checkpoint stays good), or skip those optimizer steps (a sync per step).")
    g["tracking"].add_argument("--logging_steps", type=positive_int, default=20,
                               help="Log the mean training loss every N optimizer steps (each log is a device sync).")
    g["tracking"].add_argument("--with_tracking", action="store_true",
                               help="Send metrics to the --report_to trackers (files under OUTPUT_DIR/tensorboard).")
    g["tracking"].add_argument("--report_to", type=str, default="tensorboard",
                               help="accelerate tracker(s) for --with_tracking: tensorboard, wandb, ..., or all.")
    g["hardware"].add_argument("--mixed_precision", choices=["auto", "no", "fp16", "bf16"], default="auto",
                               help="auto: bf16 on GPUs that support it and on CPUs with native bf16 (AVX512-BF16, "
                                    "AMX), else fp32, unless the accelerate config asks for fp16/bf16.")
    g["hardware"].add_argument("--cpu", action="store_true",
                               help="Train on the CPU even when a GPU is visible (the default when none is).")
    g["hardware"].add_argument("--ddp_timeout", type=positive_int, default=300,
                               help="Seconds a collective may wait for a peer before the run fails (torch's default "
                                    "is 30 minutes, which is how long survivors of a dead rank would hang).")
    return parser


def add_optimizer_args(parser, learning_rate, train_batch_size, eval_batch_size, weight_decay=0.0,
                       label_smoothing=None):
    """The flags of AdamW + warmup/schedule training, with the script's defaults; --label_smoothing only
    for scripts that pass a default for it (a flag a script ignores must not be accepted)."""
    g = parser.groups["optimization"]
    g.add_argument("--per_device_train_batch_size", type=positive_int, default=train_batch_size,
                   help="Batch size per process; the global batch is this x processes x accumulation.")
    g.add_argument("--per_device_eval_batch_size", type=positive_int, default=eval_batch_size,
                   help="Evaluation batch size per process.")
    g.add_argument("--learning_rate", type=positive_float, default=learning_rate, help="Peak AdamW learning rate.")
    g.add_argument("--weight_decay", type=float, default=weight_decay, help="AdamW weight decay.")
    g.add_argument("--lr_scheduler_type", choices=["constant", "linear", "cosine"], default="cosine",
                   help="Learning-rate schedule after warmup.")
    g.add_argument("--num_warmup_steps", type=int, default=0, help="Linear warmup steps.")
    if label_smoothing is not None:
        g.add_argument("--label_smoothing", type=float, default=label_smoothing, help="Cross-entropy label smoothing.")


def fail(message):
    """Stop every process with `message` as the error: the line is printed once (see run())."""
    raise SystemExit(f"error: {message}")


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
        if (a == "-m" and argv[i + 1:i + 2] == ["accelerate.commands.launch"]) or os.path.basename(a) == \
                "accelerate-launch":
            return ["accelerate", "launch", *argv[i + (2 if a == "-m" else 1):]]
        if a == "-m" and argv[i + 1:i + 2] == ["accelerate.commands.accelerate_cli"]:
            return ["accelerate", *argv[i + 2:]]
        if os.path.basename(a) in ("accelerate", "torchrun"):
            return [os.path.basename(a), *argv[i + 1:]]
    return None


def resume_command():
    """This run's own command with --resume_from_checkpoint latest and without --overwrite_output_dir."""
    args, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
        elif a == "--resume_from_checkpoint":
            skip = True
        elif not (a == "--overwrite_output_dir" or a.startswith("--resume_from_checkpoint=")):
            args.append(a)
    launcher = launcher_argv() or ["python"]
    return shlex.join([*launcher, sys.argv[0], *args, "--resume_from_checkpoint", "latest"])


# a file the run could not write, in words, by errno; EACCES/EPERM may also be a read (of --data_dir, say)
DISK_FAULTS = {errno.ENOSPC: "no space left on device writing {}", errno.EDQUOT: "disk quota exceeded writing {}",
               errno.EROFS: "read-only file system: cannot write {}", errno.EACCES: "permission denied: {}",
               errno.EPERM: "operation not permitted: {}"}


def disk_fault(error, output_dir):
    """The one line for an OSError in DISK_FAULTS: what, where, and what to do."""
    path = error.filename or error.filename2 or output_dir
    inside = output_dir is not None and path is not None and os.path.commonpath(
        [os.path.abspath(path), os.path.abspath(output_dir)]) == os.path.abspath(output_dir)
    advice = ("free space or pass another --output_dir" if error.errno in (errno.ENOSPC, errno.EDQUOT) else
              "pass another --output_dir" if inside else "check its permissions")
    return f"error: {DISK_FAULTS[error.errno].format(path)}; {advice}"


def run(main, args, errors=()):
    """main(args) with the ways out that users meet most made short: an error (fail(), one of
    `errors`, the script's kinds of bad input, or a full, read-only or unwritable disk) is one line
    from one process and exit 1; Ctrl-C is one line with the last checkpoint and the command that
    resumes from it, and exit 130. Under a launcher, that line comes after the launcher's own report,
    and this process dies with the launcher."""
    die_with_launcher()
    try:
        return main(args)
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        message, code = e.code, 1
    except errors as e:
        text = str(e)
        if "Original Traceback" in text:  # raised in a DataLoader worker: its own message is the last line
            text = text.strip().splitlines()[-1].split(": ", 1)[-1]
        message, code = f"error: {text}", 1
    except BrokenPipeError:  # printing into a pipe that closed (`... | head`): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail again
        sys.exit(141)
    except OSError as e:
        if e.errno not in DISK_FAULTS:
            raise
        message, code = disk_fault(e, getattr(args, "output_dir", None)), 1
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher forwards a second SIGINT
        if not first_local_process():  # torchrun's agent got the SIGINT too and waits for every worker
            os._exit(130)
        from train.checkpoint import list_checkpoints

        found = list_checkpoints(args.output_dir) if args.output_dir else []
        where = (f"last checkpoint {found[-1]}" if found else
                 "no checkpoint yet (--checkpointing_steps saves them), so a resume starts from step 0")
        message, code = f"interrupted; {where}; resume with: {resume_command()}", 130
    for undo in _on_failure:  # e.g. an output folder this run created and never wrote a result into
        undo()
    exit_once(message, code)


_on_failure = []


def on_failure(undo):
    """Have run() call undo() when the script stops with one of its one-line errors or Ctrl-C."""
    _on_failure.append(undo)
