"""Peak memory of a long fine-tuning run on a CPU: does it stay where warm-up left it?

    python bench/shape_memory.py                          # the three cases below, 60 and 300 steps
    python bench/shape_memory.py --cases sft_demo --steps 60 300 900

On a CPU every batch shape a run meets keeps memory (oneDNN's kernels, the allocator's blocks), so a
run whose batches take many lengths grows until it has met them all; data/padding.py rounds each
batch's length up to a bounded set. Each case is one process, `python train/X.py ... --max_train_steps
N --mixed_precision auto` (bf16 where the CPU has it natively, as a user's run; the bench's own
--mixed_precision changes it) in a fresh output folder, once per N; the peak resident memory of the run is
os.wait4's ru_maxrss for that run (bench/harness.py's run_measured), and its
training speed is the script's own train_tokens_per_second / train_samples_per_second. Cases:
- sft_demo: make train-sft's model (runs/lm) and pairs (runs/sft/gcide), batch 16, evaluated on start
  as make train-sft's config has it (--model_name_or_path and --pairs_dir take others);
- sft_varied: the same model, each response several definitions joined (to 8-128 tokens), batch 8;
- text_varied: text_classification.py with all-MiniLM-L6-v2 on GCIDE definitions joined to 8-128
  tokens, 4 labels, batch 8.
The goal: peak after the last N within 10% of the peak after the first.
"""

import argparse
import json
import os
import random
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness import REPO, run_measured

SFT_DEMO = {"model": "runs/lm", "pairs": "runs/sft/gcide", "make": "make sft-data (it trains runs/lm first)"}


def varied(pairs_file, out, text, seed=0, rows=4000):
    """Rows whose lengths vary widely: each response (or text) 1 to 12 of the demo's definitions joined."""
    with open(pairs_file) as f:
        pairs = [json.loads(line) for line in f]
    rng, written = random.Random(seed), []
    for i in range(rows):
        joined = " ".join(pairs[(i * 13 + k) % len(pairs)]["response"] for k in range(rng.randint(1, 12)))
        words = joined.split()[: rng.randint(4, 90)]
        row = {"text": " ".join(words), "label": f"class{len(words) % 4}"} if text else None
        written.append(row or {"prompt": pairs[i % len(pairs)]["prompt"], "response": " ".join(words)})
    with open(out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in written)
    return out


def run(command, out):
    """(peak RSS MB, the run's all_results.json, wall seconds) of one run."""
    code, wall, peak = run_measured([sys.executable, *command, "--output_dir", out], os.path.join(out, "log.txt"))
    if code != 0:
        with open(os.path.join(out, "log.txt"), errors="replace") as f:
            sys.exit(f"error: {command[0]} failed:\n{f.read()[-3000:]}")
    with open(os.path.join(out, "all_results.json")) as f:
        return peak, json.load(f), wall


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", default=["sft_demo", "sft_varied", "text_varied"])
    parser.add_argument("--steps", nargs="+", type=int, default=[60, 300])
    parser.add_argument("--mixed_precision", default="auto", choices=["auto", "no", "bf16"])
    parser.add_argument("--model_name_or_path", default=SFT_DEMO["model"], help="The causal LM of the sft cases.")
    parser.add_argument(
        "--pairs_dir", default=SFT_DEMO["pairs"], help="train.jsonl, validation.jsonl: prompt/response."
    )
    parser.add_argument("--text_model", default=None, help="The text_varied case's model (default: all-MiniLM-L6-v2).")
    args = parser.parse_args(argv)
    for path in (args.model_name_or_path, args.pairs_dir):
        if not os.path.exists(os.path.join(REPO, path)):
            sys.exit(f"error: {path} is missing; run {SFT_DEMO['make']} first")
    from train.models.pretrained import default_model_folder

    text_model = args.text_model or default_model_folder()
    pairs = os.path.join(REPO, args.pairs_dir, "train.jsonl")
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        cases = {
            "sft_demo": (
                [
                    "train/sft.py",
                    "--model_name_or_path",
                    args.model_name_or_path,
                    "--train_file",
                    pairs,
                    "--validation_file",
                    os.path.join(REPO, args.pairs_dir, "validation.jsonl"),
                    "--eval_on_start",
                    "--per_device_eval_batch_size",
                    "32",
                ],
                16,
            ),
            "sft_varied": (
                [
                    "train/sft.py",
                    "--model_name_or_path",
                    args.model_name_or_path,
                    "--train_file",
                    varied(pairs, os.path.join(scratch, "sft.jsonl"), text=False),
                    "--validation_split_percentage",
                    "5",
                    "--max_seq_length",
                    "128",
                ],
                8,
            ),
            "text_varied": (
                [
                    "train/text_classification.py",
                    "--model_name_or_path",
                    text_model,
                    "--train_file",
                    varied(pairs, os.path.join(scratch, "text.jsonl"), text=True),
                    "--validation_split_percentage",
                    "5",
                    "--max_seq_length",
                    "128",
                ],
                8,
            ),
        }
        for name in args.cases:
            command, batch = cases[name]
            peaks = []
            for steps in sorted(args.steps):
                out = tempfile.mkdtemp(dir=scratch)
                argv = [*command, "--per_device_train_batch_size", str(batch), "--max_train_steps", str(steps)]
                argv += ["--mixed_precision", args.mixed_precision, "--seed", "0"]
                argv += ["--cache_dir", os.path.join(scratch, "cache")]
                peak, results, wall = run(argv, out)
                speed = results.get("train_tokens_per_second") or results.get("train_samples_per_second")
                unit = "tokens/s" if "train_tokens_per_second" in results else "samples/s"
                peaks.append(peak)
                rows.append((name, steps, peak, speed, unit, wall))
                print(f"{name} {steps} steps: peak {peak:.0f} MB, {speed:,.0f} {unit}, {wall:.0f} s", flush=True)
            print(f"RESULT {name}: peak at {max(args.steps)} / at {min(args.steps)} steps = {peaks[-1] / peaks[0]:.3f}")
    print("\n| case | steps | peak RSS MB | training speed | wall s |\n|---|---|---|---|---|")
    for name, steps, peak, speed, unit, wall in rows:
        print(f"| {name} | {steps} | {peak:,.0f} | {speed:,.0f} {unit} | {wall:.0f} |")


if __name__ == "__main__":
    main()
