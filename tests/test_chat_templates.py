"""Chat templates as the model families ship them (the original templates TRL keeps in its package,
and Mistral's [INST] template), on small tokenizers that hold each family's special tokens: the
tokens sft.py and dpo.py score are exactly each assistant turn's text and the token that ends it,
never the template's newline after it or the generation prompt; a model reads the prompt up to the
opened assistant turn; the end-of-turn token is found where it is not the tokenizer's EOS; and a
template with no clean boundary between turns (Qwen3's, which drops earlier thinking) is one line,
not a silent mask."""

import os

import pytest

from data.errors import DataError
from data.preferences import pair_segments
from data.prompt_response import conversation_segments, prompt_ids, scored_tokens, special_texts, turn_end_id
from hf_models import WORDS

TRL_TEMPLATES = os.path.join(os.path.dirname(__import__("trl").__file__), "chat_templates")
MISTRAL = (  # Mistral-7B-Instruct-v0.1's template
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
# family: (template file or text, special tokens, eos, bos, the end of an assistant turn)
FAMILIES = {
    "smollm2": ("smollm2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>", None, "<|im_end|>"),
    "qwen2.5": ("qwen2_5.jinja", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>", None, "<|im_end|>"),
    # a base model's tokenizer: end-of-text is not the end of a turn
    "chatml-base": (
        "qwen2_5.jinja",
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "<|endoftext|>",
        None,
        "<|im_end|>",
    ),
    "llama3": (
        "llama3.jinja",
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|end_of_text|>",
        "<|begin_of_text|>",
        "<|eot_id|>",
    ),
    "qwen3": ("qwen3.jinja", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>", None, "<|im_end|>"),
    "gemma3": (
        "gemma3.jinja",
        ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"],
        "<eos>",
        "<bos>",
        "<end_of_turn>",
    ),
    "mistral": (MISTRAL, ["<s>", "</s>"], "</s>", "<s>", "</s>"),
}
CONVERSATION = [
    {"role": "user", "content": "define the river"},
    {"role": "assistant", "content": "water that moves"},
    {"role": "user", "content": "and a stone"},
    {"role": "assistant", "content": "a small light answer"},
]


def family_tokenizer(family):
    """A byte-level BPE of ~500 tokens with the family's special tokens, eos and bos, and its template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    template, specials, eos, bos, _ = FAMILIES[family]
    if template == "smollm2":  # the real model's own, where make smollm2 wrote it
        folder = os.path.join("runs", "models", "SmolLM2-135M-Instruct")
        if not os.path.isdir(folder):
            pytest.skip("make smollm2 writes the SmolLM2 folder")
        from transformers import AutoTokenizer

        template = AutoTokenizer.from_pretrained(folder).chat_template
    elif template.endswith(".jinja"):
        with open(os.path.join(TRL_TEMPLATES, template)) as f:
            template = f.read()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = " ".join(WORDS) + " user assistant model system think INST helpful Qwen Alibaba Cloud created"
    tok.train_from_iterator(
        [text] * 20,
        trainers.BpeTrainer(
            vocab_size=500,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, **({"bos_token": bos} if bos else {}))
    wrapped.chat_template = template
    return wrapped


def scored_text(tokenizer, segments):
    """The text of the tokens scored_tokens scores in one rendered example, each run of them apart."""
    [(ids, scored)] = list(scored_tokens(tokenizer, [segments], chat=True))
    runs, current = [], []
    for token, is_scored in zip(ids, scored, strict=True):
        if is_scored:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs + ([tokenizer.decode(current)] if current else []), ids


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "qwen3"])
def test_only_each_assistant_turn_and_its_end_of_turn_token_are_scored(family):
    tokenizer = family_tokenizer(family)
    end = FAMILIES[family][4]
    segments = conversation_segments(tokenizer, CONVERSATION, "a conversation", special_texts(tokenizer))
    runs, ids = scored_text(tokenizer, segments)
    assert runs == [f"water that moves{end}", f"a small light answer{end}"], runs
    # the whole text tokenized once, with the template's own BOS and no second one
    bos = tokenizer.bos_token_id
    assert bos is None or ids.count(bos) == (1 if FAMILIES[family][3] else 0)
    assert turn_end_id(tokenizer) == tokenizer.convert_tokens_to_ids(end)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_prompt_ends_with_the_opened_assistant_turn_and_training_continues_it(family):
    """What evaluation and GRPO read before an answer is the start of what training read."""
    tokenizer = family_tokenizer(family)
    turns = [{"role": "user", "content": "define the river"}, {"role": "assistant", "content": "water"}]
    segments = conversation_segments(tokenizer, turns, "a conversation", special_texts(tokenizer))
    _, ids = scored_text(tokenizer, segments)
    asked = prompt_ids(tokenizer, turns[:1])
    assert ids[: len(asked)] == asked
    assert prompt_ids(tokenizer, "define the river", template=True) == asked  # --apply_chat_template's text


def test_qwen3_scores_its_empty_thinking_block_with_a_single_turn_and_refuses_many_in_one_line():
    tokenizer = family_tokenizer("qwen3")
    one = CONVERSATION[:2]
    segments = conversation_segments(tokenizer, one, "a conversation", special_texts(tokenizer))
    runs, _ = scored_text(tokenizer, segments)
    assert runs == ["<think>\n\n</think>\n\nwater that moves<|im_end|>"], runs  # as Qwen3 answers without thinking
    with pytest.raises(DataError, match="does not render the conversation one turn after another") as e:
        conversation_segments(tokenizer, CONVERSATION, "the train conversation define the river", set())
    assert "\n" not in str(e.value) and "pass each assistant turn as its own conversation" in str(e.value)


def test_a_template_that_refuses_a_conversation_is_one_line_naming_it():
    tokenizer = family_tokenizer("gemma3")
    turns = [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"}]
    with pytest.raises(DataError, match="the model's chat template refuses the train conversation hello") as e:
        conversation_segments(tokenizer, turns, "the train conversation hello", special_texts(tokenizer))
    assert "alternate" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("family", ["llama3", "gemma3", "chatml-base"])
def test_dpo_pairs_through_the_template_score_each_response_and_its_end_of_turn(family):
    import datasets

    tokenizer = family_tokenizer(family)
    end = FAMILIES[family][4]
    ds = datasets.Dataset.from_list([{"prompt": "define the river", "chosen": "water", "rejected": "a stone"}])
    columns = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}
    (pair,), chat = pair_segments(ds, "train", columns, tokenizer, template=True)
    assert chat
    assert [scored_text(tokenizer, side)[0] for side in pair] == [[f"water{end}"], [f"a stone{end}"]]
    (plain,), chat = pair_segments(ds, "train", columns, tokenizer)
    assert not chat and plain[0] == [("define the river", False), ("water", True)]
