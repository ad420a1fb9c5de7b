"""accelerate_configs/slurm/launch_node.sh: the launch command each node of a SLURM job derives from
SLURM's variables, and that those commands really form one job (two loopback 'nodes')."""
import os
import shlex
import subprocess
import sys

import pytest
import yaml

from conftest import CONFIGS, REPO, clean_env, run_together

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


def test_derived_commands_form_one_job_on_loopback(fake_slurm_bin, tmp_path):
    """Not a dry run: both 'nodes' run what launch_node.sh derives, with 2 CPU processes each."""
    config = yaml.safe_load(open(os.path.join(CONFIGS, "2node_8gpu.yaml")))
    config.update(use_cpu=True, mixed_precision="no")
    (tmp_path / "cpu_2node.yaml").write_text(yaml.safe_dump(config))
    commands = []
    for node_id in (0, 1):
        env = clean_env(PATH=fake_slurm_bin, SLURM_JOB_NODELIST="127.0.0.1", SLURM_NNODES="2",
                        SLURM_NODEID=str(node_id), SLURM_JOB_ID=str(os.getpid()), GPUS_PER_NODE="2",
                        ACCELERATE_CONFIG=str(tmp_path / "cpu_2node.yaml"))
        commands.append((["bash", LAUNCHER, "train/regression.py", "--max_train_steps", "5", "--output_dir",
                          str(tmp_path / "out")], env))
    codes, outputs = run_together(commands)
    assert codes == [0, 0], "\n".join(o[-2000:] for o in outputs)
    assert "world_size=4 " in outputs[0]
    assert (tmp_path / "out" / "model.safetensors").exists()
