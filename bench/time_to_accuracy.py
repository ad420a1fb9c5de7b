"""Wall time from launch to final evaluation of the README's main job (`make train-only`), and its accuracy.

    python bench/time_to_accuracy.py --repeats 3                  # ~3 minutes on 2 cores
    python bench/time_to_accuracy.py --seeds 0 1 2 3 4            # the recipe's spread over seeds
    python bench/time_to_accuracy.py --seeds 0 1 2 --baseline MODEL=convnet_fast   # side by side
    python bench/time_to_accuracy.py EPOCHS=9 --repeats 1         # Makefile variables, before the flags
    python bench/time_to_accuracy.py --tiny                       # seconds; what the test suite runs

Each run is timed from starting `make` (so `accelerate launch`, the imports and process start-up
count) to its exit, which comes after the final evaluation and the saving of model, metrics and
curves.png: a slight overestimate of "launch to final evaluation". Reports each run's test accuracy
per epoch, the medians, and how many runs reached the target accuracy within the target time.
--seeds runs once per seed instead (accuracy is deterministic for a seed on one CPU's kernels).
--baseline pairs each run with a run of the same seed with more Makefile variables (the positional
ones, then these: the later value of a variable wins, EXTRA flags are joined), the two alternating
(A/B, then B/A) so the host's drift hits both; the ratio of their walls is what to quote, since this
host's speed drifts up to 2x over a day.
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness import REPO, child_env
from train.core.parser import positive_int


def make_run(out, make_vars, seed):
    """One `make train-only` run, timed; its results from all_results.json and the header, and the
    command (EXTRA joined, the seed last so it wins)."""
    extra = " ".join(v.split("=", 1)[1] for v in make_vars if v.startswith("EXTRA="))
    if seed is not None:
        extra = f"{extra} --seed {seed}".strip()
    make_vars = [v for v in make_vars if not v.startswith("EXTRA=")] + ([f"EXTRA={extra}"] if extra else [])
    shown = " ".join(["make train-only", *map(shlex.quote, make_vars)])
    cmd = ["make", "--no-print-directory", "train-only", f"OUTPUT_DIR={out}", f"PYTHON={sys.executable}", *make_vars]
    env = child_env()
    env["PYTHON"] = sys.executable
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"error: `{shown}` failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    with open(os.path.join(out, "all_results.json")) as f:
        results = json.load(f)
    header = next((line for line in proc.stdout.splitlines() if line.startswith("world_size=")), "")
    precision = header.split("mixed_precision=", 1)[-1].split(" global_batch_size")[0]
    return {
        "command": shown,
        "precision": precision,
        "wall": wall,
        "accuracy": results["eval_accuracy"],
        "seed": seed,
        "per_epoch": [h["eval_accuracy"] for h in results["history"]],
        "eval_samples": results["eval_samples"],
        "epoch_seconds": results["epoch_seconds"],
    }


def report(title, runs, args):
    met = sum(r["accuracy"] >= args.target_accuracy and r["wall"] <= args.target_seconds for r in runs)
    seeds = " and other seeds" if len(runs) > 1 and runs[0]["seed"] is not None else ""
    print(
        f"\n{title}: `{runs[0]['command']}`{seeds}"
        f", {len(runs)} run(s){' (tiny)' if args.tiny else ''}; mixed_precision={runs[0]['precision']}"
    )
    print("| run | seed | wall s (launch to exit) | train s/epoch (mean) | final test accuracy | eval samples |")
    print("|---|---|---|---|---|---|")
    for i, r in enumerate(runs, 1):
        print(
            f"| {i} | {'default' if r['seed'] is None else r['seed']} | {r['wall']:.1f} | "
            f"{statistics.mean(r['epoch_seconds']):.2f} | {r['accuracy']:.4f} | {r['eval_samples']} |"
        )
    accuracies = [r["accuracy"] for r in runs]
    print(
        f"MEDIAN wall = {statistics.median(r['wall'] for r in runs):.1f} s, final accuracy = "
        f"{statistics.median(accuracies):.4f} (mean {statistics.mean(accuracies):.4f}, lowest {min(accuracies):.4f})"
    )
    print(f"TARGET >= {args.target_accuracy:.2%} within {args.target_seconds:.0f} s: met by {met} of {len(runs)} runs")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=positive_int, help="Runs with the default seed (default 3; 1 with --tiny).")
    parser.add_argument("--seeds", type=int, nargs="+", help="One run per seed instead of --repeats.")
    parser.add_argument(
        "--baseline",
        nargs="+",
        metavar="NAME=VALUE",
        help="Makefile variables of a second "
        "variant to pair with each run, e.g. --baseline MODEL=convnet_fast EPOCHS=4.",
    )
    parser.add_argument("--target_accuracy", type=float, default=0.91)
    parser.add_argument("--target_seconds", type=float, default=60.0)
    parser.add_argument("--tiny", action="store_true", help="1 epoch of 1280 samples: checks that the bench runs")
    parser.add_argument("make_vars", nargs="*", help="Makefile variables, e.g. EPOCHS=9 MIXED_PRECISION=no")
    args = parser.parse_args(argv)
    for flag, values in (("", args.make_vars), ("--baseline ", args.baseline or [])):
        bad = [v for v in values if "=" not in v]
        if bad:
            parser.error(
                f"{flag}{' '.join(bad)}: Makefile variables are NAME=VALUE, one argument each (quote a "
                "value with spaces: 'EXTRA=--seed 1')"
            )
    if args.seeds and args.repeats:
        parser.error("--seeds sets the runs (one per seed): leave out --repeats")
    tiny = ["EPOCHS=1", "EXTRA=--max_train_samples 1280 --max_eval_samples 500"] if args.tiny else []
    variants = {"run": args.make_vars + tiny}
    if args.baseline:
        variants["baseline"] = args.make_vars + args.baseline + tiny
    seeds = args.seeds or [None] * (args.repeats or (1 if args.tiny else 3))
    runs = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for i, seed in enumerate(seeds):
            order = list(variants) if i % 2 == 0 else list(variants)[::-1]
            for name in order:
                run = make_run(os.path.join(tmp, f"{name}{i}"), variants[name], seed)
                runs[name].append(run)
                print(
                    f"{name} {i + 1}{'' if seed is None else f' (seed {seed})'}: {run['wall']:.1f} s from launch, "
                    f"test accuracy per epoch {' '.join(f'{a:.4f}' for a in run['per_epoch'])}",
                    flush=True,
                )

    from train.core.accelerator import cpu_has_native_bf16

    native, what = cpu_has_native_bf16()
    print(f"\nCPU: {what} (native bf16: {'yes' if native else 'no'})")
    report("run", runs["run"], args)
    if args.baseline:
        report("baseline", runs["baseline"], args)
        pairs = [r["wall"] / b["wall"] for r, b in zip(runs["run"], runs["baseline"], strict=True)]
        accuracy = {name: statistics.mean(r["accuracy"] for r in runs[name]) for name in ("run", "baseline")}
        print(
            f"\nRATIO wall / baseline wall = {statistics.median(pairs):.3f} (per pair: "
            f"{', '.join(f'{p:.3f}' for p in pairs)}); accuracy {accuracy['run']:.4f}"
            f" against {accuracy['baseline']:.4f} (means)"
        )


if __name__ == "__main__":
    main()
