"""Every config in accelerate_configs/ is valid for accelerate's own loader and says what it means."""

import glob
import os
import re
import subprocess
import sys

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DistributedType

from conftest import CONFIGS, REPO, clean_env

CONFIG_FILES = sorted(glob.glob(os.path.join(CONFIGS, "*.yaml")))
EXPECTED = {  # name: (distributed_type, num_processes, num_machines)
    "cpu": (DistributedType.NO, 1, 1),
    "cpu_2proc": (DistributedType.MULTI_GPU, 2, 1),
    "1gpu": (DistributedType.NO, 1, 1),
    "4gpu": (DistributedType.MULTI_GPU, 4, 1),
    "8gpu": (DistributedType.MULTI_GPU, 8, 1),
    "2node_8gpu": (DistributedType.MULTI_GPU, 16, 2),
    "2node_8gpu_c10d": (DistributedType.MULTI_GPU, 16, 2),
    "cpu_4proc": (DistributedType.MULTI_GPU, 4, 1),
    "fsdp2_4gpu": (DistributedType.FSDP, 4, 1),
}


def test_the_zoo_is_complete():
    names = {os.path.basename(f)[:-5] for f in CONFIG_FILES}
    assert set(EXPECTED) <= names, f"missing configs: {set(EXPECTED) - names}"


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
def test_config_loads_through_accelerate(path):
    config = load_config_from_file(path)  # raises on unknown keys and bad values
    # an unquoted NO is parsed as False by YAML and would not be a DistributedType
    assert isinstance(config.distributed_type, DistributedType)
    assert config.mixed_precision in (None, "no", "fp16", "bf16")  # None: left to the scripts' --mixed_precision
    name = os.path.basename(path)[:-5]
    if name in EXPECTED:
        assert (config.distributed_type, config.num_processes, config.num_machines) == EXPECTED[name]


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
def test_every_key_has_a_comment(path):
    for line in open(path):
        if re.match(r"^\s*[A-Za-z_]+:", line):
            assert "#" in line, f"{os.path.basename(path)}: key without a comment: {line.strip()}"


def test_accelerate_test_with_the_readme_command_runs_one_two_process_world(tmp_path):
    """`accelerate test`, a user's first sanity check, builds Accelerator() without cpu=True: on a
    GPU-less machine the shipped 2-process config alone gives two independent 1-process worlds that
    still report success (seen here: `Distributed environment: DistributedType.NO` twice). The README's
    command (ACCELERATE_USE_CPU=1) gives one world of 2."""

    def accelerate_test(**env):
        cmd = [
            sys.executable,
            "-c",
            "from accelerate.commands.accelerate_cli import main; main()",
            "test",
            "--config_file",
            os.path.join(CONFIGS, "cpu_2proc.yaml"),
        ]
        proc = subprocess.run(cmd, cwd=tmp_path, env=clean_env(**env), capture_output=True, text=True, timeout=300)
        return proc.returncode, proc.stdout + proc.stderr

    code, output = accelerate_test(ACCELERATE_USE_CPU="1")
    assert code == 0 and "Test is a success" in output, output[-3000:]
    assert output.count("Distributed environment: DistributedType.MULTI_CPU  Backend: gloo") == 2, output[-3000:]
    assert output.count("Num processes: 2") == 2 and "Num processes: 1" not in output


@pytest.mark.parametrize("target", ["train", "train-only", "train-images", "train-lm"])
def test_make_with_a_config_that_does_not_exist_is_one_line_before_anything_runs(target):
    proc = subprocess.run(
        ["make", "--no-print-directory", target, "CONFIG=accelerate_configs/cpu_2procs.yaml"],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and proc.stdout == "", proc.stdout[-2000:]  # no setup, no launch
    assert proc.stderr.splitlines()[0] == (
        "error: CONFIG=accelerate_configs/cpu_2procs.yaml is not a file; pass one "
        "of accelerate_configs/*.yaml or your own (accelerate config --config_file "
        "my.yaml)"
    ), proc.stderr
