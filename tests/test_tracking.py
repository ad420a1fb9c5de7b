"""What users see while training: header, metrics.jsonl, tensorboard events, curves.png, summary line;
after a resume, one history in both logs."""

import json
import os
import shutil

import pytest
from PIL import Image

from conftest import launch, output_of
from train import mnist

LOGGING_STEPS = 4
RUN = [
    "--max_train_samples",
    1280,
    "--max_eval_samples",
    301,
    "--num_train_epochs",
    2,
    "--per_device_train_batch_size",
    32,
    "--logging_steps",
    LOGGING_STEPS,
]


def in_process_run(samples):
    """RUN's arguments for one process in this one, on `samples` training samples (samples / 32 steps an epoch)."""
    return [str(a) for a in RUN[2:]] + ["--max_train_samples", str(samples)]


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def tensorboard_steps(folder, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = []
    for root, _, files in os.walk(folder):
        for name in files:
            if name.startswith("events.out.tfevents"):
                events = EventAccumulator(os.path.join(root, name))
                events.Reload()
                if tag in events.Tags()["scalars"]:
                    steps += [e.step for e in events.Scalars(tag)]
    return sorted(steps)


def tensorboard_history(folder, tag):
    """[(step, value)] of `tag` as TensorBoard shows the runs under `folder`: each folder's event files
    in the order written, where a purge marker (SummaryWriter's purge_step, a SessionLog START at step
    S) hides what the earlier files logged from step S on. Without one, every copy of a step stays."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.compat.proto.event_pb2 import SessionLog
    from tensorboard.util.tensor_util import make_ndarray

    history = []
    for root, _, files in sorted(os.walk(folder)):
        shown = []
        for name in sorted(f for f in files if f.startswith("events.out.tfevents")):
            for event in EventFileLoader(os.path.join(root, name)).Load():
                if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                    shown = [(step, value) for step, value in shown if step < event.step]
                for value in event.summary.value:
                    if value.tag == tag:
                        number = (
                            value.simple_value
                            if value.WhichOneof("value") == "simple_value"
                            else float(make_ndarray(value.tensor))
                        )
                        shown.append((event.step, number))
        history += shown
    return history


@pytest.fixture(scope="module")
def tracked_run(fashion_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("tracked")
    proc = launch("cpu_2proc", "mnist", *RUN, "--with_tracking", "--report_to", "tensorboard", "--output_dir", out)
    assert proc.returncode == 0, output_of(proc)
    return proc, out


def test_header_reports_the_real_world_size_and_global_batch(tracked_run):
    proc, _ = tracked_run
    header = [line for line in proc.stdout.splitlines() if line.startswith("world_size=")]
    assert len(header) == 1, proc.stdout[-2000:]  # printed once, by the main process
    assert "Warning" not in output_of(proc)  # no FutureWarning (broadcast_buffers) or other warnings
    assert header[0].startswith("world_size=2 device=cpu distributed_type=MULTI_CPU mixed_precision=no (auto: ")
    assert " global_batch_size=64 " in header[0]


def test_metrics_jsonl_has_every_logged_step_and_every_evaluation(tracked_run):
    _, out = tracked_run
    records = read_jsonl(out / "metrics.jsonl")
    steps_per_epoch = 1280 // 64
    train = [r for r in records if "train_loss" in r]
    evals = [r for r in records if "eval_accuracy" in r]
    assert [r["step"] for r in train] == list(range(LOGGING_STEPS, 2 * steps_per_epoch + 1, LOGGING_STEPS))
    assert all(r["train_loss"] > 0 and r["lr"] > 0 and r["samples_per_second"] > 0 for r in train)
    assert [(r["epoch"], r["step"], r["eval_samples"]) for r in evals] == [(1, 20, 301), (2, 40, 301)]
    final = json.load(open(out / "all_results.json"))
    assert evals[-1]["eval_accuracy"] == final["eval_accuracy"]


def test_tensorboard_events_hold_the_same_steps(tracked_run):
    _, out = tracked_run
    assert tensorboard_steps(out / "tensorboard", "train_loss") == list(range(LOGGING_STEPS, 41, LOGGING_STEPS))
    assert tensorboard_steps(out / "tensorboard", "eval_accuracy") == [20, 40]


def test_curves_png_is_a_valid_image(tracked_run):
    _, out = tracked_run
    with Image.open(out / "curves.png") as image:
        image.verify()  # raises on a truncated or corrupt file
    with Image.open(out / "curves.png") as image:
        assert image.format == "PNG" and image.size[0] >= 600 and image.size[1] >= 300


def test_summary_line_at_the_end(tracked_run):
    proc, out = tracked_run
    final = json.load(open(out / "all_results.json"))
    summary = [line for line in proc.stdout.splitlines() if line.startswith("final eval_accuracy=")]
    assert len(summary) == 1
    assert f"eval_accuracy={final['eval_accuracy']:.4f} eval_samples=301 wall_seconds=" in summary[0]
    assert "samples_per_second=" in summary[0]
    # the file says what the line says: wall time, then the loop's time, which holds every epoch's training
    assert f"wall_seconds={final['wall_seconds']:.1f} (training {final['train_seconds']:.1f})" in summary[0]
    assert final["wall_seconds"] >= final["train_seconds"] >= sum(final["epoch_seconds"]) > 0


def test_without_tracking_no_tensorboard_but_still_jsonl_and_png(fashion_dir, tmp_path):
    results = mnist.main(mnist.parse_args(in_process_run(320) + ["--output_dir", str(tmp_path)]))
    assert not (tmp_path / "tensorboard").exists()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "eval_accuracy" in r] == [10, 20]
    assert (tmp_path / "curves.png").stat().st_size > 0 and results["step"] == 20


def test_resume_rewrites_the_log_without_repeating_or_losing_steps(fashion_dir, tmp_path):
    # 20 steps an epoch, 40 in all
    args = in_process_run(640) + ["--checkpointing_steps", "30", "--with_tracking", "--report_to", "tensorboard"]
    full, crashed = tmp_path / "full", tmp_path / "crashed"
    mnist.main(mnist.parse_args(args + ["--output_dir", str(full)]))
    # as a crash at step 36 would leave it: every log line up to then (step 32's after the checkpoint),
    # the checkpoint of step 30
    shutil.copytree(full, crashed)
    for name in ("all_results.json", "model.safetensors", "curves.png"):
        os.remove(crashed / name)
    with open(crashed / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in read_jsonl(full / "metrics.jsonl") if r["step"] <= 35)
        f.write('{"step": 36, "train_lo')  # the kill came in the middle of a write
    mnist.main(mnist.parse_args(args + ["--output_dir", str(crashed), "--resume_from_checkpoint", "latest"]))

    def losses(folder):
        return [(r["step"], r.get("train_loss"), r.get("eval_accuracy")) for r in read_jsonl(folder / "metrics.jsonl")]

    assert losses(crashed) == losses(full)  # bit-identical resume: the same values at the same steps, once each
    assert [step for step, _, _ in losses(full)].count(32) == 1  # (a logged step between checkpoint and crash)
    for tag in ("train_loss", "eval_accuracy"):  # and TensorBoard shows one history, not the steps after 30 twice
        shown = tensorboard_history(crashed / "tensorboard", tag)
        assert shown == tensorboard_history(full / "tensorboard", tag) and len({s for s, _ in shown}) == len(shown)


def test_curves_any_data_gives_a_png_of_the_asked_size(tmp_path):
    """curves.png is drawn whatever the log holds: nothing, one point, a constant, a loss gone to nan or
    inf (those points are left out), huge and tiny values, more lines than colours."""
    from train.core.tracking import draw_chart

    nan, inf = float("nan"), float("inf")
    cases = {
        "empty": [],
        "one": [(5, 0.25)],
        "constant": [(1, 3.0), (2, 3.0)],
        "not_finite": [(1, 2.0), (2, nan), (3, inf), (4, 1.5)],
        "huge": [(0, 1e7), (10, 3e7)],
        "tiny": [(0, 1e-7), (10, 3e-7)],
        "overflowing": [(0, -1e308), (1, 1e308), (2, 1.75e308)],
        "denormal": [(0, 5e-324)],
        "not_numbers": [(0, None), (1, "x"), (2, 10**400), (3, 1.0)],
        "near_a_large_value": [(0, 1e6), (1, 1e6 + 1e-9)],
    }
    for name, points in cases.items():
        lines = [(f"line {i}", points, i % 2 == 1) for i in range(5)]
        path = draw_chart(
            tmp_path / f"{name}.png",
            [{"title": name, "ylabel": "y", "lines": lines}, {"title": "other", "ylabel": "z", "lines": lines[:1]}],
            xlabel="step",
            size=(700, 300),
        )
        with Image.open(path) as image:
            image.verify()
        with Image.open(path) as image:
            assert image.format == "PNG" and image.size == (700, 300), name


def test_curves_from_a_log_with_null_losses(tmp_path):
    """metrics.jsonl writes a nan or inf value as null (a window of skipped steps, a diverged
    evaluation): the chart leaves those points out."""
    from train.core.tracking import plot_metrics

    records = [
        {"step": 10, "train_loss": None},
        {"step": 20, "train_loss": 0.5},
        {"step": 20, "eval_loss": None, "eval_accuracy": 0.5},
        {"step": 30, "train_loss": 0.4},
        {"step": 40, "eval_loss": 0.3, "eval_accuracy": None},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with Image.open(plot_metrics(str(tmp_path))) as image:
        assert image.format == "PNG" and image.size == (1000, 400)


def test_a_chart_that_fails_is_a_warning_not_a_failed_run(fashion_dir, tmp_path, monkeypatch, capsys):
    from train.core import tracking

    def broken(*args, **kwargs):
        raise ValueError("no font")

    monkeypatch.setattr(tracking, "draw_chart", broken)
    results = mnist.main(mnist.parse_args(in_process_run(320) + ["--output_dir", str(tmp_path)]))
    assert results["step"] == 20 and (tmp_path / "model.safetensors").exists()
    assert "warning: curves.png was not drawn (ValueError: no font)" in capsys.readouterr().out
