"""Preference pairs for train/dpo.py: a prompt and two responses to it, the chosen and the rejected;
read once, tokenized once, kept as memory-mapped Arrow (the cache of data/labelled_text.py).

Two formats, as TRL's preference datasets have them: string columns (--prompt_column,
--chosen_column, --rejected_column), or conversations: `chosen` and `rejected` lists of
{"role", "content"} turns, with the prompt's turns in the prompt column or, without one, the turns
the two share at their start. A conversation is rendered with the tokenizer's chat template: the
prompt's turns with the generation prompt, then the response's turns after them.

Each side of a pair is tokenized whole, prompt then response, as data/prompt_response.py does for an
example (the tokens holding the response's characters are scored, and end-of-text after a plain-text
response), and stored as one row per pair: chosen_input_ids, chosen_labels (shifted, -100 where
nothing is scored), the same for rejected, `length` (the longer side, for batching by length) and
each side's count of scored tokens. A side over --max_seq_length is cut at its end (`truncate`),
or the pair is left out (`drop`) or refused (`error`); a pair whose prompt fills the length alone
has nothing to score and is left out under `truncate` and `drop` (counted), refused under `error`.
A pair whose chosen response is its rejected one has no preference to learn (its gradient is 0, and
it would only dilute its step): it is left out and counted. The reference model's log-probabilities
of each side are added by the training script (train/dpo.py), beside this folder.
"""

import os

from data.errors import DataError
from data.labelled_text import cached_folder, first_words, tokenizer_files_hash
from data.padding import padded_length
from data.prompt_response import (
    LONG_EXAMPLES,
    check_chat_template,
    example_row,
    render_turns,
    scored_tokens,
    special_texts,
    turn_and_separator,
)
from data.splits import inputs_key, load_splits, stem

FORMAT = 3  # of the folder written here; a change makes every cached folder stale
SIDES = ("chosen", "rejected")


def _is_conversation(value):
    return isinstance(value, list) and all(isinstance(t, dict) and {"role", "content"} <= set(t) for t in value)


def _column(ds, column, split, flag):
    if column not in ds.column_names:
        raise DataError(
            f"no column {column!r} in the {split} data (columns: {', '.join(ds.column_names)}); pass {flag} NAME"
        )
    return ds[column]


def pair_segments(ds, split, columns, tokenizer, template=False):
    """Per pair: the (text, is_target) segments of its chosen side and of its rejected side, and
    whether they went through the chat template (conversations, or with `template` plain text as a
    user turn and an assistant turn)."""
    chosen = _column(ds, columns["chosen"], split, "--chosen_column")
    rejected = _column(ds, columns["rejected"], split, "--rejected_column")
    conversational = _is_conversation(chosen[0]) if chosen else False
    prompts = ds[columns["prompt"]] if columns["prompt"] in ds.column_names else None
    if prompts is None and not conversational:
        _column(ds, columns["prompt"], split, "--prompt_column")  # plain text needs its prompt: the one line
    specials = special_texts(tokenizer) if conversational or template else set()  # once, not per pair
    pairs = []
    for i, (good, bad) in enumerate(zip(chosen, rejected, strict=True)):
        prompt = prompts[i] if prompts is not None else None
        where = f"the {split} pair {first_words(_prompt_text(prompt, good))}"
        if prompt is not None and not isinstance(prompt, str) and not _is_conversation(prompt):
            raise DataError(f"{where}: {columns['prompt']!r} holds {type(prompt).__name__}, not text or turns")
        if conversational and isinstance(prompt, str):
            raise DataError(
                f"{where}: {columns['prompt']!r} holds text and {columns['chosen']!r} conversations; pass the "
                "prompt as a list of {'role', 'content'} turns, or leave the prompt column out (the turns both "
                "sides share at their start are then the prompt)"
            )
        if not conversational and isinstance(prompt, list):
            raise DataError(
                f"{where}: {columns['prompt']!r} holds conversation turns and {columns['chosen']!r} text; pass "
                "the responses as lists of assistant turns, or the prompt as text"
            )
        if not conversational:
            for name, text in (("chosen", good), ("rejected", bad)):
                if not isinstance(text, str) or not text.strip():
                    raise DataError(f"{where} has an empty {name} response; fill it in or drop the pair")
            if template:
                user = [{"role": "user", "content": prompt or ""}]
                pairs.append(
                    tuple(
                        _rendered(tokenizer, user, [{"role": "assistant", "content": t}], where, specials)
                        for t in (good, bad)
                    )
                )
            else:
                pairs.append(tuple([(prompt or "", False), (text, True)] for text in (good, bad)))
            continue
        if not (_is_conversation(good) and _is_conversation(bad)):
            raise DataError(
                f"{where}: {columns['chosen']!r} and {columns['rejected']!r} hold conversations in some "
                "rows and not in others; every row must be a list of {'role', 'content'} turns"
            )
        if prompt is None:  # the turns both sides share at their start are the prompt (TRL's implicit prompt)
            shared = 0
            while shared < min(len(good), len(bad)) and good[shared] == bad[shared]:
                shared += 1
            prompt, good, bad = good[:shared], good[shared:], bad[shared:]
        for name, turns in (("chosen", good), ("rejected", bad)):
            if not any((t["content"] or "").strip() for t in turns):
                raise DataError(f"{where} has an empty {name} response; fill it in or drop the pair")
        pairs.append(tuple(_rendered(tokenizer, prompt, turns, where, specials) for turns in (good, bad)))
    return pairs, conversational or template


def _prompt_text(prompt, response):
    if isinstance(prompt, str):
        return prompt
    turns = prompt if isinstance(prompt, list) else response if isinstance(response, list) else []
    return next((t.get("content") or "" for t in turns if isinstance(t, dict)), "")


def _rendered(tokenizer, prompt, response, where, specials):
    """The segments of prompt turns then response turns, rendered by the chat template: the prompt with
    the generation prompt is context, what the response's turns add after it is the target, less the
    separator the template writes after its last end-of-turn token (data/prompt_response.py)."""
    check_chat_template(tokenizer, "the preference data are conversations")
    before = render_turns(tokenizer, prompt, where, add_generation_prompt=True)
    after = render_turns(tokenizer, prompt + response, where)
    if not after.startswith(before):
        raise DataError(
            f"{where}: the chat template renders the prompt differently once the response follows, so "
            "the response cannot be found; pass the pairs as plain-text prompt/chosen/rejected columns"
        )
    turn, separator = turn_and_separator(after[len(before) :], specials)
    return [(before, False), (turn, True), (separator, False)]


def encode_pairs(tokenizer, pairs, max_seq_length, long_examples, split, chat):
    """Rows (one per pair) and counts: pairs, rows, cut, dropped (longer than max_seq_length, with
    `drop`), long_prompts (left out: a prompt that fills max_seq_length alone), same (left out: the two
    sides are one text, nothing to prefer)."""
    sides = {side: scored_tokens(tokenizer, [pair[k] for pair in pairs], chat) for k, side in enumerate(SIDES)}
    rows = {key: [] for side in SIDES for key in (f"{side}_input_ids", f"{side}_labels", f"{side}_targets")}
    rows["length"] = []
    cut = dropped = long_prompts = same = 0
    for pair, chosen, rejected in zip(pairs, sides["chosen"], sides["rejected"], strict=True):
        what = f"the {split} pair {first_words(pair[0][0][0])}"
        if chosen[0] == rejected[0]:
            same += 1
            continue
        # its first scored token's position: a prompt of more than max_seq_length tokens leaves none to score
        if long_examples != "error" and any(
            True in scored and scored.index(True) > max_seq_length for _, scored in (chosen, rejected)
        ):
            long_prompts += 1
            continue
        made = [
            example_row(*tokens, max_seq_length, long_examples, f"{what}'s {side} side")
            for side, tokens in zip(SIDES, (chosen, rejected), strict=True)
        ]
        if None in made:
            dropped += 1
            continue
        cut += any(len(row[0]) < len(tokens[0]) - 1 for row, tokens in zip(made, (chosen, rejected), strict=True))
        for side, (ids, labels) in zip(SIDES, made, strict=True):
            rows[f"{side}_input_ids"].append(ids)
            rows[f"{side}_labels"].append(labels)
            rows[f"{side}_targets"].append(sum(label != -100 for label in labels))
        rows["length"].append(max(len(made[0][0]), len(made[1][0])))
    if pairs and same == len(pairs):
        raise DataError(
            f"in every pair of the {split} data the chosen response is the rejected one: nothing to "
            "prefer; check --chosen_column and --rejected_column"
        )
    if not rows["length"]:
        raise DataError(
            f"every pair of the {split} data is longer than --max_seq_length {max_seq_length}"
            + (f" ({long_prompts} of them in its prompt alone)" if long_prompts else "")
            + " and was left out; raise --max_seq_length"
        )
    return rows, {
        "pairs": len(pairs),
        "rows": len(rows["length"]),
        "cut": cut,
        "dropped": dropped,
        "long_prompts": long_prompts,
        "same": same,
        "tokens": sum(len(ids) for side in SIDES for ids in rows[f"{side}_input_ids"]),
    }


def prepare_preferences(
    inputs,
    model_dir,
    tokenizer,
    columns,
    max_seq_length,
    long_examples="truncate",
    cache_root="runs/tokens",
    template=False,
):
    """The tokenized folder for these inputs (data.splits.DataInputs; written if missing) and its
    info.json as a dict. `columns`: {"prompt": NAME, "chosen": NAME, "rejected": NAME}; `template`:
    plain-text pairs as a user turn and an assistant turn of the chat template."""
    import datasets

    if long_examples not in LONG_EXAMPLES:
        raise DataError(f"--long_examples {long_examples}: pass one of {', '.join(LONG_EXAMPLES)}")
    datasets.disable_progress_bars()
    key = {
        "format": FORMAT,
        **inputs_key(inputs),
        "tokenizer": tokenizer_files_hash(model_dir),
        "chat_template": tokenizer.chat_template,  # --chat_template_path's too
        "template": template,
        "columns": columns,
        "max_seq_length": max_seq_length,
        "long_examples": long_examples,
    }

    def write(tmp):
        splits, where = load_splits(inputs)
        info = {"columns": columns, "validation": where, "max_seq_length": max_seq_length, "splits": {}}
        for split, ds in splits.items():
            name = split if split == "train" else f"validation ({where})"
            pairs, chat = pair_segments(ds, name, columns, tokenizer, template)
            rows, counts = encode_pairs(tokenizer, pairs, max_seq_length, long_examples, name, chat)
            datasets.Dataset.from_dict(rows).save_to_disk(os.path.join(tmp, split))
            info["splits"][split] = counts
            info["conversational"] = chat
        return info

    return cached_folder(cache_root, stem(inputs), key, write)


class PairBatch:
    """A DatasetsSource transform: B pairs as one batch of 2B rows, the chosen sides then the rejected
        ones (one forward pass for both), padded on the right to the longest, rounded up to a bucket of
    data/padding.py (never beyond `max_length`); padding is never scored.
        The reference log-probabilities, where the rows carry them, come along per pair."""

    def __init__(self, pad_token_id, max_length=None):
        self.pad_token_id, self.max_length = pad_token_id, max_length

    def __call__(self, rows):
        import torch

        rows = {k: v.tolist() if isinstance(v, torch.Tensor) and v.dim() == 2 else v for k, v in rows.items()}
        sequences = rows["chosen_input_ids"] + rows["rejected_input_ids"]
        labels = rows["chosen_labels"] + rows["rejected_labels"]
        longest = padded_length(max(len(ids) for ids in sequences), self.max_length)
        out = {
            "input_ids": torch.full((len(sequences), longest), self.pad_token_id, dtype=torch.long),
            "labels": torch.full((len(sequences), longest), -100, dtype=torch.long),
            "attention_mask": torch.zeros((len(sequences), longest), dtype=torch.long),
        }
        for i, (ids, scored) in enumerate(zip(sequences, labels, strict=True)):
            out["input_ids"][i, : len(ids)] = torch.tensor(ids)
            out["labels"][i, : len(ids)] = torch.tensor(scored)
            out["attention_mask"][i, : len(ids)] = 1
        out["targets"] = torch.as_tensor(list(rows["chosen_targets"]) + list(rows["rejected_targets"]))
        for side in SIDES:
            if f"ref_{side}" in rows:
                out[f"ref_{side}"] = torch.as_tensor(rows[f"ref_{side}"], dtype=torch.float32)
        return out
