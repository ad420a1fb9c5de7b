"""data/text.py and `python -m data.prepare --tokenizer`: the GCIDE reader, the tokenizers, and token
shards that give back exactly the documents they were made from."""

import gzip
import json
import os

import numpy as np
import pytest

from data.prepare import main as prepare_main
from data.shards import shards_in
from data.sources import ParquetSource
from data.text import (
    ByteTokenizer,
    _dictd_number,
    decode_windows,
    encode_documents,
    gcide_documents,
    load_tokenizer,
    token_dtype,
    windows,
)

DOCS = [
    "Abacus\n  A counting frame.",
    "Zebra (Z\u0113\u2032bra), n. A striped animal.",
    "caf\u00e9 \u2014 a small restaurant",
]


def dictd(n):
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    digits = ""
    while True:
        digits = alphabet[n % 64] + digits
        n //= 64
        if not n:
            return digits


def fake_gcide(folder, documents):
    """A dictd database the way dict-gcide ships it: gzip-compatible text and an index of base-64 spans."""
    text, index = b"", []
    meta = b"00-database-info\nThis file was converted ...\n"
    index.append(("00-database-info", 0, len(meta)))
    text += meta
    for i, doc in enumerate(documents):
        raw = doc.encode("utf-8") + b"\n\n"
        index.append((f"head{i}", len(text), len(raw)))
        if i == 1:
            index.append(("another headword", len(text), len(raw)))  # two headwords, one entry
        text += raw
    os.makedirs(folder, exist_ok=True)
    with gzip.open(os.path.join(folder, "gcide.dict.dz"), "wb") as f:
        f.write(text)
    with open(os.path.join(folder, "gcide.index"), "w", encoding="utf-8") as f:
        f.writelines(f"{word}\t{dictd(start)}\t{dictd(length)}\n" for word, start, length in index)


def stream(folder, split):
    """The token stream the windows of `split` were cut from: the first window's first input, then
    every window's real targets, in order."""
    import torch

    manifest = json.load(open(os.path.join(folder, "manifest.json")))
    source = ParquetSource(shards_in(folder, split), decode=decode_windows(manifest["token_dtype"]))
    batch = source.read(torch.arange(source.num_rows))
    labels = batch["labels"]
    assert torch.equal(batch["input_ids"][1:, 0], labels[:-1, -1]), "neighbouring windows share one token"
    return np.concatenate([batch["input_ids"][:1, 0].numpy(), labels[labels != -100].numpy()])


def documents_of(tokens, tokenizer):
    cuts = np.nonzero(tokens == tokenizer.eot_id)[0]
    assert len(cuts) and cuts[-1] == len(tokens) - 1, "every document ends with end-of-text"
    return [tokenizer.decode(piece.tolist()) for piece in np.split(tokens, cuts + 1)[:-1]]


def test_dictd_numbers_and_the_gcide_reader(tmp_path):
    assert _dictd_number("A") == 0 and _dictd_number("BA") == 64 and _dictd_number("/") == 63
    assert all(_dictd_number(dictd(n)) == n for n in (0, 1, 63, 64, 4095, 40_000_000))
    documents = [f"entry {i} \u00e6" for i in range(250)]
    fake_gcide(str(tmp_path), documents)
    train, validation = gcide_documents(str(tmp_path))
    assert validation == [documents[99], documents[199]]  # every 100th, fixed
    assert sorted(train + validation) == sorted(documents)  # metadata left out, the shared entry once


def test_bytes_tokenizer_gives_back_every_document_and_counts_bytes():
    tokenizer = ByteTokenizer()
    tokens, num_bytes = encode_documents(DOCS, tokenizer)
    assert tokens.dtype == np.uint16 and num_bytes == sum(len(d.encode()) + 1 for d in DOCS) == len(tokens)
    assert documents_of(tokens, tokenizer) == DOCS


@pytest.mark.parametrize("length", [1, 2, 5, 9, 10, 11, 40])
@pytest.mark.parametrize("block", [1, 3, 4, 9])
def test_windows_score_every_token_after_the_first_exactly_once(length, block):
    tokens = np.arange(100, 100 + length, dtype=np.uint16)
    for keep_tail in (False, True):
        rows, targets = windows(tokens, block, keep_tail)
        assert rows.shape[1] == block + 1 and (rows[1:, 0] == rows[:-1, -1]).all()
        scored = np.concatenate([row[1 : 1 + t] for row, t in zip(rows, targets, strict=True)]) if len(rows) else []
        if keep_tail:
            assert list(scored) == list(tokens[1:])
        else:
            assert (targets == block).all() and list(scored) == list(tokens[1 : 1 + (length - 1) // block * block])


def test_token_ids_take_the_smallest_type_that_fits():
    assert token_dtype(257) == np.uint16 and token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    with pytest.raises(Exception, match="does not fit"):
        token_dtype(1 << 33)


def test_bpe_is_trained_offline_saved_and_reused_with_identical_shards(tmp_path):
    corpus = [f"The {w} of the {v} is a {w}ish {v}." for w in ("cat", "dog", "bird") for v in ("house", "garden")] * 20
    (tmp_path / "d.txt").write_text("\n".join(corpus + ["caf\u00e9 \u2014 na\u00efve"]) + "\n", encoding="utf-8")
    out = str(tmp_path / "bpe")
    prepare_main(
        [
            "--train_file",
            str(tmp_path / "d.txt"),
            "--validation_split_percentage",
            "10",
            "--tokenizer",
            "bpe",
            "--vocab_size",
            "300",
            "--output_dir",
            out,
            "--num_shards",
            "2",
            "--rows_per_group",
            "4",
            "--block_size",
            "4",
        ]
    )
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    tokenizer = load_tokenizer(os.path.join(out, "tokenizer.json"))
    assert (
        tokenizer.vocab_size == manifest["vocab_size"] == 300
        and tokenizer.decode(tokenizer.encode_batch(["na\u00efve caf\u00e9"])[0]) == "na\u00efve caf\u00e9"
    )
    for split in ("train", "validation"):  # train drops at most B - 1 tokens of the stream's tail; validation none
        counts = manifest["text"][split]
        got = stream(out, split)
        assert counts["tokens"] - len(got) < (4 if split == "train" else 1) and counts["scored_tokens"] == len(got) - 1
        assert counts["tokens"] < counts["text_bytes"]  # merges happened
    validation = documents_of(stream(out, "validation"), tokenizer)
    assert 0 < len(validation) and set(validation) <= set(corpus + ["caf\u00e9 \u2014 na\u00efve"])
    again = str(tmp_path / "again")  # the saved tokenizer.json as --tokenizer: the same token ids
    prepare_main(
        [
            "--train_file",
            str(tmp_path / "d.txt"),
            "--validation_split_percentage",
            "10",
            "--tokenizer",
            os.path.join(out, "tokenizer.json"),
            "--output_dir",
            again,
            "--num_shards",
            "2",
            "--block_size",
            "4",
        ]
    )
    assert np.array_equal(stream(out, "train"), stream(again, "train"))


def test_text_from_json_lines_with_a_text_column(tmp_path):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(DOCS)))
    out = str(tmp_path / "out")
    prepare_main(
        [
            "--train_file",
            str(tmp_path / "d.jsonl"),
            "--validation_file",
            str(tmp_path / "d.jsonl"),
            "--text_column",
            "body",
            "--tokenizer",
            "bytes",
            "--output_dir",
            out,
            "--block_size",
            "16",
        ]
    )
    assert documents_of(stream(out, "validation"), ByteTokenizer()) == DOCS
    assert not os.path.exists(os.path.join(out, "tokenizer.json"))  # bytes: nothing to save


def fails(capsys, args, text, code=1):
    with pytest.raises(SystemExit) as e:
        prepare_main(args)
    err = capsys.readouterr().err.strip()
    assert e.value.code == code and len(err.splitlines()) == 1 and text in err, err


def test_bad_text_input_is_one_line_and_nothing_is_written(tmp_path, capsys):
    out = str(tmp_path / "out")
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "x", "n": 1}) + "\n")
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9\n".encode("latin-1"))
    (tmp_path / "blank.txt").write_text("\n\n")
    (tmp_path / "fake.json").write_text("{}")
    base = ["--output_dir", out, "--tokenizer", "bytes"]
    fails(
        capsys,
        ["--train_file", str(tmp_path / "d.jsonl")] + base,
        "no column 'text' in the train data (columns: body, n)",
    )
    fails(capsys, ["--train_file", str(tmp_path / "d.jsonl"), "--text_column", "n"] + base, "not text")
    fails(capsys, ["--train_file", str(tmp_path / "latin1.txt")] + base, "could not read")
    fails(capsys, ["--train_file", str(tmp_path / "blank.txt")] + base, "has no text")
    fails(
        capsys,
        [
            "--train_file",
            str(tmp_path / "d.jsonl"),
            "--text_column",
            "body",
            "--output_dir",
            out,
            "--tokenizer",
            str(tmp_path / "fake.json"),
        ],
        "is not a tokenizer.json",
    )
    fails(
        capsys,
        [
            "--train_file",
            str(tmp_path / "d.jsonl"),
            "--text_column",
            "body",
            "--output_dir",
            out,
            "--tokenizer",
            "bpe",
            "--vocab_size",
            "200",
        ],
        "leaves no room for merges",
    )
    fails(capsys, ["--dataset", "gcide", "--data_dir", str(tmp_path)] + base, "apt-get install dict-gcide")
    fails(capsys, ["--dataset", "gcide", "--output_dir", out], "pass --tokenizer", code=2)
    assert not os.path.exists(out)
