"""What a new user meets in the first hour: the precision chosen for the CPU, a finished run never
replaced unasked, wizard configs that do what they say (the 2-process one's run stops early at one
step on every rank), one error line under `accelerate launch`, Ctrl-C that says how to resume, and
honest figures after a resume."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import (
    CONFIGS,
    REPO,
    checksums,
    clean_env,
    launch,
    output_of,
    reset_accelerate_state,
    run_as_script,
    run_main,
    run_or_dump,
)
from train import check_config, mnist
from train.core.accelerator import cpu_has_native_bf16
from wizard import run_wizard

TINY_MNIST = [
    "--model",
    "convnet_fast",
    "--max_train_samples",
    512,
    "--max_eval_samples",
    100,
    "--num_train_epochs",
    1,
    "--per_device_train_batch_size",
    32,
]


def launch_file(config_file, script_name, *args, timeout=300):
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config_file),
        os.path.join("train", script_name + ".py"),
        *map(str, args),
    ]
    return run_or_dump(cmd, timeout, env=clean_env())


# ----------------------------------------------------------------------------- mixed precision auto


@pytest.mark.parametrize(
    "flags, capability, isa, native",
    [
        (["avx2", "avx512f", "avx512_bf16"], "AVX512", "", True),
        (["avx2", "amx_bf16", "avx512_bf16"], "AVX512", "", True),
        (["avx2", "avx512f"], "AVX512", "", False),  # AVX-512 without its bf16 extension
        (["avx2"], "AVX2", "", False),
        (["avx2", "avx512_bf16"], "AVX2", "", False),  # limited by ATEN_CPU_CAPABILITY=avx2
        (["avx2", "avx512_bf16"], "AVX512", "AVX2", False),  # limited by ONEDNN_MAX_CPU_ISA=AVX2
        (["avx2", "avx512_bf16"], "AVX512", "AVX512_CORE_BF16", True),
    ],
)
def test_native_bf16_detection(flags, capability, isa, native):
    assert cpu_has_native_bf16(flags, capability, isa)[0] is native


def test_native_bf16_reason_names_amx_held_back_by_onednn():
    # an AMX CPU with oneDNN held to AVX512-BF16 (how an AMX Xeon stands in for an AVX512-BF16 EPYC)
    flags = ["avx2", "avx512f", "avx512_bf16", "amx_bf16"]
    assert cpu_has_native_bf16(flags, "AVX512", "AVX512_CORE_BF16") == (
        True,
        "avx512_bf16, AVX512, ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16",
    )
    assert cpu_has_native_bf16(flags, "AVX512", "") == (True, "amx_bf16, AVX512")
    assert cpu_has_native_bf16(flags, "AVX512", "AVX512_CORE_AMX") == (True, "amx_bf16, AVX512")


def test_auto_picks_fp32_on_an_avx2_cpu_and_bf16_asked_there_warns(tmp_path, capsys, monkeypatch):
    # in this process: the choice reads ONEDNN_MAX_CPU_ISA when the run starts (ATEN_CPU_CAPABILITY acts
    # at torch's import: its reading is test_native_bf16_detection's AVX2 case); a config that asks for
    # bf16 is obeyed: the wizard's multi-CPU file below
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    proc = run_as_script(capsys, "mnist", *TINY_MNIST, "--max_train_steps", 2, "--output_dir", tmp_path / "auto")
    assert proc.returncode == 0, output_of(proc)
    assert "mixed_precision=no (auto: no native bf16 on this CPU" in proc.stdout
    assert "warning: bf16" not in proc.stdout
    proc = run_as_script(
        capsys,
        "mnist",
        *TINY_MNIST,
        "--max_train_steps",
        2,
        "--mixed_precision",
        "bf16",
        "--output_dir",
        tmp_path / "bf16",
    )
    assert proc.returncode == 0, output_of(proc)
    assert "mixed_precision=bf16 (as asked)" in proc.stdout
    assert proc.stdout.count("warning: bf16 on a CPU without native bf16") == 1


# ----------------------------------------------------------------------------- finished runs are kept


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "run"
    run_main("regression", "--output_dir", out, "--checkpointing_steps", 64)
    assert os.path.isfile(out / "all_results.json") and os.listdir(out / "checkpoints")
    return out


@pytest.mark.parametrize("resume", ["latest", "checkpoint_path"])
def test_resuming_a_finished_run_says_so_and_changes_nothing(finished_run, resume, capsys):
    before = checksums(finished_run)
    target = str(finished_run / "checkpoints" / "step_00000128") if resume == "checkpoint_path" else "latest"
    proc = run_as_script(
        capsys,
        "regression",
        "--output_dir",
        finished_run,
        "--checkpointing_steps",
        64,
        "--resume_from_checkpoint",
        target,
    )
    assert proc.returncode == 0, output_of(proc)
    assert f"{finished_run} holds a finished run (step 128); nothing to resume, nothing changed" in proc.stdout
    assert "world_size" not in proc.stdout  # it stopped before building anything
    assert checksums(finished_run) == before


def test_a_finished_run_is_not_replaced_unasked(finished_run, capsys):
    before = checksums(finished_run)
    proc = run_as_script(capsys, "regression", "--output_dir", finished_run)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"error: --output_dir {finished_run} holds a finished run (step 128); pass "
        "--overwrite_output_dir to replace it, or another --output_dir"
    )
    assert checksums(finished_run) == before


def test_weights_without_checkpoint_refuse_to_resume(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_as_script(capsys, "regression", "--output_dir", out).returncode == 0  # no --checkpointing_steps
    os.remove(out / "all_results.json")  # as a crash between the two final writes leaves it
    before = checksums(out)
    proc = run_as_script(capsys, "regression", "--output_dir", out, "--resume_from_checkpoint", "latest")
    assert proc.returncode == 1
    assert "holds a run's weights (model.safetensors) but no checkpoint, so it cannot be resumed" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert checksums(out) == before


def test_unfinished_run_hint_names_the_resume(tmp_path, finished_run, capsys):
    out = tmp_path / "run"
    shutil.copytree(finished_run / "checkpoints" / "step_00000064", out / "checkpoints" / "step_00000064")
    proc = run_as_script(capsys, "regression", "--output_dir", out)
    assert proc.returncode == 1
    assert (
        "holds an unfinished run with checkpoints up to step_00000064; pass --resume_from_checkpoint latest "
        "to continue it" in proc.stderr
    )


# ----------------------------------------------------------------------------- the wizard's CPU answers

MULTI_CPU_ANSWERS = [
    (r"compute environment", "\r"),
    (r"Which type of machine", "1\r"),
    (r"How many processes", "2\r"),
    (r"use mixed precision", "2\r"),
]  # bf16
MULTI_GPU_ANSWERS = [(r"compute environment", "\r"), (r"Which type of machine", "4\r"), (r"How many GPU\(s\)", "2\r")]


@pytest.fixture(scope="module")
def wizard_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wizard")
    files = {}
    for name, answers in (("multi_cpu", MULTI_CPU_ANSWERS), ("multi_gpu", MULTI_GPU_ANSWERS)):
        files[name] = folder / f"{name}.yaml"
        code, screen = run_wizard(files[name], answers)
        assert code == 0 and files[name].is_file(), screen
    return files


def test_check_config_tells_the_truth_about_wizard_files(wizard_files, capsys):
    # in this process: `python -m train.check_config FILE` is main([FILE]); no GPU counted, as on a CPU machine
    assert check_config.main([str(wizard_files["multi_cpu"])]) == 1
    assert "MULTI_CPU with 2 processes per machine runs as ONE process (world size 1)" in capsys.readouterr().err
    assert check_config.problems(str(wizard_files["multi_gpu"]), gpu_count=0) == []
    said = check_config.summary(str(wizard_files["multi_gpu"]), gpu_count=0)
    assert "MULTI_GPU, 2 process(es)" in said and "run it as 2 CPU process(es) per machine" in said


def test_a_launch_that_asked_for_two_processes_but_got_one_warns(wizard_files, tmp_path):
    # the wizard's MULTI_CPU file; `--cpu --num_processes 2` warns the same: test_exits.py's kill of its launcher
    proc = launch_file(wizard_files["multi_cpu"], "regression", "--output_dir", tmp_path)
    assert proc.returncode == 0, output_of(proc)
    assert "world_size=1" in proc.stdout
    assert proc.stdout.count("warning: the launch asked for several processes but this is ONE") == 1
    # answered bf16: `auto` obeys a config that asks for it
    assert f"mixed_precision=bf16 (from the accelerate config {wizard_files['multi_cpu']})" in proc.stdout


EARLY = [
    "--max_train_steps",
    60,
    "--eval_steps",
    5,
    "--early_stopping_patience",
    2,
    "--checkpointing_steps",
    10,
    "--learning_rate",
    0.2,
    "--seed",
    1,
]


@pytest.fixture(scope="module")
def stopped_early(wizard_files, tmp_path_factory):
    """The wizard's multi-GPU file's run: 2 CPU processes, evaluating, checkpointing and stopping early
    (the rest of early stopping, in one process: test_experiments.py)."""
    out = tmp_path_factory.mktemp("early") / "run"
    proc = launch_file(wizard_files["multi_gpu"], "regression", "--output_dir", out, *EARLY)
    assert proc.returncode == 0, output_of(proc)
    return out, proc


def test_the_wizard_multi_gpu_file_is_two_cpu_processes_without_warnings(stopped_early):
    _, proc = stopped_early
    assert "world_size=2" in proc.stdout and "distributed_type=MULTI_CPU" in proc.stdout
    assert "warning" not in output_of(proc).lower() and "FutureWarning" not in output_of(proc)


def test_early_stopping_ends_every_rank_at_one_step_with_the_best_weights(stopped_early):
    out, proc = stopped_early
    results = json.loads((out / "all_results.json").read_text())
    best, last = results["best_model"], results["step"]
    assert results["stopped_early"] and last < 60
    # patience 2: the two evaluations after the best, every 5 steps, then the run ended (on both ranks:
    # a rank going on alone would hang the other's next collective, and the launch would time out)
    assert last == best["step"] + 2 * 5, output_of(proc)
    assert [h["step"] for h in results["history"]] == list(range(5, last + 1, 5))
    assert (
        f"early stopping: eval_mse has not improved (lower is better) for 2 evaluations; best "
        f"{best['value']:.4f} at step {best['step']}" in proc.stdout
    )
    assert results["eval_mse"] > best["value"] == min(h["eval_mse"] for h in results["history"])
    # model.safetensors holds the best step's weights: the checkpoint at that step holds the same
    saved = out / "checkpoints" / f"step_{best['step']:08d}"
    if saved.is_dir():
        assert (out / "model.safetensors").read_bytes() == (saved / "model.safetensors").read_bytes()
    assert (out / "model.safetensors").read_bytes() == (
        out / "checkpoints" / f"step_{(last // 10) * 10:08d}" / "best_model.safetensors"
    ).read_bytes()
    assert not (out / "best_model.safetensors").exists()


# ----------------------------------------------------------------------------- errors under accelerate launch


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["--lerning_rate", "1e-3"],
            "error: unrecognized arguments: --lerning_rate 1e-3 (did you mean --learning_rate?)",
        ),
        (["--data_dir", "EMPTY"], "error: no fashion_mnist idx files in"),
        (["--resume_from_checkpoint", "MISSING"], "error: --resume_from_checkpoint"),
    ],
    ids=["misspelled", "empty_data_dir", "missing_checkpoint"],
)
def test_bad_input_under_two_processes_is_one_line(tmp_path, args, expected):
    """One error of each stage (the arguments, the data, the checkpoint); the wording of the others is
    checked in one process (test_bad_input.py): under launch it reaches the user the same way."""
    (tmp_path / "empty").mkdir()
    args = [str(tmp_path / "empty") if a == "EMPTY" else str(tmp_path / "nope") if a == "MISSING" else a for a in args]
    started = time.perf_counter()
    proc = launch("cpu_2proc", "mnist", *args, "--output_dir", tmp_path / "out", timeout=120)
    assert proc.returncode != 0
    output = output_of(proc)
    ours = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(ours) == 1 and ours[0].startswith(expected), output
    # torchrun's ChildFailedError report (about 40 lines) comes first, our line last
    assert [line for line in output.splitlines() if line.strip()][-1] == ours[0], output[-3000:]
    assert 'mnist.py", line' not in output  # no traceback of ours; what is left is torchrun's report
    assert len(output.splitlines()) <= 45, output  # 46-90 lines before
    assert time.perf_counter() - started < 60  # before the data load and any process-group timeout
    assert not (tmp_path / "out").exists()


def test_ctrl_c_stops_at_once_with_the_resume_command(tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        os.path.join(CONFIGS, "cpu_2proc.yaml"),
        "train/mnist.py",
        "--model",
        "convnet_fast",
        "--max_train_samples",
        "20000",
        "--max_eval_samples",
        "100",
        "--num_train_epochs",
        "3",
        "--checkpointing_steps",
        "20",
        "--output_dir",
        str(out),
    ]
    # a terminal's Ctrl-C: SIGINT to the launcher and its workers, one process group
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.time() + 240
    while not (out / "checkpoints" / "step_00000040").is_dir() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    interrupted = time.perf_counter()
    output = proc.communicate(timeout=60)[0]
    assert time.perf_counter() - interrupted < 10
    assert proc.returncode != 0
    lines = [line for line in output.splitlines() if line.startswith("interrupted;")]
    assert len(lines) == 1, output
    assert [line for line in output.splitlines() if line.strip()][-1] == lines[0]  # after torchrun's traceback
    assert "last checkpoint " + str(out / "checkpoints" / "step_0000") in lines[0]
    assert "KeyboardInterrupt" not in output
    command = lines[0].split("resume with: ", 1)[1]
    assert command.startswith("accelerate launch --config_file ") and command.endswith(
        f"--output_dir {out} --resume_from_checkpoint latest"
    )


# ----------------------------------------------------------------------------- --help


def test_help_is_grouped_with_defaults(capsys):
    proc = run_as_script(capsys, "mnist", "--help")
    assert proc.returncode == 0
    for title in (
        "data:",
        "model:",
        "optimization:",
        "output and checkpoints:",
        "logging and tracking:",
        "hardware and precision:",
    ):
        assert f"\n{title}\n" in proc.stdout
    assert "(default: 64)" in proc.stdout and "(default: auto)" in proc.stdout
    assert "(default: None)" not in proc.stdout and "(default: False)" not in proc.stdout


# ----------------------------------------------------------------------------- figures after a resume


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_resumed_run_counts_the_time_before_its_checkpoint(tmp_path):
    args = [*map(str, TINY_MNIST), "--checkpointing_steps", "4", "--output_dir", str(tmp_path / "full")]
    mnist.main(mnist.parse_args(args))
    shutil.copytree(
        tmp_path / "full" / "checkpoints" / "step_00000004", tmp_path / "resumed" / "checkpoints" / "step_00000004"
    )
    meta_path = tmp_path / "resumed" / "checkpoints" / "step_00000004" / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert 0 < meta["epoch_elapsed"] < 100
    meta["epoch_elapsed"] = 1000.0  # as if the first 4 of 16 steps had taken 1000 s
    meta_path.write_text(json.dumps(meta))
    reset_accelerate_state()
    results = mnist.main(
        mnist.parse_args([*args[:-1], str(tmp_path / "resumed"), "--resume_from_checkpoint", "latest"])
    )
    assert 1000 < results["epoch_seconds"][0] < 1100
    assert results["train_samples_per_second"] == pytest.approx(16 * 32 / sum(results["epoch_seconds"]))
