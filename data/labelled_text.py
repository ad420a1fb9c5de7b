"""Labelled text for a sequence classifier: read once, tokenized once, kept as memory-mapped Arrow.

prepare_labelled_text reads --train_file/--validation_file (csv, tsv, json/jsonl, parquet) or a
`datasets` folder written by `save_to_disk`, maps the labels (strings or integers) to ids in the
training data's order of names, tokenizes each row with the model's own tokenizer (one text column,
or two for sentence pairs) and writes the result to a folder named by a hash of everything that
decides it: the inputs' contents, the tokenizer's files, the columns, --max_seq_length and the
validation split. A later run with the same inputs finds that folder and tokenizes nothing; every
process of a run reads the main process's folder.

Rows are stored unpadded (input_ids, token_type_ids for tokenizers that use them, label, length);
TokenBatch pads each batch to its own longest row (dynamic padding), on the side the tokenizer pads.
"""
import hashlib
import json
import os
import shutil

import torch

from data.errors import DataError
from data.local_files import hold_out, load_files
from data.shards import hash_files

FORMAT = 1  # of the folder written here; a change makes every cached folder stale
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.txt", "vocab.json", "merges.txt")


def tokenizer_files_hash(model_dir):
    """Of the tokenizer's files in the model folder (a sentencepiece .model and a chat template's .jinja among them)."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(os.listdir(model_dir)):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path) and (name in TOKENIZER_FILES or name.endswith((".model", ".jinja"))):
            with open(path, "rb") as f:
                h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()


def _input_hash(paths):
    """Of the inputs' contents and kinds (the same bytes as .csv and .tsv are other rows): a save_to_disk
    folder's files, or the files themselves."""
    if len(paths) == 1 and os.path.isdir(paths[0]):
        paths = [os.path.join(root, n) for root, _, names in sorted(os.walk(paths[0])) for n in sorted(names)]
    return [{"kind": os.path.splitext(entry["path"])[1], "bytes": entry["bytes"], "blake2b": entry["blake2b"]}
            for entry in hash_files(paths)]


def load_splits(train_files, validation_files, validation_split_percentage, seed):
    """{"train", "validation"} datasets from files or from one `save_to_disk` folder."""
    if len(train_files) == 1 and os.path.isdir(train_files[0]):
        import datasets

        try:
            saved = datasets.load_from_disk(train_files[0])
        except (FileNotFoundError, ValueError) as e:
            raise DataError(f"--train_file {train_files[0]} is a folder but not one written by datasets' "
                            f"save_to_disk ({' '.join(str(e).split())[:100]}); pass a csv/tsv/json/jsonl/parquet file")
        if isinstance(saved, datasets.DatasetDict):
            if "train" not in saved:
                raise DataError(f"--train_file {train_files[0]} holds the splits {', '.join(saved)}, no 'train'")
            validation = saved.get("validation", saved.get("test"))
            saved = saved["train"]
        else:
            validation = None
        if validation_files:
            validation = load_splits(validation_files, None, None, seed)["train"]
        if validation is None:
            saved, validation = hold_out(saved, validation_split_percentage or 10, seed)
        return {"train": saved, "validation": validation}
    return load_files(train_files, validation_files, None if validation_files else (validation_split_percentage or 10),
                      seed)


def label_names(train, validation, column):
    """The class names (sorted; integers in numeric order) and each split's label ids."""
    for split, ds in (("train", train), ("validation", validation)):
        if column not in ds.column_names:
            raise DataError(f"no label column {column!r} in the {split} data (columns: {', '.join(ds.column_names)});"
                            " pass --label_column NAME")
    values = {split: ds[column] for split, ds in (("train", train), ("validation", validation))}
    for split, vs in values.items():
        if any(v is None or v == "" for v in vs):
            raise DataError(f"the {split} data has {sum(v is None or v == '' for v in vs)} row(s) without a "
                            f"{column!r}; fill them in or drop those rows")
    class_names = getattr(train.features[column], "names", None)  # a datasets ClassLabel: its own names
    if class_names:
        values = {split: [class_names[v] for v in vs] for split, vs in values.items()}
    if any(isinstance(v, float) and not v.is_integer() for vs in values.values() for v in vs):
        raise DataError(f"column {column!r} holds numbers with decimals; a classifier needs classes (names or "
                        "integers): round them, or pass another --label_column")
    values = {split: [int(v) if isinstance(v, float) else v for v in vs] for split, vs in values.items()}
    numeric = all(isinstance(v, int) and not isinstance(v, bool) for vs in values.values() for v in vs)
    names = sorted({str(v) for v in values["train"]}, key=int if numeric else None)
    if len(names) < 2:
        raise DataError(f"the training data has {len(names)} distinct {column!r} value(s); a classifier needs at "
                        "least 2 classes")
    unseen = sorted({str(v) for v in values["validation"]} - set(names))
    if unseen:
        raise DataError(f"the validation data has label(s) never seen in training: {', '.join(unseen[:10])}; add "
                        "training rows with them, or drop those validation rows (pass a --validation_file when the "
                        "held-out split took every row of a rare class)")
    ids = {name: i for i, name in enumerate(names)}
    return names, {split: [ids[str(v)] for v in vs] for split, vs in values.items()}


def text_columns(ds, columns, split):
    for column in columns:
        if column not in ds.column_names:
            raise DataError(f"no text column {column!r} in the {split} data (columns: {', '.join(ds.column_names)}); "
                            "pass --text_column NAME (two comma-separated for sentence pairs)")
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


def prepare_labelled_text(train_files, validation_files, validation_split_percentage, seed, model_dir, tokenizer,
                          text_column_names, label_column, max_seq_length, cache_root="runs/tokens"):
    """The tokenized folder for these inputs (written if missing) and its info.json as a dict."""
    import datasets

    datasets.disable_progress_bars()
    key = {"format": FORMAT, "inputs": _input_hash(train_files), "validation": validation_files and
           _input_hash(validation_files),
           # the held-out split (its default as the number) and its seed, only where there is one
           "split": None if validation_files else [validation_split_percentage or 10, seed],
           "tokenizer": tokenizer_files_hash(model_dir), "text": text_column_names,
           "label": label_column, "max_seq_length": max_seq_length}
    stem = os.path.splitext(os.path.basename(os.path.normpath(train_files[0])))[0]

    def write(tmp):
        splits = load_splits(train_files, validation_files, validation_split_percentage, seed)
        names, labels = label_names(splits["train"], splits["validation"], label_column)
        info = {"labels": names, "text_columns": text_column_names, "max_seq_length": max_seq_length, "splits": {}}
        for split, ds in splits.items():
            rows, at_limit = tokenize(tokenizer, text_columns(ds, text_column_names, split), max_seq_length)
            rows["label"] = labels[split]
            datasets.Dataset.from_dict(rows).save_to_disk(os.path.join(tmp, split))
            info["splits"][split] = {"rows": len(ds), "tokens": sum(rows["length"]), "at_max_seq_length": at_limit}
        return info

    return cached_folder(cache_root, stem, key, write)


def cached_folder(cache_root, stem, key, write):
    """(folder, info): the folder CACHE_ROOT/STEM-HASH named by a hash of `key` (everything that decides
    its content), written by write(tmp_folder) -> info (kept as info.json) when it is not there yet.
    The folder appears in one rename, so one of this name is always complete."""
    digest = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=8).hexdigest()
    folder = os.path.join(cache_root, f"{stem}-{digest}")
    if os.path.isfile(os.path.join(folder, "info.json")):
        with open(os.path.join(folder, "info.json")) as f:
            return folder, json.load(f)
    tmp = f"{folder}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
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
    """A DatasetsSource transform: the rows' token lists as one padded batch with an attention mask.
    Classifiers pad on the right: on the left, a model with absolute positions gives a row another
    result in each batch it lands in."""

    def __init__(self, pad_token_id, padding_side="right"):
        self.pad_token_id, self.left = pad_token_id, padding_side == "left"

    def __call__(self, rows):
        # rows of equal length come from Arrow as one [rows, length] tensor, others as lists
        rows = {k: v.tolist() if isinstance(v, torch.Tensor) and v.dim() == 2 else v for k, v in rows.items()}
        longest = max((len(ids) for ids in rows["input_ids"]), default=0)
        out = {"labels": rows["label"]}
        for name, fill in (("input_ids", self.pad_token_id), ("token_type_ids", 0), ("attention_mask", 0)):
            values = rows["input_ids"] if name == "attention_mask" else rows.get(name)
            if values is None:
                continue
            padded = torch.full((len(values), longest), fill, dtype=torch.long)
            for i, ids in enumerate(values):
                row = torch.ones(len(ids), dtype=torch.long) if name == "attention_mask" else torch.tensor(ids)
                if self.left:
                    padded[i, longest - len(ids):] = row
                else:
                    padded[i, :len(ids)] = row
            out[name] = padded
        return out
