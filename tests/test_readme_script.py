"""The README's "Write your own script" skeleton, as printed there and saved where it says (train/),
runs under 2 real processes once its one `...` line (the user's data and model) is filled in: it
trains, counts its evaluation exactly, checkpoints, and resumes bit-identically."""

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import CONFIGS, REPO, clean_env
from test_checkpointing import identical, weights

FILL = """\
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 3, (250,), generator=g)
    images = torch.randn(250, 1, 8, 8, generator=g)
    images[torch.arange(250), 0, 0, labels] += 4  # the class is written in the first row: learnable
    data = [{"image": images[i], "label": labels[i]} for i in range(250)]
    train_set, eval_set = data[:192], data[192:]
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 3))
"""


def readme_skeleton():
    readme = open(os.path.join(REPO, "README.md")).read()
    section = readme[readme.index("## Write your own script") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    lines = code.splitlines(keepends=True)
    holes = [i for i, line in enumerate(lines) if "= ..., ..., ..." in line]
    assert len(holes) == 1, "the skeleton's data/model line changed; update FILL"
    lines[holes[0]] = FILL
    return "".join(lines)


def launch_skeleton(path, *args):
    """As the README says: saved in train/, launched from the repo root, no PYTHONPATH."""
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        os.path.join(CONFIGS, "cpu_2proc.yaml"),
        str(path),
        *map(str, args),
    ]
    return subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300)


@pytest.fixture
def skeleton():
    path = os.path.join(REPO, "train", f"_readme_skeleton_{os.getpid()}.py")
    with open(path, "w") as f:
        f.write(readme_skeleton())
    yield os.path.relpath(path, REPO)
    os.remove(path)


def test_readme_skeleton_trains_evaluates_and_resumes(skeleton, tmp_path):
    args = [
        "--per_device_train_batch_size",
        16,
        "--per_device_eval_batch_size",
        5,
        "--num_train_epochs",
        3,
        "--checkpointing_steps",
        4,
        "--learning_rate",
        0.05,
    ]
    full = tmp_path / "full"
    proc = launch_skeleton(skeleton, *args, "--output_dir", full)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.load(open(full / "all_results.json"))
    assert results["world_size"] == 2 and results["step"] == 18 and results["eval_samples"] == 58
    assert results["eval_accuracy"] > 0.6  # chance is 1/3
    resumed = tmp_path / "resumed"
    os.makedirs(resumed / "checkpoints")
    os.rename(full / "checkpoints" / "step_00000008", resumed / "checkpoints" / "step_00000008")
    proc = launch_skeleton(skeleton, *args, "--output_dir", resumed, "--resume_from_checkpoint", "latest")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert identical(weights(resumed), weights(full))  # the resumed run ends where the uninterrupted one did
