"""python -m train.check_config: one clear line per problem, exit 1; the repo's CPU configs pass."""

import subprocess
import sys

import pytest

from conftest import CONFIGS, REPO, clean_env
from train.check_config import main, problems, summary

GOOD_2NODE = """\
distributed_type: MULTI_GPU
num_machines: 2
num_processes: 16
machine_rank: 0
main_process_ip: 10.0.0.1
main_process_port: 29500
rdzv_backend: static
same_network: true
mixed_precision: bf16
"""

BAD = {
    "yaml_syntax": ("distributed_type: MULTI_GPU\n  num_processes: [2\n", "not valid YAML"),
    "unknown_key": (
        "distributed_type: 'NO'\nnum_process: 2\n",
        "unknown key 'num_process'; did you mean 'num_processes'?",
    ),
    "unquoted_NO": (
        "distributed_type: NO\nnum_processes: 1\n",
        "YAML reads an unquoted NO as False; write distributed_type: 'NO'",
    ),
    "unquoted_no_precision": ("distributed_type: 'NO'\nmixed_precision: no\n", "write mixed_precision: 'no'"),
    "no_ip": (GOOD_2NODE.replace("main_process_ip: 10.0.0.1\n", ""), "main_process_ip is not set"),
    "no_rank": (GOOD_2NODE.replace("machine_rank: 0\n", ""), "machine_rank is not set"),
    "rank_out_of_range": (GOOD_2NODE.replace("machine_rank: 0", "machine_rank: 2"), "machine_rank 2 is outside 0..1"),
    "processes_not_divisible": (
        GOOD_2NODE.replace("num_processes: 16", "num_processes: 15"),
        "not divisible by num_machines",
    ),
    "auto_port_multinode": (
        GOOD_2NODE.replace("main_process_port: 29500", "main_process_port: 0"),
        "set a fixed free port",
    ),
    "c10d_same_network": (GOOD_2NODE.replace("rdzv_backend: static", "rdzv_backend: c10d"), "set same_network: false"),
    "fsdp2_reshard_string": (
        "distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\n"
        "  fsdp_reshard_after_forward: FULL_SHARD\n",
        "must be true or false with fsdp_version: 2",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_each_bad_config_gets_its_line(tmp_path, case):
    text, expected = BAD[case]
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    found = problems(str(path), gpu_count=16)
    assert any(expected in line for line in found), found


def test_more_processes_than_gpus(tmp_path):
    assert problems(f"{CONFIGS}/8gpu.yaml", gpu_count=4) == [
        "8 processes per machine but only 4 GPU(s) here; set num_processes to 4 (one per GPU on each machine)"
    ]
    # FSDP2 runs on CPU processes (train/core/fsdp.py); accelerate's FSDP1 needs GPUs
    assert problems(f"{CONFIGS}/fsdp2_4gpu.yaml", gpu_count=0) == []
    assert "4 CPU process(es) per machine (gloo), sharded with FSDP2" in summary(
        f"{CONFIGS}/fsdp2_4gpu.yaml", gpu_count=0
    )
    assert "2 CPU process(es) per machine (gloo), sharded with FSDP2" in summary(f"{CONFIGS}/fsdp2_cpu_2proc.yaml")
    fsdp1 = tmp_path / "fsdp1.yaml"
    fsdp1.write_text("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 1\n")
    assert problems(str(fsdp1), gpu_count=0)[0].startswith("FSDP version 1 needs GPUs and this machine has none")
    # without GPUs the scripts run a GPU layout on the CPU: accepted, and said so
    assert problems(f"{CONFIGS}/1gpu.yaml", gpu_count=0) == []
    assert "no GPU used here: our scripts run it as 4 CPU process(es)" in summary(f"{CONFIGS}/4gpu.yaml", gpu_count=0)
    assert problems(f"{CONFIGS}/2node_8gpu.yaml", gpu_count=8) == []


def test_command_line_exit_codes_and_one_line_each(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(BAD["no_ip"][0].replace("machine_rank: 0\n", "") + "use_cpu: true\n")  # only the IP is wrong
    proc = subprocess.run(
        [sys.executable, "-m", "train.check_config", str(path), "--machine_rank", "1"],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: num_machines is 2 but main_process_ip")


@pytest.mark.parametrize("name", ["cpu", "cpu_2proc", "cpu_4proc"])
def test_cpu_configs_pass_here(name, capsys):
    assert main([f"{CONFIGS}/{name}.yaml"]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith(f"ok: {CONFIGS}/{name}.yaml: ")


def test_a_good_config_on_the_command_line_is_ok_and_exit_0():
    proc = subprocess.run(
        [sys.executable, "-m", "train.check_config", f"{CONFIGS}/cpu_2proc.yaml"],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("ok: "), proc.stderr


def test_the_wizards_default_config_passes(tmp_path):
    # `accelerate config default` writes JSON (even to a .yaml name); users' own files must pass
    path = tmp_path / "default_config.yaml"
    subprocess.run(
        [sys.executable, "-m", "accelerate.commands.accelerate_cli", "config", "default", "--config_file", str(path)],
        env=clean_env(),
        capture_output=True,
        check=True,
    )
    assert problems(str(path), gpu_count=0) == []
