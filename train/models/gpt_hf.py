"""train/lm.py's GPT as a Hugging Face GPT-2 folder, and back.

Our GPT is GPT-2's architecture (pre-norm blocks, learned positions, output layer tied to the token
embedding) with exact-erf GELU (F.gelu, transformers' "gelu"; GPT-2's own checkpoints use the tanh
approximation, "gelu_new") and LayerNorm eps 1e-5. Only names and one layout differ: GPT-2's Conv1D
stores a weight as [in, out], the transpose of nn.Linear's, and its fused c_attn splits q, k, v as
our qkv does ([q | k | v], heads contiguous within each). The folder is written by transformers'
own save_pretrained, so `AutoModelForCausalLM.from_pretrained(OUTPUT_DIR)` and
`AutoTokenizer.from_pretrained(OUTPUT_DIR)` load it (tests/test_gpt.py: logits equal to float rounding).
"""

import re

from data.text import EOT, ByteTokenizer
from train.models.gpt import GPTConfig

# a block's modules: ours -> GPT-2's; the four linear layers are Conv1D there
BLOCK = {
    "ln_1": "ln_1",
    "ln_2": "ln_2",
    "qkv": "attn.c_attn",
    "proj": "attn.c_proj",
    "fc": "mlp.c_fc",
    "fc_out": "mlp.c_proj",
}
CONV1D = {"qkv", "proj", "fc", "fc_out"}
TOP = ("wte", "wpe", "ln_f")  # outside the blocks: transformer.NAME in GPT-2


def to_gpt2(state_dict):
    """Our state dict in GPT-2's names and layout (the tied output layer left to transformers)."""
    out = {}
    for name, tensor in state_dict.items():
        parts = name.split(".")
        if parts[0] == "blocks":
            _, layer, module, kind = parts
            key = f"transformer.h.{layer}.{BLOCK[module]}.{kind}"
            out[key] = tensor.t().contiguous() if module in CONV1D and kind == "weight" else tensor
        elif parts[0] in TOP:
            out["transformer." + name] = tensor
        elif name != "lm_head.weight":
            raise KeyError(f"{name} is not a parameter of train/models/gpt.py's GPT")
    return out


def from_gpt2(state_dict):
    """GPT-2's state dict in our names and layout, the output layer tied to the embedding."""
    ours = {v: k for k, v in BLOCK.items()}
    out = {}
    for name, tensor in state_dict.items():
        block = re.fullmatch(r"transformer\.h\.(\d+)\.(.+)\.(weight|bias)", name)
        if block and block[2] in ours:
            layer, module, kind = block[1], ours[block[2]], block[3]
            out[f"blocks.{layer}.{module}.{kind}"] = (
                tensor.t().contiguous() if module in CONV1D and kind == "weight" else tensor
            )
        elif name.startswith("transformer.") and name.split(".")[1] in TOP:
            out[name.removeprefix("transformer.")] = tensor
        elif name != "lm_head.weight":
            raise KeyError(f"{name} is not a GPT-2 parameter that train/models/gpt.py's GPT has")
    out["lm_head.weight"] = out["wte.weight"]
    return out


def gpt2_config(config, eot_id):
    """The transformers GPT2Config of our GPTConfig: every dropout ours, end-of-text as bos and eos."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=config.vocab_size,
        n_positions=config.block_size,
        n_embd=config.n_embd,
        n_layer=config.n_layer,
        n_head=config.n_head,
        activation_function="gelu",
        resid_pdrop=config.dropout,
        embd_pdrop=config.dropout,
        attn_pdrop=config.dropout,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        architectures=["GPT2LMHeadModel"],
    )


# what our GPT computes; a GPT-2 config.json that says otherwise (OpenAI's own: gelu_new) is another model
SAME_MATH = {
    "model_type": "gpt2",
    "activation_function": "gelu",
    "layer_norm_epsilon": 1e-5,
    "n_inner": None,
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "add_cross_attention": False,
    "tie_word_embeddings": True,
}


def gpt_config(hf_config):
    """Our GPTConfig from a GPT-2 config.json's dict; ValueError naming a key our GPT cannot follow."""
    for key, value in SAME_MATH.items():
        got = hf_config.get(key, value)
        if got != value and not (key == "n_inner" and got == 4 * hf_config.get("n_embd", 0)):
            raise ValueError(f"config.json has {key} {got!r}; train/models/gpt.py's GPT computes {value!r}")
    return GPTConfig(
        hf_config["vocab_size"],
        hf_config["n_positions"],
        hf_config["n_layer"],
        hf_config["n_head"],
        hf_config["n_embd"],
        hf_config.get("resid_pdrop", 0.0),
    )


def bytes_to_unicode():
    """GPT-2's byte -> printable character table, the one tokenizers' ByteLevel pre-tokenizer uses:
    printable Latin-1 bytes stand for themselves, the other 68 take the characters from U+0100 on."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


def byte_tokenizer_json():
    """data/text.py's ByteTokenizer as a `tokenizers` Tokenizer with the same ids: a byte-level BPE
    whose vocabulary is the 256 bytes at their own values, no merges, end-of-text the special token 256.
    (One difference: a text holding the literal string <|endoftext|> encodes it as 256 here, as
    13 bytes in ByteTokenizer.)"""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE(vocab={c: b for b, c in bytes_to_unicode().items()}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(EOT, special=True)])
    assert tokenizer.token_to_id(EOT) == ByteTokenizer.eot_id
    return tokenizer


def hf_tokenizer(tokenizer, block_size):
    """Our tokenizer (data/text.py) as a transformers fast tokenizer, end-of-text as bos and eos."""
    from transformers import PreTrainedTokenizerFast

    backend = byte_tokenizer_json() if isinstance(tokenizer, ByteTokenizer) else tokenizer.tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=EOT, eos_token=EOT, model_max_length=block_size)


def save_gpt2_folder(weights, output_dir, config, tokenizer):
    """Our weights (our names) as a GPT-2 folder in output_dir: config.json, generation_config.json,
    model.safetensors, tokenizer.json, tokenizer_config.json, all written by save_pretrained."""
    from train.models.pretrained import quiet_transformers

    quiet_transformers()
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(gpt2_config(config, tokenizer.eot_id))
    state = to_gpt2(weights)
    model.load_state_dict({**state, "lm_head.weight": state["transformer.wte.weight"]})  # strict: every name fits
    model.save_pretrained(output_dir)
    hf_tokenizer(tokenizer, config.block_size).save_pretrained(output_dir)
