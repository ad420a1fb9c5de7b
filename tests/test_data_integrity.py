"""What data.prepare and the shard loaders promise about files: a folder that is not data.prepare's
own (by its manifest.json) is never emptied, one prepare per folder, a missing, cut, changed or
unreadable file is one line naming it (at prepare and at training load), a column that cannot become
a tensor is refused at prepare time, a killed prepare's leftovers are removed by the next one, and a
full or read-only disk is one line with nothing half-written left looking complete."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO, clean_env, run_as_script
from data.errors import DataError, PlanError
from data.prepare import main as prepare_main_
from data.shards import shards_in, write_manifest, write_shards
from data.sources import ParquetSource

N = 120


def write_csv(path, n=N):
    path.write_text("x,y\n" + "".join(f"{i},{i / 2}\n" for i in range(n)))
    return str(path)


def prepare_main(args):
    prepare_main_([str(a) for a in args])


def snapshot(folder):
    """Every file under folder with its bytes (hidden ones too)."""
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                out[os.path.relpath(os.path.join(root, f), folder)] = fh.read()
    return out


def fails(capsys, args, *texts, code=1):
    """prepare_main(args) exits `code` with one line on stderr holding every text."""
    with pytest.raises(SystemExit) as e:
        prepare_main(args)
    err = capsys.readouterr().err.strip()
    assert e.value.code == code and len(err.splitlines()) == 1 and all(t in err for t in texts), err
    return err


def prepare_command(*args):
    return [sys.executable, "-m", "data.prepare", *map(str, args)]


PAUSED_PREPARE = """
import os, sys, time
import data.local_files as p  # where prepare_files (--train_file) calls write_manifest
from data.prepare import main
real = p.write_manifest
def paused(*a, **k):  # every shard written into the temporary folder, the manifest not yet
    open(sys.argv[1], "w").close()
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.02)
    return real(*a, **k)
p.write_manifest = paused
main(sys.argv[3:])
"""


def start_paused_prepare(tmp_path, *args):
    """A real prepare that stops just before its manifest, until tmp_path/go exists."""
    paused, go = tmp_path / "paused", tmp_path / "go"
    for f in (paused, go):
        f.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", PAUSED_PREPARE, str(paused), str(go), *map(str, args)],
        cwd=REPO,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 60
    while not paused.exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.02)
    return proc, go


def rows_of(folder, split="train"):
    return ParquetSource(shards_in(str(folder), split)).num_rows


# ---------------------------------------------------------------------------------------- users' files


def test_prepare_never_empties_a_folder_of_the_users_files(tmp_path, capsys, fashion_dir):
    from PIL import Image

    csv, txt = write_csv(tmp_path / "d.csv"), tmp_path / "d.txt"
    txt.write_text("some text to tokenize\n" * 20)
    images = tmp_path / "my_images"  # the README's layout, as --output_dir of the PNG writer
    for split in ("train", "validation"):
        for name in ("cat", "dog"):
            os.makedirs(images / split / name)
            Image.new("RGB", (4, 4), (len(name), 0, 0)).save(images / split / name / "0001.png")
    hf = tmp_path / "hf"  # a downloaded dataset's own shard, named like ours
    hf.mkdir()
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": [1, 2, 3]}), hf / "train-00000-of-00002.parquet")
    tok = tmp_path / "tok"  # a user's tokenizer, named like the one we save
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"my": "tokenizer"}')
    before = {d: snapshot(d) for d in (images, hf, tok)}
    fails(
        capsys,
        [
            "--dataset",
            "fashion_mnist",
            "--format",
            "images",
            "--max_per_class",
            "1",
            "--data_dir",
            fashion_dir,
            "--output_dir",
            images,
        ],
        "did not write (train/cat/0001.png",
    )
    fails(capsys, ["--train_file", csv, "--output_dir", hf], "did not write (train-00000-of-00002.parquet)")
    fails(capsys, ["--train_file", txt, "--tokenizer", "bytes", "--output_dir", tok], "did not write (tokenizer.json)")
    fails(capsys, ["--train_file", csv, "--output_dir", hf, "--force"], "did not write")  # --force does not change it
    assert {d: snapshot(d) for d in (images, hf, tok)} == before  # same files, same bytes, no lock file left

    ours = tmp_path / "ours"  # our own folder with a file of the user's added: that file is in the way
    prepare_main(["--train_file", csv, "--output_dir", ours, "--num_shards", "2"])
    (ours / "notes.txt").write_text("mine")
    before = snapshot(ours)
    fails(capsys, ["--train_file", csv, "--output_dir", ours, "--num_shards", "3"], "did not write (notes.txt)")
    assert snapshot(ours) == before


# ---------------------------------------------------------------------------------------- one writer


def test_a_second_prepare_of_a_folder_is_refused_naming_the_first_which_finishes_intact(tmp_path):
    csv, out = write_csv(tmp_path / "d.csv"), tmp_path / "out"
    first, go = start_paused_prepare(tmp_path, "--train_file", csv, "--output_dir", out, "--num_shards", "2")
    try:
        second = subprocess.run(
            prepare_command("--train_file", csv, "--output_dir", out, "--num_shards", "3"),
            cwd=REPO,
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 1 and len(second.stderr.strip().splitlines()) == 1, second.stderr
        assert f"is in use as a data folder being prepared by pid {first.pid}" in second.stderr, second.stderr
    finally:
        go.touch()
    assert first.wait(timeout=120) == 0, first.communicate()
    assert len(shards_in(str(out), "train")) == 2 and rows_of(out) == N  # the first's set, complete


def test_a_killed_prepare_leaves_the_old_set_and_the_next_removes_its_leftovers(tmp_path, capsys):
    csv, out = write_csv(tmp_path / "d.csv"), tmp_path / "out"
    prepare_main(["--train_file", csv, "--output_dir", out, "--num_shards", "2"])
    before = snapshot(out)
    proc, _ = start_paused_prepare(tmp_path, "--train_file", csv, "--output_dir", out, "--num_shards", "3")
    proc.send_signal(signal.SIGKILL)  # mid-write: its shards are written, its manifest is not
    proc.wait(timeout=60)
    leftovers = [f for f in os.listdir(tmp_path) if f.startswith(".prepare-")]
    assert len(leftovers) == 1 and any(f.endswith(".parquet") for f in os.listdir(tmp_path / leftovers[0]))
    after = snapshot(out)
    assert {k: v for k, v in after.items() if k != ".lock"} == {k: v for k, v in before.items() if k != ".lock"}
    assert len(shards_in(str(out), "train")) == 2 and rows_of(out) == N  # the old set, whole
    capsys.readouterr()
    prepare_main(["--train_file", csv, "--output_dir", out, "--num_shards", "3"])
    said = capsys.readouterr().out
    assert f"removed {tmp_path / leftovers[0]}" in said and "locked by a process that is gone" in said, said
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".prepare-")]
    assert len(shards_in(str(out), "train")) == 3 and rows_of(out) == N


# ---------------------------------------------------------------------------------------- shards vs manifest


def test_training_load_refuses_a_missing_cut_or_extra_shard_naming_it(tmp_path, capsys):
    csv, out = write_csv(tmp_path / "d.csv"), tmp_path / "out"
    prepare_main(["--train_file", csv, "--output_dir", out, "--num_shards", "3", "--rows_per_group", "8"])
    shard = shards_in(str(out), "train")[1]
    saved = open(shard, "rb").read()
    os.remove(shard)
    with pytest.raises(DataError, match=f"{shard} is missing"):
        shards_in(str(out), "train")
    with open(shard, "wb") as f:  # cut short: the size is wrong
        f.write(saved[: len(saved) // 2])
    with pytest.raises(DataError, match=f"{shard} has {len(saved) // 2} bytes, not the {len(saved)}"):
        shards_in(str(out), "train")
    with open(shard, "wb") as f:
        f.write(saved)
    assert rows_of(out) == N
    extra = out / "train-00003-of-00004.parquet"  # not in the manifest: not silently part of the set
    shutil.copy(shard, extra)
    with pytest.raises(DataError, match=f"{extra} is not in"):
        shards_in(str(out), "train")
    os.remove(extra)
    manifest = json.load(open(out / "manifest.json"))  # a row count that disagrees with the footer
    manifest["splits"]["train"]["shards"][1]["rows"] += 1
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PlanError, match=f"{shard} holds .* rows, not the"):
        ParquetSource(shards_in(str(out), "train"))
    mine = tmp_path / "mine"  # the user's own parquet files, no manifest: accepted, a cut one named
    mine.mkdir()
    shutil.copy(shard, mine / "a.parquet")
    (mine / "b.parquet").write_bytes(saved[: len(saved) // 2])
    assert ParquetSource([str(mine / "a.parquet")]).num_rows == 40
    with pytest.raises(PlanError) as e:
        ParquetSource([str(mine / "a.parquet"), str(mine / "b.parquet")])
    assert str(e.value).startswith(f"{mine / 'b.parquet'} is not a readable parquet file") and "\n" not in str(e.value)


def mnist_shards(folder, n=64):
    """A small prepared folder in train/mnist.py's format (image, label; train and test)."""
    for split in ("train", "test"):
        write_shards(
            {"image": torch.zeros(n, 28, 28, dtype=torch.uint8), "label": torch.arange(n) % 10}, str(folder), split, 2
        )
    write_manifest(str(folder), [], {"dataset": "fashion_mnist"})


def test_training_scripts_refuse_a_missing_shard_and_a_garbage_manifest_in_one_line(
    tmp_path, capsys, fresh_accelerate_state
):
    mnist_shards(tmp_path / "shards")
    missing = shards_in(str(tmp_path / "shards"), "train")[0]
    os.remove(missing)
    proc = run_as_script(
        capsys,
        "mnist",
        "--streaming",
        "--parquet_dir",
        tmp_path / "shards",
        "--output_dir",
        tmp_path / "run",
        "--num_train_epochs",
        1,
        "--per_device_train_batch_size",
        8,
    )
    err = proc.stderr.strip()
    assert proc.returncode != 0 and len(err.splitlines()) == 1 and f"{missing} is missing" in err, err
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    (tokens / "manifest.json").write_text("{ this is not json")
    proc = run_as_script(capsys, "lm", "--dataset_dir", tokens, "--output_dir", tmp_path / "lm_run")
    err = proc.stderr.strip()
    assert proc.returncode != 0 and len(err.splitlines()) == 1, err
    assert f"{tokens / 'manifest.json'} is not a readable manifest" in err, err


def test_prepare_refuses_a_changed_shard_or_a_garbage_manifest_and_force_rebuilds(tmp_path, capsys):
    csv, out = write_csv(tmp_path / "d.csv"), tmp_path / "out"
    args = ["--train_file", csv, "--output_dir", out, "--num_shards", "2"]
    prepare_main(args)
    shard = shards_in(str(out), "train")[0]
    original = open(shard, "rb").read()
    changed = bytearray(original)
    changed[len(changed) // 2] ^= 0xFF  # same size, other content
    with open(shard, "wb") as f:
        f.write(changed)
    fails(capsys, args, f"{shard} changed since data.prepare wrote it (same size, other content", "--force")
    assert open(shard, "rb").read() == changed  # refused: not replaced either
    prepare_main(args + ["--force"])
    assert open(shard, "rb").read() == original  # the same bytes again: the writes are deterministic
    capsys.readouterr()
    prepare_main(args)
    assert "up to date" in capsys.readouterr().out

    (out / "manifest.json").write_text("\x00garbage")
    before = snapshot(out)
    fails(capsys, args, f"{out / 'manifest.json'} is not a readable manifest")
    fails(capsys, args + ["--force"], f"{out / 'manifest.json'} is not a readable manifest")
    assert snapshot(out) == before
    with pytest.raises(DataError, match="is not a readable manifest"):
        shards_in(str(out), "train")


# ---------------------------------------------------------------------------------------- columns


def test_a_column_that_cannot_become_a_tensor_is_refused_at_prepare_naming_it(tmp_path, capsys):
    (tmp_path / "d.csv").write_text("x,color\n" + "".join(f"{i},{'red' if i % 2 else 'blue'}\n" for i in range(20)))
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"x": None if i == 3 else i}) + "\n" for i in range(20)))
    out = tmp_path / "out"
    fails(
        capsys,
        ["--train_file", tmp_path / "d.csv", "--output_dir", out],
        "column 'color' of the train data holds text, which cannot become a tensor",
        "--text_column color",
    )
    fails(capsys, ["--train_file", tmp_path / "d.jsonl", "--output_dir", out], "column 'x'", "1 empty value")
    assert not os.path.exists(out) and not [f for f in os.listdir(tmp_path) if f.startswith(".prepare-")]
    prepare_main(["--train_file", tmp_path / "d.csv", "--output_dir", out, "--text_column", "color"])  # kept as text
    assert json.load(open(out / "manifest.json"))["splits"]["train"]["columns"]["color"] == "large_string"


# ---------------------------------------------------------------------------------------- disk faults

DRIVER = """
import contextlib, io, json, sys
from data.prepare import main
results = []
for argv in json.loads(sys.argv[1]):
    err, out = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            main(argv)
        except SystemExit as e:
            code = e.code
    results.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def can_mount():
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not shutil.which("unshare") or not can_mount(), reason="needs unshare -m (root) for a small tmpfs")
def test_a_full_or_read_only_disk_is_one_line_and_leaves_nothing_looking_complete(tmp_path):
    """A real 256 KiB tmpfs in a private mount namespace: full, then remounted read-only."""
    big, small, disk = write_csv(tmp_path / "big.csv", 40000), write_csv(tmp_path / "small.csv"), tmp_path / "disk"
    disk.mkdir()
    runs = lambda *argvs: json.dumps([[str(a) for a in argv] for argv in argvs])  # noqa: E731
    full = ["--train_file", big, "--output_dir", disk / "full"]
    ok = ["--train_file", small, "--output_dir", disk / "ok"]
    new = ["--train_file", small, "--output_dir", disk / "new"]
    script = (
        f"mount -t tmpfs -o size=256k tmpfs {disk} && "
        f"{sys.executable} -c '{DRIVER}' '{runs(full, ok)}' > {tmp_path}/rw.json && "
        f"mount -o remount,ro {disk} && "
        f"{sys.executable} -c '{DRIVER}' '{runs(ok, ok + ['--force'], new)}' > {tmp_path}/ro.json && "
        f"ls -A {disk} > {tmp_path}/listing"
    )
    proc = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    full_run, ok_run = json.load(open(tmp_path / "rw.json"))
    again, forced, fresh = json.load(open(tmp_path / "ro.json"))
    assert full_run[0] == 1 and len(full_run[2].strip().splitlines()) == 1, full_run
    assert f"could not write --output_dir {disk / 'full'}: No space left on device" in full_run[2], full_run
    assert ok_run[0] == 0 and again[0] == 0 and "up to date" in again[1]  # read-only prepared data still works
    for code, _, err in (forced, fresh):
        assert code == 1 and len(err.strip().splitlines()) == 1 and "Read-only file system" in err, err
    assert open(tmp_path / "listing").read().split() == ["ok"]  # no half-written set, no temporary folder
