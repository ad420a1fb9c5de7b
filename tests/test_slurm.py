"""accelerate_configs/slurm/launch_node.sh: the launch command each node of a SLURM job derives from
SLURM's variables, and that those commands really form one job (two loopback 'nodes')."""
import os
import shlex
import subprocess
import sys

import pytest
import yaml

from conftest import CONFIGS, REPO, clean_env

LAUNCHER = os.path.join(CONFIGS, "slurm", "launch_node.sh")


@pytest.fixture
def fake_slurm_bin(tmp_path):
    """A stand-in for `scontrol show hostnames LIST` (expands node[01-02] here), and the Python
    environment's bin/ so that `accelerate` is the one under test."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        '#!/bin/bash\n[ "$1 $2" = "show hostnames" ] || exit 2\n'
        'case "$3" in "node[01-02]") printf "node01\\nnode02\\n";; "big[1-20000]") seq -f "big%g" 20000;;\n'
        '  *) echo "$3";; esac\n')
    (bin_dir / "scontrol").chmod(0o755)
    return f"{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}"


def derive(path_env, node_id, **extra):
    slurm = {"SLURM_JOB_NODELIST": "node[01-02]", "SLURM_NNODES": "2", "SLURM_NODEID": str(node_id),
             "SLURM_JOB_ID": "123456", "SLURM_GPUS_ON_NODE": "8", "GPUS_PER_NODE": "", **extra}
    env = clean_env(PATH=path_env, DRY_RUN="1", **slurm)
    proc = subprocess.run(["bash", LAUNCHER, "train/mnist.py", "--num_train_epochs", "5"], cwd=REPO, env=env,
                          capture_output=True, text=True)
    return proc, shlex.split(proc.stdout)


@pytest.mark.parametrize("node_id", [0, 1])
def test_two_nodes_by_eight_gpus(fake_slurm_bin, node_id):
    proc, cmd = derive(fake_slurm_bin, node_id)
    assert proc.returncode == 0, proc.stderr
    assert cmd == ["accelerate", "launch", "--config_file", "accelerate_configs/2node_8gpu.yaml",
                   "--num_machines", "2", "--num_processes", "16", "--machine_rank", str(node_id),
                   "--main_process_ip", "node01", "--main_process_port", str(20000 + 123456 % 20000),
                   "train/mnist.py", "--num_train_epochs", "5"]


def test_gpu_count_with_repeat_suffix_and_config_choice(fake_slurm_bin):
    proc, cmd = derive(fake_slurm_bin, 1, SLURM_GPUS_ON_NODE="4(x2)",
                       ACCELERATE_CONFIG="accelerate_configs/2node_8gpu_c10d.yaml")
    assert proc.returncode == 0, proc.stderr
    assert cmd[cmd.index("--num_processes") + 1] == "8" and "accelerate_configs/2node_8gpu_c10d.yaml" in cmd


def test_long_node_list_takes_the_first_host(fake_slurm_bin):
    # 20000 hosts overflow the pipe: a reader that stops after one line kills scontrol with SIGPIPE.
    for _ in range(3):
        proc, cmd = derive(fake_slurm_bin, 0, SLURM_JOB_NODELIST="big[1-20000]", SLURM_NNODES="20000")
        assert proc.returncode == 0, proc.stderr
        assert cmd[cmd.index("--main_process_ip") + 1] == "big1"


def fake_nvidia_smi(path_env, tmp_path, script):
    bin_dir = tmp_path / "smi"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/bash\n" + script)
    (bin_dir / "nvidia-smi").chmod(0o755)
    return f"{bin_dir}:{path_env}"


def test_gpu_count_from_nvidia_smi(fake_slurm_bin, tmp_path):
    # Four GPUs, the first split into MIG slices, which nvidia-smi -L lists as indented lines.
    path_env = fake_nvidia_smi(fake_slurm_bin, tmp_path,
                               'for i in 0 1 2 3; do echo "GPU $i: NVIDIA H100 (UUID: GPU-$i)"; done\n'
                               'echo "  MIG 3g.40gb     Device  0: (UUID: MIG-a)"\n'
                               'echo "  MIG 3g.40gb     Device  1: (UUID: MIG-b)"\n')
    proc, cmd = derive(path_env, 0, SLURM_GPUS_ON_NODE="")
    assert proc.returncode == 0, proc.stderr
    assert cmd[cmd.index("--num_processes") + 1] == "8"


@pytest.mark.parametrize("smi", ['echo "No devices were found"; exit 6\n',
                                 'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the driver"; exit 9\n'],
                         ids=["no_devices", "no_driver"])
def test_no_gpus_is_a_clear_error(fake_slurm_bin, tmp_path, smi):
    path_env = fake_nvidia_smi(fake_slurm_bin, tmp_path, smi)
    proc, cmd = derive(path_env, 0, SLURM_GPUS_ON_NODE="")
    assert proc.returncode == 1 and cmd == [], proc.stderr
    assert "no GPUs found" in proc.stderr and "set GPUS_PER_NODE" in proc.stderr


def test_outside_srun_is_a_clear_error(fake_slurm_bin):
    env = clean_env(PATH=fake_slurm_bin, DRY_RUN="1", SLURM_JOB_NODELIST="node[01-02]", SLURM_NNODES="2")
    proc = subprocess.run(["bash", LAUNCHER, "train/mnist.py"], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "SLURM_NODEID is unset: start this with srun" in proc.stderr


SBATCH = os.path.join(CONFIGS, "slurm", "train.sbatch")


def test_time_limit_saves_requeues_and_the_requeued_job_resumes(fake_slurm_bin, tmp_path):
    """train.sbatch on two loopback 'nodes' of 2 CPU processes each, SLURM played by stand-ins:
    SIGUSR1 to the batch script (what `--signal=B:USR1@120` sends before the time limit) -> its
    `scancel --signal=TERM` signals every process of the step, DataLoader workers included (as
    slurmstepd does through its cgroup) -> every rank saves one checkpoint and stops -> `scontrol
    requeue`; the requeued script (SLURM_RESTART_COUNT=1) resumes from that checkpoint and finishes.
    Not a dry run of launch_node.sh: srun starts it on each 'node', and the commands it derives form
    one world of 4 processes."""
    import signal
    import time

    bin_dir = fake_slurm_bin.split(":")[0]
    calls = tmp_path / "calls"
    # srun: one task per node here; scancel --signal=TERM JOB: every process of the step, as
    # slurmstepd signals its whole cgroup (torch elastic starts each rank in a session of its own,
    # so the tasks' descendants, not a session or a process group)
    with open(os.path.join(bin_dir, "srun"), "w") as f:
        f.write('#!/bin/bash\nshift  # --kill-on-bad-exit=1\npids=()\n'
                'for node in 0 1; do SLURM_NODEID=$node "$@" & pids+=($!); echo $! >> "$STEP_PIDS"; done\n'
                'status=0; for p in "${pids[@]}"; do wait $p || status=$?; done; exit $status\n')
    with open(os.path.join(bin_dir, "scancel"), "w") as f:
        f.write('#!/bin/bash\necho "scancel $*" >> "$CALLS"\n'
                'tree() { echo "$1"; for c in $(pgrep -P "$1"); do tree "$c"; done; }\n'
                'for p in $(cat "$STEP_PIDS"); do kill -TERM $(tree "$p") 2>/dev/null; done; exit 0\n')
    scontrol = open(os.path.join(bin_dir, "scontrol")).read()
    with open(os.path.join(bin_dir, "scontrol"), "w") as f:
        f.write(scontrol.replace("#!/bin/bash\n", '#!/bin/bash\n[ "$1" = requeue ] && { echo "scontrol $*" >> "$CALLS"; '
                                 'exit 0; }\n', 1))
    for name in ("srun", "scancel", "scontrol"):
        os.chmod(os.path.join(bin_dir, name), 0o755)
    config = yaml.safe_load(open(os.path.join(CONFIGS, "2node_8gpu.yaml")))
    config.update(use_cpu=True, mixed_precision="no")
    (tmp_path / "cpu_2node.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "run"
    args = ["train/mnist.py", "--max_train_samples", 4000, "--max_eval_samples", 200, "--num_train_epochs", 1,
            "--per_device_train_batch_size", 8, "--dataloader_num_workers", 1, "--checkpointing_steps", 20,
            "--output_dir", out]

    def sbatch(restart_count):
        env = clean_env(PATH=fake_slurm_bin, SLURM_JOB_NODELIST="127.0.0.1", SLURM_NNODES="2",
                        SLURM_JOB_ID=str(os.getpid()), GPUS_PER_NODE="2", ACCELERATE_CONFIG=str(tmp_path / "cpu_2node.yaml"),
                        SLURM_SUBMIT_DIR=REPO, SLURM_RESTART_COUNT=str(restart_count), CALLS=str(calls),
                        STEP_PIDS=str(tmp_path / f"step_pids_{restart_count}"))
        return subprocess.Popen(["bash", SBATCH, *map(str, args)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    job = sbatch(0)
    deadline = time.time() + 180
    while not (out / "checkpoints" / "step_00000020").exists() and job.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)  # the time limit is 120 s away
    output = job.communicate(timeout=180)[0]
    assert job.returncode != 0, output[-3000:]
    stopped = [line for line in output.splitlines() if "stopped on SIGTERM at step" in line]
    # one line per node (each node's first process names its own resume command), one step for all
    steps = {int(line.split("at step ")[1].split()[0]) for line in stopped}
    assert len(stopped) == 2 and len(steps) == 1 and "DataLoader worker" not in output, output[-3000:]
    step = steps.pop()
    assert 20 < step < 125 and (out / "checkpoints" / f"step_{step:08d}").is_dir(), stopped
    assert calls.read_text().splitlines() == [f"scancel --signal=TERM {os.getpid()}", f"scontrol requeue {os.getpid()}"]

    job = sbatch(1)  # requeued: the same arguments, and the script adds --resume_from_checkpoint latest
    output = job.communicate(timeout=300)[0]
    assert job.returncode == 0, output[-3000:]
    assert f"resumed from {out}/checkpoints/step_{step:08d}" in output and "world_size=4 " in output
    results = __import__("json").load(open(out / "all_results.json"))
    assert results["step"] == 125 and results["eval_samples"] == 200
    assert (out / "model.safetensors").exists()
