"""Exact data-parallel math: with the same global batch, 2 processes compute the averaged gradient
that 1 process computes, so the weights agree to float rounding. The controls show the comparison
would catch a gradient that is not averaged across processes."""

import pytest
import torch

from conftest import launch, output_of, reset_accelerate_state
from test_checkpointing import largest_difference, weights
from train import regression

STEPS = ["--max_train_steps", 12, "--seed", 3]  # stop mid-trajectory, where mistakes show in the weights


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: one process, batch 32, in the test's process (a launch adds nothing here)."""
    try:
        return run_in_process(tmp_path_factory.mktemp("reg1"), "--per_device_train_batch_size", 32)
    finally:
        reset_accelerate_state()


def test_two_processes_equal_one_process_with_the_same_global_batch(one_process, tmp_path):
    proc = launch("cpu_2proc", "regression", "--per_device_train_batch_size", 16, "--output_dir", tmp_path, *STEPS)
    assert proc.returncode == 0, output_of(proc)
    assert "process 0/2 " in proc.stdout and "process 1/2 " in proc.stdout, output_of(proc)
    assert "world_size=2 " in proc.stdout and "distributed_type=MULTI_CPU" in proc.stdout
    assert largest_difference(weights(tmp_path), one_process) < 1e-6


def run_in_process(out, *args):
    regression.main(regression.parse_args(["--output_dir", str(out), *map(str, args), *map(str, STEPS)]))
    return weights(out)


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_control_each_process_alone_differs(one_process, tmp_path):
    # What a rank computes when its gradient is never averaged with the other's: batch 16 alone.
    alone = run_in_process(tmp_path, "--per_device_train_batch_size", 16)
    assert largest_difference(alone, one_process) > 1e-3


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_control_summed_instead_of_averaged_differs(one_process, tmp_path):
    # Summing two per-rank means instead of averaging them doubles the step.
    summed = run_in_process(tmp_path, "--per_device_train_batch_size", 32, "--learning_rate", 0.1)
    assert largest_difference(summed, one_process) > 1e-3


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_in_process_smoke(tmp_path):
    results = regression.main(regression.parse_args(["--output_dir", str(tmp_path), "--num_train_epochs", "3"]))
    assert results["eval_samples"] == 257 and results["world_size"] == 1
    assert results["eval_mse"] < 0.05  # noise variance is 0.01: the fit converged
    assert set(weights(tmp_path)) == {"weight", "bias"}
    assert torch.isfinite(weights(tmp_path)["weight"]).all()


def test_torch_compile_flags_compile_any_script_and_say_so(tmp_path, capsys, monkeypatch):
    """--torch_compile (and --torch_compile_mode, which implies it) are every script's, through
    accelerate's dynamo plugin; without them a launch config's dynamo backend is followed, and the
    header names which decided. The compiled run saves plain weights."""
    from conftest import run_as_script

    proc = run_as_script(
        capsys,
        "regression",
        "--torch_compile_mode",
        "max-autotune-no-cudagraphs",
        "--num_train_epochs",
        1,
        "--output_dir",
        tmp_path / "flag",
    )
    assert proc.returncode == 0, output_of(proc)
    assert "torch_compile: inductor, mode max-autotune-no-cudagraphs (--torch_compile)" in proc.stdout
    assert not any(k.startswith("_orig_mod") for k in weights(tmp_path / "flag"))
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")  # what a config's dynamo_backend exports
    proc = run_as_script(capsys, "regression", "--num_train_epochs", 1, "--output_dir", tmp_path / "config")
    assert proc.returncode == 0, output_of(proc)
    assert "torch_compile: inductor, mode default (the accelerate config)" in proc.stdout
    monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND")
    proc = run_as_script(capsys, "regression", "--num_train_epochs", 1, "--output_dir", tmp_path / "eager")
    assert proc.returncode == 0 and "torch_compile:" not in proc.stdout, output_of(proc)
