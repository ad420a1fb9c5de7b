"""Where the fast recipe's seconds go, launch to exit, at one or more commits, in alternating rounds.

    python bench/recipe_phases.py                              # this checkout, 4 rounds
    python bench/recipe_phases.py --trees cbfb493 HEAD --gc    # beside an older commit, with collections

Each round runs `make train-only MIXED_PRECISION=no EXTRA='--seed 3'` once in each tree (HEAD is this
checkout, any other revision a temporary git worktree), the order reversed every other round, each
into a scratch output folder, and stamps every line of its output as it arrives. A run splits into
  start     launch to the `epochs=` line: the launcher, imports, data, model, prepare();
  training  to the last `epoch N:` evaluation line (the `final` line when there is none);
  finish    to the `final` line: the final files and curves.png;
  end       to the launcher's exit: the processes' release of the run and their interpreters' exit.
The table gives each tree's medians. With --gc every training process also records, through a
sitecustomize.py put first on its PYTHONPATH, its full collections (generation 2) and the moment its
last atexit handler ran: `gc` is the main process's seconds in full collections after the `final`
line, `exit` its last atexit handler to the launcher's exit (the interpreter's teardown, whose own
collections Python cannot report, then the launcher's), and `gc in run` its full collections over
the whole run.
"""

import argparse
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness import REPO, child_env

RECORDER = '''"""recipe_phases.py's recorder: this process's full collections and its last atexit handler."""
import atexit, gc, json, os, time

if "LOCAL_RANK" in os.environ and os.environ.get("RECIPE_PHASES_GC_DIR"):
    _full, _began = [], [0.0]

    def _collection(phase, info):
        if info["generation"] != 2:
            return
        if phase == "start":
            _began[0] = time.time()
        else:
            _full.append([_began[0], time.time() - _began[0]])

    def _last():  # registered first, so it runs last
        path = os.path.join(os.environ["RECIPE_PHASES_GC_DIR"], "rank%s.json" % os.environ["RANK"])
        with open(path, "w") as f:
            json.dump({"full_collections": _full, "last_atexit": time.time()}, f)

    gc.callbacks.append(_collection)
    atexit.register(_last)
'''

PHASES = ["start", "training", "finish", "end"]
GC_COLUMNS = ["gc", "exit", "gc in run"]


def one_run(tree, output_dir, extra, mixed_precision, gc_dir):
    """The phases of one `make train-only` in `tree`, in seconds, and with gc_dir the recorder's figures."""
    env = child_env()
    if gc_dir:
        for old in glob.glob(os.path.join(gc_dir, "rank*.json")):
            os.remove(old)
        env.update(PYTHONPATH=os.path.join(gc_dir, "site"), RECIPE_PHASES_GC_DIR=gc_dir)
    cmd = [
        "make",
        "-s",
        "train-only",
        f"MIXED_PRECISION={mixed_precision}",
        f"EXTRA={extra}",
        f"OUTPUT_DIR={output_dir}",
    ]
    stamps, lines = {}, []
    launch = time.time()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for raw in iter(proc.stdout.readline, b""):
        now, line = time.time(), raw.decode(errors="replace")
        lines.append(line)
        if line.startswith("epochs=") and "epochs" not in stamps:
            stamps["epochs"] = now
        if re.search(r"epoch \d+: eval_", line):
            stamps["last_eval"] = now
        if line.startswith("final "):
            stamps["final"] = now
    code = proc.wait()
    exit_time = time.time()
    if code != 0 or "epochs" not in stamps or "final" not in stamps:
        sys.exit(f"error: {' '.join(cmd)} in {tree} failed (exit {code}):\n{''.join(lines)[-3000:]}")
    last_eval = stamps.get("last_eval", stamps["final"])
    row = {
        "launch to exit": exit_time - launch,
        "start": stamps["epochs"] - launch,
        "training": last_eval - stamps["epochs"],
        "finish": stamps["final"] - last_eval,
        "end": exit_time - stamps["final"],
    }
    if gc_dir:
        with open(os.path.join(gc_dir, "rank0.json")) as f:
            main_process = json.load(f)
        full = main_process["full_collections"]
        row["gc"] = sum(seconds for began, seconds in full if began >= stamps["final"])
        row["exit"] = exit_time - main_process["last_atexit"]
        row["gc in run"] = sum(seconds for _, seconds in full)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trees", nargs="+", default=["HEAD"], help="Git revisions; HEAD is this checkout as it is.")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--mixed_precision", default="no", choices=["no", "bf16", "auto"])
    parser.add_argument("--extra", default="--seed 3", help="make train-only's EXTRA: more flags for train/mnist.py.")
    parser.add_argument("--gc", action="store_true", help="Also record the main process's full collections.")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    print(
        f"$ python bench/recipe_phases.py --trees {' '.join(args.trees)} --rounds {args.rounds} "
        f"--mixed_precision {args.mixed_precision} --extra '{args.extra}'" + (" --gc" if args.gc else ""),
        flush=True,
    )
    scratch = tempfile.mkdtemp(prefix="recipe_phases_")
    worktrees, trees = [], {}
    try:
        for rev in args.trees:
            if rev == "HEAD":
                trees[rev] = REPO
                continue
            path = os.path.join(scratch, "tree_" + re.sub(r"\W", "_", rev))
            made = subprocess.run(
                ["git", "worktree", "add", "--detach", path, rev], cwd=REPO, capture_output=True, text=True
            )
            if made.returncode != 0:
                sys.exit(f"error: git worktree add {rev} failed: {made.stderr.strip()}")
            worktrees.append(path)
            trees[rev] = path
        gc_dir = None
        if args.gc:
            gc_dir = os.path.join(scratch, "gc")
            os.makedirs(os.path.join(gc_dir, "site"))
            with open(os.path.join(gc_dir, "site", "sitecustomize.py"), "w") as f:
                f.write(RECORDER)
        rows = {rev: [] for rev in trees}
        for round_ in range(args.rounds):
            order = list(trees) if round_ % 2 == 0 else list(trees)[::-1]
            for rev in order:
                output_dir = os.path.join(scratch, "out", re.sub(r"\W", "_", rev))
                rows[rev].append(one_run(trees[rev], output_dir, args.extra, args.mixed_precision, gc_dir))
                print(f"round {round_ + 1} {rev}: {rows[rev][-1]['launch to exit']:.2f} s", flush=True)
    finally:
        for path in worktrees:
            subprocess.run(["git", "worktree", "remove", "--force", path], cwd=REPO, capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    columns = ["launch to exit", *PHASES] + (GC_COLUMNS if args.gc else [])
    print(f"\n| tree | runs | {' | '.join(columns)} |")
    print("|---" * (len(columns) + 2) + "|")
    for rev, runs in rows.items():
        medians = [statistics.median(run[c] for run in runs) for c in columns]
        print(f"| {rev} | {len(runs)} | " + " | ".join(f"{m:.2f} s" for m in medians) + " |")
    return rows


if __name__ == "__main__":
    main()
