"""Labelled text for a sequence classifier: read once, tokenized once, kept as memory-mapped Arrow.

prepare_labelled_text reads the two splits (data/splits.py: files, a `save_to_disk` folder or a
dataset name), maps the labels to ids (a ClassLabel's own ids; names or integers otherwise, sorted;
a pretrained head's order when its names are the data's), refuses or leaves out rows without a label
(--missing_labels), tokenizes each row with the model's own tokenizer (one text column, or two for
sentence pairs) and writes the result to a folder named by a hash of everything that decides it: the
inputs' contents, the tokenizer's files, the columns, --max_seq_length and the validation split. A
later run with the same inputs finds that folder and tokenizes nothing; every process of a run reads
the main process's folder.

Rows are stored unpadded (input_ids, token_type_ids for tokenizers that use them, label, length);
TokenBatch pads each batch to its own longest row (dynamic padding), on the side the tokenizer pads.
"""

import hashlib
import json
import os
import shutil
import tempfile

import torch

from data.errors import DataError
from data.padding import padded_length
from data.splits import inputs_key, load_splits, missing_labels, stem

FORMAT = 2  # of the folder written here; a change makes every cached folder stale
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
)


def tokenizer_files_hash(model_dir):
    """Of the tokenizer's files in the model folder (a sentencepiece .model and a chat template's .jinja among them)."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(os.listdir(model_dir)):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path) and (name in TOKENIZER_FILES or name.endswith((".model", ".jinja"))):
            with open(path, "rb") as f:
                h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()


MISSING_LABELS = ("error", "drop")  # --missing_labels: a row without a label is refused, or left out and counted


def label_names(train, validation, column, preferred=None):
    """The class names and each split's label ids (None for a row without a label: splits.missing_labels).

    A datasets ClassLabel column keeps its own names in its own order: its ids are the dataset's.
    Other labels (strings, integers) are named by their values, sorted (integers in numeric order).
    `preferred` (a pretrained classifier's names, in its id order) is the order when its names are
    the data's: the head the model has then keeps its meaning."""
    for split, ds in (("train", train), ("validation", validation)):
        if column not in ds.column_names:
            raise DataError(
                f"no label column {column!r} in the {split} data (columns: {', '.join(ds.column_names)});"
                " pass --label_column NAME"
            )
    missing = {split: set(missing_labels(ds, column)) for split, ds in (("train", train), ("validation", validation))}
    values = {
        split: [None if i in missing[split] else v for i, v in enumerate(ds[column])]
        for split, ds in (("train", train), ("validation", validation))
    }
    class_names = getattr(train.features[column], "names", None)  # a datasets ClassLabel: its own names
    if class_names:
        values = {split: [None if v is None else class_names[v] for v in vs] for split, vs in values.items()}
    if any(isinstance(v, float) and not v.is_integer() for vs in values.values() for v in vs):
        raise DataError(
            f"column {column!r} holds numbers with decimals; a classifier needs classes (names or "
            "integers): round them, or pass another --label_column"
        )
    values = {split: [int(v) if isinstance(v, float) else v for v in vs] for split, vs in values.items()}
    present = [v for vs in values.values() for v in vs if v is not None]
    numeric = all(isinstance(v, int) and not isinstance(v, bool) for v in present)
    names = (
        list(class_names)
        if class_names
        else sorted({str(v) for v in values["train"] if v is not None}, key=int if numeric else None)
    )
    if preferred and sorted(map(str, preferred)) == sorted(names):
        names = [str(n) for n in preferred]
    if len(names) < 2:
        raise DataError(
            f"the training data has {len(names)} distinct {column!r} value(s); a classifier needs at least 2 classes"
        )
    unseen = sorted({str(v) for v in values["validation"] if v is not None} - set(names))
    if unseen:
        raise DataError(
            f"the validation data has label(s) never seen in training: {', '.join(unseen[:10])}; add "
            "training rows with them, or drop those validation rows (pass a --validation_file when the "
            "held-out split took every row of a rare class)"
        )
    ids = {name: i for i, name in enumerate(names)}
    return names, {split: [None if v is None else ids[str(v)] for v in vs] for split, vs in values.items()}


def first_words(text):
    """A row named by its first words: a held-out split's row numbers are not the file's (it is a
    random part of the file, in random order)."""
    text = " ".join(str(text).split())
    return repr(text[:40] + ("..." if len(text) > 40 else ""))


def without_missing_labels(ds, labels, column, split, policy, text_column=None):
    """(ds, labels) without the rows that have no label, refused in one line naming them (by their
    `text_column`'s first words where given) unless policy is "drop"; and how many were left out."""
    missing = [i for i, label in enumerate(labels) if label is None]
    if not missing:
        return ds, labels, 0
    if policy != "drop":
        text_column = text_column if text_column in ds.column_names else None  # a missing one is refused later
        named = [first_words(ds[i][text_column]) for i in missing[:3]] if text_column else missing[:5]
        shown = ", ".join(map(str, named)) + (", ..." if len(missing) > len(named) else "")
        raise DataError(
            f"the {split} data has {len(missing)} row(s) without a {column!r} ({'' if text_column else 'row '}"
            f"{shown}; empty, or datasets' -1 for 'no label'); fill them in, or pass --missing_labels drop to "
            "leave them out"
        )
    keep = [i for i, label in enumerate(labels) if label is not None]
    if not keep:
        raise DataError(
            f"no row of the {split} data has a {column!r}; pass labelled data (a split without any "
            "label cannot train or evaluate a classifier)"
        )
    return ds.select(keep), [labels[i] for i in keep], len(missing)


def text_columns(ds, columns, split):
    for column in columns:
        if column not in ds.column_names:
            raise DataError(
                f"no text column {column!r} in the {split} data (columns: {', '.join(ds.column_names)}); "
                "pass --text_column NAME (two comma-separated for sentence pairs)"
            )
        if getattr(ds.features[column], "dtype", None) not in ("string", "large_string"):
            raise DataError(f"column {column!r} holds {ds.features[column]}, not text; pass --text_column NAME")
    return [[t or "" for t in ds[column]] for column in columns]


def tokenize(tokenizer, texts, max_seq_length):
    """Token ids (and token types) per row, cut to max_seq_length, and how many rows reached it."""
    encoded = tokenizer(*texts, truncation=True, max_length=max_seq_length)
    rows = {"input_ids": encoded["input_ids"]}
    if "token_type_ids" in encoded and "token_type_ids" in tokenizer.model_input_names:
        rows["token_type_ids"] = encoded["token_type_ids"]
    rows["length"] = [len(ids) for ids in encoded["input_ids"]]
    return rows, sum(n >= max_seq_length for n in rows["length"])


def prepare_labelled_text(
    inputs,
    model_dir,
    tokenizer,
    text_column_names,
    label_column,
    max_seq_length,
    cache_root="runs/tokens",
    preferred_labels=None,
    missing_labels="error",
):
    """The tokenized folder for these inputs (data.splits.DataInputs; written if missing) and its
    info.json as a dict: the label names, which split evaluates, each split's counts."""
    import datasets

    datasets.disable_progress_bars()
    if missing_labels not in MISSING_LABELS:
        raise DataError(f"--missing_labels {missing_labels}: pass one of {', '.join(MISSING_LABELS)}")
    key = {
        "format": FORMAT,
        **inputs_key(inputs),
        "tokenizer": tokenizer_files_hash(model_dir),
        "text": text_column_names,
        "label": label_column,
        "max_seq_length": max_seq_length,
        "preferred_labels": preferred_labels,
        "missing_labels": missing_labels,
    }

    def write(tmp):
        splits, where = load_splits(inputs, label_column)
        names, labels = label_names(splits["train"], splits["validation"], label_column, preferred_labels)
        info = {
            "labels": names,
            "validation": where,
            "text_columns": text_column_names,
            "max_seq_length": max_seq_length,
            "splits": {},
        }
        for split, ds in splits.items():
            ds, ids, dropped = without_missing_labels(
                ds, labels[split], label_column, split, missing_labels, text_column_names[0]
            )
            rows, at_limit = tokenize(tokenizer, text_columns(ds, text_column_names, split), max_seq_length)
            rows["label"] = ids
            datasets.Dataset.from_dict(rows).save_to_disk(os.path.join(tmp, split))
            info["splits"][split] = {
                "rows": len(ds),
                "tokens": sum(rows["length"]),
                "at_max_seq_length": at_limit,
                "unlabelled_dropped": dropped,
            }
        return info

    return cached_folder(cache_root, stem(inputs), key, write)


def cached_folder(cache_root, stem, key, write):
    """(folder, info): the folder CACHE_ROOT/STEM-HASH named by a hash of `key` (everything that decides
    its content), written by write(tmp_folder) -> info (kept as info.json) when it is not there yet.
    The folder appears in one rename, so one of this name is always complete."""
    digest = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=8).hexdigest()
    folder = os.path.join(cache_root, f"{stem}-{digest}")
    if os.path.isfile(os.path.join(folder, "info.json")):
        with open(os.path.join(folder, "info.json")) as f:
            return folder, json.load(f)
    os.makedirs(cache_root, exist_ok=True)
    # a name no other writer has: two hosts sharing the cache may run processes of the same pid
    tmp = tempfile.mkdtemp(dir=cache_root, prefix=f"{stem}-{digest}.tmp-")
    try:
        info = write(tmp)
        with open(os.path.join(tmp, "info.json"), "w") as f:
            json.dump(info, f, indent=1)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.rename(tmp, folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isfile(os.path.join(folder, "info.json")):
            raise
        # another run wrote the same inputs meanwhile: the same content, theirs is used
    return folder, info


class TokenBatch:
    """A DatasetsSource transform: the rows' token lists as one padded batch with an attention mask,
    as long as the longest row rounded up to a bucket of data/padding.py (never beyond `max_length`).
    Classifiers pad on the right: on the left, a model with absolute positions gives a row another
    result in each batch it lands in."""

    def __init__(self, pad_token_id, padding_side="right", max_length=None):
        self.pad_token_id, self.left, self.max_length = pad_token_id, padding_side == "left", max_length

    def __call__(self, rows):
        # rows of equal length come from Arrow as one [rows, length] tensor, others as lists
        rows = {k: v.tolist() if isinstance(v, torch.Tensor) and v.dim() == 2 else v for k, v in rows.items()}
        longest = padded_length(max((len(ids) for ids in rows["input_ids"]), default=0), self.max_length)
        out = {"labels": rows["label"]}
        for name, fill in (("input_ids", self.pad_token_id), ("token_type_ids", 0), ("attention_mask", 0)):
            values = rows["input_ids"] if name == "attention_mask" else rows.get(name)
            if values is None:
                continue
            padded = torch.full((len(values), longest), fill, dtype=torch.long)
            for i, ids in enumerate(values):
                row = torch.ones(len(ids), dtype=torch.long) if name == "attention_mask" else torch.tensor(ids)
                if self.left:
                    padded[i, longest - len(ids) :] = row
                else:
                    padded[i, : len(ids)] = row
            out[name] = padded
        return out
