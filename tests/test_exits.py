"""How a run ends: its workers die with their launcher, Ctrl-C is one line and exit 130 (that the
last line under `accelerate launch` is our error: test_first_hour.py), a full, read-only or
unwritable disk is one line, and `--mixed_precision auto` obeys a config file's answer, 'no' included."""

import errno
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import types

import pytest

from conftest import CONFIGS, REPO, clean_env, output_of, run_as_script, run_or_dump
from train.core import accelerator as accelerator_module
from train.core.accelerator import check_writable, choose_mixed_precision
from train.core.run import run

TINY_MNIST = [
    "--model",
    "convnet_fast",
    "--max_train_samples",
    2000,
    "--max_eval_samples",
    100,
    "--num_train_epochs",
    1,
]
LONG_MNIST = [
    "--model",
    "convnet_fast",
    "--max_train_samples",
    20000,
    "--max_eval_samples",
    100,
    "--num_train_epochs",
    3,
]


def nonempty_lines(text):
    return [line for line in text.replace("\r", "\n").splitlines() if line.strip()]


def alive(pid):
    """A process that has not exited (a zombie waiting for its reaper has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def start(cmd, log):
    """cmd in its own process group, as from a terminal, its output into `log` (a file: no pipe that a
    surviving worker could hold open). Ctrl-C reaches it as it would from a terminal even when the suite
    itself runs in the background, where the shell sets SIGINT to be ignored and children inherit that."""
    with open(log, "w") as f:
        return subprocess.Popen(
            [str(c) for c in cmd],
            cwd=REPO,
            env=clean_env(),
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )


def wait_for(condition, proc, seconds=240):
    deadline = time.time() + seconds
    while not condition() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert condition(), "the run ended or timed out before the moment this test needs"


@pytest.fixture
def mount(tmp_path):
    """mount(options) -> a fresh tmpfs folder mounted with those options (root and mount(8) needed:
    chmod does not stop root), unmounted afterwards."""
    mounted = []

    def make(options):
        folder = tmp_path / f"mnt{len(mounted)}"
        folder.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
        mounted.append(folder)
        return folder

    yield make
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


# ----------------------------------------------------------------------------- the launcher dies


@pytest.mark.parametrize(
    "launcher, processes",
    [(["--config_file", os.path.join(CONFIGS, "cpu_2proc.yaml")], 2), (["--cpu", "--num_processes", 2], 1)],
    ids=["cpu_2proc", "cpu_flag"],
)
def test_workers_die_with_their_launcher(tmp_path, launcher, processes):
    """kill -9 (or the OOM killer) on `accelerate launch` mid-training: no worker goes on writing
    (torch elastic's workers for 2 processes, accelerate's own one-process launcher, as for cpu.yaml,
    for `--cpu --num_processes 2`: asked for two, it starts one, and the run's warning that says so is
    checked here too; a MULTI_CPU config file's: test_first_hour.py)."""
    out = tmp_path / "run"
    proc = start(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            *launcher,
            os.path.join("train", "mnist.py"),
            *LONG_MNIST,
            "--checkpointing_steps",
            10,
            "--output_dir",
            out,
        ],
        tmp_path / "log",
    )
    pids = []
    try:
        wait_for(lambda: (out / "checkpoints" / "step_00000010").is_dir(), proc)  # training, and writing
        pids = [int(p) for p in re.findall(rf"process \d/{processes} pid=(\d+)", (tmp_path / "log").read_text())]
        assert len(pids) == processes and all(alive(pid) for pid in pids)
        proc.kill()  # SIGKILL to the launcher only: its workers run in sessions of their own
        proc.wait()
        deadline = time.time() + 5
        while any(alive(pid) for pid in pids) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in pids), (tmp_path / "log").read_text()[-3000:]
        if processes == 1:  # accelerate's one-process launcher: its child got SIGTERM, so it saved first
            log = (tmp_path / "log").read_text()
            stopped = re.findall(r"^stopped on SIGTERM at step (\d+) ", log, re.M)
            assert len(stopped) == 1 and (out / "checkpoints" / f"step_{int(stopped[0]):08d}").is_dir()
            assert "world_size=1" in log
            assert log.count("warning: the launch asked for several processes but this is ONE") == 1
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


# ----------------------------------------------------------------------------- a finished run


@pytest.mark.parametrize("config", ["cpu_2proc", "fsdp2_cpu_2proc"])
def test_a_finished_run_lets_go_of_its_model_before_the_process_group_ends(tmp_path, config):
    """DDP's reducer and FSDP2's groups hold gloo state: one still alive when the group ends, left for
    interpreter exit, can abort a finished run. run() makes one collection after main() and then ends
    the group; tests/teardown_probe.py looks in between for any prepared model or accelerator left."""
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        os.path.join(CONFIGS, config + ".yaml"),
        os.path.join("tests", "teardown_probe.py"),
        "mnist",
        *map(str, TINY_MNIST),
        "--output_dir",
        str(tmp_path / "run"),
    ]
    proc = run_or_dump(cmd, 300, env=clean_env())
    assert proc.returncode == 0, output_of(proc)
    assert proc.stdout.count("alive before the group ends: []") == 2, output_of(proc)


# ----------------------------------------------------------------------------- Ctrl-C


def test_ctrl_c_of_a_plain_run_is_the_resume_line_and_130(tmp_path):
    out = tmp_path / "run"
    proc = start(
        [sys.executable, "train/mnist.py", *LONG_MNIST, "--checkpointing_steps", 10, "--output_dir", out],
        tmp_path / "log",
    )
    wait_for(lambda: (out / "checkpoints" / "step_00000010").is_dir(), proc)
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C
    assert proc.wait(timeout=30) == 130
    output = (tmp_path / "log").read_text()
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    last = nonempty_lines(output)[-1]
    assert last.startswith(f"interrupted; last checkpoint {out}/checkpoints/step_0000"), output[-3000:]
    assert last.endswith(f"--output_dir {out} --resume_from_checkpoint latest")


# ----------------------------------------------------------------------------- disk faults

FREE = "free space or pass another --output_dir"


@pytest.mark.parametrize(
    "number, expected",
    [
        (errno.ENOSPC, "error: no space left on device writing {out}/checkpoints/x; " + FREE),
        (errno.EDQUOT, "error: disk quota exceeded writing {out}/checkpoints/x; " + FREE),
        (errno.EROFS, "error: read-only file system: cannot write {out}/checkpoints/x; pass another --output_dir"),
        (errno.EACCES, "error: permission denied: {out}/checkpoints/x; pass another --output_dir"),
    ],
)
def test_a_disk_fault_is_one_line(tmp_path, capsys, number, expected):
    out = str(tmp_path / "out")

    def main(args):
        raise OSError(number, os.strerror(number), os.path.join(args.output_dir, "checkpoints", "x"))

    with pytest.raises(SystemExit) as stopped:
        run(main, types.SimpleNamespace(output_dir=out))
    assert stopped.value.code == 1
    assert capsys.readouterr().err == expected.format(out=out) + "\n"


def test_other_os_errors_are_not_disguised(tmp_path):
    def main(args):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", "elsewhere")

    with pytest.raises(FileNotFoundError):
        run(main, types.SimpleNamespace(output_dir=str(tmp_path)))


# ----------------------------------------------------------------------------- --full_determinism


@pytest.fixture
def restore_determinism():
    import torch

    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1:3]
    if before[3] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def test_full_determinism_turns_on_deterministic_kernels_before_the_run(tmp_path, capsys, restore_determinism):
    import torch

    torch.use_deterministic_algorithms(False)
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    proc = run_as_script(
        capsys, "regression", "--full_determinism", "--num_train_epochs", 1, "--output_dir", tmp_path / "run"
    )
    assert proc.returncode == 0, output_of(proc)
    assert "full_determinism: deterministic kernels only" in proc.stdout
    assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
    assert not torch.backends.cudnn.benchmark and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_an_op_without_a_deterministic_kernel_is_one_line(tmp_path, capsys, restore_determinism):
    import torch

    def main(args):  # put_ without accumulate has no deterministic kernel on any device: torch's own error
        torch.use_deterministic_algorithms(True)
        torch.zeros(3).put_(torch.tensor([0]), torch.tensor([1.0]))

    with pytest.raises(RuntimeError):  # without the flag it is not ours to explain
        run(main, types.SimpleNamespace(output_dir=str(tmp_path), full_determinism=False))
    with pytest.raises(SystemExit) as stopped:
        run(main, types.SimpleNamespace(output_dir=str(tmp_path), full_determinism=True))
    assert stopped.value.code == 1
    assert capsys.readouterr().err == (
        "error: --full_determinism: put_ has no deterministic kernel on this device; "
        "run without --full_determinism (a rerun then agrees to rounding, not to the "
        "bit)\n"
    )


def test_check_writable(tmp_path, mount):
    check_writable(str(tmp_path / "new" / "deeper"))  # a folder still to be made: its parent is checked
    assert not (tmp_path / "new").exists() and os.listdir(tmp_path) == []  # and nothing is left behind
    with pytest.raises(OSError) as raised:
        check_writable(str(mount("size=64k,ro") / "run"))
    assert raised.value.errno == errno.EROFS and raised.value.filename.endswith("/run")
    full = mount("size=4k")  # one page
    (full / "filler").write_bytes(b"x" * 4096)
    with pytest.raises(OSError) as raised:
        check_writable(str(full))
    assert raised.value.errno == errno.ENOSPC


def test_a_read_only_output_dir_is_one_line_before_training(tmp_path, mount, capsys):
    # in this process: the check runs before any accelerator (one error line under a 2-process
    # launch, whatever the stage: test_first_hour.py)
    out = mount("size=64k,ro") / "run"
    proc = run_as_script(capsys, "regression", "--output_dir", out)
    assert proc.returncode != 0
    lines = nonempty_lines(output_of(proc))
    assert lines[-1] == f"error: read-only file system: cannot write {out}; pass another --output_dir", lines[-10:]
    assert sum(line.startswith("error:") for line in lines) == 1
    assert "world_size=" not in output_of(proc)  # before any accelerator, process group or data


@pytest.mark.parametrize("checkpoint_format", ["full", "sharded"])
def test_a_full_disk_during_a_run_is_one_line(tmp_path, mount, checkpoint_format, capsys, monkeypatch):
    """The first checkpoint does not fit: one line naming the file, exit 1 (was 105 lines); the
    sharded writer's error comes out of torch.distributed.checkpoint's wrapper as the same line.
    The start's check of the room sees a large disk: this one fills after it, as by another job."""
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=1 << 40))
    out = mount("size=64k") / "run"
    proc = run_as_script(
        capsys,
        "mnist",
        *TINY_MNIST,
        "--checkpointing_steps",
        2,
        "--checkpoint_format",
        checkpoint_format,
        "--output_dir",
        out,
    )
    assert proc.returncode == 1, output_of(proc)[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = nonempty_lines(proc.stderr)[-1]
    assert re.fullmatch(
        rf"error: no space left on device writing {out}/checkpoints/\S+; free space or pass "
        r"another --output_dir",
        last,
    ), last


# ----------------------------------------------------------------------------- a config's mixed precision


@pytest.fixture
def native_bf16_cpu(monkeypatch):
    """A CPU with native bf16, as `auto` sees it, and a process launched by `accelerate launch`."""
    monkeypatch.setattr(accelerator_module, "cpu_has_native_bf16", lambda: (True, "avx512_bf16, AVX512 (faked)"))
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")  # what accelerate launch exports when nothing is said

    def launched_with(*argv):
        monkeypatch.setattr(accelerator_module, "launcher_argv", lambda: ["accelerate", "launch", *argv])

    return launched_with


def test_auto_obeys_a_config_that_says_no(tmp_path, native_bf16_cpu):
    said_no = tmp_path / "no.yaml"
    said_no.write_text(open(os.path.join(CONFIGS, "cpu_2proc.yaml")).read() + "mixed_precision: 'no'  # fp32\n")
    native_bf16_cpu("--config_file", str(said_no))
    assert choose_mixed_precision("auto", on_cpu=True) == ("no", f"from the accelerate config {said_no}")
    native_bf16_cpu(f"--config_file={said_no}")
    assert choose_mixed_precision("auto", on_cpu=True)[1] == f"from the accelerate config {said_no}"
    assert choose_mixed_precision("bf16", on_cpu=True) == ("bf16", "as asked")  # the script's flag wins


def test_auto_without_an_answer_follows_the_hardware(tmp_path, monkeypatch, native_bf16_cpu):
    native_bf16_cpu("--config_file", os.path.join(CONFIGS, "cpu_2proc.yaml"))  # the shipped file: no key
    assert choose_mixed_precision("auto", on_cpu=True) == (
        "bf16",
        "auto: native bf16 on this CPU, avx512_bf16, AVX512 (faked)",
    )
    native_bf16_cpu("--mixed_precision", "no")  # said on the launch command line
    assert choose_mixed_precision("auto", on_cpu=True) == ("no", "from accelerate launch --mixed_precision")
    # no --config_file: accelerate's default config file, as accelerate launch reads it (not with --cpu)
    import accelerate.commands.config

    default = tmp_path / "default_config.yaml"
    default.write_text('{"mixed_precision": "no", "num_processes": 1}')  # `accelerate config default` writes JSON
    monkeypatch.setattr(accelerate.commands.config, "default_config_file", str(default))
    native_bf16_cpu()
    assert choose_mixed_precision("auto", on_cpu=True) == ("no", f"from the accelerate config {default}")
    native_bf16_cpu("--cpu")
    assert choose_mixed_precision("auto", on_cpu=True)[0] == "bf16"


# ----------------------------------------------------------------------------- a stop through train.core.launch


@pytest.mark.parametrize("sigterm", [True, False], ids=["sigterm_to_a_rank", "sigkill_to_a_rank"])
def test_the_batch_launcher_ends_a_sigterm_stop_of_the_ranks_with_143_and_a_crash_as_a_crash(tmp_path, sigterm):
    """`python -m train.core.launch accelerate launch ...` (the SLURM scripts' launcher): a SIGTERM to
    one rank stops every rank at one step, saved, each with exit code 143: the launcher ends with 143
    and no traceback. A rank killed outright is a failure: torch elastic's report and exit code 1."""
    kill = ["--rank", 1, "--step", 2, "--marker", tmp_path / "signalled", *(["--sigterm", "self"] if sigterm else [])]
    cmd = [
        sys.executable,
        "-m",
        "train.core.launch",
        "accelerate",
        "launch",
        "--config_file",
        os.path.join(CONFIGS, "cpu_2proc.yaml"),
        os.path.join("tests", "kill_at_step.py"),
        "regression",
        *map(str, kill),
        "--",
        "--max_train_steps",
        "20",
        "--output_dir",
        str(tmp_path / "run"),
    ]
    proc = run_or_dump(cmd, 300, env=clean_env())
    said = [line for line in output_of(proc).splitlines() if line.startswith("stopped on SIGTERM at step ")]
    if sigterm:
        assert proc.returncode == 143 and len(said) == 1, output_of(proc)
        assert "Traceback" not in output_of(proc) and "ChildFailedError" not in output_of(proc), output_of(proc)
    else:
        assert proc.returncode == 1 and not said and "ChildFailedError" in output_of(proc), output_of(proc)
