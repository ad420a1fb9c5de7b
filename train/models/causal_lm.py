"""The setup that train/sft.py, train/dpo.py and train/grpo.py share around a pretrained causal LM: their
common flags, the checks and the run's start (inputs, model, accelerator, tokenizer), the model as it
trains (LoRA, gradient checkpointing, dropout, float32 master weights), its header line, and how its
output folder is written. Each script keeps its data, its step and its loop in view; the pieces here
are plain functions it calls in order."""

from data.splits import check_inputs
from train.core.cli import add_generation_args, add_optimizer_args, data_inputs, reading_workers, true_or_false
from train.core.run import start_run
from train.models.hf import (
    add_lora_args,
    add_pretrained_args,
    causal_lm_tokenizer,
    check_causal_lm,
    check_savable,
    describe_dtypes,
    describe_trainable,
    hub_kwargs,
    load_pretrained,
    lora_model,
    model_fingerprint,
    quiet_transformers,
    resolve_model,
    save_model_folder,
    set_training_dtype,
    torch_dtype,
)


def add_causal_lm_args(
    parser, what, eval_on_start, train_batch_size, eval_batch_size, disable_dropout=None, generation=True
):
    """The flags every causal-LM script takes besides its data: the model (`what` it must be), the
    evaluation before any step (`eval_on_start`: what it shows), --prompt's generation (unless
    `generation` is False: the script has its own), LoRA, AdamW and its schedule (the learning rate
    decided by parse_causal_lm_args), gradient clipping; with `disable_dropout` (its default) the
    flag of the same name. `model_fingerprint` is recorded in args.json, which reruns a run."""
    model = parser.groups["model"]
    add_pretrained_args(parser, what)
    model.add_argument("--eval_on_start", action="store_true", help=eval_on_start)
    if disable_dropout is not None:
        model.add_argument(
            "--disable_dropout",
            type=true_or_false,
            nargs="?",
            const=True,
            default=disable_dropout,
            help="Every dropout layer off while training, as in evaluation (TRL's name and default for this "
            f"trainer). (default: {str(disable_dropout).lower()})",
        )
    if generation:
        add_generation_args(parser)
    add_lora_args(parser)
    add_optimizer_args(
        parser, learning_rate=None, train_batch_size=train_batch_size, eval_batch_size=eval_batch_size, weight_decay=0.0
    )
    parser.groups["optimization"].add_argument(
        "--max_grad_norm", type=float, default=1.0, help="Clip the gradient norm (0: no clipping)."
    )
    parser.recorded.add("model_fingerprint")


def check_training_inputs(parser, args, full_rate, lora_rate):
    """After parse_args, for a run that trains: data to train on, and the learning rate (`full_rate`
    for the whole model, `lora_rate` for adapters, which take larger steps) unless given."""
    if not args.train_file and not args.dataset_name:
        parser.error("--train_file or --dataset_name is required (or --prompt TEXT with a trained --output_dir)")
    if args.learning_rate is None:
        args.learning_rate = lora_rate if args.lora_r else full_rate


def start_causal_lm(args, task, max_length=None):
    """The run's start, in the order it must happen: the data files and the model checked before any
    process waits on another, the accelerator (start_run), the reading workers, and the tokenizer
    (with `max_length`: args.max_seq_length resolved within the model's limit, at most that).
    Returns (accelerator, folder, config, tokenizer); `folder` is the model's local folder."""
    check_inputs(data_inputs(args))
    folder = resolve_model(args.model_name_or_path, revision=args.model_revision)
    quiet_transformers()
    config = check_causal_lm(args.model_name_or_path, **hub_kwargs(args))
    accelerator = start_run(args, task)
    if hasattr(args, "dataloader_num_workers"):
        args.dataloader_num_workers = reading_workers(args.dataloader_num_workers, accelerator.device, on_gpu=2)
    tokenizer = causal_lm_tokenizer(args, config, max_length)
    check_savable(args.model_name_or_path, config, tokenizer)  # what the run's end writes, checked before it trains
    return accelerator, folder, config, tokenizer


def disable_dropout(model):
    """Every dropout layer of `model` at p = 0 (TRL's disable_dropout_in_model): training then computes
    what evaluation does, and a reference or a sampling pass taken in eval mode matches the policy."""
    import torch

    off = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            module.p = 0.0
            off += 1
    return off


def load_causal_lm(args, accelerator, folder, check=None):
    """The model as it trains: loaded in --torch_dtype, its fingerprint in args (checkpoints hold it: a
    resume needs the same model), `check(model)` (the script's own test of it), dropout off with
    --disable_dropout, gradient checkpointing, LoRA adapters (the pretrained weights then stay as
    they are), and the weights that train in float32 (master weights) unless --pure_low_precision."""
    from transformers import AutoModelForCausalLM

    model = load_pretrained(AutoModelForCausalLM, args, "a causal LM")
    args.model_fingerprint = model_fingerprint(args.model_name_or_path, folder)
    if check is not None:
        check(model)
    if getattr(args, "disable_dropout", False):
        disable_dropout(model)
    if args.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if args.lora_r:
        model = lora_model(model, args, "CAUSAL_LM")
    set_training_dtype(model, args.pure_low_precision, accelerator.mixed_precision)
    return model


def describe_model(accelerator, model, args, details=""):
    """Print the model's header line (class, source, parameters, what trains, dtypes, `details`) and
    return (trainable, total) parameter counts."""
    trainable, total = describe_trainable(model)
    dropout = (
        ""
        if getattr(args, "disable_dropout", None) is None
        else ("; dropout off" if args.disable_dropout else "; dropout on (--disable_dropout false)")
    )
    accelerator.print(
        f"model: {type(accelerator.unwrap_model(model)).__name__} from {args.model_name_or_path}, "
        f"{total:,} parameters, {trainable:,} training ({trainable / total:.2%}"
        f"{f', LoRA r={args.lora_r}' if args.lora_r else ''}); {describe_dtypes(model)}{dropout}{details}"
    )
    return trainable, total


def model_saver(args, config, tokenizer):
    """save_model for TrainingLoop.finish: the run's weights into a Hugging Face folder in --save_dtype,
    the pretrained model rebuilt on the CPU to take them (under LoRA: the adapter in OUTPUT_DIR/adapter
    and the merged model in OUTPUT_DIR), with the tokenizer."""
    from transformers import AutoModelForCausalLM

    save_dtype = torch_dtype(args.save_dtype, config)

    def build():
        pretrained = load_pretrained(AutoModelForCausalLM, args, "a causal LM", save_dtype)
        return lora_model(pretrained, args, "CAUSAL_LM") if args.lora_r else pretrained

    return lambda weights, out: save_model_folder(weights, out, build, tokenizer, args.lora_r, save_dtype)
