"""Text for language models: the GCIDE dictionary as an offline English corpus, tokenizers, and
token shards for the exactly-once streaming path.

    python -m data.prepare --dataset gcide --tokenizer bpe --vocab_size 8192 --output_dir runs/tokens/gcide
    python -m data.prepare --train_file notes.txt --validation_split_percentage 5 --tokenizer bytes --output_dir DIR

A split's documents are encoded, each followed by the end-of-text token, into one stream of T token
ids, cut into training windows of --block_size + 1 tokens: window i is tokens [i*B, i*B + B + 1), so
neighbours share one token (the last target of one is the first input of the next) and every token
after the first is a target exactly once. A window is one row: `tokens` (its ids as uint16 when the
vocabulary fits, else uint32, in a fixed-width binary value) and `targets` (how many of its B targets
are real). Training keeps the (T-1) // B full windows; validation adds a last, shorter window padded
with end-of-text, so every validation token is scored once. Rows go into row groups of
--rows_per_group windows: the sharded plan's read unit, so each rank reads only its own row groups
when that divides the per-process batch. The manifest records the tokenizer, the vocabulary size,
the block size and each split's documents, tokens, windows and UTF-8 bytes (what bits per byte divide by).

Tokenizers, none of which touches the network: `bytes` (the 256 byte values plus end-of-text, no
files), `bpe` (a byte-level BPE trained with Hugging Face `tokenizers` on the training split, saved as
tokenizer.json beside the shards), or the path of an existing tokenizer.json.
"""

import gzip
import os

import numpy as np

from data.atomic_folder import atomic_folder, claim, report, up_to_date
from data.errors import DataError
from data.local_files import file_kind, load_files, text_column
from data.shards import fingerprint, hash_files, read_manifest, write_manifest, write_shards
from data.sources import table_to_arrays

EOT = "<|endoftext|>"
GCIDE_FOLDERS = ("/usr/share/dictd", os.path.join("runs", "corpora", "gcide", "usr", "share", "dictd"))
GCIDE_HOW_TO_GET = (
    "install it with `sudo apt-get install dict-gcide`, or without its dict server: "
    "`apt-get download dict-gcide && dpkg-deb -x dict-gcide_*.deb runs/corpora/gcide`"
)
VALIDATION_EVERY = 100  # GCIDE's fixed validation split: every 100th entry, spread over the alphabet
_B64 = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}


def _dictd_number(text):
    """dictd index numbers: base 64 in the alphabet above, most significant digit first."""
    value = 0
    for char in text:
        value = value * 64 + _B64[char]
    return value


def find_gcide(folder=None):
    for candidate in [folder] if folder else GCIDE_FOLDERS:
        if os.path.isfile(os.path.join(candidate, "gcide.index")) and os.path.isfile(
            os.path.join(candidate, "gcide.dict.dz")
        ):
            return candidate
    looked = folder or ", ".join(GCIDE_FOLDERS)
    raise DataError(f"the GCIDE dictionary (gcide.index, gcide.dict.dz) is not in {looked}; {GCIDE_HOW_TO_GET}")


def gcide_documents(folder=None):
    """(train, validation): the dictionary's entries as documents, in dictionary order; the
    database's own metadata entries (00-database-*) left out, entries shared by several headwords once."""
    folder = find_gcide(folder)
    with gzip.open(os.path.join(folder, "gcide.dict.dz"), "rb") as f:  # dictzip is gzip-compatible
        data = f.read()
    spans = set()
    with open(os.path.join(folder, "gcide.index"), encoding="utf-8") as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) == 3 and not parts[0].startswith("00-"):
                spans.add((_dictd_number(parts[1]), _dictd_number(parts[2])))
    documents = [
        data[start : start + length].decode("utf-8", errors="replace").strip() for start, length in sorted(spans)
    ]
    documents = [d for d in documents if d]
    train = [d for i, d in enumerate(documents) if i % VALIDATION_EVERY != VALIDATION_EVERY - 1]
    validation = [d for i, d in enumerate(documents) if i % VALIDATION_EVERY == VALIDATION_EVERY - 1]
    return train, validation


# ---------------------------------------------------------------------------------------- tokenizers


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255 and end-of-text as 256: nothing to train, nothing to save."""

    name, vocab_size, eot_id = "bytes", 257, 256

    def encode_batch(self, texts):
        return [list(text.encode("utf-8")) for text in texts]

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class FileTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json that has the end-of-text token."""

    def __init__(self, tokenizer, name):
        self.tokenizer, self.name = tokenizer, name
        self.vocab_size = tokenizer.get_vocab_size()
        self.eot_id = tokenizer.token_to_id(EOT)
        if self.eot_id is None:
            raise DataError(
                f"tokenizer {name} has no {EOT} token; train one with --tokenizer bpe, or add it as a special token"
            )

    def encode_batch(self, texts):
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids):
        return self.tokenizer.decode(list(ids))

    def save(self, path):
        self.tokenizer.save(path)


def train_bpe(texts, vocab_size):
    """A byte-level BPE of `vocab_size` tokens (end-of-text included) trained on `texts`, offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size <= 257:
        raise DataError(f"--vocab_size {vocab_size} leaves no room for merges (256 bytes + {EOT}); pass e.g. 8192")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return FileTokenizer(tokenizer, f"bpe-{vocab_size}")


def load_tokenizer(spec):
    """`bytes`, or the path of a tokenizer.json (for `bpe`, see train_bpe)."""
    if spec == "bytes":
        return ByteTokenizer()
    if not os.path.isfile(spec):
        raise DataError(f"--tokenizer {spec}: no such tokenizer.json; pass bytes, bpe, or the path of a tokenizer.json")
    from tokenizers import Tokenizer

    try:
        return FileTokenizer(Tokenizer.from_file(spec), os.path.abspath(spec))
    except Exception as e:  # tokenizers raises its own exception types for a malformed file
        raise DataError(
            f"--tokenizer {spec} is not a tokenizer.json ({str(e).splitlines()[0]}); pass bytes, bpe, "
            "or a file saved by Hugging Face tokenizers"
        ) from None


# ---------------------------------------------------------------------------------------- token shards


def token_dtype(vocab_size):
    if vocab_size <= 1 << 16:
        return np.uint16
    if vocab_size <= 1 << 32:
        return np.uint32
    raise DataError(f"a vocabulary of {vocab_size} tokens does not fit uint32 token ids; use a smaller vocabulary")


def encode_documents(documents, tokenizer, batch=1024):
    """One stream of token ids: every document followed by end-of-text; and its UTF-8 byte count
    (each end-of-text counted as the one byte of a separator)."""
    dtype, pieces, num_bytes = token_dtype(tokenizer.vocab_size), [], 0
    eot = np.array([tokenizer.eot_id], dtype)
    for start in range(0, len(documents), batch):
        texts = documents[start : start + batch]
        for ids in tokenizer.encode_batch(texts):
            pieces += [np.asarray(ids, dtype), eot]
        num_bytes += sum(len(t.encode("utf-8")) + 1 for t in texts)
    return (np.concatenate(pieces) if pieces else np.zeros(0, dtype)), num_bytes


def windows(tokens, block_size, keep_tail):
    """(windows [N, B + 1], targets [N]): the stream cut as in the module docstring; with keep_tail,
    a last short window padded with its final token, counted in `targets` only up to the real ones."""
    full = max(len(tokens) - 1, 0) // block_size
    # a strided view, copied once: no index array (8 bytes per token of every window)
    rows = (
        np.lib.stride_tricks.sliding_window_view(tokens, block_size + 1)[::block_size][:full].copy()
        if full
        else np.zeros((0, block_size + 1), tokens.dtype)
    )
    targets = np.full(full, block_size, np.int32)
    tail = len(tokens) - 1 - full * block_size
    if keep_tail and tail > 0:
        last = np.full(block_size + 1, tokens[-1], tokens.dtype)
        last[: tail + 1] = tokens[full * block_size :]
        rows, targets = np.concatenate([rows, last[None]]), np.append(targets, np.int32(tail))
    return rows, targets


def write_token_shards(documents, tokenizer, folder, split, num_shards, rows_per_group, block_size):
    """Encode `documents` into `num_shards` parquet files of windows; return the split's counts."""
    import torch

    if not documents or not any(documents):
        raise DataError(f"the {split} split has no text; pass files with at least one non-empty document")
    tokens, num_bytes = encode_documents(documents, tokenizer)
    rows, targets = windows(tokens, block_size, keep_tail=split != "train")
    if len(tokens) < block_size + 1:
        raise DataError(
            f"the {split} split has {len(tokens)} tokens, not enough for one window of --block_size "
            f"{block_size} + 1; pass more text or a smaller --block_size"
        )
    signed = {np.dtype(np.uint16): np.int16, np.dtype(np.uint32): np.int32}[rows.dtype]  # same bytes, a torch dtype
    write_shards(
        {"tokens": torch.from_numpy(rows.view(signed)), "targets": torch.from_numpy(targets)},
        folder,
        split,
        num_shards,
        rows_per_group,
    )
    return {
        "documents": len(documents),
        "tokens": int(len(tokens)),
        "windows": len(rows),
        "scored_tokens": int(targets.sum()),
        "text_bytes": num_bytes,
    }


def decode_windows(token_dtype_name):
    """A ParquetSource decoder for window shards: `input_ids` and `labels` [rows, B] (int64), labels
    past a window's `targets` set to -100 (ignored by cross_entropy)."""
    import torch

    dtype = np.dtype(token_dtype_name)

    def decode(table):  # in numpy: a batch's few rows cost per operation, and numpy's are cheaper than torch's
        columns = table_to_arrays(table)
        tokens, targets = columns["tokens"].view(dtype), columns["targets"]
        labels = tokens[:, 1:].astype(np.int64)
        labels[np.arange(labels.shape[1]) >= targets[:, None]] = -100  # past a short window's end (a split's tail)
        return {"input_ids": torch.from_numpy(tokens[:, :-1].astype(np.int64)), "labels": torch.from_numpy(labels)}

    return decode


# ---------------------------------------------------------------------------------------- prepare


def prepare_tokens(
    documents,
    output_dir,
    tokenizer_spec,
    vocab_size,
    num_shards,
    rows_per_group,
    inputs,
    arguments,
    block_size,
    force=False,
):
    """{split: [text, ...]} → token shards (data/text.py) + tokenizer.json (unless `bytes`) + manifest,
    atomically, unless already up to date. `documents` may be a function, called only when needed."""
    arguments = {
        **arguments,
        "tokenizer": tokenizer_spec,
        "vocab_size": vocab_size if tokenizer_spec == "bpe" else None,
        "num_shards": num_shards,
        "rows_per_group": rows_per_group,
        "block_size": block_size,
    }
    if tokenizer_spec not in ("bytes", "bpe"):
        tokenizer = load_tokenizer(tokenizer_spec)  # a bad file fails before any work
        inputs = inputs + hash_files([tokenizer_spec])
    if up_to_date(output_dir, inputs, arguments, force):
        return read_manifest(output_dir)
    claim(output_dir, force)  # someone else's folder: refused before the text is read and tokenized
    documents = documents() if callable(documents) else documents
    with atomic_folder(output_dir, force, fingerprint(inputs, arguments)) as tmp:
        if tokenizer_spec == "bpe":
            tokenizer = train_bpe(documents["train"], vocab_size)
        elif tokenizer_spec == "bytes":
            tokenizer = load_tokenizer("bytes")
        if hasattr(tokenizer, "save"):
            tokenizer.save(os.path.join(tmp, "tokenizer.json"))
        counts = {
            split: write_token_shards(docs, tokenizer, tmp, split, num_shards, rows_per_group, block_size)
            for split, docs in documents.items()
            if docs is not None
        }
        manifest = write_manifest(
            tmp,
            inputs,
            arguments,
            {
                "tokenizer": tokenizer.name,
                "vocab_size": tokenizer.vocab_size,
                "eot_id": tokenizer.eot_id,
                "block_size": block_size,
                "token_dtype": np.dtype(token_dtype(tokenizer.vocab_size)).name,
                "text": counts,
            },
        )
    report(output_dir, manifest)
    return manifest


def prepare_text(
    train_files,
    output_dir,
    tokenizer,
    block_size,
    validation_files=None,
    validation_split_percentage=None,
    text_column_name="text",
    vocab_size=8192,
    num_shards=8,
    rows_per_group=8,
    seed=0,
    force=False,
):
    """Local text files (txt, or csv/json/jsonl/parquet with a text column) → window shards."""
    file_kind(train_files, validation_files)  # bad input fails before the inputs are hashed
    inputs = hash_files(list(train_files) + list(validation_files or []))

    def documents():
        validation = list(validation_files or []) or None
        return text_column(
            load_files(list(train_files), validation, validation_split_percentage, seed), text_column_name
        )

    return prepare_tokens(
        documents,
        output_dir,
        tokenizer,
        vocab_size,
        num_shards,
        rows_per_group,
        inputs,
        {
            "kind": "text",
            "text_column": text_column_name,
            "seed": seed,
            "validation_split_percentage": validation_split_percentage,
        },
        block_size,
        force,
    )


def prepare_gcide(
    output_dir, tokenizer, block_size, vocab_size=8192, num_shards=8, rows_per_group=8, folder=None, force=False
):
    """The GCIDE dictionary (data/text.py) → window shards."""
    folder = find_gcide(folder)
    inputs = hash_files([os.path.join(folder, "gcide.index"), os.path.join(folder, "gcide.dict.dz")])
    return prepare_tokens(
        lambda: dict(zip(("train", "validation"), gcide_documents(folder), strict=True)),
        output_dir,
        tokenizer,
        vocab_size,
        num_shards,
        rows_per_group,
        inputs,
        {"kind": "gcide"},
        block_size,
        force,
    )
