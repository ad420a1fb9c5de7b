"""Experiments beyond one command line: --config files (a run's args.json reruns it bit for bit), the
best evaluation's weights as the run's model, and early stopping resumed knowing the best so far
(at the same step on every rank of 2 processes: test_first_hour.py)."""

import json
import os
import shutil

import pytest

from conftest import run_main
from data.errors import UserError
from train import lm, mnist, regression


def parse_error(capsys, parse, *argv):
    with pytest.raises(SystemExit) as e:
        parse(list(map(str, argv)))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_config_file_sets_flags_and_the_command_line_wins(tmp_path):
    config = tmp_path / "recipe.yaml"
    config.write_text(
        "learning_rate: 1e-3\nnum_train_epochs: 5\naugment: true\nno_channels_last: true\n"
        "--per_device_train_batch_size: 32\nlr_scheduler_type: linear\n"
    )
    args = mnist.parse_args(["--config", str(config), "--num_train_epochs", "2"])
    assert (args.learning_rate, args.num_train_epochs, args.augment, args.channels_last) == (1e-3, 2, True, False)
    assert (args.per_device_train_batch_size, args.lr_scheduler_type, args.config) == (32, "linear", str(config))
    as_json = tmp_path / "recipe.json"
    as_json.write_text(json.dumps({"learning_rate": 0.004, "channels_last": False, "max_train_steps": None}))
    args = mnist.parse_args([f"--config={as_json}"])
    assert (args.learning_rate, args.channels_last, args.max_train_steps) == (0.004, False, None)
    as_json.write_text(json.dumps({"greater_is_better": True, "early_stopping_threshold": 0}))
    args = mnist.parse_args(["--config", str(config), "--config", str(as_json)])  # the last one, as argparse
    assert (args.greater_is_better, args.early_stopping_threshold, args.config) == (True, 0.0, str(as_json))
    (tmp_path / "text.yaml").write_text("train_file: notes.txt\nblock_size: 64\n")
    args = lm.parse_args(["--config", str(tmp_path / "text.yaml")])
    assert args.train_file == ["notes.txt"]  # one value of a list flag is a list of one, as on the command line


def test_a_derived_value_in_args_json_is_derived_again_from_the_overriding_flags(tmp_path):
    first = lm.parse_args(["--block_size", "64"])
    assert first.dataset_dir.endswith("-b64") and first.gcide
    (tmp_path / "args.json").write_text(json.dumps(vars(first)))
    again = lm.parse_args(["--config", str(tmp_path / "args.json"), "--block_size", "32"])
    assert again.dataset_dir == first.dataset_dir[: -len("-b64")] + "-b32" and again.gcide
    own = lm.parse_args(["--config", str(tmp_path / "args.json"), "--dataset_dir", str(tmp_path / "shards")])
    assert own.dataset_dir == str(tmp_path / "shards") and not own.gcide  # the user's shards: nothing prepared


def test_a_runs_args_json_is_a_config_that_gives_the_same_arguments(tmp_path):
    first = mnist.parse_args(
        [
            "--learning_rate",
            "0.01",
            "--model",
            "convnet_wide",
            "--augment",
            "--resume_from_checkpoint",
            "latest",
            "--output_dir",
            str(tmp_path / "a"),
        ]
    )
    (tmp_path / "args.json").write_text(json.dumps(vars(first)))
    again = mnist.parse_args(["--config", str(tmp_path / "args.json")])
    # what resumes or replaces a run is the command line's alone
    assert vars(again) == {**vars(first), "config": str(tmp_path / "args.json"), "resume_from_checkpoint": None}


@pytest.mark.parametrize(
    "text, expected",
    [
        ("learning_rat: 0.1\n", "unknown key 'learning_rat' (did you mean --learning_rate?)"),
        ("learning_rate: fast\n", "learning_rate: expected a positive number, got 'fast'"),
        ("num_train_epochs: 2.5\n", "num_train_epochs: expected a positive integer, got '2.5'"),
        ("model: resnet\n", "model: 'resnet' is not one of convnet, convnet_fast, convnet_mlp, convnet_wide"),
        ("augment: 1\n", "augment takes true or false, got 1"),
        ("learning_rate: null\n", "learning_rate cannot be null"),
        ("- learning_rate\n", "expected a mapping of flag names to values"),
        ("learning_rate: [0.1\n", "not valid YAML"),
    ],
)
def test_a_bad_config_is_one_line_naming_the_key(capsys, tmp_path, text, expected):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    err = parse_error(capsys, mnist.parse_args, "--config", config)
    assert err.startswith(f"error: --config {config}: ") and expected in err, err


def test_a_missing_config_file_is_one_line(capsys, tmp_path):
    err = parse_error(capsys, mnist.parse_args, "--config", tmp_path / "nope.yaml")
    assert "cannot read it" in err
    assert "--config: expected one argument" in parse_error(capsys, mnist.parse_args, "--config")


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_metrics_direction_comes_from_its_name_and_rewards_are_always_higher_is_better():
    from train.core.best_model import lower_is_better

    lower = ["eval_loss", "eval_mse", "eval_bpb", "eval_perplexity", "eval_error_rate", "loss"]
    higher = ["eval_accuracy", "eval_f1", "eval_reward", "eval_rewards/margins", "eval_rewards/accuracies"]
    # a reward function's own name never turns its mean into a loss (rewards are maximized)
    higher += ["eval_rewards/format_error/mean", "eval_rewards/length_loss/mean", "rewards/mse_penalty/mean"]
    assert [m for m in lower if not lower_is_better(m)] == [] and [m for m in higher if lower_is_better(m)] == []


def test_metric_for_best_model_names_what_the_evaluation_reports(tmp_path):
    with pytest.raises(UserError) as e:
        regression.main(regression.parse_args(["--output_dir", str(tmp_path), "--metric_for_best_model", "eval_ms"]))
    assert "--metric_for_best_model eval_ms: the evaluation reports eval_mse (did you mean eval_mse?)" in str(e.value)


def read(path):
    with open(path, "rb") as f:
        return f.read()


STEPS = [
    "--max_train_steps",
    60,
    "--eval_steps",
    4,
    "--early_stopping_patience",
    3,
    "--checkpointing_steps",
    4,
    "--learning_rate",
    0.3,
    "--per_device_train_batch_size",
    8,
    "--seed",
    5,
]


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
    """A run that stops early, in this process (early stopping on every rank of a 2-process launch:
    test_first_hour.py's run of the wizard's multi-GPU file)."""
    whole = tmp_path_factory.mktemp("whole") / "run"
    results = run_main("regression", "--output_dir", whole, *STEPS)
    return whole, results


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_runs_args_json_reruns_it_bit_identically(whole_run, tmp_path):
    # in this process as the run was: what args.json must hold (every flag off its default here) is
    # the same under any launch, and the launch passes --config through as it came
    whole, first = whole_run
    again = regression.main(
        regression.parse_args(["--config", str(whole / "args.json"), "--output_dir", str(tmp_path / "again")])
    )
    assert read(whole / "model.safetensors") == read(tmp_path / "again" / "model.safetensors")
    assert (again["step"], again["best_model"]) == (first["step"], first["best_model"])


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_resumed_run_knows_the_best_so_far(whole_run, tmp_path):
    """A run killed after a checkpoint, with a later best already written by the killed run, resumes to
    the uninterrupted run's best step, weights and stopping step."""
    whole, results = whole_run
    best = results["best_model"]["step"]
    assert 4 < best < results["step"] and results["stopped_early"]
    # the killed run: its checkpoint at step `best - 4` (best so far: earlier), and the best weights
    # it wrote after that checkpoint, before it died
    killed = tmp_path / "killed"
    shutil.copytree(whole, killed)
    for name in ("all_results.json", "model.safetensors", "args.json"):
        os.remove(killed / name)
    for path in (killed / "checkpoints").iterdir():
        if int(path.name.split("_")[1]) > best - 4:
            shutil.rmtree(path)
    shutil.copyfile(whole / "model.safetensors", killed / "best_model.safetensors")
    resumed = regression.main(
        regression.parse_args(["--output_dir", str(killed), "--resume_from_checkpoint", "latest", *map(str, STEPS)])
    )
    assert resumed["resumed_from"].endswith(f"step_{best - 4:08d}")
    assert (resumed["best_model"], resumed["step"]) == (results["best_model"], results["step"])
    assert read(killed / "model.safetensors") == read(whole / "model.safetensors")
    # the checkpoint of the stopping step (a SIGTERM there saves one): resumed, the run trains no more
    at_stop = regression.main(
        regression.parse_args(
            [
                "--output_dir",
                str(tmp_path / "at_stop"),
                "--resume_from_checkpoint",
                str(whole / "checkpoints" / f"step_{results['step']:08d}"),
                *map(str, STEPS),
            ]
        )
    )
    assert (at_stop["step"], at_stop["best_model"], at_stop["stopped_early"]) == (
        results["step"],
        results["best_model"],
        True,
    )
    assert read(tmp_path / "at_stop" / "model.safetensors") == read(whole / "model.safetensors")


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_metric_none_keeps_the_last_steps_weights(tmp_path):
    args = ["--max_train_steps", 30, "--eval_steps", 5, "--learning_rate", 0.2, "--seed", 1]
    last = regression.main(
        regression.parse_args(
            [
                "--output_dir",
                str(tmp_path / "last"),
                "--metric_for_best_model",
                "none",
                "--checkpointing_steps",
                "30",
                *map(str, args),
            ]
        )
    )
    assert "best_model" not in last
    assert read(tmp_path / "last" / "model.safetensors") == read(
        tmp_path / "last" / "checkpoints" / "step_00000030" / "model.safetensors"
    )
    with pytest.raises(UserError, match="--early_stopping_patience needs a metric"):
        regression.main(
            regression.parse_args(
                [
                    "--output_dir",
                    str(tmp_path / "x"),
                    "--metric_for_best_model",
                    "none",
                    "--early_stopping_patience",
                    "2",
                ]
            )
        )


def test_the_threshold_decides_patience_only_and_the_best_weights_are_always_the_best(tmp_path):
    from types import SimpleNamespace

    import torch

    from train.core.best_model import BestModel

    accelerator = SimpleNamespace(num_processes=1, is_main_process=True, print=print)
    best = BestModel(accelerator, str(tmp_path), "eval_loss", patience=2, threshold=0.1)
    stops = [
        best.update({"eval_loss": value}, step, lambda step=step: {"w": torch.tensor([float(step)])})
        for step, value in enumerate([1.0, 0.95, 0.5, 0.45, 0.44], start=1)
    ]
    # 0.95 and 0.45 are better but not by more than 0.1: they count against patience, yet are kept
    assert stops == [False, False, False, False, True]
    assert (best.step, best.value, best.bad_evaluations) == (5, 0.44, 2)
    from safetensors.torch import load_file

    assert load_file(str(tmp_path / "best_model.safetensors"))["w"].item() == 5.0
