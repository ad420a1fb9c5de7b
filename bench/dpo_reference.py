"""train/dpo.py beside TRL's DPOTrainer: end-to-end speed and the reward accuracy each reaches.

    python bench/dpo_reference.py                               # make train-dpo-gcide's model and data, 2 turns
    python bench/dpo_reference.py --max_train_samples 512 --turns 1      # a quick check

Four programs take turns (A/B/C/D, then D/C/B/A, ...), each `python -m accelerate.commands.launch
--config_file accelerate_configs/cpu_2proc.yaml`: ours as it is (batches grouped by length), ours with
--group_by_length false, and TRL's DPOTrainer (bench/reference/trl_dpo.py, TRL installed by
requirements.txt for the tests) with its reference log-probabilities precomputed and with its default,
a reference model's forward pass in every step. The same model (default: make train-sft's runs/sft),
pairs (default: make dpo-data's), batch per process, epochs, learning rate, linear schedule after the
same warmup, beta, sigmoid loss, max length, seed, clipping at 1.0, no weight decay, fp32 (ours:
--mixed_precision no; TRL: bf16=False, which its DPOConfig turns on by default). Every run gets fresh
folders (its output, HF_DATASETS_CACHE, our --cache_dir): each tokenizes and computes its reference
afresh. ACCELERATE_USE_CPU=1, as bench/text_reference.py explains; a run at another world size than 2
is refused. Per run: the wall time from launch to exit, pairs/s = training pairs x epochs / wall
seconds (start-up, tokenizing, the reference, evaluation and saving included, alike for all), and the
final validation reward accuracy (TRL's: the mean of its evaluation batches' means).
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness import CPU_2PROC, REPO, reference_env, turn_order

PROGRAMS = {
    "ours": "train/dpo.py",
    "ours_plain": "train/dpo.py --group_by_length false",
    "trl_precompute": "DPOTrainer, precompute_ref_log_probs",
    "trl": "DPOTrainer (reference model each step)",
}


def launch(name, args, data, scratch):
    """One run of program `name` in fresh folders: (wall seconds from launch to exit, final reward accuracy)."""
    run_dir = tempfile.mkdtemp(prefix=name + "_", dir=scratch)
    out = os.path.join(run_dir, "out")
    common = [
        "--model_name_or_path",
        args.model_name_or_path,
        "--train_file",
        data["train"],
        "--validation_file",
        data["validation"],
        "--per_device_train_batch_size",
        str(args.per_device_train_batch_size),
        "--per_device_eval_batch_size",
        "32",
        "--num_train_epochs",
        str(args.num_train_epochs),
        "--learning_rate",
        str(args.learning_rate),
        "--num_warmup_steps",
        "10",
        "--beta",
        str(args.beta),
        "--max_length",
        "128",
        "--seed",
        str(args.seed),
        "--output_dir",
        out,
    ]
    env = reference_env(run_dir)
    if name.startswith("trl"):
        script, extra = "bench/reference/trl_dpo.py", ["--precompute_ref_log_probs"] if name == "trl_precompute" else []
    else:
        script = "train/dpo.py"
        extra = [
            "--lr_scheduler_type",
            "linear",
            "--weight_decay",
            "0",
            "--mixed_precision",
            "no",
            "--cache_dir",
            os.path.join(run_dir, "tokens"),
            *(["--group_by_length", "false"] if name == "ours_plain" else []),
        ]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CPU_2PROC, script, *common, *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    results = os.path.join(out, "all_results.json")
    if proc.returncode != 0 or not os.path.isfile(results):
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise SystemExit(f"error: {PROGRAMS[name]} failed (exit {proc.returncode}); its last lines:\n{tail}")
    with open(results) as f:
        results = json.load(f)
    if results["world_size"] != 2:
        raise SystemExit(f"error: {PROGRAMS[name]} ran with world size {results['world_size']}, not 2")
    return wall, results["eval_rewards/accuracies"]


def copy_pairs(src, dst, max_rows=None, seed=0):
    with open(src, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    if max_rows:
        random.Random(seed).shuffle(lines)
        lines = lines[:max_rows]
    with open(dst, "w", encoding="utf-8") as f:
        f.writelines(lines)
    return len(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model_name_or_path", default="runs/sft", help="A causal LM folder (make train-sft's).")
    parser.add_argument("--train_file", default="runs/dpo/gcide/train.jsonl", help="Pairs: prompt, chosen, rejected.")
    parser.add_argument("--validation_file", default="runs/dpo/gcide/validation.jsonl")
    parser.add_argument("--turns", type=int, default=2, help="Runs of each program, in alternating order.")
    parser.add_argument("--num_train_epochs", type=int, default=1)
    parser.add_argument("--per_device_train_batch_size", type=int, default=16)
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument(
        "--max_train_samples",
        type=int,
        default=None,
        help="Train on this many pairs: the head of the training pairs shuffled with --seed.",
    )
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--programs", nargs="+", choices=PROGRAMS, default=list(PROGRAMS))
    args = parser.parse_args(argv)
    for path in (args.train_file, args.validation_file):
        if not os.path.isfile(os.path.join(REPO, path)):
            parser.error(
                f"{path} is missing: make dpo-data writes the demo's pairs (or pass --train_file and --validation_file)"
            )
    if not os.path.isfile(os.path.join(REPO, args.model_name_or_path, "config.json")):
        parser.error(
            f"{args.model_name_or_path} holds no model: make train-sft trains one (or pass --model_name_or_path)"
        )

    with tempfile.TemporaryDirectory() as scratch:
        data = {"train": os.path.join(scratch, "train.jsonl"), "validation": os.path.join(scratch, "validation.jsonl")}
        pairs = copy_pairs(os.path.join(REPO, args.train_file), data["train"], args.max_train_samples, args.seed)
        copy_pairs(os.path.join(REPO, args.validation_file), data["validation"])
        print(
            f"{pairs:,} training pairs x {args.num_train_epochs} epoch(s), batch {args.per_device_train_batch_size} "
            f"per process x 2 CPU processes, fp32, max length 128, beta {args.beta}; model {args.model_name_or_path}",
            flush=True,
        )
        programs = {name: PROGRAMS[name] for name in args.programs}
        runs = {name: [] for name in programs}
        for turn in range(args.turns):
            for name in turn_order(programs, turn):  # the host's drift hits all alike
                runs[name].append(launch(name, args, data, scratch))
                wall, accuracy = runs[name][-1]
                print(f"turn {turn + 1}: {PROGRAMS[name]}: {wall:.1f} s, reward accuracy {accuracy:.4f}", flush=True)

    speed = {
        name: statistics.median(pairs * args.num_train_epochs / wall for wall, _ in rs) for name, rs in runs.items()
    }
    print("\n| program | wall s (median) | pairs/s (median) | reward accuracy (per turn) |\n|---|---|---|---|")
    for name, rs in runs.items():
        print(
            f"| {PROGRAMS[name]} | {statistics.median(w for w, _ in rs):.1f} | {speed[name]:.1f} | "
            f"{', '.join(f'{a:.4f}' for _, a in rs)} |"
        )
    for ours in ("ours", "ours_plain"):
        for theirs in ("trl_precompute", "trl"):
            if ours in speed and theirs in speed:
                print(f"RATIO {ours} / {theirs} = {speed[ours] / speed[theirs]:.2f}")


if __name__ == "__main__":
    main()
