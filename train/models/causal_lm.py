"""The setup that train/sft.py, train/dpo.py and train/grpo.py share around a pretrained causal LM: their
common flags, the checks and the run's start (inputs, a model with a causal LM head, accelerator, the
tokenizer and the longest sequence the model reads), the model as it trains (LoRA, gradient
checkpointing, dropout, float32 master weights), its header line, and how its output folder is
written. Each script keeps its data, its step and its loop in view; the pieces here are plain
functions it calls in order."""

import copy
import os

from data.errors import fail
from data.splits import check_inputs
from train.core.flags import add_generation_args, add_optimizer_args, data_inputs, reading_workers
from train.core.parser import true_or_false
from train.core.run import start_run
from train.models.fingerprint import model_fingerprint
from train.models.pretrained import (
    add_pretrained_args,
    hub_kwargs,
    load_pretrained,
    load_tokenizer,
    quiet_transformers,
    resolve_model,
    torch_dtype,
)
from train.models.saving import check_savable, save_model_folder
from train.models.trainable import add_lora_args, describe_dtypes, describe_trainable, lora_model, set_training_dtype


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
    model.add_argument(
        "--chat_template_path",
        default=None,
        help="A chat template for the model's tokenizer (a .jinja file, or a tokenizer folder holding one), "
        "used in place of its own and saved with the output. (default: the tokenizer's own)",
    )
    parser.groups["data"].add_argument(
        "--apply_chat_template",
        type=true_or_false,
        nargs="?",
        const=True,
        default=False,
        help="Text prompts (and responses) as a user turn (and the assistant's turn) of the tokenizer's chat "
        "template, as the model meets them in a chat; conversations always are. (default: false)",
    )
    model.add_argument("--eval_on_start", action="store_true", help=eval_on_start)
    if disable_dropout is not None:
        model.add_argument(
            "--disable_dropout",
            type=true_or_false,
            nargs="?",
            const=True,
            default=disable_dropout,
            help="Every dropout off while training, as in evaluation: the config's probabilities (attention_dropout, "
            f"resid_pdrop, ...) and every nn.Dropout (TRL's name). (default: {str(disable_dropout).lower()})",
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


def check_causal_lm(path, **hub):
    """The model's config, if its model type has a causal LM head in transformers (or its own code maps
    one); else one line."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    config = AutoConfig.from_pretrained(path, **hub)
    # BERT and its kind have a causal head in transformers too, for decoders built from them (is_decoder)
    encoder = config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False)
    custom = "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})  # --trust_remote_code's own class
    if (config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or encoder) and not custom:
        fail(
            f"--model_name_or_path {path} is a {config.model_type} model ({', '.join(config.architectures or [])}), "
            "not a causal language model; pass a decoder such as GPT-2, Llama or Qwen (train/lm.py's output is one)"
        )
    return config


def causal_lm_tokenizer(args, config, cap):
    """--model_name_or_path's tokenizer for a causal LM's batches (padding with end-of-text where it has
    no padding token, on the right; padding is never scored), with args.max_seq_length resolved: the
    model's limit, at most `cap`, unless given; one line when given beyond the model's limit. With `cap`
    None the script decides its lengths itself (max_positions)."""
    tokenizer = load_tokenizer(args.model_name_or_path, **hub_kwargs(args))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.convert_ids_to_tokens(0)
    tokenizer.padding_side = "right"
    if cap is None:  # the script sets its lengths itself
        return tokenizer
    limit = min(
        getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or cap,
        tokenizer.model_max_length,
    )
    if args.max_seq_length and args.max_seq_length > limit:
        fail(
            f"--max_seq_length {args.max_seq_length} is more than {args.model_name_or_path} takes ({limit} tokens); "
            f"pass --max_seq_length {limit} or less"
        )
    args.max_seq_length = args.max_seq_length or min(cap, limit)
    return tokenizer


def max_positions(config, tokenizer, cap):
    """The most tokens the model reads in one sequence: its position limit and its tokenizer's, at most `cap`."""
    return min(
        getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or cap,
        tokenizer.model_max_length,
        cap,
    )


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
    if args.chat_template_path:
        tokenizer.chat_template = read_chat_template(args.chat_template_path)
    if args.apply_chat_template and not getattr(tokenizer, "chat_template", None):
        fail(
            f"--apply_chat_template: {args.model_name_or_path}'s tokenizer has no chat template; give it one "
            "(--chat_template_path FILE.jinja), or leave the flag out to train on the text as it is"
        )
    check_savable(args.model_name_or_path, config, tokenizer)  # what the run's end writes, checked before it trains
    return accelerator, folder, config, tokenizer


def read_chat_template(path):
    """The chat template in `path`: a Jinja file, or a tokenizer folder's chat_template.jinja or the
    chat_template of its tokenizer_config.json; one line and exit 1 when there is none."""
    import json

    file = os.path.join(path, "chat_template.jinja") if os.path.isdir(path) else path
    if os.path.isfile(file):
        with open(file, encoding="utf-8") as f:
            template = f.read()
    elif os.path.isdir(path) and os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
    else:
        template = None
    if not isinstance(template, str) or not template.strip():
        fail(
            f"--chat_template_path {path} holds no chat template; pass a .jinja file, or a tokenizer folder "
            "with chat_template.jinja or a chat_template in its tokenizer_config.json"
        )
    return template


def template_note(tokenizer, used):
    """The data line's word on the chat template: whether it is used, and the flag that would use it."""
    if not getattr(tokenizer, "chat_template", None):
        return ""
    return "; chat template" if used else "; text without the chat template (--apply_chat_template uses it)"


def stop_at_turn_end(model, tokenizer):
    """The chat template's end-of-turn token (<|im_end|>, <|eot_id|>, <end_of_turn>) among the ids that end
    the model's answers (its generation config, which the output folder keeps), where it is not yet
    one: a base model given a chat template would otherwise write the next turn after its own."""
    from data.prompt_response import turn_end_id

    end = turn_end_id(tokenizer)
    ids = model.generation_config.eos_token_id
    ids = list(ids) if isinstance(ids, (list, tuple)) else [ids] if ids is not None else []
    if end is not None and end not in ids:
        model.generation_config.eos_token_id = ids + [end]


def takes_logits_to_keep(model):
    """Whether the model's forward can compute its output layer at its last positions only
    (transformers' logits_to_keep; under LoRA, the base model's forward)."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(base.forward).parameters


def response_logits(model, batch, trim):
    """The logits of a batch of labelled rows (input_ids, labels, attention_mask or position_ids), with
    `trim` (takes_logits_to_keep) only from the first position any row scores: a prompt's positions
    before it would cost the output layer and its softmax over the whole vocabulary for nothing. The
    logits are the last logits.shape[1] positions': labels[:, -logits.shape[1]:] are theirs."""
    labels = batch["labels"]
    keep = {}
    if trim:
        scored = (labels != -100).any(0).nonzero()
        start = int(scored[0, 0]) if len(scored) else 0
        keep = {"logits_to_keep": labels.shape[1] - start} if start else {}
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    return model(**inputs, use_cache=False, **keep).logits


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


def without_dropout(config):
    """A copy of a model's `config` with every dropout probability at 0 (attention_dropout, resid_pdrop,
    hidden_dropout_prob, layerdrop, ..., in its sub-configs too): Llama's attention dropout and OPT's
    dropouts are numbers the modules read in training, not nn.Dropout layers that disable_dropout
    finds. Returns (config, the names set to 0)."""
    from transformers import PretrainedConfig

    config, changed = copy.deepcopy(config), []

    def clear(c, prefix):
        for key, value in list(vars(c).items()):
            if isinstance(value, PretrainedConfig):
                clear(value, f"{prefix}{key}.")
            elif (
                any(word in key for word in ("dropout", "pdrop", "layerdrop"))
                and isinstance(value, (int, float))
                and not isinstance(value, bool)
                and value > 0
            ):
                setattr(c, key, 0.0)
                changed.append(f"{prefix}{key}")

    clear(config, "")
    return config, changed


def load_causal_lm(args, accelerator, folder, tokenizer, check=None):
    """The model as it trains: loaded in --torch_dtype, its fingerprint in args (checkpoints hold it: a
    resume needs the same model; its weights' hashes are remembered in --cache_dir), `check(model)`
    (the script's own test of it), dropout off with --disable_dropout (the config's probabilities
    and every nn.Dropout; --lora_dropout, asked for by name, stays), gradient checkpointing, LoRA
    adapters (the pretrained weights then stay as they are), and the weights that train in float32
    (master weights) unless --pure_low_precision; its answers end at the chat template's end of turn."""
    from transformers import AutoConfig, AutoModelForCausalLM

    off = getattr(args, "disable_dropout", False)
    kwargs = {}
    if off:  # the config's dropouts at 0 before the modules are built from it, and then every nn.Dropout
        kwargs["config"] = without_dropout(AutoConfig.from_pretrained(args.model_name_or_path, **hub_kwargs(args)))[0]
    model = load_pretrained(AutoModelForCausalLM, args, "a causal LM", **kwargs)
    # its weights' hashes kept in --cache_dir, or where the scripts keep tokens by default (grpo.py has no such flag)
    cache = getattr(args, "cache_dir", None) or os.path.join("runs", "tokens")
    args.model_fingerprint = model_fingerprint(args.model_name_or_path, folder, cache)
    stop_at_turn_end(model, tokenizer)
    if check is not None:
        check(model)
    if off:
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
    and the merged model in OUTPUT_DIR), with the tokenizer, set to pad on the left for generate()."""
    from transformers import AutoModelForCausalLM

    save_dtype = torch_dtype(args.save_dtype, config)

    def build():
        pretrained = load_pretrained(AutoModelForCausalLM, args, "a causal LM", save_dtype)
        stop_at_turn_end(pretrained, tokenizer)
        return lora_model(pretrained, args, "CAUSAL_LM") if args.lora_r else pretrained

    # the folder's tokenizer pads on the left: batched generate() continues each prompt from its last
    # token, where right padding would put pad tokens between a short prompt and its continuation
    saved = copy.deepcopy(tokenizer)
    saved.padding_side = "left"
    saved.init_kwargs["padding_side"] = "left"  # what save_pretrained writes to tokenizer_config.json
    return lambda weights, out: save_model_folder(weights, out, build, saved, args.lora_r, save_dtype)
