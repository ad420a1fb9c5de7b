"""Fine-tune a causal language model on your prompt/response pairs or chat conversations (supervised
fine-tuning), with Hugging Face Accelerate.

    make train-sft         # the GPT of make train-lm taught to define words (GCIDE, offline), 2 CPU processes
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml train/sft.py \
        --model_name_or_path MODEL_DIR --train_file pairs.jsonl --output_dir runs/my_sft [--lora_r 16] [--packing]
    python train/sft.py --output_dir runs/my_sft --prompt "Define: serendipity\\n"

Any AutoModelForCausalLM, a local folder (train/lm.py's output is one) or a Hub id, with its own
tokenizer; your files or a dataset (--dataset_name). Columns `prompt` and `response` (--prompt_column,
--response_column), as text or with --apply_chat_template as a user turn and the assistant's turn, or
--messages_column with chat turns; turns are rendered by the tokenizer's chat template (or
--chat_template_path's) and each assistant turn is scored up to its end-of-turn token. Each example is
tokenized whole and only the response's tokens are scored. Tokenized once into
runs/tokens (data/prompt_response.py) and read through the exactly-once sharded path.

The loss of one optimizer step is the sum over every response token of every micro-batch on every
process, divided by the number of those tokens, counted before the first backward pass from the
data plan (no communication): 1 process with batch 8 and 2 processes with batch 2 x 2 accumulation
steps take the same step. Validation loss and perplexity are per response token over exactly the
validation set. OUTPUT_DIR is a Hugging Face folder in the source checkpoint's dtype (with --lora_r:
the merged model, and adapter/).

With --reward_funcs, each evaluation also answers every validation prompt greedily (--max_new_tokens)
and scores the answers with those functions, called as TRL calls reward functions (the validation
rows' other columns, the response's included, by name): eval_reward and eval_rewards/NAME/mean, exact
over the validation set on any process count; the answers go to OUTPUT_DIR/eval_completions.jsonl.
"""

import os
import sys

if __package__ in (None, ""):  # run as a file: Python put train/ on sys.path, not the repo root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import datasets
import torch

from data.errors import fail
from data.loader import sharded_loader
from data.prompt_response import LONG_EXAMPLES, CausalBatch, prepare_prompt_response, validation_prompts
from data.sources import DatasetsSource
from train.core.accelerator import main_process_first
from train.core.answers import (
    Scoring,
    add_reward_args,
    answering,
    keep_until,
    read_validation_prompts,
    reward_metrics,
)
from train.core.evaluation import evaluate_responses
from train.core.flags import add_data_files_args, add_tokenized_data_args, data_inputs, make_parser
from train.core.loop import TrainingLoop
from train.core.parser import true_or_false
from train.core.rewards import load_reward_funcs, reward_weights
from train.core.run import run
from train.models.causal_lm import (
    add_causal_lm_args,
    check_training_inputs,
    describe_model,
    load_causal_lm,
    max_positions,
    model_saver,
    response_logits,
    start_causal_lm,
    takes_logits_to_keep,
    template_note,
)
from train.models.generation import generate
from train.models.gpt import next_token_loss
from train.models.trainable import adamw

TASK = "sft"  # the run's name in its checkpoints: another task's checkpoint is refused
METRICS = ["eval_loss", "eval_perplexity"]  # its evaluation's metrics, the headline first
MAX_LENGTH = 1024  # the default --max_seq_length's cap


def parse_args(argv=None):
    parser = make_parser(__doc__)
    data = parser.groups["data"]
    add_data_files_args(
        parser,
        "Examples: jsonl, json, csv or parquet, or a datasets folder written by save_to_disk.",
        split_percentage=10,
        dataset_name=True,
    )
    data.add_argument("--prompt_column", default="prompt", help="The prompt column: context, never scored.")
    data.add_argument("--response_column", default="response", help="The response column: what the model learns.")
    data.add_argument(
        "--messages_column",
        default=None,
        help="Instead: a column of chat turns [{role, content}], "
        "rendered with the tokenizer's chat template; every assistant turn is learned.",
    )
    add_tokenized_data_args(parser, "example", MAX_LENGTH, LONG_EXAMPLES)
    data.add_argument(
        "--packing",
        type=true_or_false,
        nargs="?",
        const=True,
        default=False,
        help="Several examples per row, attention kept inside each (models that read packed rows "
        "from position_ids; checked at start). (default: false)",
    )
    add_causal_lm_args(
        parser,
        "A Hugging Face causal language model",
        "Evaluate the model before the first step too (a fresh run): the validation loss fine-tuning starts from.",
        train_batch_size=8,
        eval_batch_size=8,
        disable_dropout=False,  # TRL's SFTTrainer keeps it too: a regularizer, and no reference to match
    )
    add_reward_args(parser)
    parser.set_defaults(output_dir="runs/sft")
    args = parser.parse_args(argv)
    if args.prompt is None:
        check_training_inputs(parser, args, full_rate=2e-5, lora_rate=1e-3)
    return args


def check_packing(model, vocab_size):
    """--packing: one line and exit 1 unless the model gives two examples packed in one row (position_ids
    restarting at 0, no attention mask) the logits it gives each alone."""
    a, b = torch.arange(3) % vocab_size, (torch.arange(4) + 5) % vocab_size
    model.eval()
    try:
        with torch.no_grad():
            packed = model(
                input_ids=torch.cat([a, b])[None], position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3]]), use_cache=False
            ).logits[0, 3:]
            alone = model(input_ids=b[None], use_cache=False).logits[0]
        tolerance = 1e-4 if packed.dtype == torch.float32 else 3e-2  # a frozen bfloat16 base computes in it
        apart = torch.allclose(packed, alone, atol=tolerance, rtol=tolerance)
    except (TypeError, ValueError, RuntimeError):
        apart = False
    if not apart:
        fail(
            f"--packing: {type(model).__name__} does not keep packed examples apart (its attention reaches from one "
            "example into the one before it); train without --packing"
        )


def main(args):
    funcs = load_reward_funcs(args.reward_funcs) if args.reward_funcs else []  # before anything is written
    weights = reward_weights(funcs, args.reward_weights)
    accelerator, folder, config, tokenizer = start_causal_lm(args, TASK, MAX_LENGTH)  # and args.max_seq_length

    # ---------------------------------------------------------------- data: tokenized once, then sharded
    columns = (
        {"messages": args.messages_column}
        if args.messages_column
        else {"prompt": args.prompt_column, "response": args.response_column}
    )
    tokens, info = main_process_first(
        accelerator,
        lambda: prepare_prompt_response(
            data_inputs(args),
            folder,
            tokenizer,
            columns,
            args.max_seq_length,
            args.long_examples,
            args.packing,
            args.cache_dir,
            args.apply_chat_template,
        ),
        share=True,
    )
    counts = info["splits"]
    one_batch = args.per_device_train_batch_size * accelerator.num_processes
    if counts["train"]["rows"] < one_batch:  # the same on every rank: every one stops here
        fail(
            f"the training data makes {counts['train']['rows']} row(s){' once packed' if args.packing else ''}, fewer "
            f"than one batch of {one_batch} (--per_device_train_batch_size x {accelerator.num_processes} processes); "
            "pass a smaller --per_device_train_batch_size"
        )
    splits = {split: datasets.load_from_disk(os.path.join(tokens, split)) for split in ("train", "validation")}
    loaders = {
        split: sharded_loader(
            DatasetsSource(ds, transform=CausalBatch(tokenizer.pad_token_id, args.max_seq_length)),
            args.per_device_train_batch_size if split == "train" else args.per_device_eval_batch_size,
            rank=accelerator.process_index,
            world_size=accelerator.num_processes,
            device=accelerator.device,
            seed=args.seed,
            train=split == "train",
            num_workers=args.dataloader_num_workers,
            lengths=list(ds["length"]) if split == "validation" or args.group_by_length else None,
            # each batch carries its optimizer step's count of response tokens over every rank and micro-batch
            weights=list(ds["targets"]) if split == "train" else None,
            accumulation_steps=args.gradient_accumulation_steps,
        )
        for split, ds in splits.items()
    }
    accelerator.print(
        f"data: {tokens}: "
        + "; ".join(
            (s if s == "train" else f"validation ({info['validation']})")
            + f" {c['examples']:,} examples, {c['targets']:,} response tokens"
            + (f", {c['cut']:,} cut" if c["cut"] else "")
            + (f", {c['dropped']:,} dropped" if c["dropped"] else "")
            for s, c in counts.items()
        )
        + f"; max_seq_length {args.max_seq_length}; "
        + (
            f"packed into {counts['train']['rows']:,} rows, {counts['train']['filled']:.0%} filled"
            if args.packing
            else f"{counts['train']['tokens'] / counts['train']['rows']:.0f} tokens per example"
        )
        + template_note(tokenizer, info["chat_template"])
    )
    asked = None  # --reward_funcs: the validation prompts, answered at each evaluation
    if funcs:
        limit = max_positions(config, tokenizer, 1 << 20)
        asked = read_validation_prompts(
            accelerator,
            args,
            lambda room: validation_prompts(data_inputs(args), tokenizer, columns, room, args.apply_chat_template),
            limit,
            Scoring(funcs, weights),
        )

    # ---------------------------------------------------------------- model
    packing = (lambda m: check_packing(m, config.vocab_size)) if args.packing else None
    model = load_causal_lm(args, accelerator, folder, tokenizer, check=packing)  # LoRA, float32 master weights
    trainable, total = describe_model(accelerator, model, args)
    optimizer = adamw(model, args.learning_rate, args.weight_decay)  # decay on weight matrices only
    model, optimizer = accelerator.prepare(model, optimizer)  # the loaders are sharded already
    policy = accelerator.unwrap_model(model)  # answers come from the model itself, not its DDP wrapper

    # ---------------------------------------------------------------- train
    trim = takes_logits_to_keep(policy)  # the output layer only from the batch's first response token

    def logits(batch):
        return response_logits(model, batch, trim)

    # accelerate divides each micro-batch's loss by the accumulation steps and DDP averages over processes:
    # this factor undoes both, so the step's gradient is that of (sum of token losses) / (step's tokens)
    scale = accelerator.num_processes * args.gradient_accumulation_steps
    scoring = Scoring(funcs, weights, os.path.join(args.output_dir, "eval_completions.jsonl"))  # the answers
    chunk = args.per_device_eval_batch_size
    answer = answering(accelerator, policy, tokenizer, asked, scoring, args.max_new_tokens, chunk)

    def evaluate():
        return evaluate_responses(accelerator, model, loaders["validation"], logits) | answer(loop.step)

    loop = TrainingLoop(
        accelerator,
        args,
        TASK,
        model,
        optimizer,
        loaders["train"],
        headline=METRICS[0],
        metrics=METRICS + reward_metrics(funcs),
        evaluate=evaluate,
    )
    if accelerator.is_main_process:  # a resumed run answers the steps after its checkpoint again
        keep_until(scoring.path, loop.step)
    before = {}
    if args.eval_on_start and loop.step == 0:
        before = {k: v for k, v in evaluate().items() if k not in ("eval_tokens", "eval_samples")}
        if accelerator.is_main_process:  # above the progress bar, as the loop's own evaluation lines
            loop.progress.write("before fine-tuning: " + " ".join(f"{k}={v:.4f}" for k, v in before.items()))
    for batch in loop.batches():
        with accelerator.accumulate(model):
            scored = logits(batch)
            nats = next_token_loss(scored, batch["labels"][:, -scored.shape[1] :], reduction="sum")
            loss = nats * (scale / batch["step_weight"]).float()
            accelerator.backward(loss)
            if accelerator.sync_gradients and args.max_grad_norm > 0:
                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        loop.after_batch(loss)

    train = counts["train"]
    tokens_per_second = loop.samples_per_second() * train["tokens"] / train["rows"]  # text tokens, not padding
    return loop.finish(
        {
            "trainable_parameters": trainable,
            "parameters": total,
            "train_examples": train["examples"],
            "train_tokens_per_second": tokens_per_second,
            **{f"{k}_before": v for k, v in before.items()},
        },
        save_model=model_saver(args, config, tokenizer),
    )


if __name__ == "__main__":
    arguments = parse_args()
    run(
        (lambda a: generate(a, "train/sft.py", chat=("messages_column", "apply_chat_template")))
        if arguments.prompt
        else main,
        arguments,
    )
