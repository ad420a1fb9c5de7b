"""Train a causal language model by online reinforcement learning with verifiable rewards (GRPO and its
variants DAPO and Dr. GRPO), with Hugging Face Accelerate: the step after supervised fine-tuning.

    make train-grpo        # SmolLM2-135M-Instruct taught two-digit sums (offline), 2 CPU processes
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml train/grpo.py \\
        --model_name_or_path MODEL_DIR --train_file prompts.jsonl --reward_funcs rewards.py:correct \\
        --output_dir runs/my_grpo [--lora_r 16]
    python train/grpo.py --output_dir runs/my_grpo --prompt "What is 12 + 30?"

Any AutoModelForCausalLM, a folder or a Hub id. Prompts: a `prompt` column of text or of conversations
([{role, content}] turns, rendered by the tokenizer's chat template), from files or --dataset_name;
every other column goes to the reward functions by name (an `answer` column, say). Rewards are your
code, called as TRL calls reward functions (train/core/rewards.py), or built-ins.

Each optimizer step: the step's prompts (completions per step / --num_generations of them) are
answered --num_generations times each; the reward of an answer is the weighted sum of the reward
functions; its advantage A = r - mean(group) is divided by the group's standard deviation
(--scale_rewards group), the whole step's (batch) or nothing (none). With the token log-probability
ratio rho = p / p_old (p_old: the policy that sampled; exactly 1 on an iteration's first pass), the
per-token loss is -min(rho A, clip(rho, 1 - epsilon, 1 + epsilon_high) A) + beta KL, KL the k3
estimate exp(q) - q - 1 with q = log p_ref - log p (p_ref: the model at the start). --loss_type says
what it is divided by, always over the whole step (every process, micro-batch and answer):
    grpo:    each answer's token mean, averaged over the step's answers
    dapo:    the step's token count (TRL's default)
    bnpo:    the step's token count (TRL divides by one process's micro-batch, which depends on the layout)
    dr_grpo: the step's answers x --max_completion_length
So 1 process with 8 completions per device, 2 with 4, and 2 with 2 x 2 accumulation steps take the
same step. A group's answers depend only on the seed, the step, the prompt and the weights: each group
is generated alone, with a generator of its own (train/models/rollout.py), wherever it runs.

Evaluation answers each validation prompt greedily and scores it with the same reward functions:
eval_reward and eval_rewards/NAME/mean, exact over the validation prompts on any process count; the
answers go to OUTPUT_DIR/eval_completions.jsonl, and every --logging_steps a step's prompts, answers,
rewards and advantages to OUTPUT_DIR/completions.jsonl.
"""

import inspect
import json
import os
import sys

if __package__ in (None, ""):  # run as a file: Python put train/ on sys.path, not the repo root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from data.errors import DataError, fail
from data.labelled_text import first_words
from data.loader import sharded_loader
from data.prompt_response import prompt_ids
from data.sources import TensorSource
from data.splits import load_splits
from train.core.accelerator import main_process_first
from train.core.answers import Prompts, Scoring, evaluate_answers, keep_until
from train.core.flags import add_data_files_args, data_inputs, make_parser
from train.core.loop import TrainingLoop
from train.core.parser import non_negative_float, positive_float, positive_int, true_or_false
from train.core.rewards import (
    RewardError,
    answer_texts,
    load_reward_funcs,
    nanstd,
    reward_weights,
    rewards_of,
    score,
    scored_everywhere,
)
from train.core.run import run
from train.models.causal_lm import (
    add_causal_lm_args,
    check_training_inputs,
    describe_model,
    load_causal_lm,
    max_positions,
    model_saver,
    start_causal_lm,
    template_note,
)
from train.models.generation import generate
from train.models.pretrained import load_pretrained
from train.models.rollout import end_ids, group_seed, round_robin, sample_groups, synced_generation
from train.models.trainable import adamw

TASK = "grpo"  # the run's name in its checkpoints: another task's checkpoint is refused
LOSS_TYPES = ("grpo", "dapo", "bnpo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")
LONG_PROMPTS = ("truncate", "drop", "error")
STD_EPSILON = 1e-4  # added to a standard deviation before dividing by it, as TRL does


def parse_args(argv=None):
    parser = make_parser(__doc__)
    data, model = parser.groups["data"], parser.groups["model"]
    add_data_files_args(
        parser,
        "Prompts: jsonl, json, csv or parquet, or a datasets folder written by save_to_disk.",
        split_percentage=10,
        dataset_name=True,
    )
    data.add_argument(
        "--prompt_column", default="prompt", help="The prompt: text, or conversation turns [{role, content}]."
    )
    data.add_argument(
        "--max_prompt_length",
        type=positive_int,
        default=None,
        help="Tokens per prompt (default: what the model reads beside --max_completion_length, at most 512).",
    )
    data.add_argument(
        "--long_examples",
        choices=LONG_PROMPTS,
        default="truncate",
        help="A prompt over --max_prompt_length: its start cut (the end is what is answered), left out, or refused.",
    )
    add_causal_lm_args(
        parser,
        "A Hugging Face causal language model (train/sft.py's output, say)",
        "Evaluate the model before the first step too (a fresh run): the rewards training starts from.",
        train_batch_size=8,
        eval_batch_size=8,
        disable_dropout=True,
        generation=False,
    )
    model.add_argument(
        "--gradient_checkpointing",
        action="store_true",
        help="Recompute activations in backward: less memory, more time.",
    )
    model.add_argument(
        "--prompt",
        nargs="+",
        help="Instead of training: answer these prompts greedily with the model in --output_dir.",
    )
    model.add_argument(
        "--reward_funcs",
        nargs="+",
        default=None,
        help="Reward functions: FILE.py:NAME[,NAME...] of your own, or built-ins (answer_match, number_only).",
    )
    model.add_argument(
        "--reward_weights", type=float, nargs="+", default=None, help="One weight per reward function (default 1)."
    )
    model.add_argument(
        "--num_generations", type=positive_int, default=8, help="Answers per prompt: the group compared."
    )
    model.add_argument("--max_completion_length", type=positive_int, default=256, help="Tokens per answer.")
    model.add_argument(
        "--generation_batch_size",
        type=positive_int,
        default=None,
        help="Answers generated in one batch, whole groups (default: one group's). The same value gives the "
        "same answers on any layout; more keeps a processor busier, fewer keeps more processes generating.",
    )
    model.add_argument("--temperature", type=positive_float, default=1.0, help="Sampling temperature.")
    model.add_argument("--top_p", type=positive_float, default=1.0, help="Sample from this top probability mass.")
    model.add_argument("--top_k", type=int, default=0, help="Sample from the k likeliest tokens (0: all).")
    model.add_argument(
        "--beta", type=non_negative_float, default=0.0, help="KL weight to the starting model (0: no reference)."
    )
    model.add_argument("--epsilon", type=positive_float, default=0.2, help="Clip the ratio below at 1 - epsilon.")
    model.add_argument(
        "--epsilon_high", type=positive_float, default=None, help="Clip the ratio above at 1 + this (default epsilon)."
    )
    model.add_argument(
        "--loss_type", choices=LOSS_TYPES, default="dapo", help="What the loss is divided by (module docstring)."
    )
    model.add_argument(
        "--scale_rewards",
        choices=SCALE_REWARDS,
        default="group",
        help="Divide advantages by the group's reward std, the step's, or nothing.",
    )
    model.add_argument(
        "--num_iterations",
        type=positive_int,
        default=1,
        help="Optimizer steps on each step's answers (the ratio to the policy that sampled them clips).",
    )
    model.add_argument(
        "--mask_truncated_completions",
        type=true_or_false,
        nargs="?",
        const=True,
        default=False,
        help="Answers cut at --max_completion_length train no token. (default: false)",
    )
    parser.set_defaults(output_dir="runs/grpo", learning_rate=None)
    parser.recorded.add("conversational")
    args = parser.parse_args(argv)
    if args.prompt is None:
        check_training_inputs(parser, args, full_rate=1e-6, lora_rate=1e-5)  # TRL's default for a whole model
        if not args.reward_funcs:
            parser.error("--reward_funcs is required: FILE.py:NAME of your own, or answer_match, number_only")
        if args.num_generations < 2:
            parser.error("--num_generations 1: an answer alone has no group to be compared with; pass 2 or more")
        args.generation_batch_size = args.generation_batch_size or args.num_generations
        if args.generation_batch_size % args.num_generations:
            parser.error(
                f"--generation_batch_size {args.generation_batch_size} is not whole groups of --num_generations "
                f"{args.num_generations}; pass a multiple of it"
            )
        if isinstance(args.checkpointing_steps, int) and args.checkpointing_steps % args.num_iterations:
            parser.error(
                f"--checkpointing_steps {args.checkpointing_steps} is not a multiple of --num_iterations "
                f"{args.num_iterations}: a checkpoint falls between two steps on the same answers"
            )
    args.epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    return args


# ---------------------------------------------------------------------------------------------- the prompts


def read_prompts(args, tokenizer):
    """{split: {"columns": {name: values}, "ids": [prompt ids]}}, the validation split's source, whether
    the prompts are conversations, and per split the prompts cut and dropped (--long_examples)."""
    splits, where = load_splits(data_inputs(args))
    out, counts, kinds = {}, {}, set()
    for split, ds in splits.items():
        if args.prompt_column not in ds.column_names:
            raise DataError(
                f"no column {args.prompt_column!r} in the {split} data (columns: {', '.join(ds.column_names)}); "
                "pass --prompt_column NAME"
            )
        columns = {name: ds[name] for name in ds.column_names}
        prompts = columns[args.prompt_column]
        keep, ids, cut = [], [], 0
        for i, prompt in enumerate(prompts):
            conversation = isinstance(prompt, list)
            kinds.add(conversation)
            if conversation and not getattr(tokenizer, "chat_template", None):
                raise DataError(
                    f"{args.prompt_column!r} holds conversations and {args.model_name_or_path}'s tokenizer has no "
                    "chat template to render them; pass text prompts, or a model with a chat template"
                )
            if not conversation and not isinstance(prompt, str):
                raise DataError(
                    f"{args.prompt_column!r} in the {split} data holds {type(prompt).__name__} values, not text or "
                    "conversations; pass --prompt_column NAME"
                )
            try:
                tokens = prompt_ids(tokenizer, prompt, args.apply_chat_template)
            except Exception as e:  # jinja2's TemplateError, the template's own raise_exception(): a row it refuses
                text = prompt[-1]["content"] if conversation and prompt else prompt
                raise DataError(
                    f"the model's chat template refuses the {split} prompt {first_words(text)} "
                    f"({' '.join(str(e).split())[:120]}); drop or fix such rows, or pass a model whose template "
                    "takes them"
                ) from None
            if len(tokens) > args.max_prompt_length:
                if args.long_examples == "error":
                    text = prompt[-1]["content"] if conversation else prompt
                    raise DataError(
                        f"the {split} prompt {first_words(text)} is {len(tokens)} tokens, over --max_prompt_length "
                        f"{args.max_prompt_length}; pass a larger one, or --long_examples truncate or drop"
                    )
                if args.long_examples == "drop":
                    continue
                tokens, cut = tokens[-args.max_prompt_length :], cut + 1
            keep.append(i)
            ids.append(tokens)
        if not keep:
            raise DataError(f"the {split} data has no prompt left (of {len(prompts)}); see --long_examples")
        out[split] = {"columns": {k: [v[i] for i in keep] for k, v in columns.items()}, "ids": ids}
        counts[split] = {"prompts": len(keep), "cut": cut, "dropped": len(prompts) - len(keep)}
    if len(kinds) > 1:
        raise DataError(f"{args.prompt_column!r} mixes text and conversations; pass one kind")
    return out, where, kinds == {True}, counts


# ---------------------------------------------------------------------------------------------- the loss


def token_logps(logits, labels, temperature):
    """log p(label) under softmax(logits / temperature) per position (0 where the label is -100), in float32."""
    logits = logits.float() / temperature
    picked = logits.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked - torch.logsumexp(logits, -1)) * (labels != -100)


def group_advantages(rewards, num_generations, scale_rewards):
    """(advantages, per-group std) of `rewards` (one per answer, groups contiguous; NaN where no reward
    function applied): r minus its group's mean, divided by the group's std (unbiased, as torch.std
    and TRL), the whole step's, or nothing; NaN-aware as TRL's, and 0 where the reward is NaN."""
    groups = rewards.view(-1, num_generations)
    mean = groups.nanmean(dim=1, keepdim=True)
    std = nanstd(groups, dim=1)
    advantages = (groups - mean).view(-1)
    if scale_rewards == "group":
        advantages = advantages / (std.repeat_interleave(num_generations) + STD_EPSILON)
    elif scale_rewards == "batch":
        advantages = advantages / (nanstd(rewards, dim=0) + STD_EPSILON)
    return torch.nan_to_num(advantages, nan=0.0), std


def policy_loss(logps, old_logps, ref_logps, advantages, mask, beta, epsilon_low, epsilon_high):
    """Per token: the clipped surrogate loss plus beta x the ratio x the k3 KL estimate, and the statistics
    TRL logs (that KL term, whether the ratio was clipped below or above). `advantages`: one per row.
    The k3 estimate alone has a biased gradient (its value is unbiased, its gradient is not that of
    KL(p || p_ref)); times the ratio, whose value is 1 on policy, its gradient is (log p - log p_ref)
    grad log p, the KL's own (TRL 1.16's use_bias_correction_kl, its default)."""
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    a = advantages.unsqueeze(1)
    loss = -torch.min(ratio * a, clipped * a)
    kl = None
    if beta:
        q = ref_logps - logps
        kl = ratio * (torch.exp(q) - q - 1)
        loss = loss + beta * kl
    low = (ratio < 1 - epsilon_low) & (a < 0)
    high = (ratio > 1 + epsilon_high) & (a > 0)
    return loss * mask, {"kl": kl, "low": low & mask.bool(), "high": high & mask.bool()}


def normalised_sum(token_loss, mask, loss_type, step_answers, step_tokens, max_completion_length):
    """This micro-batch's share of the step's loss: its rows' token losses summed and divided by the
    whole step's normaliser (every process and micro-batch), so the shares add up to the step's loss."""
    if loss_type == "grpo":
        return (token_loss.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / step_answers
    if loss_type in ("dapo", "bnpo"):
        return token_loss.sum() / max(step_tokens, 1)
    if loss_type == "dr_grpo":
        return token_loss.sum() / (step_answers * max_completion_length)
    raise ValueError(f"loss_type {loss_type!r}: one of {', '.join(LOSS_TYPES)}")


def padded_rows(prompts, completions, pad):
    """input_ids, attention_mask and labels (the completion's tokens where they are predicted, -100
    elsewhere) of prompt + completion rows, right-padded to the longest."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    ids, attention, labels = [], [], []
    for p, c in zip(prompts, completions, strict=True):
        n = len(p) + len(c)
        ids.append(list(p) + list(c) + [pad] * (width - n))
        attention.append([1] * n + [0] * (width - n))
        labels.append([-100] * (len(p) - 1) + list(c) + [-100] * (width - n + 1))
    return torch.tensor(ids), torch.tensor(attention), torch.tensor(labels)


def logps_and_mask(net, rows, temperature, device=None, trim=True):
    """(log-probabilities of the completions' tokens, which positions predict one, the logits at those
    positions [scored tokens, vocabulary]) of padded_rows' `rows` under `net`: position t holds the
    log-probability of token t + 1 (the labels are aligned already). With `trim` (models whose forward
    takes logits_to_keep) the output layer runs only from the first position that predicts a completion
    token: a prompt's positions would be a large share of its work over a big vocabulary, for nothing."""
    ids, attention, labels = (t.to(device) if device is not None else t for t in rows)
    mask = labels != -100
    start = int(mask.any(0).nonzero()[0, 0]) if trim and mask.any() else 0
    keep = {"logits_to_keep": labels.shape[1] - start} if start else {}
    logits = net(input_ids=ids, attention_mask=attention, use_cache=False, **keep).logits
    logits = logits[:, start:] if logits.shape[1] == labels.shape[1] else logits
    scored = token_logps(logits, labels[:, start:], temperature)
    logps = torch.cat([scored.new_zeros(scored.shape[0], start), scored], dim=1)
    return logps, mask, logits[mask[:, start:]]


# ---------------------------------------------------------------------------------------------- the run


def main(args):
    funcs = load_reward_funcs(args.reward_funcs)  # before anything is written
    weights = reward_weights(funcs, args.reward_weights)
    accelerator, folder, config, tokenizer = start_causal_lm(args, TASK)
    world, accumulation = accelerator.num_processes, args.gradient_accumulation_steps
    completions_per_step = args.per_device_train_batch_size * world * accumulation
    if completions_per_step % args.num_generations:
        fail(
            f"{completions_per_step} completions per step (--per_device_train_batch_size "
            f"{args.per_device_train_batch_size} x {world} processes x {accumulation} accumulation steps) do not "
            f"make whole groups of --num_generations {args.num_generations}; pass a batch whose product is a "
            "multiple of it"
        )
    prompts_per_step = completions_per_step // args.num_generations
    limit = max_positions(config, tokenizer, 1 << 20)
    if args.max_prompt_length is None:
        args.max_prompt_length = min(512, limit - args.max_completion_length)
    if args.max_prompt_length < 1 or args.max_prompt_length + args.max_completion_length > limit:
        fail(
            f"--max_prompt_length {args.max_prompt_length} + --max_completion_length {args.max_completion_length} is "
            f"more than {args.model_name_or_path} reads ({limit} tokens); pass smaller ones"
        )

    # ---------------------------------------------------------------- data: prompts, tokenized once
    data, where, conversational, counts = main_process_first(
        accelerator, lambda: read_prompts(args, tokenizer), share=True
    )
    args.conversational = conversational  # --prompt then sends a user turn
    chat = conversational or args.apply_chat_template
    if len(data["train"]["ids"]) < prompts_per_step:
        fail(
            f"the training data has {len(data['train']['ids'])} prompt(s), fewer than one step's {prompts_per_step} "
            f"({completions_per_step} completions / --num_generations {args.num_generations}); pass a smaller batch"
        )
    extra = {split: {k: v for k, v in d["columns"].items() if k != args.prompt_column} for split, d in data.items()}
    # every process reads the same prompts, a step's at a time: the groups are shared out below
    train_loader = sharded_loader(
        TensorSource({"row": torch.arange(len(data["train"]["ids"]))}),
        prompts_per_step,
        rank=0,
        world_size=1,
        device=None,
        seed=args.seed,
        train=True,
        last_batch_syncs=False,  # a batch is whole optimizer steps: accumulate() counts its micro-batches
    )
    template = template_note(tokenizer, chat)
    accelerator.print(
        "data: "
        + "; ".join(
            f"{s if s == 'train' else 'validation (' + where + ')'} {c['prompts']:,} prompts"
            + (f", {c['cut']:,} cut" if c["cut"] else "")
            + (f", {c['dropped']:,} dropped" if c["dropped"] else "")
            for s, c in counts.items()
        )
        + f"; {prompts_per_step} prompts x {args.num_generations} answers per step{template}"
    )

    # ---------------------------------------------------------------- model, and the reference
    model = load_causal_lm(args, accelerator, folder, tokenizer)
    eos, pad = end_ids(model, tokenizer), tokenizer.pad_token_id
    reference = None
    if args.beta and not args.lora_r:  # with LoRA the reference is the model with its adapters off
        from transformers import AutoModelForCausalLM

        reference = load_pretrained(AutoModelForCausalLM, args, "a causal LM").to(accelerator.device).eval()
        for p in reference.parameters():
            p.requires_grad_(False)
        if args.disable_dropout:
            from train.models.causal_lm import disable_dropout

            disable_dropout(reference)
    trainable, total = describe_model(
        accelerator,
        model,
        args,
        f"; {args.loss_type} loss, rewards scaled by {args.scale_rewards}, beta {args.beta}, "
        f"epsilon {args.epsilon}/{args.epsilon_high}, temperature {args.temperature}"
        + (f", top_p {args.top_p}" if args.top_p < 1 else "")
        + (f", top_k {args.top_k}" if args.top_k else ""),
    )
    accelerator.print(f"rewards: {', '.join(f'{n} x {w:g}' for (n, _), w in zip(funcs, weights, strict=True))}")
    optimizer = adamw(model, args.learning_rate, args.weight_decay)
    model, optimizer = accelerator.prepare(model, optimizer)
    policy = accelerator.unwrap_model(model)
    base = policy.get_base_model() if args.lora_r else policy
    takes_logits_to_keep = "logits_to_keep" in inspect.signature(base.forward).parameters
    synced = synced_generation(accelerator)

    # ---------------------------------------------------------------- answers and their rewards
    def rollout(rows, step):
        """Every answer of the step's prompts `rows`, on every process: (prompt ids, completion ids,
        terminated, rewards, reward table, group of each), groups in the order of `rows`."""
        parts, n = [], args.num_generations
        per_batch = args.generation_batch_size // n  # prompts generated together: the same on any layout
        batches = [rows[u : u + per_batch] for u in range(0, len(rows), per_batch)]
        try:
            for j in round_robin(len(batches), accelerator):
                these = batches[0] if j is None else batches[j]  # None: a round in step with the others, discarded
                answers = sample_groups(
                    policy,
                    [data["train"]["ids"][row] for row in these],
                    n,
                    args.max_completion_length,
                    eos,
                    pad,
                    args.temperature,
                    [group_seed(args.seed, step, row) for row in these],
                    args.top_k,
                    args.top_p,
                    synced,
                )
                if j is None:
                    continue
                ids = [a for a, _ in answers]
                columns = {k: [v[row] for row in these for _ in range(n)] for k, v in extra["train"].items()}
                prompts = [data["train"]["columns"][args.prompt_column][row] for row in these for _ in range(n)]
                scores = score(funcs, prompts, answer_texts(tokenizer, ids, conversational), ids, columns)
                parts.append((j, answers, scores))
        except RewardError as e:
            parts = str(e)
        groups = sorted(scored_everywhere(accelerator, parts), key=lambda g: g[0])
        completions, terminated, scores = [], [], [[] for _ in funcs]
        for _, answers, group_scores in groups:
            completions += [a for a, _ in answers]
            terminated += [t for _, t in answers]
            for f, values in enumerate(group_scores):
                scores[f] += values
        rewards, table = rewards_of(weights, scores)
        return completions, terminated, rewards, table

    def logps_of(net, prompts, completions):
        rows = padded_rows(prompts, completions, pad)
        return logps_and_mask(net, rows, args.temperature, accelerator.device, trim=takes_logits_to_keep)

    def reference_logps(prompts, completions):
        if reference is not None:
            with torch.no_grad(), accelerator.autocast():
                return logps_of(reference, prompts, completions)[0]
        with torch.no_grad(), policy.disable_adapter():  # LoRA: the pretrained model is the reference
            return logps_of(model, prompts, completions)[0]

    # ---------------------------------------------------------------- evaluation: greedy answers, scored
    def evaluate():
        val = data["validation"]
        return evaluate_answers(
            accelerator,
            policy,
            tokenizer,
            Prompts(val["ids"], val["columns"][args.prompt_column], extra["validation"], conversational),
            Scoring(funcs, weights, os.path.join(args.output_dir, "eval_completions.jsonl"), loop.step),
            args.max_completion_length,
            args.per_device_eval_batch_size,
        )

    # ---------------------------------------------------------------- train
    scale = world * accumulation  # undoes DDP's mean over processes and accelerate's division by accumulation
    metric_names = ["eval_reward"] + [f"eval_rewards/{n}/mean" for n, _ in funcs]
    loop = TrainingLoop(
        accelerator,
        args,
        TASK,
        model,
        optimizer,
        train_loader,
        headline="eval_reward",
        metrics=metric_names,
        evaluate=evaluate,
        steps_per_batch=args.num_iterations,
    )
    before = {}
    if args.eval_on_start and loop.step == 0:
        before = evaluate()
        if accelerator.is_main_process:
            loop.progress.write("before training: " + " ".join(f"{k}={v:.4f}" for k, v in before.items()))
    if accelerator.is_main_process:  # a resumed run writes the steps after its checkpoint again
        for name in ("completions.jsonl", "eval_completions.jsonl"):
            keep_until(os.path.join(args.output_dir, name), loop.step)
    logged = StepMetrics(accelerator, funcs)
    b = args.per_device_train_batch_size
    for batch in loop.batches():
        rows = batch["row"].tolist()
        completions, terminated, rewards, table = rollout(rows, loop.step)
        advantages, group_std = group_advantages(rewards, args.num_generations, args.scale_rewards)
        prompts = [data["train"]["ids"][r] for r in rows for _ in range(args.num_generations)]
        mask_rows = torch.tensor([0.0 if (args.mask_truncated_completions and not t) else 1.0 for t in terminated])
        step_answers = len(completions)
        step_tokens = sum(len(c) * m for c, m in zip(completions, mask_rows.tolist(), strict=True))
        # this process's micro-batches: answers [(m x world + rank) x b, ... + b)
        mine = [
            list(range((m * world + accelerator.process_index) * b, (m * world + accelerator.process_index + 1) * b))
            for m in range(accumulation)
        ]
        olds, refs = {}, {}
        for m, idx in enumerate(mine):
            p, c = [prompts[i] for i in idx], [completions[i] for i in idx]
            if args.num_iterations > 1:  # the policy that sampled, for the later passes' ratio
                with torch.no_grad():
                    olds[m] = logps_of(model, p, c)[0]
            if args.beta:
                refs[m] = reference_logps(p, c)
        logged.rollout(rewards, table, group_std, completions, terminated)
        for _ in range(args.num_iterations):
            for m, idx in enumerate(mine):
                p, c = [prompts[i] for i in idx], [completions[i] for i in idx]
                with accelerator.accumulate(model):
                    logps, mask, logits = logps_of(model, p, c)  # logits: the scored positions only
                    mask = mask & mask_rows[idx].to(mask.device).unsqueeze(1).bool()
                    old = olds[m] if m in olds else logps.detach()  # one pass: the ratio is exactly 1
                    token_loss, stats = policy_loss(
                        logps,
                        old,
                        refs.get(m),
                        advantages[idx].to(logps.device),
                        mask.float(),
                        args.beta,
                        args.epsilon,
                        args.epsilon_high,
                    )
                    share = normalised_sum(
                        token_loss, mask.float(), args.loss_type, step_answers, step_tokens, args.max_completion_length
                    )
                    loss = share * scale
                    accelerator.backward(loss)
                    if accelerator.sync_gradients and args.max_grad_norm > 0:
                        accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                logged.tokens(logits, mask, stats, args.temperature)
                if accelerator.sync_gradients and (loop.step + 1) % args.logging_steps == 0:
                    # before after_batch, which may stop the run at this step (SIGTERM) with its checkpoint
                    step = loop.step + 1
                    record = logged.flush(step)
                    loop.metrics.log({"step": step, **record})
                    if accelerator.is_main_process:
                        loop.progress.set_postfix(reward=f"{record['reward']:.3f}", refresh=False)
                        lines = write_completions(
                            args, step, rows, data, completions, rewards, table, advantages, funcs, tokenizer
                        )
                        if args.with_tracking:
                            show_completions(accelerator, lines, step)
                loop.after_batch(loss)
                if loop.finished():
                    break
            if loop.finished():
                break

    return loop.finish(
        {
            "trainable_parameters": trainable,
            "parameters": total,
            "train_prompts": len(data["train"]["ids"]),
            "train_completions_per_second": loop.samples_per_second(),
            **{f"{k}_before": v for k, v in before.items() if k != "eval_samples"},
        },
        save_model=model_saver(args, config, tokenizer),
    )


class StepMetrics:
    """TRL's training metrics, averaged over the steps since the last log and exact over every process:
    the rewards and lengths from the step's answers (every process has them all), the token statistics
    (KL, entropy, clipped ratios) as sums reduced over processes when logged."""

    def __init__(self, accelerator, funcs):
        self.accelerator, self.names = accelerator, [n for n, _ in funcs]
        self.steps, self.sums = [], torch.zeros(5, dtype=torch.float64)  # tokens, kl, entropy, low, high

    def rollout(self, rewards, table, group_std, completions, terminated):
        lengths = torch.tensor([len(c) for c in completions], dtype=torch.float32)
        ended = lengths[torch.tensor(terminated, dtype=torch.bool)]
        record = {
            "reward": rewards.nanmean().item(),
            "reward_std": nanstd(rewards, dim=0).item(),
            "frac_reward_zero_std": torch.isclose(group_std, torch.zeros_like(group_std)).float().mean().item(),
            "completions/mean_length": lengths.mean().item(),
            "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": 1 - len(ended) / len(lengths),
            "completions/mean_terminated_length": ended.mean().item() if len(ended) else 0.0,
            "completions/min_terminated_length": ended.min().item() if len(ended) else 0.0,
            "completions/max_terminated_length": ended.max().item() if len(ended) else 0.0,
        }
        for f, name in enumerate(self.names):
            record[f"rewards/{name}/mean"] = torch.nanmean(table[:, f]).item()
            record[f"rewards/{name}/std"] = nanstd(table[:, f], dim=0).item()
        self.steps.append(record)
        self.last = record

    def tokens(self, scored_logits, mask, stats, temperature):
        """A micro-batch's token statistics: `scored_logits` [scored tokens, vocabulary] (logps_and_mask's)."""
        with torch.no_grad():
            scored = scored_logits.float() / temperature
            logp = torch.log_softmax(scored, -1)
            entropy = -(logp.exp() * logp).sum(-1).sum()
            kl = (stats["kl"] * mask).sum() if stats["kl"] is not None else torch.zeros(())
            # kept on the device: a copy to the host here would wait for the step every micro-batch
            part = torch.stack([mask.sum(), kl, entropy, stats["low"].sum(), stats["high"].sum()]).double()
            self.sums = self.sums.to(part.device) + part

    def flush(self, step):
        sums = self.accelerator.reduce(self.sums.to(self.accelerator.device), reduction="sum").cpu()
        tokens = max(sums[0].item(), 1)
        steps = self.steps or [self.last]  # a later pass over the same answers: their rollout metrics again
        record = {k: sum(s[k] for s in steps) / len(steps) for k in steps[-1]}
        record.update(
            {
                "kl": sums[1].item() / tokens,
                "entropy": sums[2].item() / tokens,
                "clip_ratio/low_mean": sums[3].item() / tokens,
                "clip_ratio/high_mean": sums[4].item() / tokens,
                "clip_ratio/region_mean": (sums[3] + sums[4]).item() / tokens,
            }
        )
        self.steps, self.sums = [], torch.zeros_like(self.sums)
        return record


def show_completions(accelerator, records, step):
    """The logged step's answers as a table in TensorBoard's text tab (--with_tracking, its tracker)."""
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            rows = [
                f"| {json.dumps(r['prompt'])[:200]} | {json.dumps(r['completion'])[:400]} | {r['reward']:.3f} | "
                f"{r['advantage']:.3f} |"
                for r in records
            ]
            table = "\n".join(["| prompt | completion | reward | advantage |", "|---|---|---|---|", *rows])
            tracker.tracker.add_text("completions", table, step)  # its SummaryWriter


def write_completions(args, step, rows, data, completions, rewards, table, advantages, funcs, tokenizer):
    """The step's prompts, answers, rewards and advantages, one line per answer, to OUTPUT_DIR/completions.jsonl;
    returns the records."""
    records = []
    with open(os.path.join(args.output_dir, "completions.jsonl"), "a") as f:
        for i, ids in enumerate(completions):
            row = rows[i // args.num_generations]
            prompt = data["train"]["columns"][args.prompt_column][row]
            record = {
                "step": step,
                "prompt": prompt,
                "completion": tokenizer.decode(ids, skip_special_tokens=True),
                "reward": rewards[i].item(),
                "advantage": advantages[i].item(),
            }
            record.update({name: table[i, k].item() for k, (name, _) in enumerate(funcs)})
            f.write(json.dumps(record) + "\n")
            records.append(record)
    return records


def answer(args):
    """--prompt: greedy answers of the trained model, --max_completion_length tokens at most."""
    args.max_new_tokens, args.temperature, args.top_k = args.max_completion_length, 0.0, 1
    generate(args, "train/grpo.py", chat="conversational")


if __name__ == "__main__":
    arguments = parse_args()
    run(answer if arguments.prompt else main, arguments)
