"""The sharded iterable path under a real 2-process `accelerate launch`: exact coverage across ranks,
uneven shards without a hang, a step at the end of the loader, and the position in save_state."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import CONFIGS, REPO, clean_env, output_of
from data.shards import write_shards

SIZES = [37, 5, 100, 21]  # shards of very different sizes, row groups of 8 with short tails
N = sum(SIZES)


@pytest.fixture(scope="module")
def uneven_shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("uneven")
    start = 0
    for i, n in enumerate(SIZES):
        written = write_shards({"x": torch.arange(start, start + n)}, str(folder), "tmp", 1, rows_per_group=8)
        os.replace(written[0], folder / f"train-{i:05d}.parquet")
        start += n
    return str(folder)


@pytest.fixture(scope="module")
def saved_dataset(tmp_path_factory):
    """The same N rows as a datasets.Dataset saved to disk (loaded memory-mapped by the probe)."""
    import datasets

    folder = str(tmp_path_factory.mktemp("hf") / "saved")
    datasets.Dataset.from_dict({"x": list(range(N))}).save_to_disk(folder)
    return folder


CASES = [("parquet", 0), ("parquet", 2), ("datasets", 2), ("stream", 1)]


@pytest.fixture(scope="module")
def launched(uneven_shards, saved_dataset, tmp_path_factory):
    """Every case in one launch of the probe (one after the other, each with its own Accelerator), then
    tests/prepare_misuse_probe.py's, whose last step stops the run: the launch fails, with its error."""
    root = tmp_path_factory.mktemp("probe")
    cases = [
        {
            "folder": saved_dataset if data == "datasets" else uneven_shards,
            "workers": workers,
            "stream": data == "stream",
            "out": str(root / f"{data}-{workers}" / "report.json"),
        }
        for data, workers in CASES
    ]
    for case in cases:
        os.makedirs(os.path.dirname(case["out"]))
    (root / "cases.json").write_text(json.dumps(cases))
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        os.path.join(CONFIGS, "cpu_2proc.yaml"),
        os.path.join("tests", "sharded_probe.py"),
        str(root / "cases.json"),
        str(root / "misuse.json"),
    ]
    # the timeout is the failure mode of a hang on uneven batch counts
    proc = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300)
    return (
        proc,
        {(data, workers): case["out"] for (data, workers), case in zip(CASES, cases, strict=True)},
        root / "misuse.json",
    )


@pytest.fixture(scope="module")
def reports(launched):
    proc, reports, misuse = launched
    # every case ran to its end: the misuse cases, which run after them, wrote their report
    assert os.path.exists(misuse), output_of(proc)
    return reports


@pytest.mark.parametrize("data,workers", CASES)
def test_two_ranks_cover_every_epoch_exactly_once(reports, data, workers):
    out = reports[data, workers]
    report = json.load(open(out))
    assert report["world_size"] == 2
    for epoch_ids in report["epochs"]:
        assert sorted(epoch_ids) == list(range(N)), "gathered ids do not cover the epoch exactly once"
    assert report["epochs"][0] != report["epochs"][1], "set_epoch did not reshuffle"
    batches = math.ceil(N / 8)
    assert report["batches_per_rank"] == [[batches, batches]] * 2
    # 4-step accumulation over 21 batches: 5 full steps, and a 6th only if the loader flags its last batch
    assert batches % 4 and report["optimizer_steps"] == [[math.ceil(batches / 4)] * 2] * 2
    seen = report["epochs"][1][: 5 * 8]  # 5 global batches of 2 x 4 before the save
    assert sorted(seen + report["resumed_rest"]) == list(range(N)) and not set(seen) & set(report["resumed_rest"])


def test_preparing_already_sharded_data_is_refused_in_two_real_processes(launched):
    proc, _, out = launched
    report = json.load(open(out))
    assert report["world_size"] == 2
    for case in ("prepared_sharded", "prepared_distributed_sampler"):
        assert all("went through accelerator.prepare" in v for v in report[case]), report[case]
    assert report["prepared_plain"] == report["sharded_loader"] == ["accepted", "accepted"]
    # a script that never calls check_loader: the first batch stops the run instead of training on rank 0's half
    assert proc.returncode != 0 and "trained on" not in proc.stdout
    assert "went through accelerator.prepare" in proc.stdout + proc.stderr
