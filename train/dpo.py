"""Tune a causal language model on preference pairs (Direct Preference Optimization and its relatives),
with Hugging Face Accelerate: the step after supervised fine-tuning.

    make train-dpo         # make train-sft's model taught to prefer GCIDE's own definitions (offline), 2 CPU processes
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml train/dpo.py \\
        --model_name_or_path SFT_OUTPUT --train_file pairs.jsonl --output_dir runs/my_dpo [--lora_r 16]
    python train/dpo.py --output_dir runs/my_dpo --prompt "Define: serendipity\\n"

Any AutoModelForCausalLM, a folder (sft.py's output) or a Hub id; pairs of a prompt and two responses,
the chosen and the rejected, as string columns (with --apply_chat_template: a user turn and the
assistant's) or conversations (data/preferences.py), from files or --dataset_name. Each side is
tokenized whole and its response tokens scored, as sft.py does. With --reward_funcs each evaluation
also answers the validation prompts greedily and scores the answers, as sft.py does.

With log p(y|x) the sum of the log-probabilities of a response's tokens, the policy's and the
reference's, the implicit reward of a response is r = beta * (log p(y|x) - log p_ref(y|x)), and with
d = (r_chosen - r_rejected) / beta the loss of a pair is
    sigmoid (DPO):  -(1 - e) log s(beta d) - e log s(-beta d)   (e: --label_smoothing, conservative DPO)
    robust:         (-(1 - e) log s(beta d) + e log s(-beta d)) / (1 - 2e)   (robust DPO, e < 0.5)
    ipo:            (d' - 1 / (2 beta))^2, d' the same with each side's log-ratio divided by its token count
    hinge:          max(0, 1 - beta d)
    sft:            -log p(y_chosen|x) / its token count   (beside another: RPO, --loss_type sigmoid sft)
Several --loss_type are summed with --loss_weights (TRL's names). The sft term is each pair's own per-token
mean, so a pair weighs the same on any layout (TRL takes the mean over a micro-batch's chosen tokens).
The reference is the model at the start: its log-probabilities of every pair are computed once before
training by the model prepared as it trains (its dtype, autocast, FSDP2's sharding), in eval mode and
in evaluation's own batches, so before any step every reward is exactly 0; they are kept beside the
tokenized data and found again by a resume or a rerun, so training holds one model. With --lora_r the
reference is the model with its adapters off, in eval mode, computed in the step. Dropout is off
(--disable_dropout, TRL's default for DPO), so the policy trains as the reference computes.

The loss of one optimizer step is the mean over its pairs on every process and micro-batch, counted
from the data plan before the first backward (no communication): 1 process with batch 8, 2 with 4,
and 2 with 2 x 2 accumulation steps take the same step. Evaluation reports TRL's metrics, exact over
the validation pairs for any process count: rewards/chosen, rewards/rejected, rewards/accuracies (the
share of pairs whose chosen reward is the higher), rewards/margins, logps/chosen, logps/rejected, loss.
"""

import hashlib
import json
import os
import sys
import tempfile

if __package__ in (None, ""):  # run as a file: Python put train/ on sys.path, not the repo root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import datasets
import numpy as np
import torch
import torch.nn.functional as F

from data.errors import fail
from data.loader import sharded_loader
from data.preferences import LONG_EXAMPLES, SIDES, PairBatch, prepare_preferences
from data.prompt_response import validation_prompts
from data.sharding import ShardedIterableDataset
from data.sources import DatasetsSource
from train.core.accelerator import gather_patiently, main_process_first
from train.core.answers import (
    Scoring,
    add_reward_args,
    answering,
    keep_until,
    read_validation_prompts,
    reward_metrics,
)
from train.core.evaluation import evaluate_rows
from train.core.flags import add_data_files_args, add_tokenized_data_args, data_inputs, make_parser
from train.core.loop import TrainingLoop
from train.core.parser import fraction, positive_float
from train.core.rewards import load_reward_funcs, reward_weights
from train.core.run import run
from train.core.tracking import readable_by_others
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

TASK = "dpo"  # the run's name in its checkpoints: another task's checkpoint is refused
# its evaluation's metrics (TRL's names), the headline first
METRICS = [
    "eval_loss",
    "eval_rewards/accuracies",
    "eval_rewards/margins",
    "eval_rewards/chosen",
    "eval_rewards/rejected",
    "eval_logps/chosen",
    "eval_logps/rejected",
]
LOSS_TYPES = ("sigmoid", "robust", "ipo", "hinge", "sft")
MAX_LENGTH = 1024  # the default --max_seq_length's cap


def parse_args(argv=None):
    parser = make_parser(__doc__)
    data = parser.groups["data"]
    add_data_files_args(
        parser,
        "Preference pairs: jsonl, json, csv or parquet, or a datasets folder written by save_to_disk.",
        split_percentage=10,
        dataset_name=True,
    )
    data.add_argument(
        "--prompt_column",
        default="prompt",
        help="The prompt: text, or conversation turns (without it, conversations' shared first turns are the prompt).",
    )
    data.add_argument("--chosen_column", default="chosen", help="The preferred response: text, or assistant turns.")
    data.add_argument("--rejected_column", default="rejected", help="The other response: text, or assistant turns.")
    add_tokenized_data_args(parser, "side of a pair", MAX_LENGTH, LONG_EXAMPLES)
    add_causal_lm_args(
        parser,
        "A Hugging Face causal language model (train/sft.py's output, say)",
        "Evaluate the model before the first step too (a fresh run): the log-probabilities tuning starts from, "
        "every reward 0.",
        train_batch_size=8,
        eval_batch_size=8,
        disable_dropout=True,
    )
    model = parser.groups["model"]
    model.add_argument(
        "--loss_type",
        choices=LOSS_TYPES,
        nargs="+",
        default=["sigmoid"],
        help="The preference loss, or several summed with --loss_weights (TRL's names; sigmoid sft: RPO, DPO "
        "plus the chosen response's likelihood). The module docstring has each formula.",
    )
    model.add_argument(
        "--loss_weights",
        type=float,
        nargs="+",
        default=None,
        help="One weight per --loss_type (default 1 each).",
    )
    model.add_argument(
        "--beta",
        type=positive_float,
        default=0.1,
        help="How far from the reference the rewards may pull (ipo: its regularization tau).",
    )
    model.add_argument(
        "--label_smoothing",
        type=fraction,
        default=0.0,
        help="The share of pairs taken as flipped, below 0.5: conservative DPO (sigmoid) or robust DPO (robust); "
        "ipo and hinge take none.",
    )
    add_reward_args(parser)
    parser.set_defaults(output_dir="runs/dpo")
    parser.recorded.add("conversational")  # derived in main() and recorded in args.json, which reruns a run
    args = parser.parse_args(argv)
    if args.prompt is None:
        check_training_inputs(parser, args, full_rate=1e-6, lora_rate=5e-5)  # TRL's default for a whole model
        smoothless = [t for t in args.loss_type if t in ("ipo", "hinge")]
        if args.label_smoothing and smoothless:
            parser.error(
                f"--label_smoothing {args.label_smoothing}: the {smoothless[0]} loss has no label smoothing (sigmoid "
                "and robust have); leave it out"
            )
        if args.loss_weights is not None and len(args.loss_weights) != len(args.loss_type):
            parser.error(
                f"--loss_weights has {len(args.loss_weights)} value(s) for {len(args.loss_type)} --loss_type(s) "
                f"({' '.join(args.loss_type)}); pass one weight per loss"
            )
        if args.loss_type == ["sft"]:
            parser.error("--loss_type sft alone learns no preference; pass it beside one that does (sigmoid sft)")
        if args.label_smoothing >= 0.5:  # (1 - e) log s(beta d) + e log s(-beta d) prefers the rejected side then
            parser.error(
                f"--label_smoothing {args.label_smoothing}: a share of flipped pairs of 0.5 or more turns the "
                "preference around; pass less than 0.5"
            )
    return args


# ---------------------------------------------------------------------------------------------- the loss


def sequence_logps(logits, labels):
    """Per row: the sum of the log-probabilities of its scored tokens (labels not -100), in float32."""
    return -next_token_loss(logits, labels, reduction="none").view(labels.shape).sum(-1)


def preference_loss(logps, ref_logps, targets, loss_type, beta, label_smoothing=0.0, loss_weights=None):
    """Per pair: (loss, chosen reward, rejected reward). `logps`, `ref_logps`, `targets` (scored tokens):
    one value per row of a PairBatch, the chosen sides then the rejected ones. `loss_type`: a name, or
    several whose losses are summed with `loss_weights` (default 1 each)."""
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    chosen_ratio, rejected_ratio = (logps - ref_logps).chunk(2)
    d = chosen_ratio - rejected_ratio
    e = label_smoothing
    losses = 0
    for name, weight in zip(types, loss_weights or [1.0] * len(types), strict=True):
        if name == "sigmoid":
            loss = -(1 - e) * F.logsigmoid(beta * d) - e * F.logsigmoid(-beta * d)
        elif name == "robust":
            loss = (-(1 - e) * F.logsigmoid(beta * d) + e * F.logsigmoid(-beta * d)) / (1 - 2 * e)
        elif name == "ipo":  # per token, as TRL does (and the IPO authors confirmed to it)
            chosen_tokens, rejected_tokens = targets.clamp(min=1).chunk(2)
            loss = (chosen_ratio / chosen_tokens - rejected_ratio / rejected_tokens - 1 / (2 * beta)) ** 2
        elif name == "hinge":
            loss = torch.relu(1 - beta * d)
        elif name == "sft":  # the chosen response's negative log-likelihood per token, each pair's own
            loss = -logps.chunk(2)[0] / targets.chunk(2)[0].clamp(min=1)
        else:
            raise ValueError(f"loss_type {name!r}: one of {', '.join(LOSS_TYPES)}")
        losses = losses + weight * loss
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def pair_metrics(logps, ref_logps, targets, loss_type, beta, label_smoothing, loss_weights=None):
    """Per pair, TRL's metrics (and the loss), for evaluate_rows' exact means."""
    losses, chosen, rejected = preference_loss(
        logps, ref_logps, targets, loss_type, beta, label_smoothing, loss_weights
    )
    chosen_logps, rejected_logps = logps.detach().chunk(2)
    return {
        "loss": losses,
        "rewards/chosen": chosen,
        "rewards/rejected": rejected,
        "rewards/accuracies": chosen > rejected,
        "rewards/margins": chosen - rejected,
        "logps/chosen": chosen_logps,
        "logps/rejected": rejected_logps,
    }


# ---------------------------------------------------------------------------------------------- the reference


def reference_key(args, accelerator, model, tokenizer):
    """What the reference's log-probabilities depend on besides the tokens (the folder they are kept
    in): the model, the precision it computes in (the dtype asked, its weights' dtypes as they train,
    autocast, FSDP2's bf16 compute), dropout, the batches' shapes, and the libraries' kernels."""
    import transformers
    from accelerate.utils import DistributedType

    return {
        "model": args.model_fingerprint,
        "torch_dtype": args.torch_dtype,
        "weights": "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})),
        "mixed_precision": accelerator.mixed_precision,
        "sharded": accelerator.distributed_type == DistributedType.FSDP or accelerator.cpu_fsdp2 is not None,
        "disable_dropout": args.disable_dropout,
        "batch_size": args.per_device_eval_batch_size,
        "padding": f"data/padding.py buckets, pad {tokenizer.pad_token_id}, evaluation's plan",
        "versions": [torch.__version__, transformers.__version__],
    }


def with_reference(accelerator, model, logps_of, splits, folder, key, batch_size, collate):
    """`splits` with the columns ref_chosen and ref_rejected: the log-probabilities of each side of each
    pair that `logps_of(batch)` gives now, with `model` as it starts, prepared as it trains (its
    weights' dtype, autocast, FSDP2's bf16 compute) and in eval mode, without gradient. They are
    computed once and kept in FOLDER/reference-HASH.npz (HASH of `key`: what changes the values),
    where a resume or a rerun finds them. Each split is read as evaluation reads it: the pairs sorted
    by length, cut into batches of `batch_size` (the plan of data/sharding.py, the same batches for
    any process count, padded by `collate` the same way), every process as many batches (FSDP2's
    forward needs them all), so before any step evaluation computes the policy's log-probabilities
    of the validation pairs in the same shapes, bit for bit these: every reward is 0."""
    from accelerate.utils import broadcast_object_list, send_to_device

    path = os.path.join(folder, f"reference-{hashlib.blake2b(json.dumps(key).encode(), digest_size=8).hexdigest()}.npz")
    found = [os.path.isfile(path)]
    if accelerator.num_processes > 1:
        found = broadcast_object_list(found)  # the main process's look: every rank takes one path
    if found[0]:
        stored = np.load(path)
        accelerator.print(f"reference: log-probabilities of every pair found in {path}")
    else:
        stored, rank, world = {}, accelerator.process_index, accelerator.num_processes
        was_training = model.training
        model.eval()
        with torch.no_grad():
            for split, ds in splits.items():
                batches = ShardedIterableDataset(
                    DatasetsSource(ds, transform=collate),
                    batch_size * world,
                    rank=rank,
                    world_size=world,
                    shuffle=False,
                    policy="pad",
                    lengths=list(ds["length"]),
                )
                values = {}
                for batch in batches:
                    chosen, rejected = logps_of(send_to_device(batch, accelerator.device)).cpu().chunk(2)
                    ids, valid = batch["index"].tolist(), batch["valid"].tolist()
                    # the padding plan's repeats (valid False) are computed, as every rank must, and left out
                    rows = zip(ids, valid, chosen.tolist(), rejected.tolist(), strict=True)
                    values.update({i: (c, r) for i, ok, c, r in rows if ok})
                merged = {i: v for part in gather_patiently(accelerator, values) for i, v in part.items()}
                for k, side in enumerate(SIDES):
                    stored[f"{split}_{side}"] = np.array([merged[i][k] for i in range(len(ds))], dtype=np.float32)
        model.train(was_training)

        autocast = "no autocast" if key["mixed_precision"] == "no" else f"{key['mixed_precision']} autocast"
        how = ", ".join([f"weights {key['weights']}", autocast, *(["FSDP2"] if key["sharded"] else []), "eval mode"])
        if accelerator.is_main_process:  # whole or not at all; another run may write the same file at once
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".reference-")
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **stored)
                f.flush()
                os.fsync(f.fileno())
            readable_by_others(tmp)  # mkstemp's file is its owner's alone
            os.replace(tmp, path)
        accelerator.print(
            f"reference: log-probabilities of {', '.join(f'{len(ds):,} {s}' for s, ds in splits.items())} "
            f"pairs computed once, as the policy computes them before any step ({how}) -> {path}"
        )
    return {
        split: ds.add_column("ref_chosen", stored[f"{split}_chosen"].tolist()).add_column(
            "ref_rejected", stored[f"{split}_rejected"].tolist()
        )
        for split, ds in splits.items()
    }


# ---------------------------------------------------------------------------------------------- the run


def main(args):
    funcs = load_reward_funcs(args.reward_funcs) if args.reward_funcs else []  # before anything is written
    weights = reward_weights(funcs, args.reward_weights)
    accelerator, folder, config, tokenizer = start_causal_lm(args, TASK, MAX_LENGTH)  # and args.max_seq_length

    # ---------------------------------------------------------------- data: tokenized once, then sharded
    columns = {"prompt": args.prompt_column, "chosen": args.chosen_column, "rejected": args.rejected_column}
    tokens, info = main_process_first(
        accelerator,
        lambda: prepare_preferences(
            data_inputs(args),
            folder,
            tokenizer,
            columns,
            args.max_seq_length,
            args.long_examples,
            args.cache_dir,
            args.apply_chat_template,
        ),
        share=True,
    )
    args.conversational = info["conversational"]  # --prompt then sends a user turn
    counts = info["splits"]
    one_batch = args.per_device_train_batch_size * accelerator.num_processes
    if counts["train"]["rows"] < one_batch:  # the same on every rank: every one stops here
        fail(
            f"the training data makes {counts['train']['rows']} pair(s), fewer than one batch of {one_batch} "
            f"(--per_device_train_batch_size x {accelerator.num_processes} processes); pass a smaller "
            "--per_device_train_batch_size"
        )
    accelerator.print(
        f"data: {tokens}: "
        + "; ".join(
            f"{s if s == 'train' else 'validation (' + info['validation'] + ')'} {c['rows']:,} pairs, {c['tokens']:,} "
            "tokens"
            + (f", {c['cut']:,} cut" if c["cut"] else "")
            + (f", {c['dropped']:,} dropped" if c["dropped"] else "")
            + (f", {c['long_prompts']:,} left out (the prompt alone fills max_seq_length)" if c["long_prompts"] else "")
            + (f", {c['same']:,} left out (chosen = rejected)" if c["same"] else "")
            for s, c in counts.items()
        )
        + f"; max_seq_length {args.max_seq_length}"
        + template_note(tokenizer, info["conversational"])
    )
    asked = None  # --reward_funcs: the validation prompts, answered at each evaluation
    if funcs:
        asked = read_validation_prompts(
            accelerator,
            args,
            lambda room: validation_prompts(
                data_inputs(args), tokenizer, columns | {"messages": args.chosen_column}, room, args.apply_chat_template
            ),
            max_positions(config, tokenizer, 1 << 20),
            Scoring(funcs, weights),
        )

    # ---------------------------------------------------------------- model
    model = load_causal_lm(
        args, accelerator, folder, tokenizer
    )  # with --lora_r the pretrained model, frozen, is the reference
    loss_weights = args.loss_weights or [1.0] * len(args.loss_type)
    trainable, total = describe_model(
        accelerator,
        model,
        args,
        f"; {' + '.join(f'{w:g} x {t}' if w != 1 else t for t, w in zip(args.loss_type, loss_weights, strict=True))} "
        f"loss, beta {args.beta}"
        + (f", label smoothing {args.label_smoothing}" if args.label_smoothing else "")
        + ("" if args.disable_dropout else "; the reference is taken without dropout, so the rewards start off 0"),
    )
    optimizer = adamw(model, args.learning_rate, args.weight_decay)  # decay on weight matrices only
    model, optimizer = accelerator.prepare(model, optimizer)  # the loaders are sharded already
    policy = accelerator.unwrap_model(model)  # answers come from the model itself, not its DDP wrapper

    trim = takes_logits_to_keep(policy)  # the output layer only from the batch's first response token

    def logps_of(batch):
        logits = response_logits(model, batch, trim)
        return sequence_logps(logits, batch["labels"][:, -logits.shape[1] :])

    # ---------------------------------------------------------------- the reference, then the loaders
    splits = {split: datasets.load_from_disk(os.path.join(tokens, split)) for split in ("train", "validation")}
    collate = PairBatch(tokenizer.pad_token_id, args.max_seq_length)
    if not args.lora_r:  # the reference is the model as it starts, as it computes in training: once, before any step
        splits = with_reference(
            accelerator,
            model,
            logps_of,
            splits,
            tokens,
            reference_key(args, accelerator, model, tokenizer),
            args.per_device_eval_batch_size,
            collate,
        )
    loaders = {
        split: sharded_loader(
            DatasetsSource(ds, transform=collate),
            args.per_device_train_batch_size if split == "train" else args.per_device_eval_batch_size,
            rank=accelerator.process_index,
            world_size=accelerator.num_processes,
            device=accelerator.device,
            seed=args.seed,
            train=split == "train",
            num_workers=args.dataloader_num_workers,
            lengths=list(ds["length"]) if split == "validation" or args.group_by_length else None,
            # each batch carries its optimizer step's count of pairs over every rank and micro-batch
            weights=[1] * len(ds) if split == "train" else None,
            accumulation_steps=args.gradient_accumulation_steps,
        )
        for split, ds in splits.items()
    }

    # ---------------------------------------------------------------- train
    def reference(batch):
        if not args.lora_r:
            return torch.cat([batch["ref_chosen"], batch["ref_rejected"]])
        was_training = model.training
        model.eval()  # no dropout in the reference
        with torch.no_grad(), accelerator.unwrap_model(model).disable_adapter():
            ref = logps_of(batch)
        model.train(was_training)
        return ref

    def per_pair(batch):
        return pair_metrics(
            logps_of(batch),
            reference(batch),
            batch["targets"],
            args.loss_type,
            args.beta,
            args.label_smoothing,
            args.loss_weights,
        )

    # accelerate divides each micro-batch's loss by the accumulation steps and DDP averages over processes:
    # this factor undoes both, so the step's gradient is that of (sum of pair losses) / (step's pairs)
    scale = accelerator.num_processes * args.gradient_accumulation_steps
    scoring = Scoring(funcs, weights, os.path.join(args.output_dir, "eval_completions.jsonl"))  # the answers
    chunk = args.per_device_eval_batch_size
    answer = answering(accelerator, policy, tokenizer, asked, scoring, args.max_new_tokens, chunk)

    def evaluate():
        return evaluate_rows(accelerator, model, loaders["validation"], per_pair) | answer(loop.step)

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
        before = evaluate()
        if accelerator.is_main_process:  # above the progress bar, as the loop's own evaluation lines
            loop.progress.write(
                "before tuning: " + " ".join(f"{k}={v:.4f}" for k, v in before.items() if isinstance(v, float))
            )
    for batch in loop.batches():
        with accelerator.accumulate(model):
            ref = reference(batch)
            losses, _, _ = preference_loss(
                logps_of(batch),
                ref,
                batch["targets"],
                args.loss_type,
                args.beta,
                args.label_smoothing,
                args.loss_weights,
            )
            loss = losses.sum() * (scale / batch["step_weight"]).float()
            accelerator.backward(loss)
            if accelerator.sync_gradients and args.max_grad_norm > 0:
                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        loop.after_batch(loss)

    return loop.finish(
        {
            "trainable_parameters": trainable,
            "parameters": total,
            "train_pairs": counts["train"]["rows"],
            "train_pairs_per_second": loop.samples_per_second(),
            **{f"{k}_before": v for k, v in before.items() if k not in ("eval_samples", "eval_tokens")},
        },
        save_model=model_saver(args, config, tokenizer),
    )


if __name__ == "__main__":
    arguments = parse_args()
    run((lambda a: generate(a, "train/dpo.py", chat="conversational")) if arguments.prompt else main, arguments)
