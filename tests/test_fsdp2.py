"""FSDP2 on 2 real CPU processes (accelerate_configs/fsdp2_cpu_2proc.yaml) and sharded checkpoints:
the same steps as unsharded training, really sharded, exact resume after SIGKILL, resume at another process count
and across FSDP2 and DDP, and checkpoints that cannot run code or half-load."""

import contextlib
import io
import json
import os
import pickle
import shutil

import pytest
import torch

from conftest import output_of, run_as_script, run_main
from test_checkpointing import (
    crash_during_save_and_resume,
    identical,
    largest_difference,
    launch_series,
    resume_copy,
    weights,
)
from test_lm import TINY, text  # noqa: F401 (the module's text fixture)

# accumulation and clipping (lm.py clips at 1.0 by default) on the GPT, whose output layer is tied
ARGS = [*TINY, "--gradient_accumulation_steps", 2, "--max_train_steps", 10, "--checkpointing_steps", 4]


def one_process(shards, out):
    """The unsharded reference, in this process: 1 process with twice the per-process batch, so the
    same global batch (test_lm.py: 1 process takes the steps 2 DDP processes take, to float rounding)."""
    run_main("lm", "--dataset_dir", shards, *ARGS, "--per_device_train_batch_size", 8, "--output_dir", out)


@pytest.fixture(scope="module")
def runs(text, tmp_path_factory):  # noqa: F811
    """One run under FSDP2, its checkpoints written in the background (--checkpoint_async), whose rank 0
    is SIGKILLed as checkpoint 8 is about to be published (its finished files kept aside: the
    uninterrupted run's state there); torch elastic's restart resumes from step 4 and runs to the end.
    And one unsharded in 1 process, the same global batch."""
    _, shards = text
    root = tmp_path_factory.mktemp("fsdp2")
    unsharded = root / "unsharded"
    one_process(shards, unsharded)
    proc, fsdp = crash_during_save_and_resume(
        "fsdp2_cpu_2proc", "lm", 8, root, "--dataset_dir", shards, *ARGS, "--checkpoint_async"
    )
    return {"shards": shards, "fsdp": fsdp, "unsharded": unsharded, "fsdp_proc": proc}


class _Caught:
    """capsys's readouterr() for a module fixture's run_as_script: what was printed since the last call."""

    def __init__(self):
        self.out, self.err = io.StringIO(), io.StringIO()

    def readouterr(self):
        found = self.out.getvalue(), self.err.getvalue()
        for stream in (self.out, self.err):
            stream.seek(0)
            stream.truncate()
        return found


@pytest.fixture(scope="module")
def one_process_resumes(runs, tmp_path_factory):
    """FSDP2's sharded step 4 resumed by 1 process with twice the per-process batch (the same global
    batch, so the same steps), in this process: saving sharded in the background ("one") and in the
    foreground ("foreground"). Values: (the run as run_as_script returns it, its folder)."""
    root = tmp_path_factory.mktemp("one_process")
    found = {}
    for name, extra in (("one", ["--checkpoint_format", "sharded", "--checkpoint_async"]), ("foreground", [])):
        folder = resume_copy(runs["fsdp"], 4, str(root / name))
        caught = _Caught()
        with contextlib.redirect_stdout(caught.out), contextlib.redirect_stderr(caught.err):
            proc = run_as_script(
                caught,
                "lm",
                "--dataset_dir",
                runs["shards"],
                *ARGS,
                "--per_device_train_batch_size",
                8,
                *extra,
                "--output_dir",
                folder,
                "--resume_from_checkpoint",
                "latest",
            )
        found[name] = proc, folder
    return found


MNIST = ["--max_train_samples", 1000, "--max_eval_samples", 333, "--num_train_epochs", 1]
MNIST += ["--per_device_train_batch_size", 32]
MNIST_BF16 = [*MNIST, "--mixed_precision", "bf16", "--checkpointing_steps", 8]
REGRESSION = ["--max_train_steps", 30, "--per_device_train_batch_size", 16]


@pytest.fixture(scope="module")
def fsdp2_launch(runs, one_process_resumes, fashion_dir, tmp_path_factory):
    """The FSDP2 runs of the tests below, one after the other in one launch of 2 processes
    (fsdp2_cpu_2proc.yaml; tests/cases_probe.py): a launch's start-up costs more than most of them.
    Values: (folder, its case's output)."""
    root = tmp_path_factory.mktemp("fsdp2_launch")
    lm = ["--dataset_dir", runs["shards"], *ARGS]
    resume = ["--resume_from_checkpoint", "latest"]
    cases = [
        ("mnist", "mnist", MNIST, None),
        ("regression", "regression", REGRESSION, None),
        ("mnist_bf16", "mnist", MNIST_BF16, None),
        ("mnist_bf16_resumed", "mnist", [*MNIST_BF16, *resume], (root / "mnist_bf16", 8)),
        ("lm_bf16", "lm", [*lm, "--mixed_precision", "bf16", "--gradient_checkpointing"], None),
        ("lm_from_one_process", "lm", [*lm, *resume], (one_process_resumes["one"][1], 8)),
        ("lm_from_full", "lm", [*lm, *resume], (runs["unsharded"], 4)),
    ]
    return series(root, "fsdp2_cpu_2proc", cases)


@pytest.fixture(scope="module")
def ddp_launch(runs, fashion_dir, tmp_path_factory):
    """The DDP references and the DDP resume of the tests below in one launch of 2 processes
    (cpu_2proc.yaml), as fsdp2_launch. mnist without channels_last: contiguous weights, as FSDP keeps them."""
    root = tmp_path_factory.mktemp("ddp_launch")
    cases = [
        ("mnist", "mnist", [*MNIST, "--no_channels_last"], None),
        ("mnist_bf16", "mnist", [*MNIST_BF16, "--no_channels_last"], None),
        (
            "lm_from_sharded",
            "lm",
            ["--dataset_dir", runs["shards"], *ARGS, "--resume_from_checkpoint", "latest"],
            (runs["fsdp"], 4),
        ),
    ]
    return series(root, "cpu_2proc", cases)


def series(root, config, cases):
    """launch_series of (name, script, args, (run folder, step) to resume from or None): each case's
    output folder is root/NAME."""
    proc, parts = launch_series(
        config,
        root,
        [
            {
                "name": name,
                "script": script,
                "args": [*args, "--output_dir", root / name],
                **({"copy": [start[0], start[1], root / name]} if start else {}),
            }
            for name, script, args, start in cases
        ],
        timeout=900,
    )
    return {name: (root / name, parts[name]) for name, *_ in cases}


def test_fsdp2_shards_the_model_and_takes_the_unsharded_steps(runs):
    out = runs["fsdp_proc"].stdout
    assert "distributed_type=FSDP2 on CPU" in out and "world_size=2 " in out
    # the GPT's blocks are units (its _no_split_modules), as accelerate wraps them on GPUs; each
    # process holds half of every sharded tensor
    line = next(line for line in out.splitlines() if line.startswith("fsdp2: "))
    assert "units: 2 Block, 1 LayerNorm, the root GPT" in line, line
    share = float(line.split("holds ")[1].split("%")[0])
    assert 45 < share < 55, line
    assert "warning: the config asks for FSDP" not in out
    # the same global batch, accumulation and clipping: equal to float rounding (reduce-scatter
    # sums the two processes' gradients, one process sums its batch in another order)
    assert largest_difference(weights(runs["fsdp"]), weights(runs["unsharded"])) < 1e-5
    f, d = (json.load(open(runs[k] / "all_results.json")) for k in ("fsdp", "unsharded"))
    assert f["eval_loss"] == pytest.approx(d["eval_loss"], rel=1e-5) and f["eval_tokens"] == d["eval_tokens"]
    final = weights(runs["fsdp"])  # the final weights are one whole file (a GPT-2 folder's: the tied layer once)
    assert final["transformer.wte.weight"].shape == (257, 32) and "lm_head.weight" not in final


def test_checkpoints_are_sharded_under_fsdp2_and_full_unsharded(runs):  # and under DDP: the test below
    assert sorted(os.listdir(runs["fsdp"] / "checkpoints")) == ["step_00000004", "step_00000008"]  # all published
    step = runs["fsdp"] / "checkpoints" / "step_00000004"
    assert json.load(open(step / "meta.json"))["checkpoint_format"] == "sharded"
    assert sorted(os.listdir(step / "state")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (step / "model.safetensors").exists() and not (step / "optimizer.pt").exists()
    full = runs["unsharded"] / "checkpoints" / "step_00000004"
    assert json.load(open(full / "meta.json"))["checkpoint_format"] == "full" and (full / "model.safetensors").exists()


def test_sigkill_under_fsdp2_then_resume_is_bit_identical(runs):
    """The module's run: killed as its background-written step 8 was about to be published, it
    resumed from step 4 (a checkpoint not yet published is none) and saved the same step 8, read back
    from DCP (compared by crash_during_save_and_resume)."""
    out = output_of(runs["fsdp_proc"])
    assert any(s in out for s in ("SIGKILL", "exitcode: -9", "Signal 9")), out[-3000:]
    assert f"resumed from {runs['fsdp']}/checkpoints/step_00000004 (step 4, saved with 2 processes)" in out


def test_a_sharded_checkpoint_resumes_at_other_process_counts_and_under_ddp(
    runs, one_process_resumes, fsdp2_launch, ddp_launch
):
    # 1 process, twice the per-process batch: the same global batch, so the same steps
    for proc, _ in one_process_resumes.values():
        assert proc.returncode == 0, output_of(proc)
        assert "world_size=1 " in proc.stdout and "saved with 2 processes" in proc.stdout
    one = one_process_resumes["one"][1]
    assert largest_difference(weights(one), weights(runs["fsdp"])) < 1e-5
    # saving in the foreground gives the same weights to the bit: training went on while a thread
    # wrote, from a copy of the state, and changed nothing
    assert identical(weights(one_process_resumes["foreground"][1]), weights(one))
    # and the sharded checkpoint that 1 process wrote at step 8, resumed by 2 FSDP2 processes
    two, out = fsdp2_launch["lm_from_one_process"]
    assert f"resumed from {two}/checkpoints/step_00000008" in out
    assert "saved with 1 process)" in out and "world_size=2 " in out
    assert largest_difference(weights(two), weights(runs["fsdp"])) < 1e-5
    # FSDP2's shards read by DDP, which writes full checkpoints after them; a full checkpoint (of
    # 1 process) read by FSDP2
    ddp, out = ddp_launch["lm_from_sharded"]
    assert f"resumed from {ddp}/checkpoints/step_00000004" in out
    assert "distributed_type=MULTI_CPU" in out and "world_size=2 " in out
    assert largest_difference(weights(ddp), weights(runs["unsharded"])) < 1e-5
    step = os.path.join(ddp, "checkpoints", "step_00000008")
    assert json.load(open(os.path.join(step, "meta.json")))["checkpoint_format"] == "full"
    assert os.path.exists(os.path.join(step, "model.safetensors"))
    fsdp, out = fsdp2_launch["lm_from_full"]
    assert f"resumed from {fsdp}/checkpoints/step_00000004" in out
    assert largest_difference(weights(fsdp), weights(runs["fsdp"])) < 1e-5


def test_gradient_checkpointing_and_bf16_under_fsdp2(runs, fsdp2_launch):
    # recomputing each block in backward (tests/test_gpt.py: it changes neither loss nor gradient)
    # and bf16: FSDP2 computes in bf16 and keeps fp32 weights, and so fp32 checkpoints and final weights
    bf16, out = fsdp2_launch["lm_bf16"]
    assert "mixed_precision=bf16" in out
    final = weights(bf16)
    assert all(t.dtype == torch.float32 for t in final.values())
    assert 0.0 < largest_difference(final, weights(runs["fsdp"])) < 0.1  # bf16 rounding, yet the same training
    assert json.load(open(bf16 / "all_results.json"))["eval_loss"] == pytest.approx(
        json.load(open(runs["fsdp"] / "all_results.json"))["eval_loss"], rel=0.02
    )


def test_the_other_scripts_take_under_fsdp2_the_steps_they_take_unsharded(fsdp2_launch, ddp_launch, tmp_path, capsys):
    # mnist: DDP's steps to the bit (with contiguous weights, as FSDP keeps them)
    fsdp, out = fsdp2_launch["mnist"]
    assert "distributed_type=FSDP2 on CPU" in out and "fsdp2: fully_shard over 2 CPU processes" in out
    assert largest_difference(weights(fsdp), weights(ddp_launch["mnist"][0])) == 0.0
    # regression: one linear layer, whose [1, 20] weight gives rank 1 an empty shard; the steps of one
    # process with the same global batch, to float rounding
    fsdp, out = fsdp2_launch["regression"]
    assert "holds 100.0% of the parameters" in out, out
    one = run_as_script(capsys, "regression", *REGRESSION[:-1], 32, "--output_dir", tmp_path / "one")
    assert one.returncode == 0, output_of(one)
    assert largest_difference(weights(fsdp), weights(tmp_path / "one")) < 1e-6


def test_batchnorm_under_fsdp2_in_bf16_keeps_fp32_parameters_and_resumes_exactly(fsdp2_launch, ddp_launch):
    # bf16 parameters beside BatchNorm's fp32 running statistics: the CPU kernel refused the mix
    # ("expected scalar type BFloat16 but found Float") at the first step. Each BatchNorm is now a unit
    # in fp32, as under DDP with autocast, and the run resumes bit-identically.
    fsdp, out = fsdp2_launch["mnist_bf16"]
    assert "units: 2 BatchNorm2d, the root ConvNet" in out, out
    final = weights(fsdp)
    assert {t.dtype for t in final.values()} == {torch.float32, torch.int64}  # num_batches_tracked: int64
    # autocast gives DDP's convolutions and linear layers the bf16 weights FSDP2 gathers: the same steps
    assert largest_difference(final, weights(ddp_launch["mnist_bf16"][0])) == 0.0
    resumed, out = fsdp2_launch["mnist_bf16_resumed"]
    assert f"resumed from {resumed}/checkpoints/step_00000008" in out
    assert largest_difference(weights(resumed), final) == 0.0


class _WritesAFile:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_sharded_checkpoints_run_no_code_and_bad_ones_are_one_line(runs, tmp_path, capsys):
    def resume(folder):
        return run_as_script(
            capsys,
            "lm",
            "--dataset_dir",
            runs["shards"],
            *ARGS,
            "--per_device_train_batch_size",
            8,
            "--output_dir",
            folder,
            "--resume_from_checkpoint",
            "latest",
        )

    def broken(name, damage):
        folder = resume_copy(runs["fsdp"], 4, str(tmp_path / name))
        damage(os.path.join(folder, "checkpoints", "step_00000004", "state"))
        proc = resume(folder)
        assert proc.returncode != 0 and "Traceback" not in output_of(proc), output_of(proc)
        return proc.stderr.strip().splitlines()[-1]

    planted = tmp_path / "planted"

    def plant(state):
        with open(os.path.join(state, ".metadata"), "wb") as f:
            pickle.dump(_WritesAFile(str(planted)), f)

    line = broken("pickle", plant)
    assert "refused to load" in line and "io.open is not part of a checkpoint's metadata" in line, line
    assert not planted.exists()  # the payload never ran
    line = broken("missing", lambda state: os.remove(os.path.join(state, "__1_0.distcp")))
    assert "is missing the shard state/__1_0.distcp" in line, line

    def cut(state):
        with open(os.path.join(state, "__0_0.distcp"), "r+b") as f:
            f.truncate(1000)

    assert "is cut short" in broken("cut", cut)
    assert "is not a complete sharded checkpoint" in broken(
        "nometa", lambda state: os.remove(os.path.join(state, ".metadata"))
    )
    # another model's checkpoint: wider layers
    other = resume_copy(runs["fsdp"], 4, str(tmp_path / "other"))
    proc = run_as_script(
        capsys,
        "lm",
        "--dataset_dir",
        runs["shards"],
        *ARGS,
        "--per_device_train_batch_size",
        8,
        "--n_embd",
        64,
        "--output_dir",
        other,
        "--resume_from_checkpoint",
        "latest",
    )
    assert proc.returncode != 0 and "does not fit this model (shapes differ: model." in proc.stderr, output_of(proc)
    # background saves are of sharded checkpoints only
    proc = run_as_script(
        capsys, "lm", "--dataset_dir", runs["shards"], *ARGS, "--checkpoint_async", "--output_dir", tmp_path / "full"
    )
    assert proc.returncode == 1 and "--checkpoint_async writes sharded checkpoints only" in proc.stderr, output_of(proc)
    shutil.rmtree(tmp_path)


def test_a_parameter_without_gradient_yet_resumes_with_no_optimizer_state(tmp_path):
    """A sharded checkpoint of an optimizer that has stepped some parameters only (a layer not used
    yet) loads back exactly that: the fresh optimizer's placeholder state for the others is dropped."""
    from train.core.sharded_checkpoint import load_sharded, save_sharded

    def make():
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"used": torch.nn.Linear(3, 2), "unused": torch.nn.Linear(3, 2)})
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    model, optimizer = make()
    model["used"](torch.ones(4, 3)).sum().backward()
    optimizer.step()
    save_sharded(str(tmp_path), model, optimizer)
    again, fresh = make()
    load_sharded(str(tmp_path), again, fresh)
    assert identical(again.state_dict(), model.state_dict())
    assert len(fresh.state) == 2 and all(
        torch.equal(fresh.state[b]["exp_avg"], optimizer.state[a]["exp_avg"])
        for a, b in zip(model["used"].parameters(), again["used"].parameters(), strict=True)
    )
