"""Prompt/response pairs (or chat conversations) for supervised fine-tuning of a causal language model:
read once, tokenized once, kept as memory-mapped Arrow (the cache of data/labelled_text.py).

An example is the tokenizer's tokens of its whole text, prompt then response, as the model meets it
at inference, and the end-of-text token: the tokens that hold the response's characters (character
offsets) and that last token are the targets, the prompt is context only. A chat conversation (a column
of [{"role", "content"}, ...] turns, or with --apply_chat_template a prompt as a user turn and its
response as the assistant's) is rendered with the tokenizer's chat template and tokenized whole, and
every assistant turn is a target up to and with the special token that ends it (ChatML's <|im_end|>,
Llama 3's <|eot_id|>, Gemma's <end_of_turn>), not the newline some templates write after it: the model
learns to write the end of its turn, which is where its answers stop. A row stores the model's input
and, beside it, the token each position predicts (`labels`, already shifted; -100 where nothing is
scored), so an example of n tokens is a row of n - 1 positions, each scored response token predicted
exactly once. `targets` counts a row's scored positions: the training loop divides the loss by their sum
over every row of an optimizer step (data/sharding.py: step weights), so a token counts the same on any
process count.

Examples longer than --max_seq_length are cut at the end of the response (`truncate`), left out
(`drop`) or refused (`error`); one whose prompt alone fills the length is refused unless dropped.
With `packing`, the training rows are several examples each, placed by best-fit decreasing into
rows of --max_seq_length tokens, with `position_ids` starting again at 0 for each example: a model
that reads packed sequences from its position ids keeps attention inside each one (train/sft.py
checks that the model does). Validation rows are never packed, so its metrics do not depend on it.
"""

import bisect
import os

from data.errors import DataError
from data.labelled_text import cached_folder, first_words, tokenizer_files_hash
from data.padding import padded_length
from data.splits import inputs_key, load_splits, stem

FORMAT = 3  # of the folder written here; a change makes every cached folder stale
LONG_EXAMPLES = ("truncate", "drop", "error")


# the columns of TRL's prompt-completion and conversational datasets: what to pass for them instead of a flag's default
ELSEWHERE = {
    "--prompt_column": {"messages": "--messages_column messages"},
    "--response_column": {"completion": "--response_column completion", "messages": "--messages_column messages"},
}


def _strings(ds, column, split, flag):
    if column not in ds.column_names:
        known = [fix for name, fix in ELSEWHERE.get(flag, {}).items() if name in ds.column_names]
        fix = f"pass {' or '.join(known)}" if known else f"pass {flag} NAME"
        raise DataError(f"no column {column!r} in the {split} data (columns: {', '.join(ds.column_names)}); {fix}")
    if getattr(ds.features[column], "dtype", None) not in ("string", "large_string"):
        raise DataError(f"column {column!r} holds {ds.features[column]}, not text; pass {flag} NAME")
    return ds[column]


def prompt_response_segments(ds, split, prompt_column, response_column):
    """Per example: [(prompt, False), (response, True)]; an empty response is refused (its row named)."""
    prompts = _strings(ds, prompt_column, split, "--prompt_column")
    responses = _strings(ds, response_column, split, "--response_column")
    empty = [i for i, r in enumerate(responses) if not r or not r.strip()]
    if empty:
        raise DataError(
            f"the {split} data has {len(empty)} row(s) with an empty {response_column!r} (the first: "
            f"{first_words(prompts[empty[0]] or '')}); fill them in or drop those rows"
        )
    return [[(p or "", False), (r, True)] for p, r in zip(prompts, responses, strict=True)]


def check_chat_template(tokenizer, why):
    """A DataError unless the tokenizer has a chat template: `why` says what needs it."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"{why}: the model's tokenizer has no chat template; give it one (--chat_template_path FILE.jinja, "
            "or a chat_template in its tokenizer_config.json), or pass plain text without --apply_chat_template"
        )


def special_texts(tokenizer):
    """The texts of the tokenizer's special tokens (<|im_end|>, <end_of_turn>, <|eot_id|>, </s>, ...)."""
    texts = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    return texts | set(tokenizer.all_special_tokens)


def turn_and_separator(text, specials):
    """An assistant turn as the template renders it, split in two: the turn, up to and with its last
    special token (the end-of-turn the model learns to write, and stops at), and the whitespace the
    template puts after it before the next turn (ChatML's and Gemma's newline), which the model never
    writes. A turn that ends in no special token is all turn: its end is whatever the template writes."""
    body = text.rstrip()
    if body != text and any(body.endswith(s) for s in specials):
        return body, text[len(body) :]
    return text, ""


def render_turns(tokenizer, turns, where, **kwargs):
    """The chat template's text of `turns`; a DataError naming `where` when the template refuses them."""
    try:
        return tokenizer.apply_chat_template(turns, tokenize=False, **kwargs)
    except Exception as e:  # jinja2's TemplateError, the template's own raise_exception(): a row it refuses
        raise DataError(
            f"the model's chat template refuses {where} ({' '.join(str(e).split())[:120]}); drop or fix "
            "such rows, or pass a model whose template takes them"
        ) from None


def conversation_segments(tokenizer, turns, where, specials):
    """A conversation's text as the chat template renders it, cut into (text, is_assistant) pieces: each
    assistant turn is the text the template adds to the conversation before it (rendered with the
    generation prompt) when that turn is added, less the separator after its end-of-turn token."""
    text = render_turns(tokenizer, turns, where)
    segments, done = [], 0
    for i, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        before = render_turns(tokenizer, turns[:i], where, add_generation_prompt=True)
        after = render_turns(tokenizer, turns[: i + 1], where)
        if not (after.startswith(before) and text.startswith(after) and len(before) >= done):
            raise DataError(
                f"{where}: the chat template does not render the conversation one turn after another (an "
                "earlier turn's text changes when a turn is added, as Qwen3's drops earlier thinking), so its "
                "assistant turns cannot be told apart; pass each assistant turn as its own conversation "
                "(the turns before it, then it), or the pairs as --prompt_column/--response_column"
            )
        turn_text, separator = turn_and_separator(after[len(before) :], specials)
        segments += [(text[done : len(before)], False), (turn_text, True)]
        done = len(before) + len(turn_text)
    return segments + [(text[done:], False)]


def chat_segments(ds, split, column, tokenizer):
    """Per conversation (a column of [{"role", "content"}, ...] turns): conversation_segments."""
    if column not in ds.column_names:
        raise DataError(
            f"no column {column!r} in the {split} data (columns: {', '.join(ds.column_names)}); "
            "pass --messages_column NAME"
        )
    check_chat_template(tokenizer, f"--messages_column {column} holds conversations")
    specials, out = special_texts(tokenizer), []
    for turns in ds[column]:
        if not isinstance(turns, list) or not all(isinstance(t, dict) and {"role", "content"} <= set(t) for t in turns):
            raise DataError(
                f"{column!r} in the {split} data is not a list of {{'role', 'content'}} turns (its "
                f"value {first_words(repr(turns))}); pass --messages_column NAME of such a column"
            )
        where = f"the {split} conversation {first_words(turns[0]['content'] or '') if turns else '[]'}"
        if not any(t["role"] == "assistant" and (t["content"] or "").strip() for t in turns):
            raise DataError(f"{where} has no assistant turn with text: nothing to learn from; drop it")
        out.append(conversation_segments(tokenizer, turns, where, specials))
    return out


def templated_segments(examples, split, tokenizer):
    """prompt_response_segments' examples with --apply_chat_template: each prompt a user turn and its
    response the assistant's turn, rendered by the chat template (conversation_segments)."""
    check_chat_template(tokenizer, "--apply_chat_template")
    specials = special_texts(tokenizer)
    return [
        conversation_segments(
            tokenizer,
            [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}],
            f"the {split} example {first_words(prompt)}",
            specials,
        )
        for (prompt, _), (response, _) in examples
    ]


def turn_end_id(tokenizer):
    """The token that ends an assistant turn in the tokenizer's chat template (ChatML's <|im_end|>,
    Llama 3's <|eot_id|>, Gemma's <end_of_turn>), or None: no template, or a turn that ends in text."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    turns = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]
    try:
        segments = conversation_segments(tokenizer, turns, "a probe", special_texts(tokenizer))
    except DataError:
        return None
    ids = tokenizer(segments[1][0], add_special_tokens=False)["input_ids"]
    if not ids:
        return None
    added = tokenizer.added_tokens_decoder.get(ids[-1])
    return ids[-1] if ids[-1] in tokenizer.all_special_ids or (added and added.special) else None


def scored_tokens(tokenizer, examples, chat):
    """Per example (its (text, is_target) segments): the tokenizer's ids of the whole text, and per
    token whether it is a target.

    The text is tokenized whole, as the model meets it at inference: pieces tokenized apart differ
    where a tokenizer marks a text's start (SentencePiece's "▁") or joins a space to the next word.
    A token is a target when any of its characters belongs to a target segment (character offsets),
    so a token across the prompt's end and the response's start is learned with the response. The
    tokens the tokenizer adds around a text (Llama's <s>, BERT's [CLS] and [SEP]) are not characters
    of it: those after the text end it and are targets, those before it are context. Outside a chat
    template (which writes its own) end-of-text follows, a target: the model learns where a response
    stops; a tokenizer with none, which adds no token after a text either, is refused."""
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(
            f"the tokenizer ({type(tokenizer).__name__}) gives no character offsets, which tell the "
            "response's tokens from the prompt's; use the model's fast tokenizer (a tokenizer.json in its "
            "folder: AutoTokenizer.from_pretrained(...).save_pretrained(...) writes one where it can)"
        )
    texts = ["".join(text for text, _ in segments) for segments in examples]
    encoded = (
        tokenizer(texts, add_special_tokens=not chat, return_offsets_mapping=True, return_special_tokens_mask=True)
        if texts
        else {"input_ids": []}
    )
    end = [tokenizer.eos_token_id] if not chat and tokenizer.eos_token_id is not None else []
    for i, segments in enumerate(examples):
        spans, at = [], 0
        for text, is_target in segments:
            if is_target:
                spans.append((at, at + len(text)))
            at += len(text)
        ids = list(encoded["input_ids"][i])
        scored, seen_text = [], False
        for (a, b), added in zip(encoded["offset_mapping"][i], encoded["special_tokens_mask"][i], strict=True):
            if added and a == b:  # put there by the tokenizer, not read from the text
                scored.append(seen_text)
                continue
            seen_text = True
            scored.append(any(a < e and b > s for s, e in spans) if a < b else any(s <= a < e for s, e in spans))
        if end and ids[-1:] != end:  # unless the tokenizer ends a text with it already
            ids += end
            scored.append(True)
        elif not chat and not end and encoded["special_tokens_mask"][i][-1:] != [1]:  # BERT's [SEP] ends one too
            raise DataError(
                "the tokenizer has no end-of-text token (eos_token) and ends a text with nothing, so the model "
                "would never learn where a response stops; set eos_token in the model's tokenizer_config.json, "
                "or train on conversations (the chat template ends each turn)"
            )
        yield ids, scored


def context_ids(tokenizer, prompt):
    """The ids a model trained on scored_tokens' rows reads before it writes a response to `prompt`:
    the tokenizer's ids of the prompt with the tokens it adds before a text (Llama's <s>, BERT's [CLS])
    and none of those it adds after one (an end-of-text, BERT's [SEP]): training only ever puts those
    after a response, so a model that met one after the prompt would take its response as finished."""
    fast = getattr(tokenizer, "is_fast", False)
    encoded = tokenizer(prompt or "x", return_offsets_mapping=fast, return_special_tokens_mask=True)
    ids, added = encoded["input_ids"], encoded["special_tokens_mask"]
    offsets = encoded["offset_mapping"] if fast else [(0, 0)] * len(ids)
    read = [i for i, ((a, b), x) in enumerate(zip(offsets, added, strict=True)) if not (x and a == b)]
    if not prompt:  # nothing to read: what the tokenizer puts before any text (an "x" stood in to show where)
        return ids[: read[0]]
    return ids[: read[-1] + 1] if read else ids


def prompt_ids(tokenizer, prompt, template=False):
    """The ids a model reads before it answers `prompt`: a conversation (or, with `template`, a text as a
    user turn) through the chat template with the assistant's turn opened; a text as context_ids."""
    if isinstance(prompt, list) or template:
        turns = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return context_ids(tokenizer, prompt)


def split_prompts(ds, split, columns, tokenizer, template=False):
    """A split's rows as prompts for a model to answer: (the prompts as reward functions take them, the
    ids the model reads before it answers each (prompt_ids), every other column by name). The prompt
    column's text or turns, or without one the turns of columns["messages"] before the conversation's
    last assistant turn; a text with `template` as a user turn of the chat template."""
    if columns.get("prompt") in ds.column_names:  # a text, or turns (dpo.py's conversational prompts)
        name = columns["prompt"]
        prompts = [p or "" for p in ds[name]]
    elif columns.get("messages") in ds.column_names:
        name = columns["messages"]
        prompts = [turns[: max(i for i, t in enumerate(turns) if t["role"] == "assistant")] for turns in ds[name]]
    else:
        named = " or ".join(repr(columns[k]) for k in ("prompt", "messages") if columns.get(k))
        raise DataError(
            f"no column {named} in the {split} data (columns: {', '.join(ds.column_names)}); pass "
            "--prompt_column NAME or --messages_column NAME"
        )
    if (template or any(isinstance(p, list) for p in prompts)) and prompts:
        check_chat_template(tokenizer, f"the {split} prompts are chat turns")
    ids = [prompt_ids(tokenizer, p, template) for p in prompts]
    return prompts, ids, {c: list(ds[c]) for c in ds.column_names if c != name}


def validation_prompts(inputs, tokenizer, columns, room, template=False):
    """The validation split's rows (load_splits of the same inputs: the rows prepare_prompt_response
    holds out, each once) as split_prompts gives them: {"ids": cut at their start to `room` tokens,
    "prompts", "columns" (the response's included), "conversational", "cut": how many were cut}."""
    prompts, ids, other = split_prompts(
        load_splits(inputs)[0]["validation"], "validation", columns, tokenizer, template
    )
    return {
        "ids": [i[-room:] for i in ids],
        "prompts": prompts,
        "columns": other,
        "conversational": any(isinstance(p, list) for p in prompts),
        "cut": sum(len(i) > room for i in ids),
    }


def example_row(tokens, scored, max_seq_length, long_examples, what):
    """(input_ids, labels) of one example's tokens (labels shifted: the token each position predicts,
    -100 where nothing is scored), cut to max_seq_length; None when it is longer and long_examples is
    "drop"; a DataError naming `what` (the example) when it has no response token, or is longer and
    long_examples is "error", or its prompt alone fills the length."""
    labels = [t if s else -100 for t, s in zip(tokens[1:], scored[1:], strict=True)]
    tokens = tokens[:-1]
    if not any(s for s in scored[1:]):
        raise DataError(f"{what} has no response tokens; fill its response in")
    if len(tokens) <= max_seq_length:
        return tokens, labels
    prompt = scored.index(True)  # tokens before the first response token: its context
    if long_examples == "drop":
        return None
    if prompt >= max_seq_length + 1 or long_examples == "error":
        alone = prompt >= max_seq_length + 1
        raise DataError(
            f"{what} is longer than --max_seq_length {max_seq_length}: "
            + (f"its prompt alone is {prompt} tokens" if alone else f"it is {len(tokens) + 1} tokens")
            + "; raise --max_seq_length, shorten it, or pass --long_examples drop"
            + ("" if alone else " (or truncate)")
        )
    return tokens[:max_seq_length], labels[:max_seq_length]


def encode(tokenizer, examples, max_seq_length, long_examples, split, chat):
    """Rows (input_ids, labels, length, targets) and counts: cut, dropped, tokens."""
    rows = {"input_ids": [], "labels": [], "length": [], "targets": []}
    cut = dropped = 0
    for segments, (tokens, scored) in zip(examples, scored_tokens(tokenizer, examples, chat), strict=True):
        row = example_row(
            tokens, scored, max_seq_length, long_examples, f"the {split} example {first_words(segments[0][0])}"
        )
        if row is None:
            dropped += 1
            continue
        cut += len(row[0]) < len(tokens) - 1
        rows["input_ids"].append(row[0])
        rows["labels"].append(row[1])
        rows["length"].append(len(row[0]))
        rows["targets"].append(sum(label != -100 for label in row[1]))
    if not rows["length"]:
        raise DataError(
            f"every example of the {split} data is longer than --max_seq_length {max_seq_length} and "
            "was dropped; raise --max_seq_length"
        )
    return rows, {
        "examples": len(examples),
        "rows": len(rows["length"]),
        "cut": cut,
        "dropped": dropped,
        "tokens": sum(rows["length"]),
        "targets": sum(rows["targets"]),
    }


def pack(rows, max_seq_length):
    """Rows of several examples each, by best-fit decreasing: longest example first, each into the row
    with the least room that still takes it. position_ids restart at 0 with each example."""
    order = sorted(range(len(rows["length"])), key=lambda i: -rows["length"][i])
    bins, room = [], []  # room: sorted (free tokens, bin) pairs
    for i in order:
        n = rows["length"][i]
        at = bisect.bisect_left(room, (n, -1))
        free, b = room.pop(at) if at < len(room) else (max_seq_length, len(bins))
        if b == len(bins):
            bins.append([])
        bins[b].append(i)
        if free - n > 0:
            bisect.insort(room, (free - n, b))
    packed = {"input_ids": [], "labels": [], "position_ids": [], "length": [], "targets": []}
    for members in bins:
        for key in ("input_ids", "labels"):
            packed[key].append([t for i in members for t in rows[key][i]])
        packed["position_ids"].append([p for i in members for p in range(rows["length"][i])])
        packed["length"].append(sum(rows["length"][i] for i in members))
        packed["targets"].append(sum(rows["targets"][i] for i in members))
    return packed


def prepare_prompt_response(
    inputs,
    model_dir,
    tokenizer,
    columns,
    max_seq_length,
    long_examples="truncate",
    packing=False,
    cache_root="runs/tokens",
    template=False,
):
    """The tokenized folder for these inputs (data.splits.DataInputs; written if missing) and its
    info.json as a dict. `columns`: {"prompt": NAME, "response": NAME} or {"messages": NAME};
    `template`: prompt/response pairs as a user turn and an assistant turn of the chat template."""
    import datasets

    if long_examples not in LONG_EXAMPLES:
        raise DataError(f"--long_examples {long_examples}: pass one of {', '.join(LONG_EXAMPLES)}")
    datasets.disable_progress_bars()
    chat = "messages" in columns or template
    key = {
        "format": FORMAT,
        **inputs_key(inputs),
        "tokenizer": tokenizer_files_hash(model_dir),
        "chat_template": tokenizer.chat_template if chat else None,  # --chat_template_path's too
        "columns": columns,
        "max_seq_length": max_seq_length,
        "long_examples": long_examples,
        "packing": packing,
    }

    def write(tmp):
        splits, where = load_splits(inputs)
        info = {
            "columns": columns,
            "chat_template": chat,
            "validation": where,
            "max_seq_length": max_seq_length,
            "packing": packing,
            "splits": {},
        }
        for split, ds in splits.items():
            name = split if split == "train" else f"validation ({where})"
            if "messages" in columns:
                examples = chat_segments(ds, name, columns["messages"], tokenizer)
            else:
                examples = prompt_response_segments(ds, name, columns["prompt"], columns["response"])
                if template:
                    examples = templated_segments(examples, name, tokenizer)
            rows, counts = encode(tokenizer, examples, max_seq_length, long_examples, name, chat)
            if packing and split == "train":
                rows = pack(rows, max_seq_length)
                counts["rows"] = len(rows["length"])
            counts["filled"] = counts["tokens"] / (counts["rows"] * max_seq_length)  # of rows of max_seq_length
            datasets.Dataset.from_dict(rows).save_to_disk(os.path.join(tmp, split))
            info["splits"][split] = counts
        return info

    return cached_folder(cache_root, stem(inputs), key, write)


class CausalBatch:
    """A DatasetsSource transform: rows as one batch padded on the right to its longest row, rounded
    up to a bucket of data/padding.py (never beyond `max_length`). Padding
    is never scored (label -100). Unpacked rows get an attention mask; packed rows get position_ids
    instead (the padding continues as one more sequence of its own), which is how a model that
    supports packing tells the examples apart."""

    def __init__(self, pad_token_id, max_length=None):
        self.pad_token_id, self.max_length = pad_token_id, max_length

    def __call__(self, rows):
        import torch

        rows = {k: v.tolist() if isinstance(v, torch.Tensor) and v.dim() == 2 else v for k, v in rows.items()}
        longest = padded_length(max(len(ids) for ids in rows["input_ids"]), self.max_length)
        n = len(rows["input_ids"])
        out = {
            "input_ids": torch.full((n, longest), self.pad_token_id, dtype=torch.long),
            "labels": torch.full((n, longest), -100, dtype=torch.long),
        }
        packed = "position_ids" in rows
        out["position_ids" if packed else "attention_mask"] = torch.zeros((n, longest), dtype=torch.long)
        for i, ids in enumerate(rows["input_ids"]):
            k = len(ids)
            out["input_ids"][i, :k] = torch.tensor(ids)
            out["labels"][i, :k] = torch.tensor(rows["labels"][i])
            if packed:
                out["position_ids"][i, :k] = torch.tensor(rows["position_ids"][i])
                out["position_ids"][i, k:] = torch.arange(longest - k)
            else:
                out["attention_mask"][i, :k] = 1
        return out
