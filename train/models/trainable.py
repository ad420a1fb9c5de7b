"""What of a pretrained model trains, and in what precision: a task head drawn anew, LoRA adapters
through peft (everything else frozen), the weights that train kept in float32 (master weights, whatever
the checkpoint's dtype) unless --pure_low_precision trains them in --torch_dtype itself, the frozen
ones (LoRA's base) left in --torch_dtype; AdamW over the weights that train; and what the header line
says of them (how many train, their dtypes)."""

import warnings

from data.errors import fail


def add_lora_args(parser):
    g = parser.groups["model"]
    g.add_argument("--lora_r", type=int, default=0, help="LoRA rank; 0 trains every weight (full fine-tuning).")
    g.add_argument("--lora_alpha", type=float, default=16, help="LoRA scaling numerator (the update is alpha/r).")
    g.add_argument("--lora_dropout", type=float, default=0.0, help="Dropout on the LoRA branch.")
    g.add_argument(
        "--lora_target_modules",
        type=str,
        default=None,
        help="Comma-separated module names to adapt, or all-linear (default: peft's choice for the "
        "architecture, e.g. query,value for BERT; all-linear where peft has none).",
    )


def fresh_head(model):
    """Draw the task head's weights anew (every linear layer outside the pretrained body, as the model's
    own initializer does for a head it lacks: normal(0, initializer_range), zero bias) and return the
    head's module names: for a classifier whose head was trained on other labels, which its rows
    would otherwise go on meaning, whatever the new names say."""
    import torch

    body = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if not isinstance(body, torch.nn.Module) or body is model:
        fail(
            f"{type(model).__name__} does not tell its head from its pretrained body (base_model_prefix), so the head "
            "trained on other labels cannot be drawn anew; pass data with the model's labels, or its base model"
        )
    std = getattr(model.config, "initializer_range", 0.02)
    head = []
    for name, child in model.named_children():
        linear = [m for m in child.modules() if isinstance(m, torch.nn.Linear)] if child is not body else []
        with torch.no_grad():
            for m in linear:
                m.weight.normal_(0.0, std)
                if m.bias is not None:
                    m.bias.zero_()
        head += [name] if linear else []
    return head


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
    config = LoraConfig(
        task_type=task_type,
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=targets,
        modules_to_save=trained_modules or None,
    )
    try:
        with warnings.catch_warnings():  # peft asks transformers for a renamed attribute: a FutureWarning per call
            warnings.simplefilter("ignore", FutureWarning)
            return get_peft_model(model, config)
    except (ValueError, TypeError, KeyError) as e:
        import torch

        linear = sorted(
            {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        )
        fail(
            f"--lora_r: peft cannot adapt {type(model).__name__} with --lora_target_modules "
            f"{args.lora_target_modules or '(peft default)'} ({' '.join(str(e).split())[:120]}); its linear layers: "
            f"{', '.join(linear)}; pass some of them, comma-separated, or all-linear"
        )


def set_training_dtype(model, pure, mixed_precision):
    """The weights that train in float32 (master weights: AdamW's updates are not rounded away in
    bfloat16), or, with `pure`, in the dtype they were loaded in; the frozen ones stay as loaded.
    One line for float16 weights trained as they are (no loss scaling keeps their gradients from
    vanishing), and for frozen bfloat16/float16 weights beside float32 ones without autocast
    (`mixed_precision` "no"): a float32 layer would meet their outputs' dtype."""
    import torch

    trained = [p for p in model.parameters() if p.requires_grad]
    if pure and any(p.dtype == torch.float16 for p in trained):
        fail(
            "--pure_low_precision with float16 weights: their updates need loss scaling; pass --torch_dtype bfloat16 "
            "(or leave out --pure_low_precision for float32 master weights)"
        )
    if pure:
        return
    for p in trained:
        if p.dtype != torch.float32:
            p.data = p.data.float()
    low = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.dtype != torch.float32})
    if low and mixed_precision == "no":
        fail(
            f"the frozen weights are {'/'.join(low)} (--torch_dtype) and the ones that train float32, which needs "
            f"autocast: pass --mixed_precision {'bf16' if 'bfloat16' in low else 'fp16'} (the frozen weights compute "
            "in it anyway), or --torch_dtype float32"
        )


def adamw(model, learning_rate, weight_decay):
    """AdamW over the parameters that train, fused: decay on weight matrices only, not on biases and
    norms (BERT's recipe, transformers' run_*_no_trainer.py scripts' too)."""
    import torch

    trained = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        [
            {"params": [p for p in trained if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in trained if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=learning_rate,
        fused=True,
    )


def describe_trainable(model):
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total


def describe_dtypes(model):
    """The dtypes of the weights that train and of the frozen ones, for the header."""

    def kinds(trains):
        return "/".join(
            sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.requires_grad == trains})
        )

    frozen = kinds(False)
    return f"training weights {kinds(True)}" + (f", frozen {frozen}" if frozen else "")
