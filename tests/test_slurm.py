"""accelerate_configs/slurm/launch_node.sh: the launch command each node of a SLURM job derives from
SLURM's variables (DRY_RUN=1, `scontrol show hostnames` played by a stand-in). The commands forming
one job, the time limit, requeue and lost nodes run on a real cluster: tests/test_cluster.py."""

import os
import shlex
import subprocess
import sys

import pytest

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
        '  *) echo "$3";; esac\n'
    )
    (bin_dir / "scontrol").chmod(0o755)
    return f"{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}"


def derive(path_env, node_id, **extra):
    slurm = {
        "SLURM_JOB_NODELIST": "node[01-02]",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": str(node_id),
        "SLURM_JOB_ID": "123456",
        "SLURM_GPUS_ON_NODE": "8",
        "GPUS_PER_NODE": "",
        **extra,
    }
    env = clean_env(PATH=path_env, DRY_RUN="1", **slurm)
    proc = subprocess.run(
        ["bash", LAUNCHER, "train/mnist.py", "--num_train_epochs", "5"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    return proc, shlex.split(proc.stdout)


@pytest.mark.parametrize("node_id", [0, 1])
def test_two_nodes_by_eight_gpus(fake_slurm_bin, node_id):
    proc, cmd = derive(fake_slurm_bin, node_id)
    assert proc.returncode == 0, proc.stderr
    assert cmd == [
        "python",
        "-m",
        "train.core.launch",
        "accelerate",
        "launch",
        "--config_file",
        "accelerate_configs/2node_8gpu.yaml",
        "--num_machines",
        "2",
        "--num_processes",
        "16",
        "--machine_rank",
        str(node_id),
        "--main_process_ip",
        "node01",
        "--main_process_port",
        str(20000 + 123456 % 20000),
        "train/mnist.py",
        "--num_train_epochs",
        "5",
    ]


def test_gpu_count_with_repeat_suffix_and_config_choice(fake_slurm_bin):
    proc, cmd = derive(
        fake_slurm_bin, 1, SLURM_GPUS_ON_NODE="4(x2)", ACCELERATE_CONFIG="accelerate_configs/2node_8gpu_c10d.yaml"
    )
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
    path_env = fake_nvidia_smi(
        fake_slurm_bin,
        tmp_path,
        'for i in 0 1 2 3; do echo "GPU $i: NVIDIA H100 (UUID: GPU-$i)"; done\n'
        'echo "  MIG 3g.40gb     Device  0: (UUID: MIG-a)"\n'
        'echo "  MIG 3g.40gb     Device  1: (UUID: MIG-b)"\n',
    )
    proc, cmd = derive(path_env, 0, SLURM_GPUS_ON_NODE="")
    assert proc.returncode == 0, proc.stderr
    assert cmd[cmd.index("--num_processes") + 1] == "8"


@pytest.mark.parametrize(
    "smi",
    [
        'echo "No devices were found"; exit 6\n',
        'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the driver"; exit 9\n',
    ],
    ids=["no_devices", "no_driver"],
)
def test_no_gpus_is_a_clear_error(fake_slurm_bin, tmp_path, smi):
    path_env = fake_nvidia_smi(fake_slurm_bin, tmp_path, smi)
    proc, cmd = derive(path_env, 0, SLURM_GPUS_ON_NODE="")
    assert proc.returncode == 1 and cmd == [], proc.stderr
    assert "no GPUs found" in proc.stderr and "set GPUS_PER_NODE" in proc.stderr


def test_outside_srun_is_a_clear_error(fake_slurm_bin):
    env = clean_env(PATH=fake_slurm_bin, DRY_RUN="1", SLURM_JOB_NODELIST="node[01-02]", SLURM_NNODES="2")
    proc = subprocess.run(["bash", LAUNCHER, "train/mnist.py"], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "SLURM_NODEID is unset: start this with srun" in proc.stderr


def test_cpu_processes_per_node(fake_slurm_bin):
    """PROCESSES_PER_NODE on nodes without GPUs: that many processes per node, no GPU count needed."""
    proc, cmd = derive(fake_slurm_bin, 1, SLURM_GPUS_ON_NODE="", PROCESSES_PER_NODE="2")
    assert proc.returncode == 0, proc.stderr
    assert cmd[cmd.index("--num_processes") + 1] == "4" and cmd[cmd.index("--machine_rank") + 1] == "1"
    assert "--cpu" not in cmd  # accelerate would start one process


def test_elastic_nodes_use_torchrun_with_a_node_range(fake_slurm_bin):
    proc, cmd = derive(fake_slurm_bin, 1, MIN_NODES="1", MAX_RESTARTS="2")
    assert proc.returncode == 0, proc.stderr
    assert cmd == [
        "python",
        "-m",
        "train.core.launch",
        "torchrun",
        "--nnodes",
        "1:2",
        "--nproc_per_node",
        "8",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        f"node01:{20000 + 123456 % 20000}",
        "--rdzv_id",
        "123456",
        "--max_restarts",
        "2",
        "train/mnist.py",
        "--num_train_epochs",
        "5",
    ]
