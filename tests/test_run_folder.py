"""What a run may do to its --output_dir and what it refuses: only its own files are ever replaced
(and only once the new run has something to show), one writer at a time, every rank resumes from
the same checkpoint, no final model from a run whose numbers went bad, no resume into another
run's batches or data, strict JSON, and a first log after a resume that averages the same steps."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, checksums, clean_env, output_of, probe, run_as_script, run_main

QUICK = ["--max_train_steps", 6, "--checkpointing_steps", 3]


def in_process(*args):
    return run_main("regression", *args)


def error_lines(proc):
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def strict_json(path):
    def refuse(constant):
        raise ValueError(f"{path} holds {constant}, which is not JSON")

    with open(path) as f:
        return json.load(f, parse_constant=refuse)


# ----------------------------------------------------------------------------- only what the project wrote


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_folder_that_is_not_a_run_is_never_written_over(tmp_path, overwrite, capsys):
    out = tmp_path / "mine"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "my_model.pt").write_bytes(b"user weights")
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events.mine").write_bytes(b"user events")
    (out / "labels.json").write_text('["cat", "dog"]')
    (out / "notes.txt").write_text("my notes")
    before = checksums(out)
    proc = run_as_script(
        capsys, "regression", *QUICK, "--output_dir", out, *(["--overwrite_output_dir"] if overwrite else [])
    )
    assert proc.returncode == 1, output_of(proc)
    assert len(error_lines(proc)) == 1 and "checkpoints, tensorboard, labels.json but no run.json" in proc.stderr
    assert "Traceback" not in output_of(proc)
    assert checksums(out) == before  # every file kept, byte for byte, and nothing added


def test_a_users_other_files_beside_a_run_are_kept_through_runs_and_overwrites(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    in_process(*QUICK, "--output_dir", out)
    in_process(*QUICK, "--seed", 3, "--output_dir", out, "--overwrite_output_dir")
    assert (out / "notes.txt").read_text() == "my notes"
    assert not (out / "replaced_run").exists()  # the new run finished: the replaced one is gone
    assert strict_json(out / "all_results.json")["step"] == 6


def test_overwrite_keeps_the_earlier_run_until_the_new_one_has_a_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    in_process(*QUICK, "--output_dir", out)
    ours = lambda sums: {k: v for k, v in sums.items() if k not in ("run.json", ".lock")}  # noqa: E731
    finished = ours(checksums(out))
    # a replacement that fails before its first checkpoint (here: its loss diverges at once) puts it back
    proc = run_as_script(
        capsys,
        "regression",
        "--learning_rate",
        1e20,
        "--checkpointing_steps",
        50,
        "--output_dir",
        out,
        "--overwrite_output_dir",
    )
    assert proc.returncode == 1 and "non-finite" in proc.stderr, output_of(proc)
    assert f"moved the earlier run to {out / 'replaced_run'}" in proc.stdout
    assert f"put the earlier run back in {out}" in proc.stdout and not (out / "replaced_run").exists()
    assert ours(checksums(out)) == finished
    # one killed before its first checkpoint cannot put it back: the next replacement keeps it aside
    os.makedirs(out / "replaced_run")
    for name in set(os.listdir(out)) - {"run.json", ".lock", "replaced_run"}:
        os.replace(out / name, out / "replaced_run" / name)
    (out / "args.json").write_text("{}")  # what the killed replacement had written
    proc = run_as_script(
        capsys,
        "regression",
        "--learning_rate",
        1e20,
        "--checkpointing_steps",
        50,
        "--output_dir",
        out,
        "--overwrite_output_dir",
    )
    assert proc.returncode == 1 and "removed the unfinished run" in proc.stdout, output_of(proc)
    assert ours(checksums(out)) == finished and not (out / "replaced_run").exists()
    # the one that works: once it has a checkpoint the replaced run goes
    in_process(*QUICK, "--seed", 3, "--output_dir", out, "--overwrite_output_dir")
    assert not (out / "replaced_run").exists() and strict_json(out / "args.json")["seed"] == 3


def test_a_save_killed_midway_is_cleaned_up_by_the_next_run(tmp_path):
    out = tmp_path / "run"
    in_process("--max_train_steps", 3, "--checkpointing_steps", 3, "--output_dir", out)
    os.remove(out / "all_results.json")
    os.remove(out / "model.safetensors")
    shutil.copytree(out / "checkpoints" / "step_00000003", out / "checkpoints" / ".tmp-step_00000006")
    in_process(
        "--max_train_steps", 6, "--checkpointing_steps", 3, "--output_dir", out, "--resume_from_checkpoint", "latest"
    )
    assert sorted(os.listdir(out / "checkpoints")) == ["step_00000003", "step_00000006"]


# ----------------------------------------------------------------------------- one writer


def test_a_second_run_on_a_folder_in_use_is_refused_and_the_first_finishes_intact(tmp_path, capsys):
    out = tmp_path / "run"
    first = subprocess.Popen(
        [
            sys.executable,
            os.path.join("train", "regression.py"),
            "--num_train_epochs",
            "3",
            "--checkpointing_steps",
            "40",
            "--output_dir",
            str(out),
        ],
        cwd=REPO,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 60
        while not (out / ".lock").exists() or not (out / ".lock").read_text().strip():
            assert time.time() < deadline and first.poll() is None, "the first run never took its lock"
            time.sleep(0.05)
        os.kill(first.pid, signal.SIGSTOP)  # the first run holds the folder for as long as the second tries
        try:
            # the second run in this process: the first, a real one, holds the lock (the subject). Were
            # the lock to block rather than refuse, the first resumes after 120 s and this one then
            # succeeds: a failure below, not a hang
            resume = threading.Timer(120, os.kill, (first.pid, signal.SIGCONT))
            resume.start()
            try:
                second = run_as_script(capsys, "regression", "--max_train_steps", 3, "--output_dir", out)
            finally:
                resume.cancel()
        finally:
            os.kill(first.pid, signal.SIGCONT)
        out_first, err_first = first.communicate(timeout=120)
    finally:
        first.kill()
    assert second.returncode == 1 and len(error_lines(second)) == 1, output_of(second)
    assert f"is in use as the output folder of a training run by pid {first.pid}" in second.stderr
    assert first.returncode == 0, out_first + err_first
    results = strict_json(out / "all_results.json")
    assert results["step"] == 3 * 64 and results["resumed_from"] is None
    assert [r["step"] for r in map(json.loads, open(out / "metrics.jsonl"))] == sorted(
        r["step"] for r in map(json.loads, open(out / "metrics.jsonl"))
    )  # one writer: one ordered log


def test_a_lock_left_by_a_dead_process_is_taken_over_with_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (out / ".lock").write_text(
        json.dumps({"host": "here", "pid": int(dead.stdout), "started": 0, "command": "train/regression.py"})
    )
    proc = run_as_script(capsys, "regression", *QUICK, "--output_dir", out)
    assert proc.returncode == 0, output_of(proc)
    assert f"was locked by a process that is gone (pid {int(dead.stdout)}" in proc.stdout
    assert (out / ".lock").read_text() == ""  # released on purpose at the end


def test_a_run_removing_the_folder_it_made_never_leaves_two_owners(tmp_path):
    """Run A claims a new folder and fails before writing anything (it removes run.json, .lock and the
    folder) while run B takes the folder's lock: 300 rounds. B's lock must be on the OUTPUT_DIR/.lock
    that is there once A is done (else a third run also gets the folder), and A's clean-up must not raise."""
    from data.locks import FolderBusy, lock_folder
    from races import quiet, race
    from train.core import output_dir

    def fail_early(n, barrier):
        out = str(tmp_path / f"round_{n}")
        output_dir._claim(out, "regression", None, False)
        barrier.wait()
        try:
            output_dir._remove_if_unused(out)
        finally:
            barrier.wait()  # B looks at its lock once A is done
        return "removed"

    def take(n, barrier):
        out = str(tmp_path / f"round_{n}")
        barrier.wait()
        lock = None
        for _ in range(200):
            try:
                lock = lock_folder(out, note=quiet)
                break
            except FolderBusy:
                continue
        barrier.wait()
        if lock is None:
            return "busy throughout"
        try:
            here = os.path.samestat(os.fstat(lock._fd), os.stat(os.path.join(out, ".lock")))
        except FileNotFoundError:
            here = False
        lock.release()
        return "owns the folder" if here else "holds a lock file that is gone: a second owner can come"

    rounds = 300
    removed, taken = race([fail_early, take], rounds)
    bad = [o for o in removed if o != "removed"] + [o for o in taken if o not in ("owns the folder", "busy throughout")]
    assert not bad, f"{len(bad)} bad outcomes in {rounds} rounds, e.g. {bad[0]}"


# ----------------------------------------------------------------------------- wrong numbers


def test_a_diverging_loss_stops_every_rank_with_one_line_and_no_final_model(tmp_path):
    out = tmp_path / "run"
    # rank 1's 7th loss is NaN; DDP spreads its gradients to rank 0; checkpoints every 4 steps
    proc = probe(
        "cpu_2proc", ["--nan_at", 7, "--rank", 1], "--checkpointing_steps", 4, "--logging_steps", 5, "--output_dir", out
    )
    assert proc.returncode == 1, output_of(proc)
    lines = error_lines(proc)
    assert len(lines) == 1 and "the training loss became non-finite at step 7" in lines[0], output_of(proc)
    assert "step_00000004" in lines[0] and "--nonfinite_loss skip" in lines[0]
    assert not (out / "model.safetensors").exists() and not (out / "all_results.json").exists()
    assert [os.path.basename(p) for p in sorted((out / "checkpoints").iterdir())] == ["step_00000004"]
    assert all(
        torch.isfinite(t).all() for t in load_file(out / "checkpoints" / "step_00000004" / "model.safetensors").values()
    )


def test_weights_that_overflow_stop_the_run_before_a_checkpoint_of_them(tmp_path, capsys):
    # at this rate the first update takes the weights past float32's range
    proc = run_as_script(
        capsys, "regression", "--learning_rate", 1e38, "--checkpointing_steps", 1, "--output_dir", tmp_path / "run"
    )
    assert proc.returncode == 1 and len(error_lines(proc)) == 1, output_of(proc)
    assert "the model's weights are no longer finite at step 1" in proc.stderr
    assert "no checkpoint was saved" in proc.stderr
    assert not (tmp_path / "run" / "model.safetensors").exists()
    assert not (tmp_path / "run" / "checkpoints").exists() or not os.listdir(tmp_path / "run" / "checkpoints")


def test_nonfinite_loss_skip_drops_that_step_and_writes_strict_json(tmp_path):
    out = tmp_path / "run"
    proc = probe(
        "cpu_2proc",
        ["--nan_at", 7, "--rank", 1],
        "--nonfinite_loss",
        "skip",
        "--max_train_steps",
        12,
        "--logging_steps",
        4,
        "--output_dir",
        out,
    )
    assert proc.returncode == 0, output_of(proc)
    results = strict_json(out / "all_results.json")
    assert results["skipped_steps"] == 1 and results["step"] == 12
    assert all(torch.isfinite(t).all() for t in load_file(out / "model.safetensors").values())
    for name in ("args.json", "run.json"):
        strict_json(out / name)
    logged = [
        json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl"))
        for line in open(out / "metrics.jsonl")
    ]
    train = [r for r in logged if "train_loss" in r]
    assert [r["step"] for r in train] == [4, 8, 12] and [r.get("skipped_steps", 0) for r in train] == [0, 1, 1]
    assert all(r["train_loss"] is not None for r in train)  # the NaN loss is left out of the mean


# ----------------------------------------------------------------------------- resume: the same run, or none


@pytest.mark.parametrize(
    "change, what",
    [
        (
            ["--per_device_train_batch_size", 32],
            "a global batch of 16 per process x 1 processes x 1 accumulation steps",
        ),
        (["--gradient_accumulation_steps", 2], "this run has 16 per process x 1 processes x 2 accumulation steps"),
        (["--num_train_samples", 900], "saved training on 1024 samples per epoch; this run has 900"),
    ],
)
def test_resume_with_another_batch_or_data_is_refused(tmp_path, change, what, capsys):
    out = tmp_path / "run"
    in_process("--max_train_steps", 6, "--checkpointing_steps", 3, "--output_dir", out)
    os.remove(out / "all_results.json")
    proc = run_as_script(
        capsys, "regression", "--max_train_steps", 9, *change, "--output_dir", out, "--resume_from_checkpoint", "latest"
    )
    assert proc.returncode == 1 and len(error_lines(proc)) == 1, output_of(proc)
    assert what in proc.stderr, proc.stderr


def test_the_first_log_after_a_resume_averages_the_same_steps(tmp_path):
    """Checkpoint at step 30, logs every 20: the log at step 40 averages steps 21-40 as if never cut."""
    args = ["--max_train_steps", 60, "--checkpointing_steps", 30, "--logging_steps", 20, "--seed", 2]
    full, out = tmp_path / "full", tmp_path / "out"
    in_process(*args, "--output_dir", full)
    os.makedirs(out / "checkpoints")
    shutil.copytree(full / "checkpoints" / "step_00000030", out / "checkpoints" / "step_00000030")
    for name in ("run.json", "metrics.jsonl"):  # the log as a crash would leave it: the resume cuts it back
        shutil.copy(full / name, out / name)
    in_process(*args, "--output_dir", out, "--resume_from_checkpoint", "latest")

    def logged(folder):
        return [
            (r["step"], r["train_loss"]) for r in map(json.loads, open(folder / "metrics.jsonl")) if "train_loss" in r
        ]

    assert logged(out) == logged(full) and [s for s, _ in logged(out)] == [20, 40, 60]


# ----------------------------------------------------------------------------- a full disk


@pytest.fixture
def small_disk(tmp_path):
    """A 160 KiB tmpfs: room for the run's start and a few checkpoints, not for all of them."""
    folder = tmp_path / "disk"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.decode().strip()}): needs root")
    yield folder
    subprocess.run(["umount", "-l", str(folder)])


def test_a_full_disk_at_a_checkpoint_is_one_line_and_leaves_every_published_checkpoint_whole(small_disk, capsys):
    out = small_disk / "run"
    proc = run_as_script(capsys, "regression", "--max_train_steps", 60, "--checkpointing_steps", 2, "--output_dir", out)
    assert proc.returncode == 1, output_of(proc)
    assert error_lines(proc) == [line for line in proc.stderr.splitlines() if line.strip() and "%|" not in line]
    assert len(error_lines(proc)) == 1 and "no space left on device" in proc.stderr.lower(), proc.stderr
    assert str(out) in error_lines(proc)[0] and "Traceback" not in proc.stderr
    assert not list((out / "checkpoints").glob(".tmp-*"))  # the unpublished half is gone, with the space it took
    published = sorted((out / "checkpoints").glob("step_*"))
    assert published and not (out / "all_results.json").exists()
    for folder in published:  # every checkpoint that carries its name is complete and loads
        assert (folder / "meta.json").exists()
        load_file(folder / "model.safetensors")
        torch.load(folder / "optimizer.pt", weights_only=True)
