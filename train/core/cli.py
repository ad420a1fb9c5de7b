"""The command line of every script in train/: argument types, grouped --help with defaults, the
shared flags named as in transformers' run_*_no_trainer.py scripts, and argparse errors as one line
(with a did-you-mean) printed once per launch."""

import argparse
import difflib
import json
import math
import os
import sys

from train.core.process import exit_once, first_local_process
from train.core.schedule import SCHEDULES

GROUPS = (
    ("data", "data"),
    ("model", "model"),
    ("optimization", "optimization"),
    ("checkpoints", "output and checkpoints"),
    ("tracking", "logging and tracking"),
    ("hardware", "hardware and precision"),
)


def positive_int(text):
    """argparse type: an int >= 1, so `--per_device_train_batch_size 0` fails at parse time."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _finite_float(text, zero_ok):
    """argparse type behind positive_float and non_negative_float: a finite number (nan and inf are
    refused), above 0, or at least 0 with `zero_ok`."""
    what = "a number >= 0" if zero_ok else "a positive number"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not (value >= 0 if zero_ok else value > 0) or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return value


def positive_float(text):
    return _finite_float(text, zero_ok=False)


def non_negative_float(text):
    return _finite_float(text, zero_ok=True)


def true_or_false(text):
    if str(text).lower() in ("true", "1", "yes"):
        return True
    if str(text).lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def fraction(text):
    """argparse type: a number in [0, 1)."""
    value = non_negative_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be below 1, got {value}")
    return value


def json_object(text):
    """argparse type: a JSON object, as a dict (a --config file may give the mapping itself)."""
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"name\": 1}}', got {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"name\": 1}}', got {text!r}")
    return value


def steps_or_epoch(text):
    return "epoch" if text == "epoch" else positive_int(text)


# what other scripts call our flags: `--lr` is too far from `--learning_rate` for a spelling match
ALIASES = {
    "--lr": "--learning_rate",
    "--epochs": "--num_train_epochs",
    "--num_epochs": "--num_train_epochs",
    "--batch_size": "--per_device_train_batch_size",
    "--train_batch_size": "--per_device_train_batch_size",
    "--eval_batch_size": "--per_device_eval_batch_size",
    "--warmup_steps": "--num_warmup_steps",
    "--max_steps": "--max_train_steps",
    "--num_workers": "--dataloader_num_workers",
    "--resume": "--resume_from_checkpoint",
    "--fp16": "--mixed_precision",
    "--bf16": "--mixed_precision",
}


# flags of transformers' and TRL's scripts that users try here, and why there are none
NEVER_UPLOADS = (
    "this project never uploads; when the run is done, upload OUTPUT_DIR yourself: hf upload ORG/NAME OUTPUT_DIR"
)
UNSUPPORTED = {
    "--push_to_hub": NEVER_UPLOADS,
    "--hub_model_id": NEVER_UPLOADS,
    "--hub_token": NEVER_UPLOADS,
    "--hub_strategy": NEVER_UPLOADS,
    "--hub_private_repo": NEVER_UPLOADS,
}


class _HelpFormatter(argparse.HelpFormatter):
    """Shows each flag's default, except for switches and unset values, where it says nothing."""

    def _get_help_string(self, action):
        if action.default in (None, True, False, argparse.SUPPRESS) or "%(default)" in (action.help or ""):
            return action.help
        return f"{action.help} (default: %(default)s)"


# what a run records in args.json but a config file does not decide: where this invocation resumes
# from, whether it replaces a run, and which file it read
PER_INVOCATION = ("config", "resume_from_checkpoint", "overwrite_output_dir")


class Parser(argparse.ArgumentParser):
    """argparse with the flags grouped (`parser.groups["data"]`, ...), defaults in --help, no
    abbreviations (`--lr` must not silently mean `--lr_scheduler_type`), errors as one line, and
    `--config FILE`: a YAML or JSON mapping of flag names to values, under the command line's own."""

    def __init__(self, doc):
        super().__init__(description=doc.split("\n")[0], allow_abbrev=False, formatter_class=_HelpFormatter)
        self.add_argument(
            "--config",
            type=str,
            default=None,
            help="YAML or JSON file of flag values (keys are flag names without --); flags on the "
            "command line override it. A run's args.json reruns that run.",
        )
        self.groups = {key: self.add_argument_group(title) for key, title in GROUPS}
        self.recorded = set()  # values a script derives after parsing and records in args.json (not flags)

    def error(self, message):
        if message.startswith("unrecognized arguments:"):
            for word in message.split(":", 1)[1].split():
                if word.split("=")[0] in UNSUPPORTED:
                    exit_once(f"error: {word.split('=')[0]}: {UNSUPPORTED[word.split('=')[0]]}", 2)
                close = self._did_you_mean(word.split("=")[0]) if word.startswith("--") else ""
                if close:
                    message += close
                    break
        exit_once(f"error: {message}; see {self.prog} --help", 2)

    def _did_you_mean(self, flag):
        known = [s for action in self._actions for s in action.option_strings if s not in ("-h", "--help")]
        close = [ALIASES[flag]] if ALIASES.get(flag) in known else difflib.get_close_matches(flag, known, 1, 0.75)
        return f" (did you mean {close[0]}?)" if close else ""

    def parse_args(self, args=None, namespace=None):
        argv = sys.argv[1:] if args is None else list(args)
        path = None  # the last --config, as argparse records it; without a value argparse says so
        for i, a in enumerate(argv):
            if a.startswith("--config="):
                path = a.split("=", 1)[1]
            elif a == "--config" and i + 1 < len(argv):
                path = argv[i + 1]
        if path:
            self.set_defaults(**self._read_config(path))
        return super().parse_args(argv, namespace)

    def _read_config(self, path):
        """The file's values, each checked as its flag would check it on the command line."""

        def bad(message):
            exit_once(f"error: --config {path}: {message}", 2)

        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            bad(f"cannot read it ({e.strerror}); pass a YAML or JSON file of flag values")
        import yaml  # YAML 1.1 reads JSON too

        try:
            values = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
        except (ValueError, yaml.YAMLError) as e:  # both say where
            bad(f"not valid {'JSON' if path.endswith('.json') else 'YAML'} ({' '.join(str(e).split())[:160]})")
        if values is None:
            return {}
        if not isinstance(values, dict):
            bad("expected a mapping of flag names to values, e.g. learning_rate: 0.001")
        by_dest = {a.dest: a for a in self._actions if a.option_strings}
        by_flag = {s[2:]: a for a in self._actions for s in a.option_strings if s.startswith("--")}
        out, ignored = {}, []
        for key, value in values.items():
            key = str(key).lstrip("-").replace("-", "_")
            if key in PER_INVOCATION or key in ("help",):
                if value not in (None, False) and key != "config":
                    ignored.append(key)
                continue
            if key in self.recorded:
                out[key] = value
                continue
            action = by_dest.get(key) or by_flag.get(key)
            if action is None:
                bad(f"unknown key {key!r}{self._did_you_mean('--' + key)}; {self.prog} --help lists the flags")
            out[action.dest] = self._config_value(action, key, value, bad)
        if ignored and first_local_process():
            print(
                f"note: --config {path} sets {', '.join(ignored)}; a config file does not resume or replace a "
                "run, pass those on the command line",
                flush=True,
            )
        return out

    @staticmethod
    def _config_value(action, key, value, bad):
        if action.nargs == 0:  # a switch: store_true, or --no_X storing False into X
            if not isinstance(value, bool):
                bad(f"{key} takes true or false, got {value!r}")
            return value if action.dest == key else (action.const if value else action.default)
        if action.type is true_or_false and isinstance(value, bool):
            return value
        if action.type is json_object and isinstance(value, dict):  # a mapping in the file itself
            return value
        if value is None:
            if action.default is not None:
                bad(f"{key} cannot be null; leave it out for its default ({action.default})")
            return None
        if isinstance(value, (dict, bool)) or (isinstance(value, list) and action.nargs in (None, "?")):
            bad(f"{key} takes {'a list of values' if action.nargs else 'one value'}, got {value!r}")
        if action.nargs in ("+", "*") and not isinstance(value, list):
            value = [value]  # train_file: notes.txt means [notes.txt], as on the command line
        items = value if isinstance(value, list) else [value]
        try:
            items = [action.type(str(v)) if action.type else str(v) for v in items]
        except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
            bad(
                f"{key}: {e}"
                if isinstance(e, argparse.ArgumentTypeError)
                else f"{key} expects {getattr(action.type, '__name__', 'a value')}, got {value!r}"
            )
        for v in items:
            if action.choices is not None and v not in action.choices:
                bad(f"{key}: {v!r} is not one of {', '.join(map(str, action.choices))}")
        return items if action.nargs in ("+", "*") else items[0]


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
    """--prompt and its sampling flags, for the scripts that train a causal LM (train.models.hf.generate)."""
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
