"""What a finished sft.py or dpo.py run says to a prompt: `--prompt TEXT ...` with `--output_dir`, the
causal LM the run saved, read the way training read its prompts (data/prompt_response.py)."""

import os

from data.errors import fail
from train.models.pretrained import load_tokenizer, quiet_transformers


def check_causal_head(folder, script, **hub):
    """One line unless the model saved in `folder` is a causal LM with its language-modelling head (a
    classifier of the same family, text_classification.py's output, has a model type with one but
    saved another head, which from_pretrained would replace by a random one)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = AutoConfig.from_pretrained(folder, **hub)
    causal = {c for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for c in ([v] if isinstance(v, str) else v)}
    saved = config.architectures or []
    custom = "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    if saved and not custom and not set(saved) & causal:
        fail(
            f"--output_dir {folder} holds a {', '.join(saved)}, not a causal language model: {script} --prompt "
            "continues text; pass the output folder of a train/sft.py or train/dpo.py run"
        )


def generate(args, script, chat):
    """Print each of --prompt's continuation (prompt<TAB>continuation, newlines as \\n) with the causal LM
    in --output_dir, a finished run of `script`; a prompt is a user turn when that run's args.json sets
    `chat` (the key, or keys, of the flags that made it train on conversations)."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from data.prompt_response import context_ids

    quiet_transformers()
    try:
        with open(os.path.join(args.output_dir, "args.json")) as f:
            trained = json.load(f)
    except OSError:
        trained = None
    if trained is None or not os.path.isfile(os.path.join(args.output_dir, "all_results.json")):
        fail(f"--output_dir {args.output_dir} holds no finished {script} run; train one there first")
    check_causal_head(args.output_dir, script, trust_remote_code=args.trust_remote_code)
    tokenizer = load_tokenizer(args.output_dir, "--output_dir", trust_remote_code=args.trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(
        args.output_dir, dtype=torch.float32, trust_remote_code=args.trust_remote_code
    ).eval()
    torch.manual_seed(args.seed)
    sampling = (
        {"do_sample": True, "temperature": args.temperature, "top_k": args.top_k}
        if args.temperature > 0
        else {"do_sample": False}
    )
    for prompt in (p.replace("\\n", "\n") for p in args.prompt):
        if any(
            trained.get(key) for key in ((chat,) if isinstance(chat, str) else chat)
        ):  # a chat model: the prompt is a user turn
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
            )["input_ids"]
        else:  # as training tokenized it: no end-of-text after the prompt, though the tokenizer adds one
            ids = torch.tensor([context_ids(tokenizer, prompt)])
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                **sampling,
            )
        text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        print(f"{prompt.strip()}\t{text.strip()}".replace("\n", "\\n"))
