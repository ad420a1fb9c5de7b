"""The flags several train/ scripts share, named as in transformers' run_*_no_trainer.py scripts:
make_parser's common ones (epochs, steps, checkpoints, tracking, hardware) and the groups a script adds
(optimizer, data files, tokenized data, generation), with what turns their values into what data/ and
the loop take. The parser itself and the value types are train/core/parser.py."""

import os

from train.core.parser import (
    Parser,
    fraction,
    json_object,
    non_negative_float,
    positive_float,
    positive_int,
    steps_or_epoch,
    true_or_false,
)
from train.core.schedule import SCHEDULES


def make_parser(doc):
    """The parser of a script in train/, with the flags every script shares, named as in
    transformers' run_*_no_trainer.py scripts; the script adds its own to `parser.groups`."""
    parser = Parser(doc)
    g = parser.groups
    g["optimization"].add_argument(
        "--num_train_epochs", type=positive_int, default=3, help="Passes over the training data."
    )
    g["optimization"].add_argument(
        "--max_train_steps",
        type=positive_int,
        default=None,
        help="Optimizer steps to run; overrides --num_train_epochs when set.",
    )
    g["optimization"].add_argument(
        "--gradient_accumulation_steps", type=positive_int, default=1, help="Micro-batches per optimizer step."
    )
    g["optimization"].add_argument("--seed", type=int, default=42, help="Seed for weights, shuffling and dropout.")
    g["optimization"].add_argument(
        "--global_batch_size",
        type=positive_int,
        default=None,
        help="Samples per optimizer "
        "step on any process count: sets --per_device_train_batch_size to it / (processes x "
        "accumulation), so a resume on fewer nodes takes the same steps.",
    )
    g["checkpoints"].add_argument(
        "--output_dir", type=str, default=None, help="Where weights, metrics and checkpoints go."
    )
    g["checkpoints"].add_argument(
        "--overwrite_output_dir",
        action="store_true",
        help="Replace a run already in --output_dir (its checkpoints are deleted).",
    )
    g["tracking"].add_argument(
        "--eval_steps",
        type=positive_int,
        default=None,
        help="Also evaluate every N optimizer steps (for runs shorter than an epoch).",
    )
    g["checkpoints"].add_argument(
        "--checkpointing_steps",
        type=steps_or_epoch,
        default=None,
        help="Save a checkpoint every N optimizer steps, or 'epoch' at each epoch's end.",
    )
    g["checkpoints"].add_argument(
        "--resume_from_checkpoint",
        type=str,
        default=None,
        help="A checkpoint folder (OUTPUT_DIR/checkpoints/step_00000040, say) or 'latest': the newest "
        "complete one in --output_dir, or a fresh start if there is none yet.",
    )
    g["checkpoints"].add_argument(
        "--checkpoints_total_limit", type=positive_int, default=None, help="Keep only the newest N checkpoints."
    )
    g["checkpoints"].add_argument(
        "--checkpoint_format",
        choices=["auto", "sharded", "full"],
        default="auto",
        help="sharded: each process writes its own part (torch.distributed.checkpoint), no "
        "gather; full: whole state dicts from the main process. auto: sharded under FSDP "
        "unless its config says FULL_STATE_DICT, else full. Both resume at any process count.",
    )
    g["checkpoints"].add_argument(
        "--checkpoint_async",
        action="store_true",
        help="Sharded checkpoints: write them in the background while training goes on "
        "(the state is copied first); one is `latest` once every part is written.",
    )
    g["checkpoints"].add_argument(
        "--metric_for_best_model",
        type=str,
        default=None,
        help="The evaluation metric whose best value's weights become model.safetensors "
        "(default: the script's headline metric; 'accuracy' means eval_accuracy); "
        "none: the last step's weights.",
    )
    g["checkpoints"].add_argument(
        "--greater_is_better",
        type=true_or_false,
        default=None,
        help="Whether a higher --metric_for_best_model is better (default: lower for "
        "loss, mse, perplexity, bpb, error; higher otherwise).",
    )
    g["checkpoints"].add_argument(
        "--early_stopping_patience",
        type=positive_int,
        default=None,
        help="End the run after N evaluations in a row without a better "
        "--metric_for_best_model (every process at the same step).",
    )
    g["checkpoints"].add_argument(
        "--early_stopping_threshold",
        type=non_negative_float,
        default=0.0,
        help="How much better an evaluation must be to count as an improvement.",
    )
    g["optimization"].add_argument(
        "--nonfinite_loss",
        choices=["stop", "skip"],
        default="stop",
        help="A NaN or infinite training loss: stop the run (no final model; the last "
        "checkpoint stays good), or skip those optimizer steps (a sync per step).",
    )
    g["tracking"].add_argument(
        "--logging_steps",
        type=positive_int,
        default=20,
        help="Log the mean training loss every N optimizer steps (each log is a device sync).",
    )
    g["tracking"].add_argument(
        "--with_tracking",
        action="store_true",
        help="Send metrics to the --report_to trackers (files under OUTPUT_DIR/tensorboard).",
    )
    g["tracking"].add_argument(
        "--report_to",
        type=str,
        default="tensorboard",
        help="accelerate tracker(s) for --with_tracking: tensorboard, wandb, ..., or all.",
    )
    g["hardware"].add_argument(
        "--mixed_precision",
        choices=["auto", "no", "fp16", "bf16"],
        default="auto",
        help="auto: bf16 on GPUs that support it and on CPUs with native bf16 (AVX512-BF16, "
        "AMX), else fp32, unless the accelerate config asks for fp16/bf16.",
    )
    g["hardware"].add_argument(
        "--cpu", action="store_true", help="Train on the CPU even when a GPU is visible (the default when none is)."
    )
    g["hardware"].add_argument(
        "--torch_compile",
        action="store_true",
        help="Compile the model with torch.compile (inductor) through accelerate's dynamo "
        "plugin; the first steps wait for the compiler.",
    )
    g["hardware"].add_argument(
        "--torch_compile_mode",
        choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
        default=None,
        help="torch.compile's mode; reduce-overhead replays CUDA graphs on a GPU, for steps "
        "bound by launching many small kernels (docs/gpu.md). Implies --torch_compile.",
    )
    g["hardware"].add_argument(
        "--full_determinism",
        action="store_true",
        help="Deterministic kernels only (torch.use_deterministic_algorithms, cuDNN, cuBLAS), "
        "so a rerun or a resume on a GPU repeats a run bit for bit; slower there. A CPU's "
        "kernels already are.",
    )
    g["hardware"].add_argument(
        "--ddp_timeout",
        type=positive_int,
        default=300,
        help="Seconds a collective may wait for a peer before the run fails (torch's default "
        "is 30 minutes, which is how long survivors of a dead rank would hang).",
    )
    return parser


def add_optimizer_args(
    parser, learning_rate, train_batch_size, eval_batch_size, weight_decay=0.0, label_smoothing=None
):
    """The flags of AdamW + warmup/schedule training, with the script's defaults; --label_smoothing only
    for scripts that pass a default for it (a flag a script ignores must not be accepted)."""
    g = parser.groups["optimization"]
    g.add_argument(
        "--per_device_train_batch_size",
        type=positive_int,
        default=train_batch_size,
        help="Batch size per process; the global batch is this x processes x accumulation.",
    )
    g.add_argument(
        "--per_device_eval_batch_size",
        type=positive_int,
        default=eval_batch_size,
        help="Evaluation batch size per process.",
    )
    g.add_argument("--learning_rate", type=positive_float, default=learning_rate, help="Peak AdamW learning rate.")
    g.add_argument("--weight_decay", type=float, default=weight_decay, help="AdamW weight decay.")
    g.add_argument(
        "--lr_scheduler_type",
        choices=SCHEDULES,
        default="cosine",
        metavar="{" + ",".join(SCHEDULES) + "}",
        help="Learning-rate schedule after warmup: constant, linear, cosine, or another of transformers' "
        "schedules by its name (docs/scripts.md).",
    )
    g.add_argument(
        "--lr_scheduler_kwargs",
        type=json_object,
        default=None,
        help="JSON arguments of transformers' schedules that take more, e.g. '{\"min_lr_rate\": 0.1}' for "
        "cosine_with_min_lr, '{\"num_decay_steps\": 100}' for warmup_stable_decay.",
    )
    g.add_argument("--num_warmup_steps", type=int, default=0, help="Linear warmup steps.")
    g.add_argument(
        "--warmup_ratio",
        type=fraction,
        default=0.0,
        help="Without --num_warmup_steps: warmup for this fraction of the run's optimizer steps.",
    )
    if label_smoothing is not None:
        g.add_argument("--label_smoothing", type=float, default=label_smoothing, help="Cross-entropy label smoothing.")


def add_data_files_args(parser, train_help, split_percentage, dataset_name=False):
    """--train_file, --validation_file and --validation_split_percentage, for the scripts that read a user's files;
    with dataset_name, also --dataset_name and --dataset_config_name (data.splits reads them)."""
    data = parser.groups["data"]
    data.add_argument("--train_file", nargs="+", help=train_help)
    data.add_argument(
        "--validation_file", nargs="+", help="Validation rows, the same kind of file (default: a held-out split)."
    )
    data.add_argument(
        "--validation_split_percentage",
        type=positive_float,
        default=None,
        help=f"Without a validation split: the percent of training rows held out (default {split_percentage}).",
    )
    if dataset_name:
        data.add_argument(
            "--dataset_name",
            default=None,
            help="Instead of files: a dataset as datasets.load_dataset takes it, a Hub name (org/name) or "
            "a local dataset folder (data files, a README naming its configs); its train split "
            "trains, its validation (else test) split evaluates.",
        )
        data.add_argument("--dataset_config_name", default=None, help="The dataset's configuration, e.g. sst2 of glue.")


def add_tokenized_data_args(parser, row, max_length, long_examples=None):
    """The flags of the scripts that tokenize a user's text once into a cache and read it in batches of
    similar lengths: a `row` (a text, an example, a side of a pair) is cut to --max_seq_length (default the
    model's limit, at most `max_length`), or with `long_examples` (the choices) it may be left out or refused."""
    data = parser.groups["data"]
    data.add_argument(
        "--max_seq_length",
        "--max_length",
        type=positive_int,
        default=None,
        help=f"Tokens per {row} (default: the model's limit, at most {max_length}).",
    )
    if long_examples:
        data.add_argument(
            "--long_examples",
            choices=long_examples,
            default="truncate",
            help=f"A {row} over --max_seq_length: cut at its end, left out (with its pair), or refused.",
        )
    data.add_argument(
        "--group_by_length",
        type=true_or_false,
        nargs="?",
        const=True,
        default=True,
        help="Training batches of rows of similar length, so less of each batch is padding (docs/text.md: "
        "about 2x the samples/s on short texts); false: batches as drawn. (default: true)",
    )
    data.add_argument(
        "--cache_dir",
        default=os.path.join("runs", "tokens"),
        help="Where tokenized data is kept and found again by the next run with the same inputs.",
    )
    data.add_argument(
        "--dataloader_num_workers",
        type=int,
        default=None,
        help="Processes reading batches per rank (default 2 on a GPU, 0 on a CPU).",
    )
    parser.groups["model"].add_argument(
        "--gradient_checkpointing",
        action="store_true",
        help="Recompute activations in backward: less memory, more time.",
    )


def add_generation_args(parser):
    """--prompt and its sampling flags, for the scripts that train a causal LM (train.models.generation.generate)."""
    g = parser.groups["model"]
    g.add_argument(
        "--prompt",
        nargs="+",
        help="Instead of training: continue these prompts with the model in "
        "--output_dir (\\n in a prompt is a newline).",
    )
    g.add_argument("--max_new_tokens", type=positive_int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy decoding.")
    g.add_argument("--top_k", type=positive_int, default=50)


def data_inputs(args):
    """The data flags of add_data_files_args as one value for data/ (data.splits.DataInputs)."""
    from data.splits import DataInputs

    return DataInputs(
        args.train_file,
        args.validation_file,
        getattr(args, "dataset_name", None),
        getattr(args, "dataset_config_name", None),
        args.validation_split_percentage,
        args.seed,
    )


def reading_workers(requested, device, on_gpu):
    """--dataloader_num_workers once the device is known: as asked, else `on_gpu` on a GPU, where the CPU
    queues every step and a read in the training process delays it, and 0 on a CPU, where workers would
    take cores from the training processes (docs/gpu.md, docs/lm.md). Decided from the run's device,
    not from whether a GPU exists: `--cpu` on a GPU machine is a CPU run."""
    return requested if requested is not None else (on_gpu if device.type == "cuda" else 0)
