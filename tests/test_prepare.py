"""python -m data.prepare on a user's own files and image folders: every row lands in exactly one
shard of one split, the shards stream exactly once through the sharded plan, re-runs are no-ops,
and bad input is one line with nothing overwritten."""

import hashlib
import json
import os

import pytest
import torch

from data.prepare import main as prepare_main
from data.sharding import ShardedIterableDataset
from data.shards import shards_in
from data.sources import ParquetSource, table_to_columns

N = 203


def write_inputs(folder, n=N):
    rows = [{"x": i, "text": f"row {i}, with a comma"} for i in range(n)]
    (folder / "d.csv").write_text("x,text\n" + "".join(f'{r["x"]},"{r["text"]}"\n' for r in rows))
    (folder / "d.tsv").write_text("x\ttext\n" + "".join(f"{r['x']}\t{r['text']}\n" for r in rows))
    (folder / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "d.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "d.txt").write_text("".join(f"{r['x']} {r['text']}\n" for r in rows))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": [r["x"] for r in rows], "text": [r["text"] for r in rows]}), folder / "d.parquet")


def row_ids(folder, split, world=2, workers=0):
    """Every row id the sharded plan delivers from the shards of `split`, over `world` ranks."""
    seen = []
    for rank in range(world):
        ds = ShardedIterableDataset(
            ParquetSource(shards_in(folder, split), decode=table_to_columns), 4 * world, rank, world, policy="pad"
        )
        for batch in ds:
            if "x" in batch:
                ids = batch["x"].tolist()
            else:  # text: one column, the id is its first word
                ids = [int(line.split()[0]) for line in batch["text"]]
            seen += [i for i, ok in zip(ids, batch["valid"].tolist(), strict=True) if ok]
    return seen


@pytest.mark.parametrize("kind", ["csv", "tsv", "jsonl", "json", "parquet", "txt"])
def test_each_kind_of_file_becomes_shards_that_stream_every_row_once(tmp_path, kind):
    write_inputs(tmp_path)
    out = tmp_path / "out"
    prepare_main(
        [
            "--train_file",
            str(tmp_path / f"d.{kind}"),
            "--validation_split_percentage",
            "10",
            "--output_dir",
            str(out),
            "--num_shards",
            "3",
            "--rows_per_group",
            "8",
        ]
    )
    manifest = json.load(open(out / "manifest.json"))
    train, validation = row_ids(str(out), "train", world=2), row_ids(str(out), "validation", world=3)
    assert len(validation) == round(N * 0.1) and len(train) == N - len(validation)
    assert sorted(train + validation) == list(range(N))  # disjoint, nothing lost
    assert manifest["splits"]["train"]["rows"] == len(train) and len(manifest["splits"]["train"]["shards"]) == 3
    if kind != "txt":
        assert manifest["splits"]["train"]["columns"]["x"] == "int64"


def test_a_rerun_writes_nothing_and_a_changed_input_or_argument_rewrites(tmp_path, capsys):
    write_inputs(tmp_path)
    out = tmp_path / "out"
    args = [
        "--train_file",
        str(tmp_path / "d.csv"),
        "--validation_file",
        str(tmp_path / "d.csv"),
        "--output_dir",
        str(out),
        "--num_shards",
        "2",
    ]
    prepare_main(args)
    stamps = {f: os.stat(out / f).st_mtime_ns for f in os.listdir(out)}
    fingerprint = json.load(open(out / "manifest.json"))["fingerprint"]
    capsys.readouterr()
    prepare_main(args)
    assert "up to date" in capsys.readouterr().out
    assert {f: os.stat(out / f).st_mtime_ns for f in os.listdir(out)} == stamps
    prepare_main(args[:-1] + ["3"])  # another shard count: rewritten, old shards gone
    assert (
        len(shards_in(str(out), "train")) == 3 and json.load(open(out / "manifest.json"))["fingerprint"] != fingerprint
    )
    with open(tmp_path / "d.csv", "a") as f:
        f.write('999,"one more row"\n')
    prepare_main(args[:-1] + ["3"])
    assert json.load(open(out / "manifest.json"))["splits"]["train"]["rows"] == N + 1


def test_an_image_folder_becomes_shards_of_the_files_bytes_and_labels(tmp_path):
    from PIL import Image

    files = {}
    for split in ("train", "val"):
        for c, name in enumerate(["cat", "dog", "emu"]):
            os.makedirs(tmp_path / split / name)
            for i in range(7 if split == "train" else 2):
                path = tmp_path / split / name / f"{i}.png"
                Image.new("RGB", (5 + i, 4), (40 * c, i, 0)).save(path)
                files[hashlib.md5(path.read_bytes()).hexdigest()] = (split, c)
    (tmp_path / "train" / "cat" / "notes.txt").write_text("not an image")
    out = tmp_path / "out"
    prepare_main(
        [
            "--train_dir",
            str(tmp_path / "train"),
            "--validation_dir",
            str(tmp_path / "val"),
            "--output_dir",
            str(out),
            "--num_shards",
            "2",
            "--rows_per_group",
            "4",
        ]
    )
    manifest = json.load(open(out / "manifest.json"))
    assert manifest["class_names"] == ["cat", "dog", "emu"]
    got = {}
    for split, expected in (("train", 21), ("validation", 6)):
        source = ParquetSource(shards_in(str(out), split), decode=table_to_columns)
        batch = source.read(torch.arange(source.num_rows))
        assert source.num_rows == expected
        for image, label in zip(batch["image"], batch["label"].tolist(), strict=True):
            got[hashlib.md5(image).hexdigest()] = ({"train": "train", "validation": "val"}[split], label)
    assert got == files  # every image once, with its class, byte for byte


def fails(capsys, args, text, code=1):
    with pytest.raises(SystemExit) as e:
        prepare_main(args)
    err = capsys.readouterr().err.strip()
    assert e.value.code == code and len(err.splitlines()) == 1 and text in err, err
    return err


def test_bad_input_is_one_line_and_nothing_is_overwritten(tmp_path, capsys):
    write_inputs(tmp_path, n=5)
    out = str(tmp_path / "out")
    (tmp_path / "empty.csv").write_text("")
    (tmp_path / "bad.json").write_text('{"x": 1}\n{"x": \n')
    (tmp_path / "d.xlsx").write_text("?")
    fails(capsys, ["--train_file", str(tmp_path / "missing.csv"), "--output_dir", out], "does not exist")
    fails(capsys, ["--train_file", str(tmp_path / "empty.csv"), "--output_dir", out], "is empty")
    fails(capsys, ["--train_file", str(tmp_path / "d.xlsx"), "--output_dir", out], "unknown file type '.xlsx'")
    fails(capsys, ["--train_file", str(tmp_path / "bad.json"), "--output_dir", out], "could not read")
    fails(
        capsys,
        ["--train_file", str(tmp_path / "d.csv"), "--validation_file", str(tmp_path / "d.jsonl"), "--output_dir", out],
        "different kinds of file",
    )
    for pct in ("0", "100"):
        fails(
            capsys,
            ["--train_file", str(tmp_path / "d.csv"), "--validation_split_percentage", pct, "--output_dir", out],
            "is not between 0 and 100",
            code=2,
        )
    fails(
        capsys,
        ["--train_file", str(tmp_path / "d.csv"), "--validation_split_percentage", "99", "--output_dir", out],
        "leaves no training rows",
    )
    fails(
        capsys,
        ["--train_file", str(tmp_path / "d.csv"), "--train_dir", str(tmp_path), "--output_dir", out],
        "not several",
        code=2,
    )
    assert not os.path.exists(out) and not [f for f in os.listdir(tmp_path) if f.startswith(".prepare-")]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("precious")
    fails(capsys, ["--train_file", str(tmp_path / "d.csv"), "--output_dir", str(mine)], "did not write (thesis.tex)")
    assert os.listdir(mine) == ["thesis.tex"] and (mine / "thesis.tex").read_text() == "precious"
