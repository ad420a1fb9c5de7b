"""Preference pairs from a model's own answers, for train/dpo.py: each prompt answered --num_generations
times by sampling, the answers scored by --reward_funcs (the functions and calling convention of
sft.py's, dpo.py's and grpo.py's, TRL's), and the best answer written as chosen, the worst as rejected.
Pairs a model drew itself teach it what it actually says (on-policy); a prompt whose answers all score
alike has nothing to prefer and gives no pair (counted).

    python train/sample_pairs.py --model_name_or_path runs/chat --train_file runs/sft/sums/train.jsonl \\
        --validation_file runs/sft/sums/validation.jsonl --reward_funcs answer_match --output_dir runs/dpo/sums
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml train/sample_pairs.py ...  # shared out

Prompts: the --prompt_column (text, or chat turns), or without one the turns of --messages_column before
its last assistant turn; the rows' other columns (`answer`) go to the reward functions by name and into
each pair. Each prompt's answers are drawn from a generator seeded by (--seed, the split, its row) in
batches of whole prompts taken in order (train/models/rollout.py), so any process count writes the same
pairs. OUTPUT_DIR/train.jsonl (and validation.jsonl, from --validation_file) hold one pair per line:
prompt, chosen, rejected (text, or one assistant turn each when the prompt is turns), their rewards,
and the row's other columns; dpo.py reads them as they are.
"""

import argparse
import json
import math
import os
import sys

if __package__ in (None, ""):  # run as a file: Python put train/ on sys.path, not the repo root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data.errors import fail
from data.prompt_response import split_prompts
from data.splits import DataInputs, load_splits
from train.core.rewards import RewardError, answer_texts, load_reward_funcs, reward_weights, rewards_of, score
from train.core.run import run
from train.models.rollout import end_ids, group_seed, round_robin, sample_groups


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name_or_path", required=True, help="The model that answers: a folder or a Hub id.")
    parser.add_argument("--train_file", nargs="+", required=True, help="Prompts: jsonl, json, csv or parquet.")
    parser.add_argument("--validation_file", nargs="+", default=None, help="Prompts for validation pairs too.")
    parser.add_argument("--prompt_column", default="prompt", help="The prompt: text, or chat turns.")
    parser.add_argument(
        "--messages_column", default="messages", help="Without a prompt column: turns, the last assistant turn cut."
    )
    parser.add_argument(
        "--apply_chat_template", action="store_true", help="Text prompts as a user turn of the chat template."
    )
    parser.add_argument("--reward_funcs", nargs="+", required=True, help="FILE.py:NAME[,NAME...] or built-ins.")
    parser.add_argument("--reward_weights", type=float, nargs="+", default=None, help="One per function (default 1).")
    parser.add_argument("--num_generations", type=int, default=8, help="Answers sampled per prompt.")
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top_k", type=int, default=0, help="0: no top-k narrowing.")
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--batch_size", type=int, default=8, help="Prompts generated together.")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args(argv)
    if args.num_generations < 2 or args.temperature <= 0:
        parser.error("--num_generations must be 2 or more and --temperature above 0: pairs need different answers")
    return args


def main(args):
    import torch
    from accelerate import Accelerator
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from train.core.accelerator import gather_patiently
    from train.models.pretrained import quiet_transformers

    quiet_transformers()
    funcs = load_reward_funcs(args.reward_funcs)
    weights = reward_weights(funcs, args.reward_weights)
    # cpu=True where no accelerator is visible: only then does accelerate form a CPU process group under
    # torchrun, and without one every process would answer every prompt (train/core/accelerator.py)
    accelerator = Accelerator(cpu=not torch.accelerator.is_available())
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32).to(accelerator.device)
    model.eval()
    eos, n = end_ids(model, tokenizer), args.num_generations
    # without a validation file load_splits would hold a share of the rows out: here every row is a prompt
    splits = load_splits(DataInputs(args.train_file, args.validation_file or args.train_file, None, None, None, 0))[0]
    if not args.validation_file:
        del splits["validation"]
    os.makedirs(args.output_dir, exist_ok=True)
    for split, ds in splits.items():
        names = {"prompt": args.prompt_column, "messages": args.messages_column}
        prompts, ids, columns = split_prompts(ds, split, names, tokenizer, args.apply_chat_template)
        conversational = any(isinstance(p, list) for p in prompts)
        parts = []
        chunks = round_robin(math.ceil(len(ids) / args.batch_size), accelerator)
        for c in tqdm(chunks, desc=f"{split} prompts x {n}", disable=not accelerator.is_main_process):
            if c is None:
                continue
            rows = range(c * args.batch_size, min((c + 1) * args.batch_size, len(ids)))
            seeds = [group_seed(args.seed, split, i) for i in rows]
            answers = sample_groups(
                model, [ids[i] for i in rows], n, args.max_new_tokens, eos, tokenizer.pad_token_id,
                args.temperature, seeds, args.top_k, args.top_p,
            )  # fmt: skip
            texts = answer_texts(tokenizer, [a for a, _ in answers], conversational)
            asked = [prompts[i] for i in rows for _ in range(n)]
            extra = {k: [v[i] for i in rows for _ in range(n)] for k, v in columns.items()}
            try:
                scores = score(funcs, asked, texts, [a for a, _ in answers], extra)
            except RewardError as e:
                fail(str(e))
            rewards = rewards_of(weights, scores)[0].view(len(rows), n)
            for k, i in enumerate(rows):
                r = rewards[k].nan_to_num(nan=-math.inf)
                if r.max() == r.min():
                    continue
                best, worst = int(r.argmax()), int(r.argmin())
                pair = {"prompt": prompts[i], "chosen": texts[k * n + best], "rejected": texts[k * n + worst]}
                pair |= {"chosen_reward": r[best].item(), "rejected_reward": r[worst].item()}
                parts.append((i, pair | {name: values[i] for name, values in columns.items()}))
        pairs = sorted((p for part in gather_patiently(accelerator, parts) for p in part), key=lambda p: p[0])
        if accelerator.is_main_process:
            path = os.path.join(args.output_dir, f"{split}.jsonl")
            with open(path + ".tmp", "w") as f:
                f.writelines(json.dumps(pair) + "\n" for _, pair in pairs)
            os.replace(path + ".tmp", path)
        accelerator.print(
            f"{split}: {len(pairs):,} pairs from {len(ids):,} prompts x {n} answers on {accelerator.num_processes} "
            f"process(es); {len(ids) - len(pairs):,} "
            f"prompts whose answers all scored alike gave none -> {os.path.join(args.output_dir, split + '.jsonl')}"
        )
    accelerator.end_training()


if __name__ == "__main__":
    run(main, parse_args())
