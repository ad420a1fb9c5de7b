"""Wall time from launch to final evaluation of the README's main job (`make train-only`), and its accuracy.

    python bench/time_to_accuracy.py --repeats 3                  # ~3 minutes on 2 cores
    python bench/time_to_accuracy.py --repeats 1 EPOCHS=9         # other Makefile variables pass through
    python bench/time_to_accuracy.py --tiny                       # seconds; what the test suite runs

Each run is timed from starting `make` (so `accelerate launch`, the imports and process start-up
count) to its exit, which comes after the final evaluation and the saving of model, metrics and
curves.png: a slight overestimate of "launch to final evaluation". Reports each run's test accuracy
per epoch, the medians, and how many runs reached the target accuracy within the target time.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness import REPO, child_env


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--target_accuracy", type=float, default=0.91)
    parser.add_argument("--target_seconds", type=float, default=60.0)
    parser.add_argument("--tiny", action="store_true", help="1 epoch of 1280 samples: checks that the bench runs")
    parser.add_argument("make_vars", nargs="*", help="Makefile variables, e.g. EPOCHS=9 MIXED_PRECISION=no")
    args = parser.parse_args(argv)
    make_vars = list(args.make_vars)
    if args.tiny:
        args.repeats = 1
        make_vars += ["EPOCHS=1", "EXTRA=--max_train_samples 1280 --max_eval_samples 500"]
    env = child_env()
    env["PYTHON"] = sys.executable
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            out = os.path.join(tmp, f"run{repeat}")
            start = time.perf_counter()
            proc = subprocess.run(["make", "--no-print-directory", "train-only", f"OUTPUT_DIR={out}",
                                   f"PYTHON={sys.executable}", *make_vars], cwd=REPO, env=env,
                                  capture_output=True, text=True)
            wall = time.perf_counter() - start
            if proc.returncode != 0:
                raise SystemExit(f"error: make train-only failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
            results = json.load(open(os.path.join(out, "all_results.json")))
            header = next((line for line in proc.stdout.splitlines() if line.startswith("world_size=")), "")
            precision = header.split("mixed_precision=", 1)[-1].split(" global_batch_size")[0]
            accuracies = [h["eval_accuracy"] for h in results["history"]]
            runs.append({"precision": precision, "wall": wall, "accuracy": results["eval_accuracy"], "per_epoch": accuracies,
                         "eval_samples": results["eval_samples"], "epoch_seconds": results["epoch_seconds"]})
            print(f"run {repeat + 1}: {wall:.1f} s from launch, test accuracy per epoch "
                  f"{' '.join(f'{a:.4f}' for a in accuracies)}", flush=True)
    met = sum(r["accuracy"] >= args.target_accuracy and r["wall"] <= args.target_seconds for r in runs)
    from train.core.accelerator import cpu_has_native_bf16

    native, what = cpu_has_native_bf16()
    print(f"\n`make train-only {' '.join(make_vars)}`, {args.repeats} run(s){' (tiny)' if args.tiny else ''}")
    print(f"CPU: {what} (native bf16: {'yes' if native else 'no'}); mixed_precision={runs[0]['precision']}")
    print("| run | wall s (launch to exit) | train s/epoch (mean) | final test accuracy | eval samples |")
    print("|---|---|---|---|---|")
    for i, r in enumerate(runs, 1):
        print(f"| {i} | {r['wall']:.1f} | {statistics.mean(r['epoch_seconds']):.2f} | {r['accuracy']:.4f} | "
              f"{r['eval_samples']} |")
    print(f"MEDIAN wall = {statistics.median(r['wall'] for r in runs):.1f} s, final accuracy = "
          f"{statistics.median(r['accuracy'] for r in runs):.4f}")
    print(f"TARGET >= {args.target_accuracy:.2%} within {args.target_seconds:.0f} s: met by {met} of {len(runs)} runs")


if __name__ == "__main__":
    main()
