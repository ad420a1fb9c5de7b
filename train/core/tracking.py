"""What a run leaves behind: metrics.jsonl, the trackers (TensorBoard, ...), curves.png, and the final
model.safetensors, all_results.json and args.json; and two figures a run reports about its machine
(a matmul peak, the denominator of mfu; peak memory)."""

import json
import math
import os
import re
import resource
import time

import torch

from data.errors import fail


def fsync_path(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path, write):
    """write(tmp) then rename: readers, and a run looking at its folder after a crash or power loss,
    never see half a file under the final name."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    write(tmp)
    fsync_path(tmp)
    os.replace(tmp, path)


def strict(value):
    """`value` with every NaN or infinity as None: JSON has no such numbers (json.dump writes a bare
    NaN, which other readers refuse)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def to_json(payload, **kwargs):
    return json.dumps(strict(payload), allow_nan=False, **kwargs)


def write_json(path, payload):
    def write(tmp):
        with open(tmp, "w") as f:
            f.write(to_json(payload, indent=2, sort_keys=True) + "\n")

    atomic_write(path, write)


def save_tensors(tensors, path):
    """safetensors' save_file, with a full disk as an OSError naming the file (safetensors raises its
    own error type, whose text carries the OS error number)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, path)
    except SafetensorError as e:
        found = re.search(r"os error (\d+)", str(e))
        if found:
            number = int(found.group(1))
            raise OSError(number, os.strerror(number), path) from None
        raise


def save_weights(weights, path):
    """A run's weights file, written whole or not at all, readable as the user's umask allows."""

    def write(tmp):
        save_tensors(weights, tmp)
        readable_by_others(tmp)

    atomic_write(path, write)


def readable_by_others(path):
    """A file, or every .safetensors file in a folder (a model folder's weights), readable as the user's
    umask allows: safetensors creates its files readable by their owner alone, and a team shares them."""
    umask = os.umask(0)  # the only way to read it
    os.umask(umask)
    files = (
        [path]
        if os.path.isfile(path)
        else [
            os.path.join(root, name)
            for root, _, names in os.walk(path)
            for name in names
            if name.endswith(".safetensors")
        ]
    )
    for file in files:
        os.chmod(file, 0o666 & ~umask)


def save_final(accelerator, weights, output_dir, results, hparams):
    """The run's outputs: model.safetensors (`weights`, from train.core.checkpoint.model_weights, or None),
    all_results.json and args.json (`hparams`, the resolved arguments) in output_dir, written by the
    main process."""
    if accelerator.is_main_process:  # the weights first: all_results.json marks a finished run
        if weights is not None:  # None: already in place (the best evaluation's, train/core/best_model.py)
            save_weights(weights, os.path.join(output_dir, "model.safetensors"))
        write_json(os.path.join(output_dir, "all_results.json"), results)
        write_json(os.path.join(output_dir, "args.json"), hparams)


# accelerate's trackers and the package each needs (accelerate itself only warns when one is missing,
# and the run then logs nothing)
TRACKER_PACKAGES = {
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "comet_ml": "comet_ml",
    "mlflow": "mlflow",
    "aim": "aim",
    "clearml": "clearml",
    "dvclive": "dvclive",
    "trackio": "trackio",
    "swanlab": "swanlab",
}


def tracking_kwargs(with_tracking, report_to, output_dir):
    """Accelerator arguments for --with_tracking: trackers write under OUTPUT_DIR/tensorboard/. One
    line for a tracker accelerate does not know or whose package is not installed."""
    if not with_tracking:
        return {}
    import importlib.util

    for name in [n.strip() for n in report_to.split(",") if n.strip()]:
        if name != "all" and name not in TRACKER_PACKAGES:
            fail(
                f"--report_to {name}: not a tracker accelerate has; pass one or more of "
                f"{', '.join(TRACKER_PACKAGES)} (comma-separated), or all"
            )
        if name != "all" and importlib.util.find_spec(TRACKER_PACKAGES[name]) is None:
            fail(
                f"--report_to {name}: the {TRACKER_PACKAGES[name]} package is not installed; pip install "
                f"{TRACKER_PACKAGES[name]}, or pass --report_to tensorboard"
            )
    names = [n.strip() for n in report_to.split(",") if n.strip()]
    return {"log_with": names if len(names) > 1 else names[0], "project_dir": os.path.join(output_dir, "tensorboard")}


def format_metrics(metrics):
    """`k=v` for the numbers and words; what is not (a confusion matrix) stays in the history and metrics.jsonl."""
    return " ".join(
        f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
        for k, v in metrics.items()
        if isinstance(v, (int, float, str))
    )


class MetricsLog:
    """OUTPUT_DIR/metrics.jsonl and, with --with_tracking, accelerate's trackers: one record (a dict
    with "step") at a time."""

    def __init__(self, accelerator, output_dir, with_tracking):
        self.accelerator, self.path, self.with_tracking = (
            accelerator,
            os.path.join(output_dir, "metrics.jsonl"),
            with_tracking,
        )

    def start(self, project_name, hparams, completed_steps):
        """Start the trackers and cut metrics.jsonl back to `completed_steps`, so a resumed run neither
        repeats nor loses lines (the steps logged after the checkpoint are logged again)."""
        if self.with_tracking:
            # hparams must be scalars: tensorboard rejects None
            config = {k: v for k, v in hparams.items() if isinstance(v, (int, float, str, bool))}
            # a resumed run logs the steps after its checkpoint again: TensorBoard hides the earlier
            # copies of those steps from purge_step on, as metrics.jsonl is cut back below
            purge = {"tensorboard": {"purge_step": completed_steps + 1}} if completed_steps else None
            self.accelerator.init_trackers(project_name, config=config, init_kwargs=purge)
        if self.accelerator.is_main_process:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            records = _read_jsonl(self.path) if completed_steps else []
            with open(self.path + ".tmp", "w") as f:
                f.writelines(to_json(r) + "\n" for r in records if r["step"] <= completed_steps)
            os.replace(self.path + ".tmp", self.path)  # a crash now leaves the old log, never half of it
        self.accelerator.wait_for_everyone()

    def log(self, record):
        if self.with_tracking:  # trackers take numbers; a confusion matrix goes to metrics.jsonl only
            self.accelerator.log(
                {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}, step=record["step"]
            )
        if self.accelerator.is_main_process:
            with open(self.path, "a") as f:
                f.write(to_json(record) + "\n")

    def finish(self):
        """Flush and close the trackers (TensorBoard's event files)."""
        for tracker in self.accelerator.trackers:
            tracker.finish()


def _read_jsonl(path):
    """The records of a metrics.jsonl; a line torn by a crash mid-write is dropped."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return records


LARGEST = 1e300  # beyond this a value is left out like a nan: matplotlib's axis arithmetic would overflow


def plottable(points):
    """The (x, y) points that are finite numbers within +-LARGEST, as floats: metrics.jsonl writes a
    nan or inf loss as null, and a chart must not fail a finished run."""
    kept = []
    for x, y in points:
        try:
            x, y = float(x), float(y)
        except (TypeError, ValueError, OverflowError):
            continue
        if abs(x) <= LARGEST and abs(y) <= LARGEST:  # False for nan too
            kept.append((x, y))
    return kept


def draw_chart(path, panels, xlabel, size=(1000, 400)):
    """A PNG of panels side by side, each {"title", "ylabel", "lines": [(label, [(x, y), ...], markers)]};
    points that are not finite are left out, a legend where a panel has more than one line. matplotlib's
    object API draws with Agg (no display needed) without importing pyplot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(size[0] / 100, size[1] / 100), dpi=100)
    FigureCanvasAgg(figure)
    for axes, panel in zip(figure.subplots(1, len(panels), squeeze=False)[0], panels, strict=True):
        for label, points, markers in panel["lines"]:
            kept = plottable(points)
            axes.plot([x for x, _ in kept], [y for _, y in kept], "o-" if markers else "-", label=label)
        axes.set(xlabel=xlabel, ylabel=panel["ylabel"], title=panel["title"])
        axes.grid(alpha=0.3)
        if len(panel["lines"]) > 1:
            axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100, format="png")
    return path


def plot_metrics(output_dir, metric="eval_accuracy"):
    """OUTPUT_DIR/curves.png: training (and eval) loss and `metric` against optimizer steps, from
    metrics.jsonl; its path, or None with a warning line when the chart failed: it is a convenience,
    not worth a finished run. A full or read-only disk is raised, as for any other file."""
    records = _read_jsonl(os.path.join(output_dir, "metrics.jsonl"))
    evals = [r for r in records if metric in r]
    loss = [("train", [(r["step"], r["train_loss"]) for r in records if "train_loss" in r], False)]
    if evals and "eval_loss" in evals[0]:
        loss.append(("eval", [(r["step"], r["eval_loss"]) for r in evals], True))
    percent = metric.endswith("accuracy")
    scale = 100 if percent else 1  # a null (a nan written to the log) stays one, left out of the chart
    headline = [(metric, [(r["step"], r[metric] and r[metric] * scale) for r in evals], True)]
    try:
        return draw_chart(
            os.path.join(output_dir, "curves.png"),
            [
                {"title": "loss", "ylabel": "loss", "lines": loss},
                {"title": metric.replace("_", " "), "ylabel": metric + (" (%)" if percent else ""), "lines": headline},
            ],
            xlabel="optimizer step",
        )
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001
        print(f"warning: curves.png was not drawn ({type(e).__name__}: {e})", flush=True)
        return None


def matmul_peak(accelerator, size=1024, seconds=1.0):
    """FLOP/s of square matmuls in the dtype that autocast gives the run's matmuls (fp32, or bf16/fp16
    under mixed precision, on a CPU too: with AMX a bf16 matmul is several times an fp32 one, so an
    fp32 peak would overstate a bf16 run's mfu), summed over processes, measured with every process
    busy at once, as in training: the denominator of mfu. On a GPU the matrices are 8192 wide and
    ten products share one sync: a 1024-wide product takes microseconds there, less than the sync
    and the launch, which would understate the peak several times (and overstate mfu)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)
    gpu = accelerator.device.type != "cpu"
    size, per_sync = (8192, 10) if gpu else (size, 1)
    a = torch.randn(size, size, device=accelerator.device, dtype=dtype)
    (a @ a).sum().item()  # the first product loads the library and picks its kernel: not timed
    accelerator.wait_for_everyone()
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(per_sync):
            b = a @ a
        b.sum().item()
        runs += per_sync
    per_process = torch.tensor([2 * size**3 * runs / (time.perf_counter() - start)], device=accelerator.device)
    return accelerator.reduce(per_process, reduction="sum").item()


def peak_memory_mb(accelerator):
    """The largest per-process peak: GPU memory allocated by torch, or the process's resident set on a CPU."""
    if accelerator.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return accelerator.reduce(torch.tensor([peak], device=accelerator.device), reduction="max").item()
