"""Answers to held-out prompts, scored by reward functions: the evaluation of a model by what it says,
exact over the prompts on any process count.

The prompts are answered greedily in fixed chunks (the same chunks on any layout, so the same answers),
shared out across processes; every process gets every score back, so the means are over exactly the
held-out prompts. The answers go to a jsonl (prompt, completion, whether it ended, each reward) that a
person can read, one line per prompt, with the step."""

import dataclasses
import json
import math
import os
from dataclasses import dataclass

import torch

from data.errors import fail
from train.core.accelerator import main_process_first
from train.core.rewards import RewardError, answer_texts, rewards_of, score, scored_everywhere
from train.models.rollout import complete, end_ids, round_robin, synced_generation


@dataclass
class Prompts:
    """Held-out prompts: their token ids as the model reads them before answering, the prompts as the
    reward functions take them (text or turns), the data's other columns by name, and whether the
    prompts are conversations (then a completion is an assistant turn)."""

    ids: list
    prompts: list
    columns: dict
    conversational: bool


@dataclass
class Scoring:
    """The reward functions [(name, function)], their weights, the jsonl the answers go to (None: none
    written) and the step they are written with."""

    funcs: list
    weights: list
    path: str = None
    step: int = 0


def evaluate_answers(accelerator, model, tokenizer, prompts, scoring, max_new_tokens, chunk_size):
    """{"eval_reward", "eval_rewards/NAME/mean", "eval_completions/mean_length", "eval_samples"} of the
    greedy answers of `model` (unwrapped) to `prompts`, at most max_new_tokens each."""
    eos, pad = end_ids(model, tokenizer), tokenizer.pad_token_id
    synced, n = synced_generation(accelerator), len(prompts.ids)
    parts = []
    try:
        for c in round_robin(math.ceil(n / chunk_size), accelerator):
            rows = range((c or 0) * chunk_size, min(((c or 0) + 1) * chunk_size, n))
            answers = complete(model, [prompts.ids[i] for i in rows], max_new_tokens, eos, pad, synced=synced)
            if c is None:  # a round in step with the other processes (FSDP2), nothing to score
                continue
            ids = [a for a, _ in answers]
            texts = answer_texts(tokenizer, ids, prompts.conversational)
            asked = [prompts.prompts[i] for i in rows]
            columns = {k: [v[i] for i in rows] for k, v in prompts.columns.items()}
            parts.append((c, answers, score(scoring.funcs, asked, texts, ids, columns), texts, asked))
    except RewardError as e:
        parts = str(e)
    done = sorted(scored_everywhere(accelerator, parts), key=lambda part: part[0])
    scores = [[v for part in done for v in part[2][f]] for f in range(len(scoring.funcs))]
    rewards, table = rewards_of(scoring.weights, scores)
    lengths = torch.tensor([len(a) for part in done for a, _ in part[1]], dtype=torch.float32)
    metrics = {"eval_reward": rewards.nanmean().item()}
    for f, (name, _) in enumerate(scoring.funcs):
        metrics[f"eval_rewards/{name}/mean"] = table[:, f].nanmean().item()
    metrics["eval_completions/mean_length"] = lengths.mean().item()
    metrics["eval_samples"] = len(rewards)
    if accelerator.is_main_process and scoring.path:
        with open(scoring.path, "a") as f:
            k = 0
            for _, answers, _, texts, asked in done:
                for (_, ended), text, prompt in zip(answers, texts, asked, strict=True):
                    text = text[-1]["content"] if isinstance(text, list) else text  # the answer's text alone
                    record = {"step": scoring.step, "prompt": prompt, "completion": text, "ended": ended}
                    record.update({name: table[k, i].item() for i, (name, _) in enumerate(scoring.funcs)})
                    f.write(json.dumps(record) + "\n")
                    k += 1
    return metrics


def answering(accelerator, model, tokenizer, prompts, scoring, max_new_tokens, chunk_size):
    """step -> evaluate_answers' metrics of `prompts` at that step (`scoring` with that step); {} at every
    step without prompts (no --reward_funcs): what an evaluation of sft.py or dpo.py adds."""
    if prompts is None:
        return lambda step: {}

    def at(step):
        at_step = dataclasses.replace(scoring, step=step)
        return evaluate_answers(accelerator, model, tokenizer, prompts, at_step, max_new_tokens, chunk_size)

    return at


def keep_until(path, step):
    """A jsonl of records with a "step" as it stood at `step`: a resumed run's later lines go."""
    if os.path.isfile(path):
        with open(path) as f:
            kept = [line for line in f if json.loads(line)["step"] <= step]
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)


def add_reward_args(parser):
    """--reward_funcs and --reward_weights of a script that trains on answers given (sft.py, dpo.py): its
    evaluation then also answers the validation prompts and scores the answers."""
    model = parser.groups["model"]
    model.add_argument(
        "--reward_funcs",
        nargs="+",
        default=None,
        help="Also score greedy answers to the validation prompts at each evaluation (eval_reward): FILE.py:NAME"
        "[,NAME...] of your own, or built-ins (answer_match, number_only). (default: no answers, no generation)",
    )
    model.add_argument(
        "--reward_weights", type=float, nargs="+", default=None, help="One weight per reward function (default 1)."
    )


def reward_metrics(funcs):
    """The metrics evaluate_answers adds for the reward functions `funcs` ([(name, function)])."""
    return ["eval_reward"] + [f"eval_rewards/{name}/mean" for name, _ in funcs] if funcs else []


def read_validation_prompts(accelerator, args, read, limit, scoring):
    """The validation prompts that evaluate_answers answers (`read(room)`: data/prompt_response.py's
    validation_prompts of the script's data, each prompt cut at its start to `room` tokens), after one
    line unless --max_new_tokens leaves room for a prompt in the `limit` tokens the model reads."""
    if args.max_new_tokens >= limit:
        fail(
            f"--max_new_tokens {args.max_new_tokens} leaves no room for a prompt in the {limit} tokens "
            f"{args.model_name_or_path} reads; pass a smaller one"
        )
    room = limit - args.max_new_tokens  # a longer prompt's start is cut: the end is what is answered
    got = main_process_first(accelerator, lambda: read(room), share=True)
    named = ", ".join(f"{n} x {w:g}" for (n, _), w in zip(scoring.funcs, scoring.weights, strict=True))
    accelerator.print(
        f"rewards: {named} of greedy answers to the {len(got['ids']):,} validation prompts, at most "
        f"{args.max_new_tokens} tokens each"
        + (f"; {got['cut']:,} prompts cut at the start to {room} tokens" if got["cut"] else "")
    )
    return Prompts(got["ids"], got["prompts"], got["columns"], got["conversational"])
