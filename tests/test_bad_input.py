"""Bad input: one clear line naming the problem and the fix, a non-zero exit, nothing written."""

import gzip
import os
import shutil

import pytest

from conftest import FASHION_DIR, output_of, run_as_script


def copy_fashion(dst):
    dst.mkdir()
    for name in os.listdir(FASHION_DIR):
        shutil.copy(os.path.join(FASHION_DIR, name), dst / name)
    return dst


def error_line(proc):
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:") or ": error:" in line]
    assert lines, output_of(proc)
    return lines[0]


def test_missing_data_dir(tmp_path, capsys):
    proc = run_as_script(capsys, "mnist", "--data_dir", tmp_path / "nope", "--output_dir", tmp_path / "out")
    assert proc.returncode != 0
    line = error_line(proc)
    assert "nope does not exist" in line and "apt-get install dataset-fashion-mnist" in line
    assert not (tmp_path / "out").exists()


def test_data_dir_without_idx_files(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    proc = run_as_script(capsys, "mnist", "--data_dir", tmp_path / "empty", "--output_dir", tmp_path / "out")
    assert proc.returncode != 0
    assert "no fashion_mnist idx files in" in error_line(proc)


@pytest.mark.parametrize("damage", ["truncated", "garbage_header", "bad_gzip"])
def test_corrupt_idx_file(fashion_dir, tmp_path, damage, capsys):
    data_dir = copy_fashion(tmp_path / "data")
    target = data_dir / "t10k-images-idx3-ubyte.gz"
    payload = gzip.open(target).read()
    if damage == "truncated":
        target.write_bytes(gzip.compress(payload[: len(payload) // 2]))
    elif damage == "garbage_header":
        target.write_bytes(gzip.compress(b"\xff" * 16 + payload[16:]))
    else:
        target.write_bytes(b"this is not gzip at all")
    proc = run_as_script(capsys, "mnist", "--data_dir", data_dir, "--output_dir", tmp_path / "out")
    assert proc.returncode != 0
    line = error_line(proc)
    assert "t10k-images-idx3-ubyte.gz" in line and ("not a valid idx file" in line or "labels" in line), line
    assert not (tmp_path / "out").exists()


def test_mismatched_image_and_label_counts(fashion_dir, tmp_path, capsys):
    data_dir = copy_fashion(tmp_path / "data")
    # the test labels replaced by the training labels: a valid file, but 60000 labels for 10000 images
    shutil.copy(data_dir / "train-labels-idx1-ubyte.gz", data_dir / "t10k-labels-idx1-ubyte.gz")
    proc = run_as_script(capsys, "mnist", "--data_dir", data_dir, "--output_dir", tmp_path / "out")
    assert proc.returncode != 0
    assert "10000 images but" in error_line(proc) and "60000 labels" in error_line(proc)


def test_unknown_dataset_name(tmp_path, capsys):
    proc = run_as_script(capsys, "mnist", "--dataset", "cifar10", "--output_dir", tmp_path)
    assert proc.returncode == 2
    assert "invalid choice: 'cifar10'" in error_line(proc)


@pytest.mark.parametrize(
    "flag", ["--per_device_train_batch_size", "--per_device_eval_batch_size", "--gradient_accumulation_steps"]
)
def test_zero_batch_size(tmp_path, flag, capsys):
    proc = run_as_script(capsys, "mnist", flag, "0", "--output_dir", tmp_path)
    assert proc.returncode == 2
    assert f"argument {flag}: must be a positive integer, got 0" in error_line(proc)


def test_a_misspelled_or_abbreviated_flag_is_refused(tmp_path, capsys):
    proc = run_as_script(capsys, "mnist", "--lerning_rate", "1e-3", "--output_dir", tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        "error: unrecognized arguments: --lerning_rate 1e-3 (did you mean --learning_rate?); see mnist.py --help"
    )
    proc = run_as_script(capsys, "mnist", "--learning", "1e-3", "--output_dir", tmp_path)  # no abbreviations
    assert proc.returncode == 2 and "error: unrecognized arguments: --learning 1e-3" in error_line(proc)


def test_mnist_without_network_or_data_dir(tmp_path, capsys):
    # MNIST has no Debian package; offline the download fails and the message says what to do.
    proc = run_as_script(capsys, "mnist", "--dataset", "mnist", "--output_dir", tmp_path / "out")
    if proc.returncode == 0:
        pytest.skip("MNIST was downloadable here (network or cache present)")
    line = error_line(proc)
    assert "mnist not found" in line and "--data_dir" in line
