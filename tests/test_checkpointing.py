"""Checkpoints: exact resume at any step, real crashes (SIGKILL of a rank, of a save), restarts,
refusing planted pickles and bad input, and not overwriting an earlier run."""

import json
import os
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import CONFIGS, clean_env, launch, output_of, run_as_script, run_main, run_or_dump
from train import mnist, regression
from train.core.output_dir import list_checkpoints

# 1024 samples / batch 32 = 32 steps per epoch, 2 epochs; lr small enough to stay mid-trajectory
REGRESSION = ["--num_train_epochs", 2, "--learning_rate", 0.01, "--seed", 5]
MNIST = [
    "--max_train_samples",
    768,
    "--max_eval_samples",
    101,
    "--num_train_epochs",
    2,
    "--per_device_train_batch_size",
    16,
    "--gradient_accumulation_steps",
    2,
    "--logging_steps",
    5,
]


def weights(folder):
    return load_file(os.path.join(folder, "model.safetensors"))


def identical(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def largest_difference(a, b):
    """The largest absolute difference between two state dicts of the same tensors."""
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def resume_copy(full_dir, step, new_dir):
    """A run folder as a crash after checkpoint `step` would have left it."""
    os.makedirs(os.path.join(new_dir, "checkpoints"))
    name = f"step_{step:08d}"
    shutil.copytree(os.path.join(full_dir, "checkpoints", name), os.path.join(new_dir, "checkpoints", name))
    return new_dir


def same_state(a, b):
    """Equal tensors, numbers and containers, recursively (a checkpoint's .pt files)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same_state, a, b))
    return a == b


def sharded_contents(checkpoint):
    """The model and optimizer a sharded checkpoint's state/ holds, read whole in this process."""
    import io

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    buffer = io.BytesIO()
    dcp_to_torch_save(os.path.join(checkpoint, "state"), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def same_checkpoint(a, b):
    """Two checkpoints of one step hold the same run: weights, optimizer, schedule, every rank's RNG
    streams and buffers, and the data position; a sharded checkpoint's model and optimizer are read
    back from its DCP files."""
    names = sorted(f for f in os.listdir(a) if f.endswith(".pt"))
    assert "rank_state_1.pt" in names and names == sorted(f for f in os.listdir(b) if f.endswith(".pt")), names
    if os.path.isdir(os.path.join(a, "state")):
        contents = [sharded_contents(f) for f in (a, b)]
        assert contents[0]["optimizer"]["state"] and same_state(*contents)
    else:
        assert identical(weights(a), weights(b))
    for name in names:
        states = [torch.load(os.path.join(f, name), weights_only=True) for f in (a, b)]
        assert same_state(*states), name
    positions = [json.load(open(os.path.join(folder, "meta.json")))["data"] for folder in (a, b)]
    assert positions[0] == positions[1], positions


def crash_during_save_and_resume(config, script, step, folder, *args):
    """One launch: rank 0 SIGKILLed as checkpoint `step` is about to be published (its files
    finished: kept aside as the uninterrupted run's state there), then torch elastic's restart
    resumes from the checkpoint before it and saves `step` again, which must be the same. Returns
    the launch (its output holds both attempts') and the folder of the resumed run."""
    out, kill = crash_kill(step, folder)
    proc = kill_launch(
        config, script, kill, *args, "--resume_from_checkpoint", "latest", "--output_dir", out, max_restarts=1
    )
    return proc, check_crash(proc, step, folder)


def crash_kill(step, folder):
    """crash_during_save_and_resume's run folder and kill_at_step.py's arguments."""
    kept = folder / f"uninterrupted_step_{step}"
    return folder / "crashed", [
        "--rank",
        0,
        "--step",
        step,
        "--marker",
        folder / "killed",
        "--during_save",
        "--keep",
        kept,
    ]


def check_crash(proc, step, folder):
    """crash_during_save_and_resume's checks of its launch; the resumed run's folder."""
    out, kept = folder / "crashed", folder / f"uninterrupted_step_{step}"
    assert proc.returncode == 0 and (folder / "killed").exists() and kept.is_dir(), output_of(proc)
    assert f"no checkpoint in {out}/checkpoints yet" in proc.stdout  # the first attempt started fresh
    same_checkpoint(kept, out / "checkpoints" / f"step_{step:08d}")
    return out


def sigterm_at_step_one_and_resume(config, script, steps, folder, *args):
    """One launch: SIGTERM to rank 1 right after optimizer step 1, the ranks' first agreed check
    (train/core/preemption.py), so every rank stops there and saves that step with its state; torch
    elastic's restart resumes from it and runs to the end (`steps`). Returns the launch and the run's
    folder, to compare with an uninterrupted run."""
    out, kill = sigterm_kill(folder)
    proc = kill_launch(
        config, script, kill, *args, "--resume_from_checkpoint", "latest", "--output_dir", out, max_restarts=1
    )
    return proc, check_sigterm(proc, steps, folder, proc.stdout)


def sigterm_kill(folder):
    """sigterm_at_step_one_and_resume's run folder and kill_at_step.py's arguments."""
    return folder / "stopped", ["--rank", 1, "--step", 1, "--marker", folder / "signalled", "--sigterm", "self"]


def check_sigterm(proc, steps, folder, own_output):
    """sigterm_at_step_one_and_resume's checks of its launch (`own_output`: the run's part of the launch's
    stdout, all of it when the launch holds one run); the run's folder."""
    out = folder / "stopped"
    said = [line for line in output_of(proc).splitlines() if line.startswith("stopped on SIGTERM at step ")]
    assert proc.returncode == 0 and (folder / "signalled").exists() and len(said) == 1, output_of(proc)
    stop = out / "checkpoints" / "step_00000001"
    assert said[0].startswith(f"stopped on SIGTERM at step 1 of {steps}, saved {stop}; resume with: "), said[0]
    assert {"rank_state_0.pt", "rank_state_1.pt", "meta.json"} <= set(os.listdir(stop))
    assert f"resumed from {stop}" in proc.stdout
    assert "was locked by a process that is gone" not in own_output  # the stop let go of its folder
    return out


def kill_launch(config, script, kill, *args, timeout=300, max_restarts=None):
    """accelerate launch of tests/kill_at_step.py: `kill` = [--rank, R, --step, K, --marker, F, ...]."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", os.path.join(CONFIGS, config + ".yaml")]
    if max_restarts is not None:
        cmd += ["--max_restarts", str(max_restarts), "--monitor_interval", "0.5"]
    cmd += [os.path.join("tests", "kill_at_step.py"), script, *map(str, kill), "--", *map(str, args)]
    return run_or_dump(cmd, timeout, env=clean_env())


def launch_series(config, folder, cases, timeout=600):
    """One accelerate launch (config) of tests/cases_probe.py running train scripts one after the other
    in the same ranks: `cases` = [{"name", "script", "args", "copy" and "stale_latest" (optional)}, ...].
    The timeout is the hang's, for all of them together. Returns the launch and {case name: its output}."""
    from cases_probe import CASE_MARK, case_output, launch_cases

    proc = launch_cases(config, cases, timeout=timeout)
    assert proc.returncode == 0, output_of(proc)
    names = [line[len(CASE_MARK) + 1 :].strip() for line in proc.stdout.splitlines() if line.startswith(CASE_MARK)]
    assert names == [case["name"] for case in cases], names
    return proc, {case["name"]: case_output(proc.stdout, case["name"]) for case in cases}


# ----------------------------------------------------------------------------- exact resume


def run_regression(config, *args):
    """train/regression.py under `config`: the 1-process one in this process (as `python
    train/regression.py` runs it, without a cold interpreter), the others through accelerate launch.
    Returns what it printed."""
    if config == "cpu":
        run_main("regression", *args)
        return None
    proc = launch(config, "regression", *args)
    assert proc.returncode == 0, output_of(proc)
    return proc.stdout


@pytest.fixture(scope="module")
def regression_runs(tmp_path_factory):
    """Runs with a checkpoint at every step, to the end: 1 process (batch 32) uninterrupted, in this
    process; 2 processes (16 each) in one launch whose rank 0 is SIGKILLed as it publishes checkpoint
    33, which torch elastic's restart resumes from 32 (an epoch's start: no batch to skip) and saves
    again, the same as the uninterrupted run's 33 (crash_during_save_and_resume). Values: (run folder,
    batch); "restarted": that launch."""
    out = str(tmp_path_factory.mktemp("cpu"))
    run_regression(
        "cpu", *REGRESSION, "--per_device_train_batch_size", 32, "--checkpointing_steps", 1, "--output_dir", out
    )
    proc, crashed = crash_during_save_and_resume(
        "cpu_2proc",
        "regression",
        33,
        tmp_path_factory.mktemp("cpu_2proc"),
        *REGRESSION,
        "--per_device_train_batch_size",
        16,
        "--checkpointing_steps",
        1,
    )
    return {"cpu": (out, 32), "cpu_2proc": (str(crashed), 16), "restarted": proc}


# an epoch's start and its last step (31 batches skipped, the one left also the loader's last), the
# latter under 2 processes too (an epoch's start under 2: the restart of regression_runs); mid-epoch,
# the same skip with batches after it, in one process
@pytest.mark.parametrize(
    "config, step",
    [
        pytest.param("cpu", 32, id="epoch_start-cpu"),
        pytest.param("cpu", 45, id="mid_epoch-cpu"),
        pytest.param("cpu", 63, id="last_step-cpu"),
        pytest.param("cpu_2proc", 63, id="last_step-cpu_2proc"),
    ],
)
def test_regression_resume_is_bit_identical(regression_runs, request, tmp_path, config, step, capsys):
    full, batch = regression_runs[config]
    if config == "cpu":
        out = resume_copy(full, step, str(tmp_path / "resumed"))
        args = [*REGRESSION, "--per_device_train_batch_size", batch, "--resume_from_checkpoint", "latest"]
        run_regression(config, *args, "--output_dir", out)
        printed = capsys.readouterr().out
    else:  # rank 1 is made to see no checkpoint (as when one lands between two ranks' looks at the folder):
        # resolving 'latest' alone it would start from step 0 and hang the others; the main process's counts.
        # A case of mnist_2proc_runs' 2-process launch (cases_probe's stale_latest, as fault_probe's),
        # resumed from a copy of step 63 with these arguments
        out, printed = request.getfixturevalue("mnist_2proc_runs")["regression_last_step"]
    assert f"resumed from {out}/checkpoints/step_{step:08d}" in printed
    assert identical(weights(out), weights(full))


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_control_resume_without_the_data_position_differs(regression_runs, tmp_path):
    full, batch = regression_runs["cpu"]
    out = resume_copy(full, 45, str(tmp_path / "resumed"))
    meta_path = os.path.join(out, "checkpoints", "step_00000045", "meta.json")
    meta = json.load(open(meta_path))
    assert meta["data"] == {"epoch": 1, "next_batch": 13}
    meta["data"]["next_batch"] = 0  # what resuming with accelerate's save_state alone does: replay the epoch
    json.dump(meta, open(meta_path, "w"))
    regression.main(
        regression.parse_args(
            [
                *map(str, REGRESSION),
                "--per_device_train_batch_size",
                str(batch),
                "--resume_from_checkpoint",
                "latest",
                "--output_dir",
                out,
            ]
        )
    )
    assert not identical(weights(out), weights(full))


@pytest.fixture(scope="module")
def mnist_1proc_runs(fashion_dir, tmp_path_factory):
    """Uninterrupted 1-process MNIST runs in this process (24 optimizer steps of 2 accumulated batches
    per epoch), a checkpoint every 12 steps, by their extra arguments: made on first use."""
    runs = {}

    def run(extra):
        if tuple(extra) not in runs:
            args = [*map(str, MNIST), "--checkpointing_steps", "12", *extra]
            full = str(tmp_path_factory.mktemp("mnist_full"))
            run_main("mnist", *args, "--output_dir", full, "--overwrite_output_dir")
            runs[tuple(extra)] = full, args
        return runs[tuple(extra)]

    return run


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize(
    "step,extra",
    [
        (12, []),
        (24, []),
        (36, []),  # mid-epoch, epoch boundary, mid-epoch 2
        (36, ["--augment", "--label_smoothing", "0.1"]),
    ],
)
def test_mnist_resume_in_process_with_accumulation_is_bit_identical(mnist_1proc_runs, tmp_path, step, extra):
    full, args = mnist_1proc_runs(extra)
    out = resume_copy(full, step, str(tmp_path / "resumed"))
    results = mnist.main(mnist.parse_args(args + ["--output_dir", out, "--resume_from_checkpoint", "latest"]))
    assert results["resumed_from"].endswith(f"step_{step:08d}")
    assert identical(weights(out), weights(full))
    assert [h["epoch"] for h in results["history"]] == [1, 2]  # history survives the resume


def mnist_2proc_args(streaming, root):
    """The arguments of a 2-process MNIST run (batch 8 per process), map-style or streaming, that the
    runs resumed from its checkpoints must give again."""
    return [*MNIST, "--per_device_train_batch_size", 8, *(["--streaming", "--parquet_dir", root] if streaming else [])]


def sigterm_launch(args, folder, to):
    """A 2-process MNIST run (args) signalled after optimizer step 9 of 48 (SIGTERM to rank 1 itself or
    to the launcher); to rank 1 itself, the exit of its ranks restarts them (--max_restarts 1) and the
    restart resumes. Returns the launch and the run's folder."""
    out = folder / "preempted"
    restart = to == "self"
    proc = kill_launch(
        "cpu_2proc",
        "mnist",
        ["--rank", 1, "--step", 9, "--marker", folder / "signalled", "--sigterm", to],
        *args,
        "--output_dir",
        out,
        *(["--resume_from_checkpoint", "latest"] if restart else []),
        max_restarts=1 if restart else None,
    )
    return proc, out


@pytest.fixture(scope="module")
def mnist_2proc_runs(fashion_dir, regression_runs, tmp_path_factory):
    """Uninterrupted 2-process MNIST runs, map-style and streaming (True), with the arguments that runs
    resumed from their checkpoints must give again; and "stopped": the map-style run stopped by a
    SIGTERM to its launcher (a DataLoader worker per rank), what its folder held then, and the second
    launch's resume of it. That resume and both uninterrupted runs are one launch of 2 processes
    (launch_series), the resume first, as a fresh launch runs it; with them, for
    test_regression_resume_is_bit_identical[last_step-cpu_2proc], regression_runs' 2-process run
    resumed from its last step's checkpoint, rank 1 seeing no checkpoint ("regression_last_step":
    its folder and output)."""
    root = tmp_path_factory.mktemp("mnist_2proc")
    runs = {
        streaming: (
            str(root / ("streaming" if streaming else "map_style")),
            mnist_2proc_args(streaming, root / "parquet"),
        )
        for streaming in (False, True)
    }
    stopped_args = [*runs[False][1], "--dataloader_num_workers", 1]  # the data order is the same
    proc, out = sigterm_launch(stopped_args, root, "launcher")
    held = {
        "checkpoints": sorted(os.listdir(out / "checkpoints")) if (out / "checkpoints").is_dir() else None,
        "finished": (out / "model.safetensors").exists(),
    }
    held["checkpoint"] = [sorted(os.listdir(out / "checkpoints" / name)) for name in held["checkpoints"] or []]
    cases = [
        {
            "name": "resumed",
            "script": "mnist",
            "args": [*stopped_args, "--resume_from_checkpoint", "latest", "--output_dir", out],
        },
        *({"name": name, "script": "mnist", "args": [*args, "--output_dir", name]} for name, args in runs.values()),
    ]
    full, batch = regression_runs["cpu_2proc"]
    regression_out = root / "regression_last_step"
    resume = [*REGRESSION, "--per_device_train_batch_size", batch, "--resume_from_checkpoint", "latest"]
    cases.insert(
        1,
        {
            "name": "regression_last_step",
            "script": "regression",
            "args": [*resume, "--output_dir", regression_out],
            "copy": [full, 63, regression_out],
            "stale_latest": 1,
        },
    )
    _, parts = launch_series("cpu_2proc", root, cases)
    runs["stopped"] = proc, out, held, parts["resumed"]
    runs["regression_last_step"] = str(regression_out), parts["regression_last_step"]
    return runs


# SIGTERM to the launcher (map-style, a DataLoader worker per rank: torch elastic signals each rank's
# process group; the launch ends, and a second one resumes it) and to rank 1 alone (streaming: its
# ranks' exit restarts them, --max_restarts 1, and the restart resumes), after optimizer step 9 of 48
@pytest.mark.parametrize("streaming, to", [(False, "launcher"), (True, "self")], ids=["map_style", "streaming"])
def test_sigterm_saves_one_step_on_every_rank_and_the_resume_is_bit_identical(
    mnist_2proc_runs, tmp_path, streaming, to
):
    full, args = mnist_2proc_runs[streaming]
    restart = to == "self"
    if restart:
        proc, out = sigterm_launch([*args, "--dataloader_num_workers", 0], tmp_path, to)
        signalled = tmp_path / "signalled"
    else:  # the fixture's: the stopped launch, what its folder held before the resume, the resume's output
        proc, out, held, resumed = mnist_2proc_runs["stopped"]
        signalled = out.parent / "signalled"
    assert (proc.returncode == 0) is restart and signalled.exists(), output_of(proc)
    said = [line for line in output_of(proc).splitlines() if line.startswith("stopped on SIGTERM at step ")]
    assert len(said) == 1, output_of(proc)  # from the first process only
    step = int(said[0].split()[5])
    assert 9 < step < 24, said[0]  # the ranks' next agreed check, at most 10 steps on: mid-epoch 1 of 2
    checkpoint = out / "checkpoints" / f"step_{step:08d}"
    assert f"saved {checkpoint}; resume with: accelerate launch --config_file " in said[0]
    assert said[0].endswith(" --resume_from_checkpoint latest")
    if restart:
        held = {"checkpoints": sorted(os.listdir(out / "checkpoints")), "checkpoint": [sorted(os.listdir(checkpoint))]}
        resumed = proc.stdout
    assert held["checkpoints"] == [checkpoint.name]  # one step, saved by both ranks
    assert {"rank_state_0.pt", "rank_state_1.pt", "meta.json"} <= set(held["checkpoint"][0])
    if not restart:
        assert not held["finished"]  # the stopped run is not taken for a finished one
    assert f"resumed from {checkpoint}" in resumed and "world_size=2 " in resumed  # mid-epoch, 2 ranks
    assert identical(weights(out), weights(full))


# ----------------------------------------------------------------------------- crashes


def test_sigkill_during_save_leaves_latest_on_the_previous_checkpoint_and_max_restarts_resumes_there(regression_runs):
    """The 2-process launch of regression_runs: checkpoint 33 was finished but unpublished (.tmp-) when
    rank 0 was SIGKILLed; torch elastic's restart found the latest at 32, not 33, and its 33 is the
    uninterrupted run's (weights, optimizer, schedule, both ranks' RNG, data position: compared by
    crash_during_save_and_resume)."""
    out, _ = regression_runs["cpu_2proc"]
    proc = regression_runs["restarted"]
    assert proc.stdout.count("resumed from ") == 1, output_of(proc)
    assert f"resumed from {out}/checkpoints/step_00000032" in proc.stdout
    # the next save of 33 replaced the unpublished one; every step's checkpoint is there, once
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == [f"step_{s:08d}" for s in range(1, 65)]
    assert list_checkpoints(out)[-1].endswith("step_00000064") and os.path.isfile(
        os.path.join(out, "model.safetensors")
    )


# ----------------------------------------------------------------------------- safety and bad input


@pytest.fixture(scope="module")
def one_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    run_regression("cpu", "--max_train_steps", 4, "--checkpointing_steps", 4, "--output_dir", out)
    return out / "checkpoints" / "step_00000004"


class Payload:
    """Unpickling this creates a file: proof that a pickle ran."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("victim", ["optimizer.pt", "rank_state_0.pt"])
def test_planted_pickle_is_refused_not_executed(one_checkpoint, tmp_path, victim, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(one_checkpoint, ckpt)
    proof = tmp_path / "pwned"
    torch.save({"state": Payload(str(proof))}, ckpt / victim)
    proc = run_as_script(capsys, "regression", "--resume_from_checkpoint", ckpt, "--output_dir", tmp_path / "out")
    assert proc.returncode != 0
    assert f"refused to load {ckpt / victim}" in proc.stderr, output_of(proc)
    assert not proof.exists()


def test_resume_path_missing(tmp_path, capsys):
    proc = run_as_script(
        capsys, "regression", "--resume_from_checkpoint", tmp_path / "nope", "--output_dir", tmp_path / "out"
    )
    assert proc.returncode != 0 and "is not a checkpoint (no meta.json there)" in proc.stderr


def test_a_mistyped_checkpoint_path_names_the_checkpoints_there(one_checkpoint, tmp_path, capsys):
    run = one_checkpoint.parent.parent
    for typed in (run / "checkpoints" / "step_4", run):  # the step without its zeros; the run's folder itself
        proc = run_as_script(capsys, "regression", "--resume_from_checkpoint", typed, "--output_dir", tmp_path / "out")
        assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
            f"error: --resume_from_checkpoint {typed} is not a checkpoint (no meta.json there); pass one of "
            f"{one_checkpoint} (the newest last) or 'latest'"
        ], output_of(proc)


def test_checkpoint_from_another_script(one_checkpoint, tmp_path, capsys):
    proc = run_as_script(
        capsys,
        "mnist",
        "--resume_from_checkpoint",
        one_checkpoint,
        "--max_train_samples",
        64,
        "--output_dir",
        tmp_path / "out",
    )
    assert proc.returncode != 0
    assert "was written by train/regression.py" in proc.stderr and "not train/mnist.py" in proc.stderr


def test_corrupt_safetensors(one_checkpoint, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(one_checkpoint, ckpt)
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    proc = run_as_script(capsys, "regression", "--resume_from_checkpoint", ckpt, "--output_dir", tmp_path / "out")
    assert proc.returncode != 0 and "model.safetensors is corrupt or missing" in proc.stderr


def test_existing_run_is_not_overwritten_unless_asked(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_as_script(capsys, "regression", "--max_train_steps", 3, "--output_dir", out).returncode == 0
    before = (out / "model.safetensors").read_bytes()
    proc = run_as_script(capsys, "regression", "--max_train_steps", 3, "--seed", 9, "--output_dir", out)
    assert proc.returncode != 0 and "holds a finished run (step 3); pass --overwrite_output_dir" in proc.stderr
    assert (out / "model.safetensors").read_bytes() == before
    proc = run_as_script(
        capsys, "regression", "--max_train_steps", 3, "--seed", 9, "--overwrite_output_dir", "--output_dir", out
    )
    assert proc.returncode == 0 and (out / "model.safetensors").read_bytes() != before


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_keep_last_k_and_epoch_checkpoints(tmp_path):
    regression.main(
        regression.parse_args(
            [
                "--num_train_epochs",
                "3",
                "--checkpointing_steps",
                "epoch",
                "--checkpoints_total_limit",
                "2",
                "--output_dir",
                str(tmp_path),
            ]
        )
    )
    names = [os.path.basename(p) for p in list_checkpoints(str(tmp_path))]
    assert names == ["step_00000128", "step_00000192"]  # 64 steps per epoch at batch 16
    assert json.load(open(tmp_path / "checkpoints" / names[-1] / "meta.json"))["data"] == {"epoch": 3, "next_batch": 0}
