"""Each script's --help, word for word: what `python train/SCRIPT.py --help` prints at 120 columns
is compared with tests/help/SCRIPT.txt, so a change to the command line machinery (train/core/)
that changes a flag, a default, a group or a line break shows up as a diff here.

A script whose flags change on purpose updates its snapshot:

    TEST_HELP_UPDATE=1 python -m pytest -q -n 0 tests/test_help.py

writes tests/help/*.txt from the current code (and passes); commit them with the change.
"""

import importlib
import os
import sys

import pytest

from conftest import REPO

HELP_DIR = os.path.join(REPO, "tests", "help")
# every script in train/ with a command line; check_config reads its arguments in main(argv)
SCRIPTS = (
    "mnist",
    "image_classification",
    "lm",
    "text_classification",
    "sft",
    "dpo",
    "grpo",
    "sample_pairs",
    "regression",
    "sweep",
    "check_config",
)


def help_text(script, capsys, monkeypatch):
    """What `COLUMNS=120 python train/SCRIPT.py --help` prints, run in this process."""
    module = importlib.import_module(f"train.{script}")
    monkeypatch.setenv("COLUMNS", "120")
    monkeypatch.setattr(sys, "argv", [os.path.join("train", f"{script}.py")])  # argparse's prog
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        (module.main if script == "check_config" else module.parse_args)(["--help"])
    assert exit_.value.code in (0, None)
    out, err = capsys.readouterr()
    assert not err, err
    return out


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_matches_snapshot(script, capsys, monkeypatch):
    text = help_text(script, capsys, monkeypatch)
    path = os.path.join(HELP_DIR, f"{script}.txt")
    if os.environ.get("TEST_HELP_UPDATE"):
        os.makedirs(HELP_DIR, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return
    assert os.path.exists(path), f"no {path}; write it with TEST_HELP_UPDATE=1 (this file's docstring)"
    with open(path, encoding="utf-8") as f:
        expected = f.read()
    assert text == expected, f"train/{script}.py --help differs from tests/help/{script}.txt"
