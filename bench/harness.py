"""What the benches share: where things are, starting a bench's workers, the alternating-turn timer,
and an endless stream of batches.

A bench that measures inside training processes is one file with two halves: its main() parses the
command line and calls run_workers(), which starts the same file with --worker under `accelerate
launch`; the worker measures and its main process prints one `RESULT {json}` line, which main()
turns into the table. Only the standard library is imported here, so the parent that prints the
table never pays for importing torch.

Why turns: this host's speed drifts by 10-20% within a minute, so two loops timed one after the
other differ by more than the 1-3% we look for. Loops that live in the same processes and take
turns (A/B, then B/A, ...) see the same drift; the median of the per-turn ratios shrugs off a turn
that a hiccup of the host hit.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FASHION_DIR = "/usr/share/datasets/fashion-mnist"
CPU_2PROC = os.path.join(REPO, "accelerate_configs", "cpu_2proc.yaml")
MNIST_BATCH = 50  # samples per process: the reference recipe's global batch of 100 on 2 processes


def child_env():
    """This environment without PYTHONPATH: children find the repo as from a user's shell."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def run_measured(cmd, log, env=None):
    """Run `cmd` from the repo with its output in the file `log`: (exit code, wall seconds, peak RSS MB).
    The peak is os.wait4's ru_maxrss for this child alone: the largest of it and every process it (or
    they) waited for, i.e. the largest training process of a launch."""
    with open(log, "w") as log_file:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env or child_env(), stdout=log_file, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
    return os.waitstatus_to_exitcode(status), wall, usage.ru_maxrss / 1024  # Linux: kB


def reference_env(run_dir):
    """child_env() for a run beside a Hugging Face reference script: offline, a datasets cache of the
    run's own (so each run tokenizes afresh), and ACCELERATE_USE_CPU=1, what `accelerate launch --cpu`
    sets: the config's MULTI_GPU launch does not, and without it a plain Accelerator() finds no GPU and
    each process trains alone (world size 1)."""
    return {
        **child_env(),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "ACCELERATE_USE_CPU": "1",
        "HF_DATASETS_CACHE": os.path.join(run_dir, "hf_datasets"),
    }


def add_worker_flags(parser):
    """The hidden flags run_workers passes to the bench's own file."""
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--log_dir", default=None, help=argparse.SUPPRESS)


def run_workers(script, worker_args, config_file=CPU_2PROC):
    """`script --worker` in the processes of `config_file` (2 CPU processes unless told) with a scratch
    --log_dir: what its main process printed after RESULT, parsed."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            config_file,
            os.path.abspath(script),
            "--worker",
            "--log_dir",
            tmp,
            *worker_args,
        ]
        proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"error: the bench workers failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def print_result(result):
    """The worker's answer to run_workers (call it on the main process only)."""
    print("RESULT " + json.dumps(result), flush=True)


def flag(name, on):
    """`--name` when `on`, as a list to splice into a command line."""
    return [f"--{name}"] if on else []


class Batches:
    """An endless stream of one loader's batches, a new epoch (set_epoch) when one runs out: the raw
    loops' data, which, unlike TrainingLoop.batches(), has no end to plan for."""

    def __init__(self, loader, set_epoch):
        self.loader, self.set_epoch, self.epoch, self.it = loader, set_epoch, 0, iter(())

    def next(self):
        try:
            return next(self.it)
        except StopIteration:
            self.set_epoch(self.epoch)
            self.epoch, self.it = self.epoch + 1, iter(self.loader)
            return next(self.it)


# ---------------------------------------------------------------------------------- taking turns
def turn_order(names, turn):
    """A/B/C on even turns, C/B/A on odd ones: each goes first and last equally often, so neither
    position's share of the drift (or of the other rank's lateness) favours one loop."""
    names = list(names)
    return names if turn % 2 == 0 else names[::-1]


class Phases:
    """Wall seconds between named points of a step, per step: `mark = phases.start()` where a step
    starts, then `mark(name)` where each phase ends. No device sync in between: on a GPU a phase is
    the CPU's time to queue its work (or to wait, once the queue is full or something syncs)."""

    def __init__(self):
        self.seconds, self.steps = {}, 0

    def start(self):
        self.steps += 1
        last = [time.perf_counter()]

        def mark(name):
            now = time.perf_counter()
            self.seconds.setdefault(name, []).append(now - last[0])
            last[0] = now

        return mark

    def means(self):
        """Milliseconds per step of each phase, in the order they were first marked."""
        return {name: 1000 * sum(s) / max(self.steps, 1) for name, s in self.seconds.items()}

    def medians(self):
        """The same, the median step's: a phase that costs once (a first log, a lazily loaded
        kernel) moves the mean, not this."""
        return {name: 1000 * statistics.median(s) for name, s in self.seconds.items()}

    def maxima(self):
        return {name: 1000 * max(s) for name, s in self.seconds.items()}


def time_turns(loops, turns, synchronize, steps_per_turn=1, sync_after=False):
    """Milliseconds per step of each of `loops` (name -> a function taking one turn), per turn.
    `synchronize` runs before each turn's clock starts, so no loop inherits another's pending work;
    with `sync_after`, also before it stops (asynchronous devices: the turn's kernels have run)."""
    ms_per_step = {name: [] for name in loops}
    for turn in range(turns):
        for name in turn_order(loops, turn):
            synchronize()
            start = time.perf_counter()
            loops[name]()
            if sync_after:
                synchronize()
            ms_per_step[name].append(1000 * (time.perf_counter() - start) / steps_per_turn)
    return ms_per_step


def speed_ratio(ms_per_step, name, base):
    """How fast `name` runs against `base`: by total time, and the median of the per-turn ratios."""
    totals = sum(ms_per_step[base]) / sum(ms_per_step[name])
    return totals, statistics.median(b / v for b, v in zip(ms_per_step[base], ms_per_step[name], strict=True))


def ratio_line(label, ms_per_step, name, base):
    """`RATIO label = total (median of turns m)`: the line the README and docs/speed.md quote."""
    totals, per_turn = speed_ratio(ms_per_step, name, base)
    return f"RATIO {label} = {totals:.3f} (median of turns {per_turn:.3f})"
