"""A verifiable task made offline: questions of adding two two-digit numbers, as chat prompts with the
right answer beside them, for train/grpo.py's demo (and sft.py's: --with_responses adds the answer
as an assistant turn). Train and validation questions never share a pair of numbers.

    python -m data.arithmetic --output_dir runs/grpo/sums [--train_rows 2000] [--validation_rows 200]

Each row: {"prompt": [{"role": "user", "content": "What is 23 + 58? Answer with the number only."}],
"answer": "81"}; the built-in rewards answer_match and number_only (train/core/rewards.py) score it.
"""

import argparse
import json
import os
import random

QUESTION = "What is {a} + {b}? Answer with the number only."


def sums(seed):
    """Every pair (a, b) of two-digit numbers, shuffled by `seed`."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    return pairs


def row(a, b, with_response=False):
    turns = [{"role": "user", "content": QUESTION.format(a=a, b=b)}]
    if with_response:
        return {"messages": [*turns, {"role": "assistant", "content": str(a + b)}], "answer": str(a + b)}
    return {"prompt": turns, "answer": str(a + b)}


def write(output_dir, train_rows, validation_rows, seed=0, with_responses=False):
    """train.jsonl and validation.jsonl in `output_dir`, written whole (a temporary name, then renamed)."""
    pairs = sums(seed)
    if train_rows + validation_rows > len(pairs):
        raise SystemExit(f"error: {train_rows + validation_rows} rows asked; there are {len(pairs)} distinct sums")
    os.makedirs(output_dir, exist_ok=True)
    splits = {"validation": pairs[:validation_rows], "train": pairs[validation_rows : validation_rows + train_rows]}
    for split, chosen in splits.items():
        path = os.path.join(output_dir, f"{split}.jsonl")
        with open(path + ".tmp", "w") as f:
            f.writelines(json.dumps(row(a, b, with_responses)) + "\n" for a, b in chosen)
        os.replace(path + ".tmp", path)
    return {split: len(chosen) for split, chosen in splits.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--train_rows", type=int, default=2000)
    parser.add_argument("--validation_rows", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--with_responses", action="store_true", help="Conversations with the answer (for sft.py).")
    args = parser.parse_args(argv)
    counts = write(args.output_dir, args.train_rows, args.validation_rows, args.seed, args.with_responses)
    print(f"{args.output_dir}: {counts['train']:,} training and {counts['validation']:,} validation questions")


if __name__ == "__main__":
    main()
