"""What a sweep leaves to read: a table of its trials (printed and in SWEEP_DIR/results.md), and
the optimization history and parameter importances as PNG files."""

import functools
import os
import secrets
import warnings


def write_whole(path, write):
    """write(tmp) to a name of this call's own beside path, then os.replace: sweep commands ending
    together each put a whole file in place (the last one's stays), and a reader never sees the file
    emptied or half written."""
    folder, name = os.path.split(path)
    # random, not a pid: sweep commands on two machines sharing the folder can have the same pid
    tmp = os.path.join(folder, f".{name}.{secrets.token_hex(8)}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def rows(study):
    """One row per trial folder: an interrupted trial and the trial that resumed it are one row,
    with the state of the last; the best first."""
    from optuna.trial import TrialState

    by_folder = {}
    for trial in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number):
        folder = trial.user_attrs.get("folder", trial.number)
        resumed = folder in by_folder
        by_folder[folder] = {
            "trial": folder,
            "params": trial.params,
            "value": trial.value,
            "seconds": trial.user_attrs.get("seconds"),
            "state": trial.state.name,
            "resumed": resumed or by_folder.get(folder, {}).get("resumed", False),
            "failure": trial.user_attrs.get("failure"),
        }
        if trial.state == TrialState.PRUNED and trial.intermediate_values:
            step = max(trial.intermediate_values)
            by_folder[folder].update(value=trial.intermediate_values[step], pruned_at=step)
    sign = -1 if study.direction.name == "MAXIMIZE" else 1
    order = {"COMPLETE": 0, "PRUNED": 1, "RUNNING": 2, "WAITING": 2, "FAIL": 3}
    return sorted(
        by_folder.values(),
        key=lambda r: (order.get(r["state"], 4), sign * r["value"] if r["value"] is not None else 0, r["trial"]),
    )


def _fmt(value):
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def table(study, metric):
    found = rows(study)
    names = sorted({name for row in found for name in row["params"]})
    lines = [
        "| trial | " + " | ".join(names) + f" | {metric} | seconds | state |",
        "|---:|" + "---:|" * len(names) + "---:|---:|---|",
    ]
    for row in found:
        state = row["state"].lower()
        if "pruned_at" in row:
            state += f" at step {row['pruned_at']}"
        if row["resumed"]:
            state += " (resumed)"
        if row["failure"]:
            state += f": {row['failure'][:80]}"
        value = "" if row["value"] is None else _fmt(row["value"])
        lines.append(
            f"| {row['trial']} | "
            + " | ".join(_fmt(row["params"].get(n, "")) for n in names)
            + f" | {value} | {_fmt(row['seconds'] or '')} | {state} |"
        )
    return "\n".join(lines)


def plots(study, sweep_dir):
    """optimization_history.png and param_importances.png (the latter needs 2 finished trials and a
    parameter that varies); returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna.visualization.matplotlib as vis
    from optuna.trial import TrialState

    written = []
    finished = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # optuna marks its matplotlib plots experimental, on every call
        for name, draw, enough in (
            ("optimization_history", vis.plot_optimization_history, 1),
            ("param_importances", vis.plot_param_importances, 2),
        ):
            if len(finished) < enough:
                continue
            try:
                axes = draw(study)
            except (ValueError, RuntimeError):  # e.g. no parameter varies among the finished trials
                continue
            figure = axes.get_figure() if hasattr(axes, "get_figure") else axes.flat[0].get_figure()
            figure.set_size_inches(8, 5)
            figure.tight_layout()
            path = os.path.join(sweep_dir, name + ".png")
            write_whole(path, functools.partial(figure.savefig, dpi=100, format="png"))
            plt.close(figure)
            written.append(path)
    return written


def report(study, sweep_dir, sweep):
    text = table(study, sweep["metric"])
    best = next((r for r in rows(study) if r["state"] == "COMPLETE"), None)
    summary = (
        f"best: trial {best['trial']}, {sweep['metric']}={_fmt(best['value'])}, "
        f"{' '.join(f'{k}={_fmt(v)}' for k, v in best['params'].items())} "
        f"(weights: {sweep_dir}/trials/trial_{best['trial']:04d}/model.safetensors)"
        if best
        else "no trial has finished yet"
    )

    def write(tmp):
        with open(tmp, "w") as f:
            f.write(f"{sweep['script']}, {sweep['direction']} {sweep['metric']}\n\n{text}\n\n{summary}\n")

    write_whole(os.path.join(sweep_dir, "results.md"), write)
    written = plots(study, sweep_dir)
    print(
        f"{text}\n{summary}\ntable: {sweep_dir}/results.md" + (f"; plots: {', '.join(written)}" if written else ""),
        flush=True,
    )
